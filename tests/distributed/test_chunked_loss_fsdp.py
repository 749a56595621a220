"""train.loss_chunk_tokens under FSDP2 on 2 gloo ranks (spawned functions): the chunked head + loss trains as the plain
one does."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.spawn import run_distributed, train_and_read_metrics
from tests.helpers import FAST, column

# 2 sequences of 64 tokens per rank: 128 tokens, chunks of 48, 48 and 32 (the fp32 test).
ARGS = [*FAST, "--train.steps=3", "--train.batch_size=2", "--distributed.dp_shard=2"]


def _two_ranks(args: list[str], dump: Path) -> list[dict]:
    return run_distributed(train_and_read_metrics, world_size=2, args=(args, str(dump)))[0]


def test_fsdp_chunked_loss_matches_plain(tmp_path: Path) -> None:
    # fp32: the head's weight sits in the root FSDP2 unit, gathered once for every chunk's forward and
    # recompute; the gradients reduce-scatter once, after the last chunk's backward.
    plain = _two_ranks(ARGS, tmp_path / "plain")
    chunked = _two_ranks([*ARGS, "--train.loss_chunk_tokens=48"], tmp_path / "chunked")
    assert column(chunked, "loss") == pytest.approx(column(plain, "loss"), rel=1e-5)
    assert column(chunked, "grad_norm") == pytest.approx(column(plain, "grad_norm"), rel=1e-5)


def test_fsdp_fp8_compiled_chunked_loss_tracks_plain(tmp_path: Path) -> None:
    # fp8 head (Float8Linear, fp8 all-gather), compiled per chunk: each chunk scales its own activations
    # and logit gradients, so the runs agree to fp8 rounding, not bit for bit: the first loss (same
    # weights) closely, later ones as far apart as fp8 runs drift (tests/distributed/test_float8_fsdp.py).
    # Two even chunks of 64 (one compiled chunk graph): a shorter last chunk is covered by the fp32 test
    # above, and compiled by tests/unit/test_chunked_loss.py. fp32 master weights (bf16 ones:
    # tests/cli/test_bf16_master.py).
    args = [*ARGS, "--train.mixed_precision=fp8", "--train.compile_model=true", "--distributed.master_dtype=fp32"]
    plain = _two_ranks(args, tmp_path / "plain")
    chunked = _two_ranks([*args, "--train.loss_chunk_tokens=64"], tmp_path / "chunked")
    assert column(chunked, "loss")[0] == pytest.approx(column(plain, "loss")[0], rel=1e-3)
    assert column(chunked, "loss") == pytest.approx(column(plain, "loss"), rel=1e-2)
    assert column(chunked, "grad_norm") == pytest.approx(column(plain, "grad_norm"), rel=3e-2)
