"""scripts/benchmark.py's functions, loaded in-process: the MFU peak table, precision overrides, the memory cap.
Its runs as a command: tests/cli/test_benchmark.py."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import load_script
from trainer.metrics.logger import PEAK_BF16_FLOPS


def _load_benchmark():
    return load_script("benchmark")


@pytest.mark.parametrize(("gpu", "peak"), [("NVIDIA H100 80GB HBM3", 989.5e12), ("NVIDIA H100 PCIe", 756e12),
                                           ("NVIDIA A100-SXM4-80GB", 312e12)])
def test_benchmark_mfu_uses_the_metrics_peak_table(monkeypatch, gpu, peak) -> None:
    benchmark = _load_benchmark()
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: gpu)
    assert peak in dict(PEAK_BF16_FLOPS).values()
    assert benchmark.mfu_pct(100e12, torch.device("cuda", 0)) == pytest.approx(100 * 100e12 / peak)
    assert benchmark.mfu_pct(100e12, torch.device("cpu")) is None


def test_precision_may_name_a_recipe() -> None:
    overrides = _load_benchmark().precision_overrides
    assert overrides("bf16") == ["--train.mixed_precision=bf16"]
    assert overrides("fp8:blockwise") == ["--train.mixed_precision=fp8", "--float8.recipe=blockwise"]


def test_memory_cap_gives_back_the_state_a_larger_job_would_not_hold() -> None:
    benchmark = _load_benchmark()
    assert benchmark.state_bytes_per_param("fp32", "stochastic") == 16  # fp32 weight, grad, exp_avg, exp_avg_sq
    assert benchmark.state_bytes_per_param("bf16", "stochastic") == 8
    assert benchmark.state_bytes_per_param("bf16", "kahan") == 10
    assert benchmark.state_bytes_per_param("bf16", "stochastic", "fp8", "auto") == 2 + 2 + 1 + 4 / 128 + 2
    # Llama 3 8B (8.03B parameters) on 4 GPUs, emulating 16 H100s: each rank holds 2.0B parameters' state (32 GB)
    # where a 16-GPU rank holds 8 GB, so the cap is 80 GB + 24 GB.
    cap = benchmark.memory_cap_bytes(local_params=2_007_500_000, bytes_per_param=16, world=4, emulate_gpus=16,
                                     gpu_bytes=80 * 10**9)
    assert cap == 80 * 10**9 + 3 * 2_007_500_000 * 16 // 4
    # Emulating the same number of GPUs is no cap beyond the GPU itself.
    assert benchmark.memory_cap_bytes(local_params=10, bytes_per_param=16, world=4, emulate_gpus=4, gpu_bytes=1000) == 1000


def test_inductor_options_take_inductors_keys_in_their_types() -> None:
    benchmark = _load_benchmark()
    assert benchmark.inductor_options(["triton.prefer_nd_tiling=true", "coordinate_descent_tuning=0",
                                       "triton.max_tiles=3"]) == {
        "triton.prefer_nd_tiling": True, "coordinate_descent_tuning": False, "triton.max_tiles": 3}
    assert benchmark.inductor_options([]) == {}
    for item, message in [
        ("triton.prefer_nd_tilling=true", "--inductor triton.prefer_nd_tilling=true: inductor has no option "
                                          "'triton.prefer_nd_tilling' (did you mean triton.prefer_nd_tiling?)"),
        ("triton.prefer_nd_tiling=maybe", "--inductor triton.prefer_nd_tiling=maybe: triton.prefer_nd_tiling is "
                                          "true or false"),
        ("triton.max_tiles=two", "--inductor triton.max_tiles=two: triton.max_tiles is a number"),
        ("triton.prefer_nd_tiling", "--inductor triton.prefer_nd_tiling: expected KEY=VALUE"),
    ]:
        with pytest.raises(ValueError) as e:
            benchmark.inductor_options([item])
        assert str(e.value) == message
