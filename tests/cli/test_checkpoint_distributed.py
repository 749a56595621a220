"""Checkpoints across processes (gloo on CPU): kill mid-save, exact resume under dp_shard=2, resharding.

Run as a module under torchrun (`--worker OUT -- TRAINER ARGS`), this file is also
the resharding worker: it builds the Trainer (which loads the checkpoint), gathers
the full model and optimizer state and writes them from rank 0.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.helpers import TRAIN, env, launch, losses_by_step, run_until_paused  # noqa: E402

pytestmark = pytest.mark.slow
TIMEOUT = 150  # seconds per launch; each takes 5-15 s, so this only ends a hang early

# fp32 + deterministic: a resumed run must reproduce the uninterrupted one exactly.
ARGS = [
    "--config", str(REPO / "configs" / "train" / "debug_model.toml"),
    "--train.steps=10", "--train.seq_len=32", "--train.batch_size=2", "--train.grad_accum_steps=2",
    "--train.mixed_precision=fp32", "--train.deterministic=true",
    "--metrics.log_freq=1", "--metrics.enable_tensorboard=false", "--checkpoint.interval=5",
]


def _torchrun(nproc: int, script: str, args: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", script, *args]


def _run_until_paused(cmd: list[str], pause: str) -> str:
    return run_until_paused(cmd, pause, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def dp2_run(tmp_path_factory):
    """Reference 10-step dp_shard=2 run, and the same run killed inside the step-10 save and relaunched."""
    root = tmp_path_factory.mktemp("dp2")
    ref = launch([*ARGS, "--distributed.dp_shard=2", f"--job.dump_folder={root / 'ref'}"], nproc=2, timeout=TIMEOUT)
    assert ref.returncode == 0, ref.stdout[-3000:] + ref.stderr[-3000:]
    dump = root / "resumed"
    ckpt_args = [*ARGS, "--distributed.dp_shard=2", f"--job.dump_folder={dump}", "--checkpoint.enable=true",
                 "--checkpoint.async_mode=async"]
    # Rank 1 stops after writing its shard of step 10; rank 0 has written its own and waits for rank 1.
    killed_log = _run_until_paused(_torchrun(2, TRAIN, ckpt_args), pause="save:10:1")
    killed = {
        "dirs": sorted(p.name for p in (dump / "checkpoint").iterdir()),
        "tmp_files": sorted(p.name for p in (dump / "checkpoint" / "step-10.tmp").iterdir()),
    }
    step5 = root / "step-5"
    shutil.copytree(dump / "checkpoint" / "step-5", step5)  # for the resharding tests
    # The relaunch also writes the final weights-only export, gathered from both ranks.
    relaunch = launch([*ckpt_args, "--checkpoint.model_only=true"], nproc=2, timeout=TIMEOUT)
    assert relaunch.returncode == 0, relaunch.stdout[-3000:] + relaunch.stderr[-3000:]
    return {"ref": losses_by_step(root / "ref"), "resumed": losses_by_step(dump), "killed": killed,
            "killed_log": killed_log, "relaunch_log": relaunch.stdout, "dump": dump, "step5": step5, "root": root}


def test_kill_mid_save_on_two_ranks_leaves_previous_checkpoint_latest(dp2_run):
    killed = dp2_run["killed"]
    assert killed["dirs"] == ["step-10.tmp", "step-5"], killed
    # Both ranks wrote shard files, but the save never completed: no .metadata, no checkpoint.json.
    assert "__0_0.distcp" in killed["tmp_files"] and "__1_0.distcp" in killed["tmp_files"]
    assert ".metadata" not in killed["tmp_files"] and "checkpoint.json" not in killed["tmp_files"]
    log = dp2_run["relaunch_log"]
    assert "ignoring incomplete checkpoint" in log and "step-10.tmp" in log
    assert "resumed from checkpoint" in log and "step-5 at step 5" in log
    assert sorted(p.name for p in (dp2_run["dump"] / "checkpoint").iterdir()) == ["step-10", "step-10-hf", "step-5"]


def test_export_gathers_sharded_weights(dp2_run):
    from trainer.checkpoint import load_model
    from trainer.hf import read_hf_weights
    from trainer.models.llama import FLAVORS

    checkpoint = dp2_run["dump"] / "checkpoint"
    weights = load_model(checkpoint / "step-10").state_dict()
    exported = read_hf_weights(checkpoint / "step-10-hf", args=FLAVORS["debug"])
    assert exported.keys() == weights.keys()
    for k, v in weights.items():
        assert exported[k].dtype == torch.bfloat16 and torch.equal(exported[k], v.to(torch.bfloat16)), k


def test_exact_resume_dp_shard_2_grad_accum_async(dp2_run):
    ref, resumed = dp2_run["ref"], dp2_run["resumed"]
    assert sorted(resumed) == list(range(1, 11))
    for step in range(6, 11):
        assert abs(resumed[step] - ref[step]) <= 1e-6, (step, resumed[step], ref[step])


# -- resharding -------------------------------------------------------------


def _worker(out: str, args: list[str]) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    from trainer.config import load_job_config
    from trainer.distributed import destroy_distributed
    from trainer.log import setup_logging
    from trainer.run.train import build_trainer

    setup_logging(int(os.environ.get("RANK", "0")))
    trainer = build_trainer(load_job_config(args))
    try:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model = get_model_state_dict(trainer.model, options=options)
        optim = get_optimizer_state_dict(trainer.model, trainer.optimizer, options=options)
        if trainer.env.rank == 0:
            torch.save({"model": model, "optimizer": optim["state"], "step": trainer.state.step,
                        "consumed_samples": trainer.data_loader.consumed_samples,
                        "lr": trainer.optimizer.param_groups[0]["lr"]}, out)
    finally:
        trainer.close()
        destroy_distributed()


@pytest.fixture(scope="module")
def saved_state(dp2_run):
    """The step-5 checkpoint (saved at dp_shard=2) read back by DCP's own converter: the reference."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = dp2_run["root"] / "reference.pt"
    dcp_to_torch_save(str(dp2_run["step5"]), str(out))
    return torch.load(out, weights_only=False)


