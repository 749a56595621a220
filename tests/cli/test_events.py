"""metrics.event_log through the CLI (one process, CPU): a run stopped by SIGTERM leaves its run start with the hash of
its resolved.toml, one step record per step whose times fit the step's wall time, the profiler window's profile record,
checkpoint begin/end pairs and the stop; scripts/summarize_events.py reads it."""

from __future__ import annotations

import hashlib
import json
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

from tests.helpers import FAST, REPO, TRAIN, env
from trainer.metrics.events import CPU_TRACE


def test_event_log_of_a_run_stopped_by_sigterm(tmp_path: Path) -> None:
    args = [*FAST, "--train.steps=100000", "--train.batch_size=2", "--checkpoint.enable=true",
            "--checkpoint.interval=2", "--metrics.event_log=true", f"--job.dump_folder={tmp_path}",
            "--profiling.enable=true", "--profiling.start_step=2", "--profiling.end_step=3"]
    proc = subprocess.Popen([sys.executable, TRAIN, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env(), cwd=REPO)
    try:
        metrics = tmp_path / "metrics.jsonl"
        deadline = time.time() + 120
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 5):
            assert proc.poll() is None and time.time() < deadline, "training did not start"
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, err[-3000:]
    stopped = json.loads((tmp_path / "preempted.json").read_text())["step"]
    records = [json.loads(line) for line in (tmp_path / "events" / "rank-00000.jsonl").read_text().splitlines()]
    assert all(r["rank"] == 0 and isinstance(r["time"], float) for r in records)

    start = records[0]
    assert start["event"] == "run_start" and start["resumed_step"] == 0 and start["device"] == "cpu"
    assert start["layout"] == {"dp_replicate": 1, "dp_shard": 1, "tp": 1, "ep": 1, "pp": 1, "cp": 1, "world_size": 1}
    resolved = tomllib.loads((tmp_path / "resolved.toml").read_text())
    canonical = json.dumps(resolved, sort_keys=True, separators=(",", ":"), ensure_ascii=True, default=str)
    assert start["config_hash"] == hashlib.sha256(canonical.encode()).hexdigest()

    steps = [r for r in records if r["event"] == "step"]
    assert [r["step"] for r in steps] == list(range(1, stopped + 1))
    # The loop's own timer (metrics.jsonl's step_time_s, log_freq=1) spans each step's fetch, step and logging.
    wall = {row["step"]: row["step_time_s"] for row in map(json.loads, metrics.read_text().splitlines())}
    for r in steps:
        parts = [r["data_s"], r["forward_backward_s"], r["optimizer_s"]]
        assert min(parts) >= 0 and sum(parts) <= r["step_s"] + 1e-9 and r["step_s"] <= wall[r["step"]], r
        assert r["comm_s"] == 0.0  # one rank: no communication
    assert [r["time"] for r in steps] == sorted(r["time"] for r in steps) and steps[0]["time"] >= start["time"]

    # The profiler window's trace, summarized by the trainer into the log (a CPU trace: no communication timed).
    [profile] = [r for r in records if r["event"] == "profile"]
    trace = tmp_path / "profiler_traces" / "rank0_step2-3.pt.trace.json.gz"
    assert profile == {**profile, "step": 3, "steps": [2, 3], "num_steps": 2, "trace": str(trace), "device": "cpu",
                       "comm_s": None, "exposed_comm_s": None, "reason": CPU_TRACE}
    assert trace.exists() and profile["wall_s"] > 0

    saves = [(r["event"], r["step"]) for r in records if r["event"].startswith("checkpoint_")]
    expected = sorted({*range(2, stopped + 1, 2), stopped})
    assert saves == [(e, s) for s in expected for e in ("checkpoint_begin", "checkpoint_end")]
    ends = [r for r in records if r["event"] == "checkpoint_end"]
    assert all(r["error"] is None and r["seconds"] > 0 and r["path"] == str(tmp_path / "checkpoint" / f"step-{r['step']}")
               for r in ends)
    assert records[-1] == {"event": "stop", "time": records[-1]["time"], "rank": 0, "step": stopped,
                           "reason": "signal", "signal": "SIGTERM"}

    summary = subprocess.run([sys.executable, str(REPO / "scripts" / "summarize_events.py"), str(tmp_path)],
                             capture_output=True, text=True, cwd=REPO)
    assert summary.returncode == 0, summary.stderr
    row = next(line.split() for line in summary.stdout.splitlines() if line.split()[:1] == ["0"])
    assert row[:2] == ["0", str(stopped - 1)]  # its first step left out
    assert f"rank 0: launch 1 stopped at step {stopped} by SIGTERM" in summary.stdout
    assert f"config sha256 {start['config_hash']}" in summary.stdout
    assert f"the profiler trace of steps 2-3 times no communication: {CPU_TRACE}" in summary.stdout
