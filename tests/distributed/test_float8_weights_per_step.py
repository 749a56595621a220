"""float8.weights_per_step on 2 gloo ranks (spawned): HSDP replicas (each rank holds whole weights) and a 1F1B
pipeline of 2 stages (each stage's Linears cast once per step, reused by every pipeline and accumulation
microbatch; tensorwise, and blockwise's 128x128 casts) train bit for bit as casting per use. One process: tests/unit/test_float8_weights_per_step.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.spawn import run_distributed, train_and_read_metrics
from tests.helpers import DEBUG_CONFIG

ARGS = ["--config", DEBUG_CONFIG, "--train.seq_len=64", "--metrics.log_freq=1", "--metrics.enable_tensorboard=false",
        "--train.mixed_precision=fp8", "--float8.emulate=true", "--train.steps=3", "--train.grad_accum_steps=2",
        "--train.batch_size=2"]


@pytest.mark.slow  # 2 x 2 spawned ranks, 3 steps each
@pytest.mark.parametrize("layout", [["--distributed.dp_replicate=2"],
                                    ["--distributed.pp=2", "--distributed.pp_microbatch_size=1"],
                                    ["--distributed.pp=2", "--distributed.pp_microbatch_size=1",
                                     "--float8.recipe=blockwise"]],
                         ids=["replicas", "pipeline", "blockwise-pipeline"])
def test_kept_casts_train_as_casting_per_use_on_two_ranks(tmp_path: Path, layout: list[str]) -> None:
    def losses(setting: str) -> list[tuple[float, float]]:
        args = [*ARGS, *layout, f"--float8.weights_per_step={setting}"]
        rows = run_distributed(train_and_read_metrics, world_size=2, args=(args, str(tmp_path / setting)))[0]
        return [(r["loss"], r["grad_norm"]) for r in rows]

    kept = losses("on")  # 'on' refuses a layout it cannot run: this run does keep the casts
    assert kept == losses("off") and len(kept) == 3
