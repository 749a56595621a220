"""A stop signal to one rank, or SIGTERM or Ctrl-C to torchrun, stops every rank after the same step, with a
checkpoint; rank 0 says what torchrun's own lines and status after it mean (docs/cluster.md, "A stopped job's log")."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import FAST, REPO, TRAIN, env


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


@pytest.mark.slow  # starts 2 processes
@pytest.mark.parametrize("target, sig, worker_code", [
    ("one worker", signal.SIGTERM, 143),
    ("torchrun", signal.SIGINT, 130),  # Ctrl-C in the terminal: torchrun sends SIGINT to every worker
    ("torchrun", signal.SIGTERM, 143),  # a scheduler's stop: torchrun forwards SIGTERM to every worker
])
def test_stop_signal_stops_all_ranks_together(tmp_path: Path, target: str, sig: signal.Signals,
                                              worker_code: int) -> None:
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
        # With one worker told to stop, the other must learn it from the agreement.
        import os

        os.kill(max(workers) if target == "one worker" else proc.pid, sig)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    # torchrun exits 1 either way: a worker that exited 143 is a failure to it, and so is its own SIGINT.
    assert proc.returncode == 1, err[-3000:]
    if target == "one worker":
        assert f"exitcode  : {worker_code}" in err
    elif sig == signal.SIGTERM:  # torch's traceback, not ours: the lines docs/cluster.md shows
        assert "torch.distributed.elastic.multiprocessing.api.SignalException: Process" in err
    # Ours, once, after the stop line: what torchrun's status (and traceback) mean, and the record to read.
    notes = [line for line in out.splitlines() if "under torchrun: its exit status is 1 whatever its workers" in line]
    assert len(notes) == 1 and notes[0].startswith("[rank0 ") and str(tmp_path / "preempted.json") in notes[0]
    assert "nanobind" not in out + err
    name = sig.name
    assert f"received {name}: stopping after this step" in out + err
    last = json.loads(metrics.read_text().splitlines()[-1])["step"]
    stopped = [line for line in out.splitlines() if f"stopped by {name} at step" in line]
    step = int(stopped[-1].split(f"stopped by {name} at step ")[1].split()[0])
    assert stopped[-1].endswith(f"exiting with code {worker_code}")
    assert json.loads((tmp_path / "preempted.json").read_text()) == {
        "step": step, "of_steps": 100000, "checkpoint_saved": True, "signal": name}
    assert step >= last
    assert (tmp_path / "checkpoint" / f"step-{step}").is_dir()  # saved on the way out
