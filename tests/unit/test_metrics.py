"""trainer/metrics/: throughput and MFU arithmetic, the console line, metrics.jsonl rows, the health counters,
and the outputs of an earlier run set aside or truncated on resume."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import trainer.metrics.logger as metrics
from trainer.metrics.logger import MetricsLogger, StepStats, device_peak_flops, set_aside, truncate_jsonl


def _logger(tmp_path: Path, **kw) -> MetricsLogger:
    args = dict(dump_folder=str(tmp_path), rank=0, total_steps=10, flops_per_token=1e9, peak_flops=None,
                device=torch.device("cpu"), enable_tensorboard=False, enable_jsonl=True, loss_spike_factor=3.0,
                fp8_converted_fraction=None)
    args.update(kw)
    return MetricsLogger(**args)


def _rows(tmp_path: Path) -> list[dict]:
    return [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture
def on_a_gpu(monkeypatch):
    """The logger as on a GPU (the line then shows TFLOP/s and MFU), with fixed memory peaks and a clock that the
    test moves."""
    clock = [100.0]
    monkeypatch.setattr(metrics, "peak_memory_gib", lambda device: (1.5, 2.25))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(metrics, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    return clock


def test_tps_tflops_mfu_and_eta_follow_from_tokens_time_and_peak(tmp_path: Path, on_a_gpu, caplog) -> None:
    # 6e9 FLOPs per token at 2,000 tokens/s is 12 TFLOP/s; against a 1e15 FLOP/s peak, 1.2% MFU.
    log = _logger(tmp_path, device=torch.device("cuda", 0), peak_flops=1e15, flops_per_token=6e9, total_steps=100)
    with caplog.at_level(logging.INFO, logger="trainer"):
        on_a_gpu[0] = 105.0
        first = log.log(StepStats(step=1, loss=4.0, grad_norm=0.5, lr=3e-4, tokens=1000, seconds=0.5,
                                  steps_in_interval=1), first_step=1)
        on_a_gpu[0] = 125.0  # 4 steps after the first in 20 s: 5 s a step, 95 to go
        row = log.log(StepStats(step=5, loss=3.0, grad_norm=0.25, lr=3e-4, tokens=8000, seconds=2.0,
                                steps_in_interval=4, extra={"aux_loss": 0.0125, "val_loss": 3.5,
                                                            "val_ppl": math.exp(3.5)}), first_step=1)
    log.close()
    assert first["tps"] == 2000 and first["tflops"] == pytest.approx(12.0) and first["mfu"] == pytest.approx(1.2)
    assert row["tps"] == 4000 and row["tflops"] == pytest.approx(24.0) and row["mfu"] == pytest.approx(2.4)
    assert row["step_time_s"] == 0.5 and row["elapsed_s"] == 25.0  # 2 s over 4 steps; since the logger began
    lines = [r.getMessage() for r in caplog.records]
    # The first step holds the warm-up: no ETA from it. Then 95 steps x 5 s = 7m55s.
    assert lines[0].endswith("| eta ?")
    assert lines[1] == ("step      5/100 | loss  3.0000 | aux_loss 0.0125 | grad_norm   0.250 | lr 3.00e-04 | "
                        "tps 4,000 | tflops   24.0 | mfu   2.4% | mem  1.50/ 2.25 GiB | eta 7m55s | "
                        "val_loss  3.5000 ppl 33.12")


def test_unknown_peak_says_mfu_n_a_and_a_cpu_line_leaves_flops_out(tmp_path: Path, on_a_gpu, caplog) -> None:
    stats = StepStats(step=1, loss=4.0, grad_norm=0.5, lr=3e-4, tokens=1000, seconds=0.5, steps_in_interval=1)
    with caplog.at_level(logging.INFO, logger="trainer"):
        _logger(tmp_path / "gpu", device=torch.device("cuda", 0)).log(stats, first_step=1)
        _logger(tmp_path / "cpu").log(stats, first_step=1)
    gpu, cpu = [r.getMessage() for r in caplog.records]
    assert "| tflops    2.0 | mfu n/a |" in gpu
    assert "tflops" not in cpu and "mfu" not in cpu and "| tps 2,000 | mem " in cpu


def test_jsonl_rows_hold_every_field_and_the_hooks_scalars(tmp_path: Path, on_a_gpu) -> None:
    log = _logger(tmp_path, fp8_converted_fraction=0.75)
    for step in (1, 2):
        log.log(StepStats(step=step, loss=2.0, grad_norm=1.0, lr=1e-3, tokens=10, seconds=1.0, steps_in_interval=1,
                          extra={"moe/imbalance_mean": 1.5}), first_step=1)
    log.close()
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[1] == {"step": 2, "loss": 2.0, "grad_norm": 1.0, "lr": 1e-3, "tps": 10.0, "tflops": 1e-2, "mfu": None,
                       "step_time_s": 1.0, "memory_peak_gib": 1.5, "memory_reserved_gib": 2.25, "loss_spike": False,
                       "nonfinite_count": 0, "elapsed_s": 0.0, "fp8_converted_fraction": 0.75,
                       "moe/imbalance_mean": 1.5}


def test_only_rank_0_writes(tmp_path: Path) -> None:
    log = _logger(tmp_path / "rank1", rank=1)
    record = log.log(StepStats(step=1, loss=2.0, grad_norm=1.0, lr=1e-3, tokens=10, seconds=1.0, steps_in_interval=1),
                     first_step=1)
    log.close()
    assert record["tps"] == 10.0  # the values are computed for the caller on every rank
    assert not (tmp_path / "rank1").exists()


def test_loss_spikes_nonfinite_counts_and_fp8_fraction_are_recorded(tmp_path: Path) -> None:
    log = _logger(tmp_path, fp8_converted_fraction=29 / 30)
    for step, loss in enumerate([4.0, 3.9, 3.8, 12.0, 3.7], start=1):
        if step == 5:
            log.record_nonfinite()
        log.log(StepStats(step=step, loss=loss, grad_norm=1.0, lr=1e-3, tokens=1000, seconds=0.5,
                          steps_in_interval=1), first_step=1)
    log.close()
    records = _rows(tmp_path)
    assert [r["loss_spike"] for r in records] == [False, False, False, True, False]
    assert [r["nonfinite_count"] for r in records] == [0, 0, 0, 0, 1]
    assert records[0]["tps"] == 2000 and records[0]["tflops"] == pytest.approx(2000 * 1e9 / 1e12)
    assert all(r["fp8_converted_fraction"] == pytest.approx(29 / 30) for r in records)
    assert records[0]["mfu"] is None


@pytest.mark.parametrize("name, peak", [("NVIDIA H100 80GB HBM3", 989.5e12), ("NVIDIA H100 PCIe", 756e12),
                                        ("NVIDIA H100 NVL", 835e12), ("NVIDIA A100-SXM4-80GB", 312e12),
                                        ("NVIDIA L4", 121e12), ("NVIDIA GeForce RTX 4090", None)])
def test_device_peak_is_the_most_specific_name_in_the_table(monkeypatch, caplog, name: str, peak) -> None:
    """"H100 PCIe" must not read as the SXM "H100" (the table lists the longer names first)."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    with caplog.at_level(logging.WARNING, logger="trainer"):
        assert device_peak_flops(torch.device("cuda", 0)) == peak
    assert ("MFU will not be reported" in caplog.text) == (peak is None)
    assert device_peak_flops(torch.device("cpu")) is None


