"""Peak GPU memory of training configs, and what is live at the peak, grouped by the code that allocated it.

    python3 scripts/memory_peak.py [NAME ...]        (the names of CONFIGS below; default: all; one GPU)
    torchrun --nproc_per_node=2 scripts/memory_peak.py bf16_8L_pp2_interleaved   (the pipeline configs: each rank)
    python3 scripts/memory_peak.py --fake-world 2 moe16b_8L_b2_fp8_ep2_padded   (rank 0 of 2 on one GPU: below)

For each config: three steps of `Trainer.train_step` (compilation, allocator warm-up), then one step with the CUDA
allocator's history recorded (for the configs marked True) and two more. Prints and appends to $OUT/memprobe.jsonl
(default /tmp) one JSON line per config: the allocated bytes before the step (`base_gib`: the resident state), the
peak of `torch.cuda.max_memory_allocated` over the last three steps, and `at_peak`: the allocations of the recorded
step still live at its peak, summed by (innermost trainer/ frame | innermost frame). docs/benchmarks.md ("The dry
run's memory plan") reads trainer/validate/plan.py's estimate against these.
"""

from __future__ import annotations

import collections
import gc
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: E402  (importing it registers "fake")
from trainer.config import load_job_config  # noqa: E402
from trainer.log import setup_logging  # noqa: E402
from trainer.parallel.expert_parallel import AllToAllDispatcher  # noqa: E402
from trainer.run.train import build_trainer  # noqa: E402

BASE = ["--train.seq_len=4096", "--data.source=synthetic",
        "--train.compile_model=true", "--checkpoint.enable=false", "--train.steps=20",
        "--metrics.enable_tensorboard=false", "--metrics.enable_jsonl=false", "--job.dump_folder=/tmp/mp"]


def stand_for_rank0_of(world: int) -> None:
    """--fake-world: this process as rank 0 of `world` ranks on torch's fake process group (the module docstring)."""
    os.environ.update(WORLD_SIZE=str(world), RANK="0", LOCAL_RANK="0")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    new_group = dist.new_group
    dist.new_group = lambda *a, backend=None, **k: new_group(*a, **k)  # a gloo group (the checkpoint's): fake as well

    def balanced_counts(self, counts: torch.Tensor) -> torch.Tensor:
        rows = counts.to(torch.int64).sum().view(1, 1)  # the rows this rank sends; each source is taken to send as many
        share = rows // (self.ep * self.n_local)
        recv = share.expand(self.ep, self.n_local).clone()
        recv[:, 0] += rows[0, 0] - share[0, 0] * self.ep * self.n_local  # the rest of a source's rows to one expert
        return recv

    AllToAllDispatcher._received_counts = balanced_counts


def key_of(frames: list[dict]) -> str:
    ours = [f for f in frames if "/trainer/" in f["filename"]]
    inner = frames[0] if frames else {"filename": "?", "line": 0, "name": "?"}
    o = ours[0] if ours else {"filename": "?", "line": 0, "name": "?"}
    ours_at = f"{o['filename'].split('/trainer/')[-1]}:{o['line']} {o['name']}"
    return f"{ours_at} | {inner['filename'].split('/')[-1]}:{inner['line']} {inner['name']}"


def run(name: str, extra: list[str], breakdown: bool) -> None:
    cfg = load_job_config(([] if "--config" in extra else ["--config", "configs/train/llama3_8b.toml"]) + BASE + extra)
    r = build_trainer(cfg)
    dev = r.device
    try:
        for _ in range(3):
            r.train_step(r.data_loader.next_batch())
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
        if breakdown:
            torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
        r.train_step(r.data_loader.next_batch())
        torch.cuda.synchronize()
        peak1 = torch.cuda.max_memory_allocated(dev)
        out = {"name": name, "rank": r.env.rank, "extra": extra, "base_gib": base / 2**30, "peak_gib": peak1 / 2**30}
        if breakdown:
            snap = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
            live, cur, best, best_live = {}, base, base, {}
            for ev in snap["device_traces"][dev.index or 0]:
                a = ev["action"]
                if a == "alloc":
                    live[ev["addr"]] = (ev["size"], key_of(ev.get("frames", [])))
                    cur += ev["size"]
                    if cur > best:
                        best, best_live = cur, dict(live)
                elif a == "free_completed" and ev["addr"] in live:
                    cur -= live.pop(ev["addr"])[0]
            groups = collections.Counter()
            for size, k in best_live.values():
                groups[k] += size
            out["replay_peak_gib"] = best / 2**30
            out["at_peak"] = [(round(v / 2**30, 3), k) for k, v in groups.most_common(25)]
        for _ in range(2):
            r.train_step(r.data_loader.next_batch())
        torch.cuda.synchronize()
        out["peak_gib"] = torch.cuda.max_memory_allocated(dev) / 2**30
        out["params"] = sum(p.numel() for p in r.model.parameters())
        print("RESULT " + json.dumps(out), flush=True)
        with open(os.path.join(os.environ.get("OUT", "/tmp"), "memprobe.jsonl"), "a") as f:
            f.write(json.dumps(out) + "\n")
    finally:
        r.close()
        del r
        gc.collect()
        torch.cuda.empty_cache()

