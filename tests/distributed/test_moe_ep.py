"""Expert parallelism reproduces the 1-process MoE run (gloo, 2 and 4 CPU processes), and checkpoints
move between ep layouts.

Same seed, same global batch: the sequence-wise aux loss and the globally summed expert
loads make every term layout-independent, so fp32 losses agree to rounding.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.distributed.spawn import (gradients_of_one_step, run_distributed, train_and_read_metrics,
                                    train_then_one_process_in_float64)
from tests.helpers import REPO, column, launch, read_metrics, train

MOE_CONFIG = str(REPO / "configs" / "train" / "debug_moe.toml")
ARGS = ["--config", MOE_CONFIG, "--train.seq_len=64", "--train.steps=4", "--metrics.log_freq=1",
        "--metrics.enable_tensorboard=false"]
FP32 = ["--train.mixed_precision=fp32"]
CKPT = ["--checkpoint.enable=true", "--checkpoint.interval=2"]
# Held-out loss at steps 2 and 4 over 8 samples (validation.steps x batch_size x dp ranks = 8 where used).
VAL = ["--validation.enable=true", "--validation.freq=2", "--validation.steps=2"]


def assert_same_run(got: list[dict], ref: list[dict], *, rel: float = 1e-5) -> None:
    assert column(got, "step") == column(ref, "step")
    assert column(got, "loss") == pytest.approx(column(ref, "loss"), rel=rel)
    assert column(got, "aux_loss") == pytest.approx(column(ref, "aux_loss"), rel=rel)
    assert column(got, "grad_norm") == pytest.approx(column(ref, "grad_norm"), rel=10 * rel)
    # Expert loads are summed over all ranks before the bias moves: the same routing everywhere.
    assert column(got, "moe/imbalance_max") == pytest.approx(column(ref, "moe/imbalance_max"), rel=rel)
    if any("val_loss" in r for r in got):  # evaluation through EP's all-to-all, the same held-out samples
        val = [(r["step"], r["val_loss"]) for r in got if "val_loss" in r]
        assert val == [(r["step"], pytest.approx(r["val_loss"], rel=rel)) for r in ref if "val_loss" in r]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """1 process, batch 4, fp32, checkpoints at steps 2 and 4."""
    dump = tmp_path_factory.mktemp("ref")
    return {"metrics": train([*ARGS, *FP32, *CKPT, *VAL, "--train.batch_size=4"], dump), "dump": dump}


@pytest.fixture(scope="module")
def ep2(tmp_path_factory) -> dict:
    """2 processes, ep=2 (all of dp_shard), batch 2 each, checkpoints at steps 2 and 4."""
    dump = tmp_path_factory.mktemp("ep2")
    args = [*ARGS, *FP32, *CKPT, *VAL, "--train.batch_size=2", "--distributed.ep=2"]
    return {"metrics": train(args, dump, nproc=2), "dump": dump}


def test_ep2_matches_single_process(ep2, reference) -> None:
    assert_same_run(ep2["metrics"], reference["metrics"])


def test_ep2_x_dp_shard2_matches_single_process(reference, tmp_path: Path) -> None:
    # 4 ranks: experts split over ep=2 and FSDP-sharded over dp_shard/ep = 2.
    got = train([*ARGS, *FP32, *VAL, "--train.batch_size=1", "--distributed.ep=2"], tmp_path, nproc=4)
    assert_same_run(got, reference["metrics"])
    log = (tmp_path / "metrics.jsonl").read_text()
    assert '"moe/layer1/imbalance"' in log and '"moe/layer3/dropped_fraction": 0.0' in log


@pytest.mark.parametrize(
    "nproc, args",
    [
        (1, ["--train.batch_size=4", "--train.activation_checkpointing=selective"]),
        (2, ["--train.batch_size=2", "--distributed.ep=2", "--train.activation_checkpointing=full"]),
        (2, ["--train.batch_size=2", "--distributed.ep=2", "--train.activation_checkpointing=selective",
             "--train.selective_ac_every=2"]),
        (4, ["--train.batch_size=1", "--distributed.ep=2", "--distributed.dp_replicate=2",
             "--distributed.dp_shard=2"]),
    ],
    ids=["op-selective-ac", "ep2-full-ac", "ep2-selective-every2", "hsdp2-x-ep2"],
)
def test_ep_composes_with_ac_and_hsdp(nproc: int, args: list[str], reference, tmp_path: Path) -> None:
    assert_same_run(train([*ARGS, *FP32, *args], tmp_path, nproc=nproc), reference["metrics"])


def test_compiled_moe_under_ep2_matches_eager_single_process(reference, tmp_path: Path) -> None:
    # MoE blocks compile with graph breaks (the EP split sizes are read on the host; the CPU grouped GEMM
    # stays eager), the loss compiles whole; Inductor reorders fp32 reductions.
    got = run_distributed(train_and_read_metrics, world_size=2, args=(
        [*ARGS, *FP32, "--train.batch_size=2", "--distributed.ep=2", "--train.compile_model=true"], str(tmp_path)))[0]
    ref = reference["metrics"]
    assert column(got, "step") == column(ref, "step")
    assert column(got, "loss") == pytest.approx(column(ref, "loss"), rel=1e-4)
    assert column(got, "aux_loss") == pytest.approx(column(ref, "aux_loss"), rel=1e-4)
    assert column(got, "grad_norm") == pytest.approx(column(ref, "grad_norm"), rel=1e-3)


def test_fp8_ep2_x_dp_shard2_matches_fp8_single_process(tmp_path: Path) -> None:
    # 1 rank x 4 microbatches of 1 sees, per microbatch, what each of the 4 ranks sees, so
    # tensorwise activation scales agree; bf16 compute then leaves bf16-level differences.
    fp8 = ["--train.mixed_precision=fp8"]
    # "auto" gathers in fp8 on 4 ranks only; the 1-rank reference casts its weights the same way.
    one = train([*ARGS, *fp8, "--train.batch_size=1", "--train.grad_accum_steps=4",
                 "--float8.enable_fsdp_float8_all_gather=true"], tmp_path / "one")
    proc = launch([*ARGS, *fp8, "--train.batch_size=1", "--distributed.ep=2", f"--job.dump_folder={tmp_path / 'ep'}"],
                  nproc=4)
    assert proc.returncode == 0, proc.stderr[-4000:]
    four = read_metrics(tmp_path / "ep")
    assert column(four, "loss") == pytest.approx(column(one, "loss"), rel=2e-3)
    # The aux loss is a product of routing probabilities and load fractions, each moved by bf16 rounding
    # (relative 2**-8) of the router input: the runs reduce their bf16 gradients in another order, so after
    # s - 1 updates the weights differ by up to s - 1 roundings. Bound per step: 2 factors x 2**-8 x s (at
    # step 4, 3.1e-2; measured 5.4e-3 on one CPU, 1.08e-2 on another); a missing or doubled layer would move
    # it by a third or more.
    got, ref = column(four, "aux_loss"), column(one, "aux_loss")
    assert column(four, "step") == column(one, "step") == [1, 2, 3, 4]
    for step, (a, b) in enumerate(zip(got, ref), start=1):
        assert a == pytest.approx(b, rel=2 * 2**-8 * step), (step, got, ref)
    # What FP8 converted, on an MoE model under EP: attention, the dense block and the head.
    log = proc.stdout + proc.stderr
    assert "converted 20/32 Linear layers; excluded: layers.{1..3}.moe.router.gate (MoE router)" in log
    assert "MoE routed experts stay bf16" in log
    assert "expert parallel: ep=2, 4 of 8 routed experts per rank" in log


def test_ep2_equals_single_process_in_float64_for_50_steps(tmp_path: Path) -> None:
    # In fp32 an ep=2 run follows the 1-process run to ~1e-5 only until rounding flips a near-tied top-k
    # choice of some token (debug_moe at seq_len 128: first at step 11, an exact fp32 tie); each flip moves
    # that token's output and the loads that move the expert biases, and by step 30 the runs differ by
    # ~1e-4 in the loss and a few % in the gradient norm: rounding, not EP (docs/moe.md). In float64 the
    # runs differ by ~1e-12, far below the smallest top-k margins (>= 5e-8), so no choice flips and the
    # whole EP path (dispatch, expert gradients divided by dp, the balancer's global loads, the norm over
    # the ep mesh, AdamW on sharded experts) must give the same run at every step.
    # 2 MoE layers of 32-token sequences: every part of the path, at ~60% of debug_moe's cost.
    args = [*ARGS, *FP32, "--train.steps=50", "--model.n_layers=3", "--train.seq_len=32",
            "--optimizer.implementation=foreach"]
    got, ref = run_distributed(train_then_one_process_in_float64, world_size=2, args=(
        [*args, "--train.batch_size=2", "--distributed.ep=2"], [*args, "--train.batch_size=4"], str(tmp_path)))[0]
    assert column(got, "step") == column(ref, "step") == list(range(1, 51))
    # float64 sums in another order differ by ~1e-16 and grow over 50 steps of training (<= 5e-12 measured);
    # 1e-9 is far below what one fp32 rounding anywhere in the step (>= 6e-8) or one routing flip makes.
    # Measured: loads summed per rank instead of over the stage, expert gradients not divided by dp, or a
    # norm not summed over the ep shards each miss by >= 2e-3 within 2 steps.
    assert column(got, "grad_norm") == pytest.approx(column(ref, "grad_norm"), rel=1e-9, abs=0)
    assert column(got, "aux_loss") == pytest.approx(column(ref, "aux_loss"), rel=1e-9, abs=0)
    assert column(got, "loss") == pytest.approx(column(ref, "loss"), rel=2**-22, abs=0)  # logged as fp32: 2 ulps
    # Ratios of token counts: every token chose the same experts in both runs, every step.
    assert column(got, "moe/imbalance_max") == column(ref, "moe/imbalance_max")


def _resume(checkpoint: Path, dump: Path, args: list[str], *, nproc: int) -> dict[int, float]:
    shutil.copytree(checkpoint, dump / "checkpoint" / checkpoint.name)
    proc = launch([*ARGS, *FP32, *CKPT, *args, f"--job.dump_folder={dump}"], nproc=nproc)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "resumed from checkpoint" in proc.stdout + proc.stderr
    return {r["step"]: r["loss"] for r in read_metrics(dump)}


def test_checkpoint_saved_at_ep2_resumes_at_ep1(ep2, reference, tmp_path: Path) -> None:
    losses = _resume(ep2["dump"] / "checkpoint" / "step-2", tmp_path, ["--train.batch_size=4"], nproc=1)
    want = {r["step"]: r["loss"] for r in ep2["metrics"]}
    assert sorted(losses) == [3, 4]
    for step in (3, 4):
        assert losses[step] == pytest.approx(want[step], rel=1e-5), step


def test_checkpoint_saved_at_ep1_resumes_at_ep2(reference, tmp_path: Path) -> None:
    args = ["--train.batch_size=2", "--distributed.ep=2"]
    losses = _resume(reference["dump"] / "checkpoint" / "step-2", tmp_path, args, nproc=2)
    want = {r["step"]: r["loss"] for r in reference["metrics"]}
    assert sorted(losses) == [3, 4]
    for step in (3, 4):
        assert losses[step] == pytest.approx(want[step], rel=1e-5), step


def test_ep_that_does_not_divide_the_experts_is_one_line(tmp_path: Path) -> None:
    proc = launch([*ARGS, "--distributed.ep=3", "--train.steps=1", f"--job.dump_folder={tmp_path}"], nproc=3)
    assert proc.returncode != 0
    assert proc.stderr.count(
        "config error: distributed.ep=3 must divide the 8 routed experts of model.flavor='debug_moe'") == 1


# -- gradients ----------------------------------------------------------------
# Adam is blind to a constant factor on one parameter's gradient, so losses alone would
# not catch a wrongly scaled expert gradient: compare every gradient after one backward.


def _grads(tmp_path: Path, name: str, nproc: int, args: list[str]) -> dict[str, torch.Tensor]:
    return run_distributed(gradients_of_one_step, world_size=nproc, args=([*ARGS, *FP32, *args], str(tmp_path / name)))[0]


@pytest.mark.parametrize(
    "nproc, args",
    [
        (2, ["--train.batch_size=2", "--distributed.ep=2"]),
        (4, ["--train.batch_size=1", "--distributed.ep=2"]),
        (4, ["--train.batch_size=1", "--distributed.ep=2", "--distributed.dp_replicate=2", "--distributed.dp_shard=2"]),
    ],
    ids=["ep2", "ep2-x-dp_shard2", "hsdp2-x-ep2"],
)
def test_every_ep_gradient_matches_single_process(nproc: int, args: list[str], tmp_path: Path) -> None:
    ref = _grads(tmp_path, "ref", 1, ["--train.batch_size=4"])
    got = _grads(tmp_path, "ep", nproc, args)
    assert got.keys() == ref.keys()
    for fqn, g in ref.items():
        err = ((got[fqn] - g).norm() / g.norm()).item()
        assert err < 1e-5, (fqn, err)


# FP8 experts (emulated) with every Linear left bf16: rowwise scales depend on a row alone, so the layout
# cannot change what is quantized, only bf16 summation orders.
FP8_EXPERTS = ["--train.mixed_precision=fp8", "--float8.emulate=true", "--float8.exclude_fqns=layers,output_head"]


def test_fp8_experts_under_ep2_match_single_process(tmp_path: Path) -> None:
    def grads(name: str, nproc: int, args: list[str]) -> dict[str, torch.Tensor]:
        return run_distributed(gradients_of_one_step, world_size=nproc,
                               args=([*ARGS, *FP8_EXPERTS, *args], str(tmp_path / name)))[0]

    ref = grads("ref", 1, ["--train.batch_size=4", "--float8.moe_experts=rowwise"])
    got = grads("ep", 2, ["--train.batch_size=2", "--distributed.ep=2", "--float8.moe_experts=rowwise"])
    bf16_experts = grads("off", 1, ["--train.batch_size=4", "--float8.moe_experts=off"])
    assert got.keys() == ref.keys()
    for fqn, g in ref.items():
        err = ((got[fqn].float() - g.float()).norm() / g.float().norm()).item()
        assert err < 1e-2, (fqn, err)  # bf16 gradients, summed in other orders
    w1 = "layers.1.moe.experts.w1"
    err = ((bf16_experts[w1].float() - ref[w1].float()).norm() / ref[w1].float().norm()).item()
    assert err > 3e-2, err  # the FP8 experts ran: their gradient is an FP8 rounding away from the bf16 one
