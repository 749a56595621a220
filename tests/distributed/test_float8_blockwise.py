"""float8.recipe='blockwise' (emulated) under FSDP2 with bf16 all-gather and selective AC, under pipeline parallelism
and under expert parallelism: 2 gloo ranks match 1 rank. A precision schedule into blockwise and a resume under another
recipe, through the trainer as a command: tests/cli/test_float8_blockwise.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.distributed.spawn import run_distributed, train_and_read_metrics, train_then_one_process
from tests.helpers import DEBUG_CONFIG, REPO, column

ARGS = ["--config", DEBUG_CONFIG, "--train.steps=4", "--train.seq_len=64", "--metrics.log_freq=1",
        "--metrics.enable_tensorboard=false", "--train.mixed_precision=fp8", "--float8.recipe=blockwise",
        "--float8.emulate=true", "--train.activation_checkpointing=selective", "--train.batch_size=2"]


def test_blockwise_two_ranks_match_one_rank(tmp_path: Path) -> None:
    # 1 rank x 2 microbatches of 2 sequences sees, per microbatch, the 128 tokens each of 2 ranks sees: the same
    # 1x128 tiles and the same 128-token groups of the weight-gradient GEMM. Weights are all-gathered in bf16
    # ("auto" is off for blockwise) and the master weights are fp32 on both sides, so the layouts differ only
    # in the order the two microbatches' gradients are summed.
    fp32_master = ["--distributed.master_dtype=fp32"]
    one = run_distributed(train_and_read_metrics, world_size=1,
                          args=([*ARGS, *fp32_master, "--train.grad_accum_steps=2"], str(tmp_path / "one")))[0]
    two = run_distributed(train_and_read_metrics, world_size=2,
                          args=([*ARGS, *fp32_master, "--distributed.dp_shard=2"], str(tmp_path / "two")))[0]
    assert column(two, "loss") == pytest.approx(column(one, "loss"), rel=1e-3)
    assert column(two, "grad_norm") == pytest.approx(column(one, "grad_norm"), rel=1e-2)
    assert column(one, "fp8_converted_fraction") == [21 / 29] * 4


# ARGS less its batch size, with fp32 master weights: bf16 ones (fp8's default) round stochastically, per shard,
# so layouts part at step 2.
COMMON = [*ARGS[:-1], "--distributed.master_dtype=fp32"]


def _fp8_layers(dump: Path) -> dict[str, str]:
    return json.loads((dump / "fp8_layers.json").read_text())["layers"]


def test_blockwise_pipeline_matches_one_process(tmp_path: Path) -> None:
    # pp=2, 1F1B: 4 microbatches of 1 sequence, 64 tokens each, which the layer zero-pads to one 128-token
    # group of the weight-gradient GEMM (a zero row changes no amax). The reference runs the same 4
    # microbatches one after another: each stage quantizes the tiles and blocks the whole model does and sums
    # the microbatches' gradients in the same order, so nothing differs but the order the global grad norm adds
    # the stages' parts in.
    got, ref = run_distributed(train_then_one_process, world_size=2, args=(
        [*COMMON, "--distributed.pp=2", "--train.batch_size=4"],
        [*COMMON, "--train.batch_size=1", "--train.grad_accum_steps=4"], str(tmp_path)))[0]
    # Measured bit-identical over the 4 steps; 1e-6 is ~10 fp32 ulps. Blockwise left off one layer of one
    # stage moves step 1's loss by 5e-5 or more, a perturbed scale on one stage by 5e-4.
    assert column(got, "loss") == pytest.approx(column(ref, "loss"), rel=1e-6)
    assert column(got, "grad_norm") == pytest.approx(column(ref, "grad_norm"), rel=1e-6)
    # Both stages' conversions, gathered: the whole model's.
    assert _fp8_layers(tmp_path / "layout") == _fp8_layers(tmp_path / "one_process")
    assert column(got, "fp8_converted_fraction") == [21 / 29] * 4


# No AC: its per-op selective policy is refused with ep > 1 (trainer/validate/layout.py).
MOE = ["--config", str(REPO / "configs" / "train" / "debug_moe.toml"),
       *(arg for arg in COMMON[2:] if not arg.startswith("--train.activation_checkpointing"))]


def test_blockwise_expert_parallel_matches_one_process(tmp_path: Path) -> None:
    # ep=2 (all of dp_shard), 2 sequences per rank; the reference runs each rank's 2 sequences as one of 2
    # microbatches. Blockwise converts attention, the dense block and the head; the routed experts (bf16
    # grouped GEMMs, float8.moe_experts='off'), shared expert and router stay bf16.
    got, ref = run_distributed(train_then_one_process, world_size=2, args=(
        [*MOE, "--distributed.ep=2", "--train.batch_size=2"],
        [*MOE, "--train.batch_size=2", "--train.grad_accum_steps=2"], str(tmp_path)))[0]
    # Step 1 (the same weights): every token passes through the same per-token ops whichever rank holds its
    # expert, so the losses are bit-identical (measured). Of the gradients only the routed experts' differ, at
    # bf16 rounding (below): grad norm 2e-7 apart (measured). Blockwise left off one layer on one rank, or a
    # perturbed scale there, moves step 1's loss by 7e-5 or more; blockwise left out of one rank's weight
    # gradients moves step 1's grad norm by 5e-4.
    assert got[0]["loss"] == pytest.approx(ref[0]["loss"], rel=1e-6)
    assert got[0]["aux_loss"] == pytest.approx(ref[0]["aux_loss"], rel=1e-6)
    assert got[0]["grad_norm"] == pytest.approx(ref[0]["grad_norm"], rel=1e-5)
    # Later steps: an expert's weight gradient is one bf16 grouped GEMM over both ranks' tokens under EP, one
    # per microbatch in the reference (2e-3 apart after step 1, measured), so the weights part at bf16
    # rounding. Measured over 4 steps: loss 8e-4, aux loss 1.3e-3, grad norm 5e-3 at most. Loss and aux loss
    # at the tensorwise EP test's tolerances (tests/cli/test_moe_ep.py), the grad norm at 4x the measured.
    assert column(got, "loss") == pytest.approx(column(ref, "loss"), rel=2e-3)
    assert column(got, "aux_loss") == pytest.approx(column(ref, "aux_loss"), rel=1e-2)
    assert column(got, "grad_norm") == pytest.approx(column(ref, "grad_norm"), rel=2e-2)
    assert _fp8_layers(tmp_path / "layout") == _fp8_layers(tmp_path / "one_process")
    assert column(got, "fp8_converted_fraction") == [12 / 32] * 4
