"""Profiling through the trainer run as a command: the window writes a trace and a summary, and an fp8 run's
summary says FP8 GEMMs ran. FP8 weight statistics in-process: tests/unit/test_observability.py."""

from __future__ import annotations

from pathlib import Path

from tests.helpers import DEBUG_CONFIG, launch


def _profile(tmp_path: Path, precision: str):
    trace_dir = tmp_path / f"traces_{precision}"
    proc = launch(["--config", DEBUG_CONFIG, "--train.steps=6", "--train.seq_len=32",
                   f"--train.mixed_precision={precision}", "--profiling.enable=true", "--profiling.start_step=3",
                   "--profiling.end_step=5", f"--profiling.trace_dir={trace_dir}",
                   f"--job.dump_folder={tmp_path / precision}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return trace_dir, proc.stdout


def test_profiling_window_writes_trace_and_summary(tmp_path: Path) -> None:
    trace_dir, out = _profile(tmp_path, "bf16")
    assert sorted(p.name for p in trace_dir.iterdir()) == ["rank0_step3-5.pt.trace.json.gz", "summary_step3-5.txt"]
    from trainer.metrics.trace_summary import load_trace_events, profiler_steps

    assert profiler_steps(load_trace_events(str(trace_dir / "rank0_step3-5.pt.trace.json.gz"))) == [3, 4, 5]
    summary = (trace_dir / "summary_step3-5.txt").read_text()
    assert "GEMM" in summary and summary.strip().endswith("FP8 GEMMs ran: no (only bf16/fp32 GEMMs)")
    assert "FP8 GEMMs ran: no" in out  # also logged


def test_fp8_run_summary_says_fp8_ran(tmp_path: Path) -> None:
    trace_dir, out = _profile(tmp_path, "fp8")
    summary = (trace_dir / "summary_step3-5.txt").read_text()
    assert "FP8 GEMMs ran: yes" in summary and "aten::_scaled_mm" in summary
    assert "no FP8 GEMM ran" not in out
