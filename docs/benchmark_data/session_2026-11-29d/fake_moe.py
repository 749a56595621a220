"""Step time of moe_16b x 8 layers (batch 2 x 4096, compile, no AC, ep = WORLD) on one GPU, as itself (world 1) or as rank 0 of
2 on torch's fake process group (dp_shard=2: FSDP's local work without any communication).
    python3 tmp_gpu/fake_speed.py WORLD PRECISION [CONFIG ARGS...]"""
import json, os, sys, time
sys.path.insert(0, "scripts"); sys.path.insert(0, ".")
world, precision = int(sys.argv[1]), sys.argv[2]
import memory_peak
if world > 1:
    memory_peak.stand_for_rank0_of(world)
import torch
from trainer.config import load_job_config
from trainer.log import setup_logging
from trainer.run.train import build_trainer
from trainer.run import step as step_mod

_opt = step_mod.TrainStep._optimizer_step
def full_update(self, norm, found_inf):  # the fake group's values may be non-finite: run the whole update anyway
    return _opt(self, norm.nan_to_num(1.0, 1.0, 1.0), torch.zeros_like(found_inf))
step_mod.TrainStep._optimizer_step = full_update
setup_logging(0)
cpu = not torch.cuda.is_available()
base = (["--config", "configs/train/debug_model.toml", "--train.compile_model=false"] if cpu else
        ["--config", "configs/train/moe_16b_4gpu_fp8.toml", "--model.n_layers=8", "--train.batch_size=2", "--train.seq_len=4096", "--float8.moe_experts=off", f"--distributed.ep={world}",
         "--train.compile_model=true"])
cfg = load_job_config(base + ["--data.source=synthetic", "--train.activation_checkpointing=none", "--checkpoint.enable=false",
                              "--train.steps=100", "--metrics.enable_tensorboard=false", "--metrics.enable_jsonl=false",
                              "--job.dump_folder=/tmp/fake_speed", f"--train.mixed_precision={precision}", *sys.argv[3:]])
r = build_trainer(cfg)
sync = (lambda: None) if cpu else torch.cuda.synchronize
for _ in range(6):
    r.train_step(r.data_loader.next_batch())
sync()
times = []
for _ in range(3):
    t = time.perf_counter()
    for _ in range(8):
        r.train_step(r.data_loader.next_batch())
    sync()
    times.append((time.perf_counter() - t) / 8)
tokens = cfg.train.batch_size * cfg.train.seq_len
out = {"world": world, "precision": precision, "step_s": times, "best_tok_s": tokens / min(times),
       "peak_gib": 0 if cpu else torch.cuda.max_memory_allocated() / 2**30, "extra": sys.argv[3:]}
print("SPEED " + json.dumps(out), flush=True)
r.close()
