"""Profiling through the trainer and FP8 statistics (the health metrics: tests/unit/test_metrics.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers import DEBUG_CONFIG, fp8_linear_counts, launch


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
    from trainer.trace_summary import load_trace_events, profiler_steps

    assert profiler_steps(load_trace_events(str(trace_dir / "rank0_step3-5.pt.trace.json.gz"))) == [3, 4, 5]
    summary = (trace_dir / "summary_step3-5.txt").read_text()
    assert "GEMM" in summary and summary.strip().endswith("FP8 GEMMs ran: no (only bf16/fp32 GEMMs)")
    assert "FP8 GEMMs ran: no" in out  # also logged


def test_fp8_run_summary_says_fp8_ran(tmp_path: Path) -> None:
    trace_dir, out = _profile(tmp_path, "fp8")
    summary = (trace_dir / "summary_step3-5.txt").read_text()
    assert "FP8 GEMMs ran: yes" in summary and "aten::_scaled_mm" in summary
    assert "no FP8 GEMM ran" not in out


def test_fp8_weight_stats_per_layer() -> None:
    from trainer.models import FLAVORS, Llama
    from trainer.parallel.float8 import apply_float8, float8_weight_stats

    model = Llama(FLAVORS["debug"])
    model.init_weights(seed=0)
    apply_float8(model, recipe="tensorwise", enable_fsdp_float8_all_gather=False, exclude_fqns=[], emulate=True,
                 require=False, device=torch.device("cpu"))
    stats = float8_weight_stats(model)
    amax = stats["fp8/weight_amax/layers.0.attention.q_proj"]
    assert amax == pytest.approx(model.layers["0"].attention.q_proj.weight.abs().max().item())
    assert stats["fp8/weight_scale/layers.0.attention.q_proj"] == pytest.approx(448.0 / amax)
    assert len(stats) == 2 * fp8_linear_counts(FLAVORS["debug"])[0]  # amax and scale per converted Linear
