"""scripts/gpu_checks.sh's multi-GPU steps without a GPU: GPU_CHECKS_DRY_RUN=N validates every job they would
launch by its --dry-run for the ranks it would start, so a table's command is known to be a valid job before a
multi-GPU machine is lent."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tests.helpers import REPO, env


def test_dry_run_plans_the_multi_gpu_steps_for_their_ranks(tmp_path: Path) -> None:
    e = env() | {"GPU_CHECKS_DRY_RUN": "4", "OUT": str(tmp_path)}
    e.pop("CUDA_VISIBLE_DEVICES", None)
    proc = subprocess.run(["bash", "scripts/gpu_checks.sh", "full8b", "ckpt_stall", "ckpt_speed"], capture_output=True,
                          text=True, env=e, cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    # full8b: bf16 and fp8 on 4 GPUs; ckpt_stall and ckpt_speed: one train.py job each on 4 GPUs; each a valid job
    # that fits an H200.
    assert out.count("dry run for 4 ranks: nothing was started") == 4
    assert out.count("dp_shard=4, tp=1 (world size 4)") == 4
    assert out.count("fits a 139.8 GiB GPU") == 4 and "MORE than" not in out
    assert "error" not in proc.stderr.lower() and "error" not in out.lower()
    assert (tmp_path / "env.txt").read_text().startswith("dry run: 4 GPUs of 139.8 GiB planned")
    assert not os.path.exists("/tmp/stall_run/checkpoint") and not os.path.exists("/tmp/ckpt_speed/checkpoint")


def test_a_failing_step_makes_the_script_exit_1_and_names_it(tmp_path: Path) -> None:
    e = env() | {"GPU_CHECKS_DRY_RUN": "2", "OUT": str(tmp_path), "PROFILE_ARGS": "--train.bach_size=3"}
    e.pop("CUDA_VISIBLE_DEVICES", None)
    proc = subprocess.run(["bash", "scripts/gpu_checks.sh", "scaling_profile", "no_such_step"], capture_output=True,
                          text=True, env=e, cwd=REPO, timeout=600)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "config error: unknown key [train].bach_size (did you mean batch_size?)" in proc.stdout
    assert proc.stdout.splitlines()[-1] == "== FAILED steps: scaling_profile no_such_step =="
