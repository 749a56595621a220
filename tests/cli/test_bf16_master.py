"""bf16 master weights in whole runs (the trainer as a command): a small-lr run where plain bf16 stalls and the
safe roundings track fp32 master weights, an exact resume of a bf16-master run, and switching the rounding or the
master dtype across a resume. The rounded update's unit properties: tests/unit/test_bf16_master.py."""

from __future__ import annotations

import math
import subprocess
from pathlib import Path

import pytest

from tests.helpers import DEBUG_CONFIG, launch_ok, losses_by_step


RUN = ["--config", DEBUG_CONFIG, "--train.seq_len=64", "--train.mixed_precision=bf16", "--train.deterministic=true",
       "--scheduler.decay_type=constant", "--scheduler.warmup_steps=1", "--metrics.log_freq=5",
       "--metrics.enable_tensorboard=false"]


def _run(args: list[str], dump: Path) -> subprocess.CompletedProcess:
    return launch_ok(args, dump, timeout=180)


@pytest.mark.slow
def test_small_lr_run_tracks_fp32_master_where_plain_bf16_stalls(tmp_path: Path) -> None:
    """lr=1e-5: most updates are below half an ulp of their weight. Measured on CPU (30 steps): fp32 master
    6.68 -> 5.36, plain bf16 -> 6.06, stochastic 5.36, kahan 5.37."""
    args = [*RUN, "--train.steps=30", "--optimizer.lr=1e-5"]
    runs = {}
    for name, extra in {"fp32": [], "nearest": ["--distributed.master_dtype=bf16", "--optimizer.bf16_update=nearest"],
                        "stochastic": ["--distributed.master_dtype=bf16", "--optimizer.bf16_update=stochastic"],
                        "kahan": ["--distributed.master_dtype=bf16", "--optimizer.bf16_update=kahan"]}.items():
        proc = _run([*args, *extra], tmp_path / name)
        runs[name] = losses_by_step(tmp_path / name)
        if name in ("stochastic", "kahan"):
            assert f"AdamW (bf16 master weights, {name} rounding)" in proc.stdout + proc.stderr
    ref = runs["fp32"]
    drop = ref[1] - ref[30]
    assert drop > 1.0
    gap = {name: max(abs(losses[s] - ref[s]) for s in ref) for name, losses in runs.items()}
    assert runs["nearest"][30] - ref[30] > 0.3 * drop, gap  # plain bf16 learns at half the pace or less
    for name in ("stochastic", "kahan"):
        assert gap[name] < 0.05 * drop, gap


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["stochastic", "kahan"])
def test_bf16_master_resume_is_exact(kind: str, tmp_path: Path) -> None:
    """10 steps uninterrupted vs 5 + resume + 5: the same losses, bit for bit (the rounding's random bits
    come from the saved step counter, the Kahan buffer from the checkpoint)."""
    args = [*RUN, "--metrics.log_freq=1", "--optimizer.lr=1e-4", "--distributed.master_dtype=bf16",
            f"--optimizer.bf16_update={kind}", "--checkpoint.enable=true", "--checkpoint.interval=5"]
    _run([*args, "--train.steps=10"], tmp_path / "ref")
    _run([*args, "--train.steps=5"], tmp_path / "run")
    proc = _run([*args, "--train.steps=10"], tmp_path / "run")
    assert "at step 5" in proc.stdout + proc.stderr
    ref, resumed = losses_by_step(tmp_path / "ref"), losses_by_step(tmp_path / "run")
    assert sorted(resumed) == list(range(1, 11))
    assert [resumed[s] for s in range(6, 11)] == [ref[s] for s in range(6, 11)]


@pytest.mark.slow
def test_switching_rounding_or_master_dtype_across_a_resume(tmp_path: Path) -> None:
    """stochastic -> kahan (no compensation buffers in the checkpoint: they start at zero) -> fp32 master."""
    args = [*RUN, "--distributed.master_dtype=bf16", "--checkpoint.enable=true", "--checkpoint.interval=2"]
    dump = tmp_path / "run"
    _run([*args, "--train.steps=2", "--optimizer.bf16_update=stochastic"], dump)
    proc = _run([*args, "--train.steps=4", "--optimizer.bf16_update=kahan"], dump)
    assert "checkpoint has no Kahan compensation buffers" in proc.stdout + proc.stderr
    assert "at step 2" in proc.stdout + proc.stderr
    proc = _run([*args, "--train.steps=6", "--distributed.master_dtype=fp32"], dump)
    assert "at step 4" in proc.stdout + proc.stderr
    losses = losses_by_step(dump)
    assert max(losses) == 6 and all(math.isfinite(v) for v in losses.values())
    assert losses[6] < losses[1] - 1.0  # still learning after both switches
