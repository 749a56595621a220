"""Expert parallelism through the trainer under torchrun (2-4 processes) reproduces the 1-process MoE run, and
checkpoints move between ep layouts; an ep that does not divide the experts is one line. The spawned-function
cases (compiled, float64, every gradient): tests/distributed/test_moe_ep.py.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.distributed.test_moe_ep import ARGS, CKPT, FP32, VAL, assert_same_run
from tests.helpers import column, launch, read_metrics, train

pytestmark = pytest.mark.slow  # every test starts 2-4 training processes (or needs a run that did)


@pytest.fixture(scope="module")
def ep2(tmp_path_factory) -> dict:
    """2 processes, ep=2 (all of dp_shard), batch 2 each, checkpoints at steps 2 and 4."""
    dump = tmp_path_factory.mktemp("ep2")
    args = [*ARGS, *FP32, *CKPT, *VAL, "--train.batch_size=2", "--distributed.ep=2"]
    return {"metrics": train(args, dump, nproc=2), "dump": dump}


def test_ep2_matches_single_process(ep2, moe_ep_reference) -> None:
    assert_same_run(ep2["metrics"], moe_ep_reference["metrics"])


def test_ep2_x_dp_shard2_matches_single_process(moe_ep_reference, tmp_path: Path) -> None:
    # 4 ranks: experts split over ep=2 and FSDP-sharded over dp_shard/ep = 2.
    got = train([*ARGS, *FP32, *VAL, "--train.batch_size=1", "--distributed.ep=2"], tmp_path, nproc=4)
    assert_same_run(got, moe_ep_reference["metrics"])
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
def test_ep_composes_with_ac_and_hsdp(nproc: int, args: list[str], moe_ep_reference, tmp_path: Path) -> None:
    assert_same_run(train([*ARGS, *FP32, *args], tmp_path, nproc=nproc), moe_ep_reference["metrics"])


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


def _resume(checkpoint: Path, dump: Path, args: list[str], *, nproc: int) -> dict[int, float]:
    shutil.copytree(checkpoint, dump / "checkpoint" / checkpoint.name)
    proc = launch([*ARGS, *FP32, *CKPT, *args, f"--job.dump_folder={dump}"], nproc=nproc)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "resumed from checkpoint" in proc.stdout + proc.stderr
    return {r["step"]: r["loss"] for r in read_metrics(dump)}


def test_checkpoint_saved_at_ep2_resumes_at_ep1(ep2, moe_ep_reference, tmp_path: Path) -> None:
    losses = _resume(ep2["dump"] / "checkpoint" / "step-2", tmp_path, ["--train.batch_size=4"], nproc=1)
    want = {r["step"]: r["loss"] for r in ep2["metrics"]}
    assert sorted(losses) == [3, 4]
    for step in (3, 4):
        assert losses[step] == pytest.approx(want[step], rel=1e-5), step


def test_checkpoint_saved_at_ep1_resumes_at_ep2(moe_ep_reference, tmp_path: Path) -> None:
    args = ["--train.batch_size=2", "--distributed.ep=2"]
    losses = _resume(moe_ep_reference["dump"] / "checkpoint" / "step-2", tmp_path, args, nproc=2)
    want = {r["step"]: r["loss"] for r in moe_ep_reference["metrics"]}
    assert sorted(losses) == [3, 4]
    for step in (3, 4):
        assert losses[step] == pytest.approx(want[step], rel=1e-5), step


def test_ep_that_does_not_divide_the_experts_is_one_line(tmp_path: Path) -> None:
    proc = launch([*ARGS, "--distributed.ep=3", "--train.steps=1", f"--job.dump_folder={tmp_path}"], nproc=3)
    assert proc.returncode != 0
    assert proc.stderr.count(
        "config error: distributed.ep=3 must divide the 8 routed experts of model.flavor='debug_moe'") == 1
