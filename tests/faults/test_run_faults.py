"""Faults a run must survive or refuse in one line: preemption, two runs on one folder, unwritable outputs."""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import FAST, REPO, TRAIN, env, launch, read_metrics
from trainer.errors import UserError
from trainer.run.lock import LOCK_NAME, RunLock, RunLockError, check_writable


def _start(args: list[str], dump: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, TRAIN, *args, f"--job.dump_folder={dump}"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env(), cwd=REPO)


def _wait_for_steps(proc: subprocess.Popen, dump: Path, n: int, timeout: float = 120) -> None:
    metrics, deadline = dump / "metrics.jsonl", time.time() + timeout
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= n):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.time() < deadline, "training did not start"
        time.sleep(0.1)


@pytest.mark.slow
def test_sigterm_saves_exits_143_and_resume_has_no_duplicate_rows(tmp_path: Path) -> None:
    args = [*FAST, "--train.steps=100000", "--train.batch_size=2", "--checkpoint.enable=true",
            "--checkpoint.interval=100000"]
    proc = _start(args, tmp_path)
    try:
        _wait_for_steps(proc, tmp_path, 3)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 143, err[-3000:]
    step = read_metrics(tmp_path)[-1]["step"]
    assert f"stopped by SIGTERM at step {step} of 100000; checkpoint step-{step} saved; exiting with code 143" in out
    assert "training finished" not in out
    assert json.loads((tmp_path / "preempted.json").read_text()) == {"step": step, "of_steps": 100000,
                                                                    "checkpoint_saved": True, "signal": "SIGTERM"}
    # The requeued run resumes, finishes (exit 0), clears the marker, and logs each step once.
    done = launch([*args[:-3], f"--train.steps={step + 2}", "--checkpoint.enable=true",
                   f"--job.dump_folder={tmp_path}"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert not (tmp_path / "preempted.json").exists()
    steps = [r["step"] for r in read_metrics(tmp_path)]
    assert steps == sorted(set(steps)) and steps[-1] == step + 2


@pytest.mark.slow
@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)], ids=["sigterm", "ctrl-c"])
def test_a_stop_signal_while_step_1_compiles_stops_at_once(tmp_path: Path, sig: signal.Signals, code: int) -> None:
    """A stop waits for the current step to end, but step 1 of a compiled CPU run is minutes of compilation and
    nothing is saved before it ends: a signal then stops the run at once, with its exit code and one line."""
    cmd = [sys.executable, TRAIN, *FAST, "--train.steps=3", "--train.compile_model=true",
           f"--job.dump_folder={tmp_path}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env(), cwd=REPO)
    out = []
    try:
        for line in proc.stdout:
            out.append(line)
            if "training steps 1-3" in line:  # the loop starts: step 1 compiles (seconds even from a warm cache)
                proc.send_signal(sig)
                sent = time.monotonic()
                break
        out.append(proc.communicate(timeout=120)[0])
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = "".join(out)
    assert proc.returncode == code, text[-3000:]
    assert (f"stopped by {sig.name} before step 1 finished: nothing to save (no step had finished); exiting with "
            f"code {code}") in text
    assert "Traceback" not in text and "| loss" not in text and "received" not in text
    assert not (tmp_path / "metrics.jsonl").exists() or not read_metrics(tmp_path)
    assert json.loads((tmp_path / "preempted.json").read_text()) == {"step": 0, "of_steps": 3,
                                                                    "checkpoint_saved": False, "signal": sig.name}
    # Not after step 1's compilation (1-5 minutes on a shared 2-core machine); the bound is teardown under load.
    assert took < 30, took


@pytest.mark.slow
def test_second_run_on_the_same_folder_fails_at_once_naming_the_first(tmp_path: Path) -> None:
    first = _start([*FAST, "--train.steps=100000"], tmp_path)
    try:
        _wait_for_steps(first, tmp_path, 2)
        start = time.time()
        second = launch([*FAST, "--train.steps=3", "--train.seed=1", f"--job.dump_folder={tmp_path}"])
        assert time.time() - start < 60
        assert second.returncode == 2
        line = second.stderr.strip()
        assert len(line.splitlines()) == 1 and "Traceback" not in second.stderr
        assert f"is in use by another run (host {socket.gethostname()}, pid {first.pid}, started " in line
        # Another dump folder, but checkpoints inside the first run's folder (an absolute checkpoint.folder).
        other = tmp_path.with_name(tmp_path.name + "-other")
        third = launch([*FAST, "--train.steps=3", f"--job.dump_folder={other}", "--checkpoint.enable=true",
                        f"--checkpoint.folder={tmp_path / 'checkpoint'}"])
        assert third.returncode == 2 and third.stderr.strip() == (
            f"error (rank 0): checkpoint.folder {tmp_path / 'checkpoint'} is inside {tmp_path}, the folder of another "
            f"run (host {socket.gethostname()}, pid {first.pid}, started {_lock_holder(tmp_path)['start_time']}); "
            "wait for it to finish or use another checkpoint.folder"), third.stderr[-3000:]
        assert first.poll() is None  # the first run is untouched
    finally:
        first.terminate()
        out, err = first.communicate(timeout=120)
    # The first run released its lock when it stopped.
    assert not (tmp_path / LOCK_NAME).exists(), (first.returncode, err[-3000:])


def _lock_holder(folder: Path) -> dict:
    return json.loads((folder / LOCK_NAME).read_text())


def test_a_stale_lock_is_reclaimed_with_a_log_line(tmp_path: Path, caplog, monkeypatch) -> None:
    import logging

    monkeypatch.setattr(logging.getLogger("trainer"), "propagate", True)  # setup_logging may have run
    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid that no longer exists
    (tmp_path / LOCK_NAME).write_text(json.dumps({"host": socket.gethostname(), "pid": dead.pid,
                                                   "start_time": "yesterday"}))
    lock = RunLock(tmp_path)
    lock.acquire()
    try:
        assert f"pid {dead.pid} on this host is gone" in caplog.text
        assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
        with pytest.raises(RunLockError, match=f"pid {os.getpid()}"):
            RunLock(tmp_path).acquire()  # a live holder is not stale
    finally:
        lock.release()
    assert not (tmp_path / LOCK_NAME).exists()


def test_a_lock_from_another_host_is_stale_only_without_heartbeat(tmp_path: Path) -> None:
    path = tmp_path / LOCK_NAME
    path.write_text(json.dumps({"host": "node-17", "pid": 4242, "start_time": "t0"}))
    with pytest.raises(RunLockError, match="host node-17, pid 4242, started t0"):
        RunLock(tmp_path, stale_seconds=300).acquire()
    old = time.time() - 600
    os.utime(path, (old, old))
    lock = RunLock(tmp_path, stale_seconds=300)
    lock.acquire()
    lock.release()


def test_unwritable_outputs_fail_before_the_model_is_built(tmp_path: Path, monkeypatch) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    proc = launch([*FAST, "--train.steps=1", f"--job.dump_folder={blocker}/run"])
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith(f"error (rank 0): job.dump_folder='{blocker}/run' is not writable: "), proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Model:" not in proc.stdout
    # The checkpoint folder under a file is found before training, not at the first save.
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "ckpt").write_text("")
    proc = launch([*FAST, "--train.steps=1", "--checkpoint.enable=true", "--checkpoint.folder=ckpt",
                   f"--job.dump_folder={tmp_path / 'run'}"])
    assert proc.returncode == 2 and "checkpoint.folder=" in proc.stderr and "is not writable" in proc.stderr
    assert "Model:" not in proc.stdout and "| loss" not in proc.stdout

    # A read-only mount (root ignores permission bits, so the filesystem's answer is simulated).
    def read_only(self, data):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))

    monkeypatch.setattr(Path, "write_bytes", read_only)
    with pytest.raises(UserError, match="job.dump_folder='.*' is not writable: Read-only file system"):
        check_writable(tmp_path / "ro", key="job.dump_folder")
