"""SIGTERM to one rank stops every rank after the same step, with a checkpoint."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.helpers import FAST, REPO, TRAIN, env


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def test_sigterm_on_one_rank_stops_all_ranks_together(tmp_path: Path) -> None:
    args = [*FAST, "--train.steps=100000", "--train.batch_size=2", "--distributed.dp_shard=2",
            "--checkpoint.enable=true", "--checkpoint.interval=100000", f"--job.dump_folder={tmp_path}"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", TRAIN, *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env(), cwd=REPO)
    try:
        metrics = tmp_path / "metrics.jsonl"
        deadline = time.time() + 120
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
            assert proc.poll() is None and time.time() < deadline, "training did not start"
            time.sleep(0.2)
        workers = _children(proc.pid)
        assert len(workers) == 2
        # Only one rank is told to stop: the other must learn it from the agreement.
        import os

        os.kill(max(workers), signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    # Each worker exits 143 (preempted); torchrun turns any worker failure into its own exit code 1.
    assert proc.returncode == 1, err[-3000:]
    assert "exitcode  : 143" in err
    assert "received SIGTERM: stopping after this step" in out + err
    last = json.loads(metrics.read_text().splitlines()[-1])["step"]
    stopped = [line for line in out.splitlines() if "stopped by SIGTERM at step" in line]
    step = int(stopped[-1].split("stopped by SIGTERM at step ")[1].split()[0])
    assert json.loads((tmp_path / "preempted.json").read_text())["step"] == step
    assert step >= last
    assert (tmp_path / "checkpoint" / f"step-{step}").is_dir()  # saved on the way out
