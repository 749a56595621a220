"""FP8 health with the block-input kurtosis (metrics.fp8_stats_freq, metrics.kurtosis_warn) on 2 gloo ranks under
FSDP2 (dp_shard=2): the stats steps log every block's kurtosis, within its bounds (1 to the width), the max is the
blocks' max, and the stats change no loss (the same run without them). One process: tests/cli/test_fp8_health.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.spawn import run_distributed, train_and_read_metrics
from tests.helpers import DEBUG_CONFIG

ARGS = ["--config", DEBUG_CONFIG, "--train.seq_len=64", "--metrics.log_freq=1", "--metrics.enable_tensorboard=false",
        "--train.mixed_precision=fp8", "--float8.emulate=true", "--train.steps=4", "--train.batch_size=2",
        "--distributed.dp_shard=2"]
KURTOSIS = "fp8_health/block_input/"


@pytest.mark.slow  # 2 x 2 spawned ranks, 4 steps each
def test_block_input_kurtosis_on_two_fsdp_ranks_changes_no_loss(tmp_path: Path) -> None:
    def rows(name: str, *extra: str) -> list[dict]:
        return run_distributed(train_and_read_metrics, world_size=2,
                               args=([*ARGS, *extra], str(tmp_path / name)))[0]

    stats = rows("stats", "--metrics.fp8_stats_freq=2", "--metrics.kurtosis_warn=1e9")
    plain = rows("plain")
    assert [r["loss"] for r in stats] == [r["loss"] for r in plain] and len(stats) == 4
    logged = [{k: v for k, v in r.items() if k.startswith(KURTOSIS)} for r in stats]
    assert [bool(k) for k in logged] == [False, True, False, True]
    for k in logged[1::2]:
        blocks = {n: v for n, v in k.items() if n.endswith("/kurtosis")}
        assert sorted(blocks) == [f"{KURTOSIS}layers.{i}/kurtosis" for i in range(4)]
        assert all(1 <= v <= 128 for v in blocks.values())  # debug model: dim 128
        assert k[f"{KURTOSIS}kurtosis_max"] == max(blocks.values())