@pytest.mark.parametrize("nproc, layout", [
    (1, []),
    (4, ["--distributed.dp_shard=4"]),
    (4, ["--distributed.dp_shard=2", "--distributed.tp=2"]),
], ids=["1-process", "dp_shard=4", "dp_shard=2xtp=2"])
def test_reshard_on_load(dp2_run, saved_state, tmp_path, nproc, layout):
    dump = tmp_path / "dump"
    shutil.copytree(dp2_run["step5"], dump / "checkpoint" / "step-5")
    out = tmp_path / "loaded.pt"
    args = [*ARGS, *layout, f"--job.dump_folder={dump}", "--checkpoint.enable=true"]
    cmd = _torchrun(nproc, __file__, ["--worker", str(out), "--", *args])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, env=env(), cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "resharded from dp_replicate=1, dp_shard=2, tp=1 (world size 2)" in proc.stdout
    loaded = torch.load(out, weights_only=False)
    assert loaded["step"] == 5
    assert loaded["consumed_samples"] == 5 * 2 * 2 * 2  # steps x batch x grad_accum x dp (global batch unchanged)
    model = saved_state["model"]
    assert model.keys() == loaded["model"].keys()
    for k, v in model.items():
        assert torch.equal(loaded["model"][k], v), k
    assert loaded["optimizer"].keys() == saved_state["optimizer"]["state"].keys()
    for fqn, state in loaded["optimizer"].items():
        for key, value in state.items():
            assert torch.equal(value, saved_state["optimizer"]["state"][fqn][key]), (fqn, key)
    # Non-tensor state is JSON beside the tensors (never pickled into the DCP files).
    saved_lr = json.loads((dp2_run["step5"] / "state.json").read_text())["lr_scheduler"]["_last_lr"][0]
    assert loaded["lr"] == saved_lr


if __name__ == "__main__":
    # torchrun tests/cli/test_checkpoint_distributed.py --worker OUT -- TRAINER ARGS
    assert sys.argv[1] == "--worker" and sys.argv[3] == "--", sys.argv
    _worker(sys.argv[2], sys.argv[4:])
