"""Context parallelism reproduces the 1-process run (gloo, 2 and 4 CPU processes, spawned functions).

Same seed, same global batch, fp32: each cp rank holds chunks i and 2cp-1-i of every sequence,
attends over all of it through the K/V all-gather, and the losses, gradient norms, held-out
losses and every gradient equal one process's to fp32 rounding, with FSDP, PP, MoE and EP
around it; FP8 (emulated) converts the same layers and stays within FP8 rounding; checkpoints
move between cp=2 and one process; a context extension (longer seq_len, cp, the data started
over) continues as one process would; and the bytes saved for backward per rank fall with cp.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.distributed.spawn import (
    gradients_of_one_step, run_distributed, saved_bytes_of_one_forward, train_and_read_metrics,
)
from tests.helpers import FAST, REPO, column, train

STEPS = ["--train.steps=4"]
CKPT = ["--checkpoint.enable=true", "--checkpoint.interval=2"]
# Held-out loss at steps 2 and 4 (validation.steps x batch_size x dp ranks = 8 samples in every layout).
VAL = ["--validation.enable=true", "--validation.freq=2", "--validation.steps=2"]
CP2 = ["--distributed.cp=2"]
MOE = ["--config", str(REPO / "configs" / "train" / "debug_moe.toml"), "--train.seq_len=64",
       "--train.mixed_precision=fp32", "--metrics.log_freq=1", "--metrics.enable_tensorboard=false"]
# Qwen3-MoE's shapes: q/k norms before the rotation of each chunk's positions, every other block MoE.
QWEN3_MOE = ["--config", str(REPO / "configs" / "train" / "qwen3_moe_debug.toml"), *MOE[2:]]


def assert_same_run(got: list[dict], ref: list[dict], *, rel: float = 1e-5, moe: bool = False) -> None:
    assert column(got, "step") == column(ref, "step")
    assert column(got, "loss") == pytest.approx(column(ref, "loss"), rel=rel)
    assert column(got, "grad_norm") == pytest.approx(column(ref, "grad_norm"), rel=10 * rel)
    if moe:  # the aux loss over whole sequences, the token loads summed over the cp ranks
        assert column(got, "aux_loss") == pytest.approx(column(ref, "aux_loss"), rel=rel)
        assert column(got, "moe/imbalance_max") == pytest.approx(column(ref, "moe/imbalance_max"), rel=rel)
    val = [(r["step"], r["val_loss"]) for r in got if "val_loss" in r]
    if val:
        assert val == [(r["step"], pytest.approx(r["val_loss"], rel=rel)) for r in ref if "val_loss" in r]


def _spawned(nproc: int, args: list[str], dump: Path) -> list[dict]:
    return run_distributed(train_and_read_metrics, world_size=nproc, args=(args, str(dump)))[0]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """1 process, batch 4, seq 64, checkpoints at steps 2 and 4."""
    dump = tmp_path_factory.mktemp("ref")
    return {"metrics": train([*FAST, *STEPS, *CKPT, *VAL, "--train.batch_size=4"], dump), "dump": dump}


@pytest.fixture(scope="module")
def cp2(tmp_path_factory) -> dict:
    dump = tmp_path_factory.mktemp("cp2")
    return {"metrics": _spawned(2, [*FAST, *STEPS, *CKPT, *VAL, *CP2, "--train.batch_size=4"], dump), "dump": dump}


def test_cp2_matches_single_process(cp2, reference) -> None:
    assert_same_run(cp2["metrics"], reference["metrics"])


@pytest.mark.parametrize(
    "nproc, args",
    [
        (4, ["--distributed.cp=4", "--train.batch_size=4", *VAL]),
        # cp ranks join FSDP's shard group: weights sharded over dp_shard x cp = 4.
        (4, [*CP2, "--distributed.dp_shard=2", "--train.batch_size=2", *VAL]),
        # Pipeline stages pass this rank's chunks of the hidden states.
        (4, [*CP2, "--distributed.pp=2", "--train.batch_size=4", *VAL]),
        # The per-op selective AC policy around the gathered attention (its masks are made outside the policy).
        (2, [*CP2, "--train.activation_checkpointing=selective", "--train.batch_size=4"]),
        # Compiled blocks around the gathered attention (measured within 1e-6 of eager one process).
        (2, [*CP2, "--train.compile_model=true", "--train.batch_size=4"]),
    ],
    ids=["cp4", "cp2-x-dp_shard2", "cp2-x-pp2", "cp2-selective-ac", "cp2-compile"],
)
def test_cp_layout_matches_single_process(nproc: int, args: list[str], reference, tmp_path: Path) -> None:
    assert_same_run(_spawned(nproc, [*FAST, *STEPS, *args], tmp_path), reference["metrics"])


def test_every_cp_gradient_matches_single_process(tmp_path: Path) -> None:
    ref = run_distributed(gradients_of_one_step, world_size=1, args=([*FAST, "--train.batch_size=4"],
                                                                      str(tmp_path / "ref")))[0]
    got = run_distributed(gradients_of_one_step, world_size=2, args=([*FAST, *CP2, "--train.batch_size=4"],
                                                                      str(tmp_path / "cp2")))[0]
    assert got.keys() == ref.keys()
    for fqn, g in ref.items():
        err = ((got[fqn] - g).norm() / g.norm()).item()
        assert err < 1e-5, (fqn, err)


# GPT-OSS (trainer/models/gpt_oss.py): each rank's query chunks attend with their sinks and sliding windows (16 keys,
# the chunks' length at seq 64 and cp=2) to the gathered keys at their global positions.
GPT_OSS = ["--model.flavor=debug_gpt_oss"]


@pytest.mark.parametrize(
    "model, nproc, args",
    [
        (MOE, 2, [*CP2, "--train.batch_size=4"]),
        # ep carved out of dp_shard x cp: the two cp ranks of one sequence hold 4 experts each.
        (MOE, 2, [*CP2, "--distributed.ep=2", "--train.batch_size=4"]),
        (QWEN3_MOE, 2, [*CP2, "--train.batch_size=4"]),
        (QWEN3_MOE, 2, [*CP2, "--distributed.ep=2", "--train.batch_size=4"]),
        ([*MOE, *GPT_OSS, *VAL], 2, [*CP2, "--train.batch_size=4"]),  # held-out losses: the reference's too
        ([*MOE, *GPT_OSS], 2, [*CP2, "--distributed.ep=2", "--train.batch_size=4"]),
    ],
    ids=["moe-cp2", "moe-cp2-x-ep2", "qwen3-moe-cp2", "qwen3-moe-cp2-x-ep2", "gpt_oss-cp2", "gpt_oss-cp2-x-ep2"],
)
def test_moe_under_cp_matches_single_process(model: list[str], nproc: int, args: list[str], tmp_path: Path) -> None:
    ref = train([*model, *STEPS, "--train.batch_size=4"], tmp_path / "ref")
    assert_same_run(_spawned(nproc, [*model, *STEPS, *args], tmp_path / "cp"), ref, moe=True)


@pytest.mark.parametrize("flavor", [[], GPT_OSS], ids=["debug_moe", "debug_gpt_oss"])
def test_every_moe_gradient_matches_single_process_under_cp2_x_ep2(flavor: list[str], tmp_path: Path) -> None:
    # The aux loss's gradient reaches each rank's tokens once: injected cp times as strong, then averaged by FSDP.
    ref = run_distributed(gradients_of_one_step, world_size=1, args=([*MOE, *flavor, "--train.batch_size=4"],
                                                                      str(tmp_path / "ref")))[0]
    got = run_distributed(gradients_of_one_step, world_size=2, args=(
        [*MOE, *flavor, *CP2, "--distributed.ep=2", "--train.batch_size=4"], str(tmp_path / "cp")))[0]
    assert got.keys() == ref.keys()
    for fqn, g in ref.items():
        err = ((got[fqn] - g).norm() / g.norm()).item()
        assert err < 1e-5, (fqn, err)
    assert ref["layers.2.moe.router.gate.weight"].norm() > 0
    if flavor:
        assert ref["layers.1.attention.sinks"].norm() > 0


def test_fp8_under_cp2_converts_the_same_layers_and_tracks_single_process_fp8(tmp_path: Path) -> None:
    # FP8's tensorwise activation scales depend on which tokens a rank holds: fp8 rounding, not fp32.
    fp8 = [a for a in FAST if not a.startswith("--train.mixed_precision")] + [
        "--train.mixed_precision=fp8", "--float8.emulate=true", "--train.batch_size=4"]
    one = train([*fp8, *STEPS], tmp_path / "one")
    got = _spawned(2, [*fp8, *STEPS, *CP2], tmp_path / "cp2")
    assert column(got, "loss") == pytest.approx(column(one, "loss"), rel=1e-2)
    assert got[0]["fp8_converted_fraction"] == one[0]["fp8_converted_fraction"] == 1.0


def test_checkpoint_saved_at_cp2_resumes_in_one_process(cp2, reference, tmp_path: Path) -> None:
    shutil.copytree(cp2["dump"] / "checkpoint" / "step-2", tmp_path / "checkpoint" / "step-2")
    resumed = train([*FAST, *STEPS, *CKPT, "--train.batch_size=4"], tmp_path)
    want = {r["step"]: r["loss"] for r in reference["metrics"]}
    assert [r["step"] for r in resumed] == [3, 4]
    assert column(resumed, "loss") == pytest.approx([want[3], want[4]], rel=1e-5)


def test_one_process_checkpoint_resumes_at_cp2(reference, tmp_path: Path) -> None:
    shutil.copytree(reference["dump"] / "checkpoint" / "step-2", tmp_path / "checkpoint" / "step-2")
    resumed = _spawned(2, [*FAST, *STEPS, *CKPT, *CP2, "--train.batch_size=4"], tmp_path)
    want = {r["step"]: r["loss"] for r in reference["metrics"]}
    assert [r["step"] for r in resumed] == [3, 4]
    assert column(resumed, "loss") == pytest.approx([want[3], want[4]], rel=1e-5)


def test_context_extension_relaunch_at_cp2_continues_as_one_process(reference, tmp_path: Path) -> None:
    # Trained at seq_len 64, relaunched at 128 with cp=2: model, optimizer, schedule and step from the checkpoint,
    # the data started over (its position counts sequences of the old length).
    longer = [a for a in FAST if not a.startswith("--train.seq_len")] + [
        "--train.seq_len=128", "--train.batch_size=4", *STEPS, *CKPT, "--checkpoint.restart_data=true"]
    for name in ("one", "cp2"):
        shutil.copytree(reference["dump"] / "checkpoint" / "step-2", tmp_path / name / "checkpoint" / "step-2")
    one = train(longer, tmp_path / "one")
    got = _spawned(2, [*longer, *CP2], tmp_path / "cp2")
    assert [r["step"] for r in got] == [3, 4]
    assert column(got, "loss") == pytest.approx(column(one, "loss"), rel=1e-5)


def test_bytes_saved_for_backward_per_rank_fall_with_cp(tmp_path: Path) -> None:
    args = [a for a in FAST if not a.startswith("--train.seq_len")] + ["--train.seq_len=8192", "--train.batch_size=1"]
    saved = {cp: run_distributed(saved_bytes_of_one_forward, world_size=cp,
                                 args=([*args, f"--distributed.cp={cp}"], str(tmp_path / f"cp{cp}")))[0]
             for cp in (1, 2)}
    # Activations scale with the local tokens; the gathered K/V (the whole sequence's, GQA-narrow) do not.
    assert 0.45 * saved[1] < saved[2] < 0.6 * saved[1], saved
