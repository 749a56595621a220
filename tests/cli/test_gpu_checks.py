"""scripts/gpu_checks.sh's multi-GPU steps without a GPU: GPU_CHECKS_DRY_RUN=N validates every job they would
launch by its --dry-run for the ranks it would start, so a table's command is known to be a valid job before a
multi-GPU machine is lent."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

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


@pytest.mark.parametrize("parity_exit, status, last", [
    (3, 3, "== INCONCLUSIVE parity steps: parity_moe parity_dispatch =="),
    (1, 1, "== FAILED steps: parity_moe parity_dispatch =="),
])
def test_an_inconclusive_parity_verdict_is_not_a_failure(tmp_path: Path, parity_exit: int, status: int,
                                                         last: str) -> None:
    """scripts/fp8_parity.py exits 3 for INCONCLUSIVE (no leg failed): the parity steps are listed as such and the
    script exits 3, not 1; its exit 1 (a FAIL) stays a failed step. A python3 ahead on PATH stands for the parity
    script and hands every other call to the real interpreter."""
    shim = tmp_path / "bin" / "python3"
    shim.parent.mkdir()
    shim.write_text(f'#!/usr/bin/env bash\nif [ "$1" = scripts/fp8_parity.py ]; then echo "verdict of $*"; '
                    f'exit {parity_exit}; fi\nexec {sys.executable} "$@"\n')
    shim.chmod(0o755)
    e = env() | {"GPU_CHECKS_DRY_RUN": "1", "OUT": str(tmp_path / "out"), "PATH": f"{shim.parent}:{os.environ['PATH']}"}
    proc = subprocess.run(["bash", "scripts/gpu_checks.sh", "parity_moe", "parity_dispatch"], capture_output=True,
                          text=True, env=e, cwd=REPO, timeout=120)
    assert proc.returncode == status, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stdout.splitlines()[-1] == last
    assert "verdict of scripts/fp8_parity.py --config configs/train/debug_moe.toml" in proc.stdout
    assert "FAILED (exit 3)" not in proc.stdout


def test_tracks_run_one_per_gpu_with_their_env_and_stop_at_the_limit(tmp_path: Path) -> None:
    """scripts/gpu_tracks.sh: track i gets GPU i, its own OUT and its env (+ for a space), a seed folder copied in
    first; a track still running at the limit is stopped with every process of its session, and the archive holds
    both tracks' folders."""
    import tarfile

    stub = tmp_path / "checks.sh"  # stands for gpu_checks.sh: says what it got; the step "hang" never ends alone
    stub.write_text('echo "gpu=$CUDA_VISIBLE_DEVICES out=$OUT ac=${PEER_AC:-} steps=$*"\n'
                    'ls "$OUT"\n'
                    'if [ "$1" = hang ]; then sleep 300 & echo $! > "$OUT/child.pid"; wait; fi\n')
    (tmp_path / "seed" / "track0").mkdir(parents=True)
    (tmp_path / "seed" / "track0" / "leg_done.txt").write_text("finished\n")
    work, out = tmp_path / "work", tmp_path / "out"
    e = env() | {"OUT": str(out), "GPU_CHECKS": str(stub), "GPU_TRACKS_WORK": str(work),
                 "GPU_TRACKS_SEED": str(tmp_path / "seed"), "GPU_CHECKS_DRY_RUN": "1"}
    proc = subprocess.run(["bash", "scripts/gpu_tracks.sh", "4", "PEER_AC=none+selective|families peer8b", "|hang"],
                          capture_output=True, text=True, env=e, cwd=REPO, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    first, second = (work / "track0" / "track.log").read_text(), (work / "track1" / "track.log").read_text()
    assert f"gpu=0 out={work}/track0 ac=none selective steps=families peer8b" in first
    assert "leg_done.txt" in first and "[track 0] exit 0" in first
    assert f"gpu=1 out={work}/track1 ac= steps=hang" in second and "[track 1] stopped at the 4 s limit" in second
    child = int((work / "track1" / "child.pid").read_text())
    assert not Path(f"/proc/{child}").exists() or "Z" in Path(f"/proc/{child}/stat").read_text().split()[2]
    with tarfile.open(out / "tracks.tgz") as tar:
        names = set(tar.getnames())
    assert {"track0/track.log", "track0/leg_done.txt", "track1/track.log"} <= names
    assert "[track 0] gpu=0" in proc.stdout and "[track 1] [track 1] stopped" in proc.stdout


def test_tracks_of_two_gpus_each(tmp_path: Path) -> None:
    """GPU_TRACKS_GPUS=2: track i gets GPUs 2i and 2i+1 (two 2-GPU steps side by side on a 4-GPU machine)."""
    stub = tmp_path / "checks.sh"
    stub.write_text('echo "gpu=$CUDA_VISIBLE_DEVICES steps=$*"\n')
    work = tmp_path / "work"
    e = env() | {"OUT": str(tmp_path / "out"), "GPU_CHECKS": str(stub), "GPU_TRACKS_WORK": str(work),
                 "GPU_TRACKS_GPUS": "2", "GPU_CHECKS_DRY_RUN": "1"}
    proc = subprocess.run(["bash", "scripts/gpu_tracks.sh", "20", "|scaling_variants", "|pp_variants"],
                          capture_output=True, text=True, env=e, cwd=REPO, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "gpu=0,1 steps=scaling_variants" in (work / "track0" / "track.log").read_text()
    assert "gpu=2,3 steps=pp_variants" in (work / "track1" / "track.log").read_text()
