"""Profiling through the trainer, health metrics and FP8 statistics."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers import DEBUG_CONFIG, launch
from trainer.metrics import MetricsLogger, StepStats


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


def _logger(tmp_path: Path, **kw) -> MetricsLogger:
    args = dict(dump_folder=str(tmp_path), rank=0, total_steps=10, flops_per_token=1e9, peak_flops=None,
                device=torch.device("cpu"), enable_tensorboard=False, enable_jsonl=True, loss_spike_factor=3.0,
                fp8_converted_fraction=None)
    args.update(kw)
    return MetricsLogger(**args)


def test_loss_spikes_nonfinite_counts_and_fp8_fraction_are_recorded(tmp_path: Path) -> None:
    log = _logger(tmp_path, fp8_converted_fraction=29 / 30)
    for step, loss in enumerate([4.0, 3.9, 3.8, 12.0, 3.7], start=1):
        if step == 5:
            log.record_nonfinite()
        log.log(StepStats(step=step, loss=loss, grad_norm=1.0, lr=1e-3, tokens=1000, seconds=0.5,
                          steps_in_interval=1), first_step=1)
    log.close()
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss_spike"] for r in records] == [False, False, False, True, False]
    assert [r["nonfinite_count"] for r in records] == [0, 0, 0, 0, 1]
    assert records[0]["tps"] == 2000 and records[0]["tflops"] == pytest.approx(2000 * 1e9 / 1e12)
    assert all(r["fp8_converted_fraction"] == pytest.approx(29 / 30) for r in records)
    assert records[0]["mfu"] is None


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
    assert len(stats) == 2 * 29
