"""FP8 through the trainer as a command: the log lines that confirm it (fp8 runs only), and an fp8 run's losses
as close to bf16 as bf16 is to itself under another seed, where deliberately broken scales are not. Which Linears
convert and the guards, in-process: tests/unit/test_float8.py."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import (DEBUG_CONFIG, REPO, column, env, fp8_linear_counts, launch, lines_before_step_1,
                           read_metrics, train)
from trainer.models import FLAVORS


def _messages(proc) -> list[str]:
    """The log messages of a run (the `[rank0   1.2s] ` prefix removed); fails the test on a non-zero exit."""
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    prefixed = (re.match(r"\[rank\d+ +[\d.]+s\] (.*)", line) for line in proc.stdout.splitlines())
    return [m.group(1) for m in prefixed if m]


def _fp8_block(messages: list[str]) -> list[str]:
    """The run's consecutive lines from the first one that mentions float8 to the FP8 summary's last."""
    first = next(i for i, m in enumerate(messages) if "loat8" in m)
    last = next(i for i, m in enumerate(messages) if m.startswith("float8 matmuls: "))
    return messages[first:last + 1]


def test_cli_logs_confirmation_only_for_fp8(tmp_path: Path) -> None:
    converted, linears = fp8_linear_counts(FLAVORS["debug"])
    base = ["--config", DEBUG_CONFIG, "--train.steps=1", "--train.seq_len=32"]
    messages = _messages(launch([*base, "--train.mixed_precision=fp8", f"--job.dump_folder={tmp_path / 'a'}"]))
    assert _fp8_block(messages) == [
        "float8 on CPU: oneDNN disabled so torch._scaled_mm uses aten's CPU kernel",
        # One process: "auto" leaves fp8 all-gather off (one rank in the shard group gathers nothing).
        "Applied Float8 training: recipe=TENSORWISE, fsdp_float8_all_gather=False, "
        "format=hybrid (e4m3 weights and activations, e5m2 gradients)",
        f"converted {converted}/{linears} Linear layers; excluded: none",
        "float8 matmuls: CPU: real torch._scaled_mm path (aten's CPU kernel; for correctness, not speed)",
    ]
    messages = _messages(launch([*base, "--train.mixed_precision=fp8", "--float8.recipe=rowwise",
                                 "--float8.enable_fsdp_float8_all_gather=false", "--float8.emulate=true",
                                 "--float8.exclude_fqns=output_head.proj",
                                 f"--job.dump_folder={tmp_path / 'b'}"]))
    assert _fp8_block(messages) == [
        "Applied Float8 training: recipe=ROWWISE, fsdp_float8_all_gather=False, format=e4m3 everywhere",
        f"converted {converted - 1}/{linears} Linear layers; excluded: output_head.proj (float8.exclude_fqns)",
        "float8 matmuls: EMULATED in high precision (float8.emulate=true)",
    ]
    messages = _messages(launch([*base, "--train.mixed_precision=bf16", f"--job.dump_folder={tmp_path / 'c'}"]))
    assert [m for m in messages if "loat8" in m or "Linear layers" in m or "FP8" in m] == []


def test_fp8_unavailable_here_is_one_story_from_every_startup_line(tmp_path: Path) -> None:
    """float8.recipe='blockwise' on a CPU without emulation trains in bf16: the banner says so, and so do the
    precision line, the CPU hint, the memory plan (a bf16 run's) and fp8_layers.json; no line claims FP8 matmuls,
    converted layers, or layers left bf16 "because of their shapes"."""
    import json

    base = ["--config", DEBUG_CONFIG, "--train.steps=1", "--train.seq_len=32"]
    proc = launch([*base, "--train.mixed_precision=fp8", "--float8.recipe=blockwise",
                   f"--job.dump_folder={tmp_path / 'fp8'}"])
    header = "\n".join(lines_before_step_1(proc.stdout + proc.stderr))
    messages = _messages(proc)
    assert "FP8 IS UNAVAILABLE ON THIS DEVICE: CPU has no blockwise FP8 kernels" in header
    assert "This run trains in BF16 instead." in header
    precision = next(m for m in messages if m.startswith("precision: "))
    assert precision.startswith("precision: train.mixed_precision='fp8': bfloat16 compute, NO FP8: blockwise FP8 is "
                                "unavailable on this device, every Linear layer runs in bfloat16;"), precision
    for claim in ("FP8 blockwise matmuls", "Linear layers stay bf16 because of their shapes", "Applied Float8",
                  "Linear layers; excluded", "float8 matmuls:", "train.mixed_precision='fp8' runs several times"):
        assert claim not in header, claim
    assert "on CPU, bf16 (what train.mixed_precision='fp8' runs here, FP8 being unavailable)" in header
    fp8 = json.loads((tmp_path / "fp8" / "fp8_layers.json").read_text())
    assert fp8["unavailable"].startswith("CPU has no blockwise FP8 kernels")
    assert "converted" not in fp8["layers"].values()
    assert fp8["layers"]["layers.0.attention.q_proj"] == "not converted: FP8 is unavailable on this device (trains in bf16)"
    bf16 = _messages(launch([*base, "--train.mixed_precision=bf16", f"--job.dump_folder={tmp_path / 'bf16'}"]))

    def plan(lines: list[str]) -> str:
        return next(m for m in lines if m.startswith("memory plan: "))

    assert plan(messages) == plan(bf16)  # what runs is bf16, and the plan is bf16's


# The same training run with torchao's dynamic scales multiplied by FACTOR (argv[1]): a deliberately
# broken FP8 (at 4, every value above a quarter of its tensor's amax saturates at the e4m3 maximum).
_BROKEN_SCALES = """
import functools, sys
import torchao.float8.float8_scaling_utils as su
factor, wrapped = float(sys.argv[1]), su.tensor_to_scale
su.tensor_to_scale = functools.wraps(wrapped)(lambda *a, **k: wrapped(*a, **k) * factor)
from trainer.cli import main
sys.exit(main(sys.argv[2:]))
"""


def _train_with_broken_scales(args: list[str], dump: Path, *, factor: float) -> list[float]:
    proc = subprocess.run([sys.executable, "-c", _BROKEN_SCALES, str(factor), *args, f"--job.dump_folder={dump}"],
                          capture_output=True, text=True, env=env(), cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return column(read_metrics(dump), "loss")


def _distance(a: list[float], b: list[float]) -> float:
    """Mean |a - b| over the second half of the run, relative to b's mean there."""
    half = len(b) // 2
    return sum(abs(x - y) for x, y in zip(a[half:], b[half:])) / sum(b[half:])


@pytest.mark.slow
def test_fp8_loss_tracks_bf16(tmp_path: Path) -> None:
    """fp8 must stay as close to bf16 as bf16 stays to itself under another seed (the noise floor).

    Measured (debug model, 20 steps, seq 64, CPU): two bf16 seeds are 2.4-4.2% apart; fp8 is
    0.8-4.4% from bf16 of the same seed; fp8 with 4x scales is 28% away. Criterion: within
    2x the noise floor measured here."""
    args = ["--config", DEBUG_CONFIG, "--train.steps=20", "--train.seq_len=64", "--metrics.log_freq=1",
            "--metrics.enable_tensorboard=false"]
    bf16 = column(train([*args, "--train.mixed_precision=bf16"], tmp_path / "bf16"), "loss")
    other_seed = column(train([*args, "--train.mixed_precision=bf16", "--train.seed=1"], tmp_path / "seed1"), "loss")
    f8 = column(train([*args, "--train.mixed_precision=fp8"], tmp_path / "fp8"), "loss")
    noise_floor = _distance(other_seed, bf16)
    assert noise_floor > 0.005  # the seed changed the run: the floor is a measurement, not zero
    assert f8[0] == pytest.approx(bf16[0], rel=0.01)  # same init and data: the first loss is nearly equal
    assert f8 != bf16  # and fp8 really changed the numerics
    assert _distance(f8, bf16) <= 2 * noise_floor
    # The criterion catches a broken FP8: scales 4x too large (saturation) fail it.
    broken = _train_with_broken_scales([*args, "--train.mixed_precision=fp8"], tmp_path / "broken", factor=4.0)
    assert _distance(broken, bf16) > 2 * noise_floor
    # And the harness really runs the trainer's fp8: with the factor at 1 it reproduces the fp8 run.
    assert _train_with_broken_scales([*args, "--train.mixed_precision=fp8"], tmp_path / "unbroken", factor=1.0) == f8