def _dense(layers: int, batch: int, precision: str, ac: str = "none", *more: str) -> list[str]:
    """Llama 3 8B shapes (configs/train/llama3_8b.toml) with these layers, batch, precision and AC."""
    return [*([f"--model.n_layers={layers}"] if layers else []), f"--train.batch_size={batch}",
            f"--train.mixed_precision={precision}", f"--train.activation_checkpointing={ac}", *more]


_MOE = ["--config", "configs/train/moe_16b_4gpu_fp8.toml", "--model.n_layers=8", "--distributed.ep=1",
        "--float8.moe_experts=off", "--train.batch_size=2"]

# Long sequences (configs/train/llama3_8b_128k_cp8.toml on one GPU: full AC, 4,096-token loss chunks, batch 1).
_LONG = ["--config", "configs/train/llama3_8b_128k_cp8.toml", "--model.n_layers=8", "--distributed.cp=1",
         "--checkpoint.restart_data=false"]

_PP2 = ["--distributed.pp=2", "--distributed.dp_shard=1", "--distributed.pp_microbatch_size=1"]

# name -> (overrides, record what is live at the peak)
CONFIGS = {
    "bf16_8L_b4": (_dense(8, 4, "bf16"), True),
    "fp8_8L_b4": (_dense(8, 4, "fp8"), True),
    "bf16_8L_b4_sel": (_dense(8, 4, "bf16", "selective"), True),
    "fp8_8L_b4_sel": (_dense(8, 4, "fp8", "selective"), False),
    "bf16_8L_b4_full": (_dense(8, 4, "bf16", "full"), True),
    "fp8_8L_b4_full": (_dense(8, 4, "fp8", "full"), False),
    "fp8_8L_b2": (_dense(8, 2, "fp8"), False),
    "bf16_4L_b4": (_dense(4, 4, "bf16"), False),
    "bf16_8L_b2_eager": (_dense(8, 2, "bf16", "none", "--train.compile_model=false"), True),
    "fp8_8L_b4_chunk": (_dense(8, 4, "fp8", "none", "--train.loss_chunk_tokens=4096"), False),
    "fp8_8L_b4_fp32m": (_dense(8, 4, "fp8", "none", "--distributed.master_dtype=fp32"), False),
    "moe16b_8L_b2_bf16": ([*_MOE, "--train.mixed_precision=bf16"], True),
    "moe16b_8L_b2_fp8": ([*_MOE, "--train.mixed_precision=fp8"], True),
    # --fake-world 2: rank 0 of moe_16b x 8 layers at ep=2 (over dp_shard=2), each all-to-all
    "moe16b_8L_b2_fp8_ep2_sized": ([*_MOE, "--train.mixed_precision=fp8", "--distributed.ep=2", "--moe.dispatch=sized"],
                                   True),
    "moe16b_8L_b2_fp8_ep2_padded": ([*_MOE, "--train.mixed_precision=fp8", "--distributed.ep=2",
                                     "--moe.dispatch=padded"], True),
    "fp8_32L_b1_full": (_dense(0, 1, "fp8", "full"), False),
    "bf16_8L_s32k_full": ([*_LONG, "--train.seq_len=32768"], True),
    "bf16_8L_s64k_full": ([*_LONG, "--train.seq_len=65536"], False),
    "bf16_8L_s128k_full": ([*_LONG, "--train.seq_len=131072"], True),
    # 2 ranks (torchrun --nproc_per_node=2; each rank prints its own): pp=2, 8 microbatches of one sequence
    "bf16_8L_pp2_1f1b": (_dense(8, 8, "bf16", "none", *_PP2, "--distributed.pipeline_schedule=1F1B"), True),
    "bf16_8L_pp2_interleaved": (_dense(8, 8, "bf16", "none", *_PP2, "--distributed.pipeline_schedule=Interleaved1F1B"),
                                True),
}


if __name__ == "__main__":
    setup_logging(0)
    names = sys.argv[1:]
    if names[:1] == ["--fake-world"]:
        stand_for_rank0_of(int(names[1]))
        names = names[2:]
    names = names or list(CONFIGS)
    for n in names:
        extra, bd = CONFIGS[n]
        try:
            run(n, extra, bd)
        except Exception as e:  # one config that fails (out of memory) does not stop the others
            print("FAILED", n, repr(e)[:500], flush=True)