def test_fresh_run_sets_earlier_outputs_aside_without_deleting(tmp_path: Path) -> None:
    jsonl, tb = tmp_path / "metrics.jsonl", tmp_path / "tb"
    for n in (1, 2):
        jsonl.write_text(f'{{"step": {n}}}\n')
        tb.mkdir()
        set_aside([jsonl, tb])
    assert not jsonl.exists() and not tb.exists()
    assert (tmp_path / "metrics.jsonl.prev-1").read_text() == '{"step": 1}\n'
    assert (tmp_path / "metrics.jsonl.prev-2").read_text() == '{"step": 2}\n'
    assert (tmp_path / "tb.prev-1").is_dir() and (tmp_path / "tb.prev-2").is_dir()


def test_resume_drops_rows_after_the_checkpoint_and_a_torn_line(tmp_path: Path) -> None:
    jsonl = tmp_path / "metrics.jsonl"
    jsonl.write_text('{"step": 1}\n{"step": 2}\n{"step": 3}\n{"step": 4, "lo')
    log = _logger(tmp_path, resumed_step=2)
    log.log(StepStats(step=3, loss=2.0, grad_norm=1.0, lr=1e-3, tokens=10, seconds=1.0, steps_in_interval=1),
            first_step=3)
    log.close()
    assert [r["step"] for r in _rows(tmp_path)] == [1, 2, 3]  # each step once; nothing set aside
    assert not list(tmp_path.glob("*.prev-*"))
    truncate_jsonl(tmp_path / "absent.jsonl", after_step=1)  # no file yet: nothing to do
