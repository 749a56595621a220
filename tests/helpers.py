"""Run the real trainer in subprocesses (1 process or torchrun) and read what it wrote."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TRAIN = str(REPO / "scripts" / "train.py")
DEBUG_CONFIG = str(REPO / "configs" / "train" / "debug_model.toml")

# Small, fp32 and deterministic: comparisons across layouts hold to fp32 rounding.
FAST = [
    "--config", DEBUG_CONFIG,
    "--train.seq_len=64",
    "--train.mixed_precision=fp32",
    "--metrics.log_freq=1",
    "--metrics.enable_tensorboard=false",
]


def env() -> dict[str, str]:
    e = dict(os.environ)
    e["OMP_NUM_THREADS"] = "1"  # 2-4 processes on a 2-core machine
    e["PYTHONPATH"] = str(REPO) + os.pathsep + e.get("PYTHONPATH", "")
    e.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path("/tmp") / "trainer_inductor_cache"))
    return e


def launch(args: list[str], *, nproc: int = 1, timeout: int = 300) -> subprocess.CompletedProcess:
    if nproc == 1:
        cmd = [sys.executable, TRAIN, *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", TRAIN, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env(), cwd=REPO)


def train(args: list[str], dump: Path, *, nproc: int = 1) -> list[dict]:
    """Run training; return the metrics.jsonl records. Fails the test with the output on error."""
    proc = launch([*args, f"--job.dump_folder={dump}"], nproc=nproc)
    if proc.returncode != 0:
        raise AssertionError(f"training failed (rc={proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return read_metrics(dump)


def read_metrics(dump: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(dump) / "metrics.jsonl").read_text().splitlines()]


def column(records: list[dict], key: str) -> list[float]:
    return [r[key] for r in records]


def hooks_env(**variables: str) -> dict[str, str]:
    """env() plus the test-only hooks of tests/support/sitecustomize.py, e.g. TRAINER_TEST_PAUSE="save:10:1"."""
    e = env()
    e["PYTHONPATH"] = str(REPO / "tests" / "support") + os.pathsep + e["PYTHONPATH"]
    e.update(variables)
    return e


def run_until_paused(cmd: list[str], pause: str, *, timeout: float = 150) -> str:
    """Start cmd with TRAINER_TEST_PAUSE=pause, wait until a rank reports the pause, then SIGKILL
    the whole process group (torchrun and every rank): no cleanup of any kind runs."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                            env=hooks_env(TRAINER_TEST_PAUSE=pause), start_new_session=True)
    out = []
    watchdog = threading.Timer(timeout, os.killpg, (proc.pid, signal.SIGKILL))  # a hang fails, not blocks
    watchdog.start()
    try:
        for line in proc.stdout:
            out.append(line)
            if line.startswith("TRAINER_TEST_PAUSE"):
                break
        else:
            raise AssertionError("the run ended without reaching the pause:\n" + "".join(out[-60:]))
    finally:
        watchdog.cancel()
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    return "".join(out)
