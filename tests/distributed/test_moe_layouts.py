"""MoE models in every layout reproduce the 1-process run: pipeline (x expert parallel) and tensor parallel; the
Qwen3-MoE shapes (qwen3_moe_debug: q/k norms, no shared experts, every other block MoE) in each layout too.

Same seed, same global batch, fp32 on gloo: the LM loss, the aux loss (injected in each MoE
layer's backward on whatever stage holds it), the expert loads and the held-out loss agree to
fp32 rounding, every gradient agrees after one step, and checkpoints move between pp2 x ep2
and one process. Each layout runs as a function in spawned processes (tests/distributed/spawn.py).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.distributed.spawn import gradients_of_one_step, run_distributed, train_and_read_metrics
from tests.helpers import REPO, column, read_metrics, train

MOE_CONFIG = str(REPO / "configs" / "train" / "debug_moe.toml")
RUN = ["--train.seq_len=64", "--train.mixed_precision=fp32", "--metrics.log_freq=1",
       "--metrics.enable_tensorboard=false"]
ARGS = ["--config", MOE_CONFIG, *RUN]
# The model of each case: its config and run settings, and the blocks that route (the per-layer metrics name them).
MODELS = {"debug_moe": ARGS, "qwen3_moe": ["--config", str(REPO / "configs" / "train" / "qwen3_moe_debug.toml"), *RUN]}
MOE_BLOCKS = {"debug_moe": [1, 2, 3], "qwen3_moe": [1, 3]}
STEPS = ["--train.steps=4"]
CKPT = ["--checkpoint.enable=true", "--checkpoint.interval=2"]
# Held-out loss at steps 2 and 4 over 8 samples (validation.steps x batch_size x dp ranks = 8).
VAL = ["--validation.enable=true", "--validation.freq=2", "--validation.steps=2"]
PP2 = ["--distributed.pp=2"]


def assert_same_run(got: list[dict], ref: list[dict], *, rel: float = 1e-5) -> None:
    assert column(got, "step") == column(ref, "step")
    assert column(got, "loss") == pytest.approx(column(ref, "loss"), rel=rel)
    # The logged aux loss sums every MoE layer's statistics, gathered over the pipeline ranks.
    assert column(got, "aux_loss") == pytest.approx(column(ref, "aux_loss"), rel=rel)
    assert column(got, "grad_norm") == pytest.approx(column(ref, "grad_norm"), rel=10 * rel)
    # Expert loads summed over every rank of a stage before the biases move: the same routing everywhere, in every
    # MoE block (debug_moe: 1-3; qwen3_moe: 1 and 3).
    layers = sorted({k for r in ref for k in r if k.startswith("moe/layer") and k.endswith("/imbalance")})
    assert layers == sorted({k for r in got for k in r if k.startswith("moe/layer") and k.endswith("/imbalance")})
    for key in layers:
        assert column(got, key) == pytest.approx(column(ref, key), rel=rel), key
    val = [(r["step"], r["val_loss"]) for r in got if "val_loss" in r]
    if val:  # evaluated through the same layout (the pipeline's forward-only schedule, EP's all-to-all, TP)
        assert val == [(r["step"], pytest.approx(r["val_loss"], rel=rel)) for r in ref if "val_loss" in r]


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """references(model): 1 process, batch 4, checkpoints at steps 2 and 4; run once per model in the module."""
    runs: dict[str, dict] = {}

    def reference_of(model: str) -> dict:
        if model not in runs:
            dump = tmp_path_factory.mktemp(f"ref-{model}")
            runs[model] = {"metrics": train([*MODELS[model], *STEPS, *CKPT, *VAL, "--train.batch_size=4"], dump),
                           "dump": dump}
        return runs[model]

    return reference_of


@pytest.fixture(scope="module")
def reference(references) -> dict:
    return references("debug_moe")


@pytest.fixture(scope="module")
def pp2_ep2(tmp_path_factory) -> dict:
    """4 processes: 2 pipeline stages x 2 expert-parallel ranks (dp_shard=2, batch 2 each), checkpoints."""
    dump = tmp_path_factory.mktemp("pp2ep2")
    args = [*ARGS, *STEPS, *CKPT, *VAL, *PP2, "--distributed.ep=2", "--train.batch_size=2"]
    return {"metrics": run_distributed(train_and_read_metrics, world_size=4, args=(args, str(dump)))[0], "dump": dump}


def test_pp2_x_ep2_matches_single_process(pp2_ep2, reference) -> None:
    assert_same_run(pp2_ep2["metrics"], reference["metrics"])


@pytest.mark.parametrize(
    "model, nproc, args",
    [
        # Both stages hold MoE layers (blocks 1-3; block 0 is dense): 8 microbatches of 1 through 1F1B.
        ("debug_moe", 2, [*PP2, "--distributed.pipeline_schedule=1F1B", "--train.batch_size=4", *VAL]),
        # 4 stages, 2 per rank: the first stage holds only the dense block.
        ("debug_moe", 2, [*PP2, "--distributed.pipeline_schedule=Interleaved1F1B", "--train.batch_size=4", *VAL]),
        # Each tp rank routes its half of every sequence; the aux loss reduces its statistics over tp.
        ("debug_moe", 2, ["--distributed.tp=2", "--train.batch_size=4", *VAL]),
        # pp x tp, with the experts and routers FSDP-sharded over dp_shard x tp inside each stage.
        ("debug_moe", 4, [*PP2, "--distributed.tp=2", "--train.batch_size=4", *VAL]),
        # Qwen3-MoE's shapes: FSDP alone; the experts split over ep; each stage a dense and an MoE block (0-1, 2-3);
        # 4 stages of one block, every other one MoE; q/k norms and the routed-only blocks under tp; pp x ep.
        ("qwen3_moe", 2, ["--train.batch_size=2", *VAL]),
        ("qwen3_moe", 2, ["--distributed.ep=2", "--train.batch_size=2", *VAL]),
        ("qwen3_moe", 2, [*PP2, "--distributed.pipeline_schedule=1F1B", "--train.batch_size=4", *VAL]),
        ("qwen3_moe", 2, [*PP2, "--distributed.pipeline_schedule=Interleaved1F1B", "--train.batch_size=4"]),
        ("qwen3_moe", 2, ["--distributed.tp=2", "--train.batch_size=4", *VAL]),
        ("qwen3_moe", 4, [*PP2, "--distributed.ep=2", "--train.batch_size=2"]),
    ],
    ids=["pp2-1f1b", "pp2-interleaved1f1b", "tp2", "pp2-x-tp2", "qwen3-fsdp2", "qwen3-ep2", "qwen3-pp2-1f1b",
         "qwen3-pp2-interleaved1f1b", "qwen3-tp2", "qwen3-pp2-x-ep2"],
)
def test_moe_layout_matches_single_process(model: str, nproc: int, args: list[str], references,
                                           tmp_path: Path) -> None:
    got = run_distributed(train_and_read_metrics, world_size=nproc, args=([*MODELS[model], *STEPS, *args],
                                                                          str(tmp_path)))[0]
    assert_same_run(got, references(model)["metrics"])
    assert sorted({k for r in got for k in r if k.endswith("/imbalance") and k.startswith("moe/layer")}) == [
        f"moe/layer{i}/imbalance" for i in MOE_BLOCKS[model]]


@pytest.mark.parametrize(
    "model, nproc, args",
    [
        ("debug_moe", 4, [*PP2, "--distributed.ep=2", "--train.batch_size=2"]),
        # Zero-bubble: each stage's backward runs in two passes (input, then weight gradients), the aux
        # loss's gradient included.
        ("debug_moe", 2, [*PP2, "--distributed.pipeline_schedule=InterleavedZeroBubble", "--train.batch_size=4"]),
        ("debug_moe", 2, ["--distributed.tp=2", "--train.batch_size=4"]),
        # Compiled MoE blocks break the graph: the first one still takes the embeddings' output with its gradient.
        ("debug_moe", 2, ["--distributed.tp=2", "--train.batch_size=4", "--train.compile_model=true"]),
        # Qwen3-MoE: the q/k norms' gradients summed over tp; pp x ep with an MoE block on each stage.
        ("qwen3_moe", 2, ["--distributed.tp=2", "--train.batch_size=4"]),
        ("qwen3_moe", 4, [*PP2, "--distributed.ep=2", "--train.batch_size=2"]),
    ],
    ids=["pp2-x-ep2", "pp2-interleaved-zero-bubble", "tp2", "tp2-compile", "qwen3-tp2", "qwen3-pp2-x-ep2"],
)
def test_every_moe_layout_gradient_matches_single_process(model: str, nproc: int, args: list[str],
                                                          tmp_path: Path) -> None:
    ref = run_distributed(gradients_of_one_step, world_size=1, args=([*MODELS[model], "--train.batch_size=4"],
                                                                      str(tmp_path / "ref")))[0]
    got = run_distributed(gradients_of_one_step, world_size=nproc, args=([*MODELS[model], *args],
                                                                          str(tmp_path / "got")))[0]
    assert got.keys() == ref.keys()
    for fqn, g in ref.items():
        err = ((got[fqn] - g).norm() / g.norm()).item()
        assert err < 1e-5, (fqn, err)
    # The routers' gradients come from the aux loss as well as the LM loss: they are there and equal.
    routers = [fqn for fqn in ref if fqn.endswith("moe.router.gate.weight")]
    assert len(routers) >= 2 and all(ref[fqn].norm() > 0 for fqn in routers)


def _resume(checkpoint: Path, dump: Path, args: list[str], *, nproc: int) -> dict[int, float]:
    shutil.copytree(checkpoint, dump / "checkpoint" / checkpoint.name)
    run_distributed(train_and_read_metrics, world_size=nproc, args=([*ARGS, *STEPS, *CKPT, *args], str(dump)))
    return {r["step"]: r["loss"] for r in read_metrics(dump)}


def test_pp2_x_ep2_checkpoint_resumes_in_one_process(pp2_ep2, reference, tmp_path: Path) -> None:
    losses = _resume(pp2_ep2["dump"] / "checkpoint" / "step-2", tmp_path, ["--train.batch_size=4"], nproc=1)
    want = {r["step"]: r["loss"] for r in reference["metrics"]}
    assert sorted(losses) == [3, 4]
    assert [losses[s] for s in (3, 4)] == pytest.approx([want[s] for s in (3, 4)], rel=1e-5)


def test_one_process_checkpoint_resumes_at_pp2_x_ep2(reference, tmp_path: Path) -> None:
    args = [*PP2, "--distributed.ep=2", "--train.batch_size=2"]
    losses = _resume(reference["dump"] / "checkpoint" / "step-2", tmp_path, args, nproc=4)
    want = {r["step"]: r["loss"] for r in reference["metrics"]}
    assert sorted(losses) == [3, 4]
    assert [losses[s] for s in (3, 4)] == pytest.approx([want[s] for s in (3, 4)], rel=1e-5)


# GPT-OSS (trainer/models/gpt_oss.py): every block is MoE, with attention sinks and sliding windows (tensor and
# context parallel are refused for it; FSDP, HSDP and EP: tests/distributed/test_moe_ep.py).
GPT_OSS = ["--model.flavor=debug_gpt_oss"]


@pytest.mark.parametrize("schedule", ["1F1B", "Interleaved1F1B"])
def test_gpt_oss_pipeline_matches_single_process(schedule: str, tmp_path: Path) -> None:
    ref = run_distributed(train_and_read_metrics, world_size=1, args=(
        [*ARGS, *STEPS, *VAL, *GPT_OSS, "--train.batch_size=4"], str(tmp_path / "ref")))[0]
    got = run_distributed(train_and_read_metrics, world_size=2, args=(
        [*ARGS, *STEPS, *VAL, *GPT_OSS, *PP2, f"--distributed.pipeline_schedule={schedule}", "--train.batch_size=4"],
        str(tmp_path / "pp")))[0]
    assert_same_run(got, ref)


def test_gpt_oss_pp2_x_ep2_gradients_match_single_process(tmp_path: Path) -> None:
    ref = run_distributed(gradients_of_one_step, world_size=1, args=([*ARGS, *GPT_OSS, "--train.batch_size=4"],
                                                                      str(tmp_path / "ref")))[0]
    got = run_distributed(gradients_of_one_step, world_size=4, args=(
        [*ARGS, *GPT_OSS, *PP2, "--distributed.ep=2", "--train.batch_size=2"], str(tmp_path / "got")))[0]
    assert got.keys() == ref.keys()
    for fqn, g in ref.items():
        err = ((got[fqn] - g).norm() / g.norm()).item()
        assert err < 1e-5, (fqn, err)
    assert ref["layers.3.attention.sinks"].norm() > 0 and ref["layers.0.moe.experts.b13"].norm() > 0


@pytest.mark.parametrize("nproc, args", [
    (2, ["--distributed.tp=2", "--train.batch_size=4"]),
    (4, [*PP2, "--distributed.tp=2", "--train.batch_size=4"]),
], ids=["tp2", "pp2-x-tp2"])
def test_gpt_oss_tensor_parallel_gradients_match_single_process(nproc: int, args: list[str], tmp_path: Path) -> None:
    """The sinks sharded with their heads, q/k/v's biases column-wise, o's bias replicated (added once)."""
    ref = run_distributed(gradients_of_one_step, world_size=1, args=([*ARGS, *GPT_OSS, "--train.batch_size=4"],
                                                                      str(tmp_path / "ref")))[0]
    got = run_distributed(gradients_of_one_step, world_size=nproc, args=([*ARGS, *GPT_OSS, *args],
                                                                         str(tmp_path / "got")))[0]
    assert got.keys() == ref.keys()
    for fqn, g in ref.items():
        err = ((got[fqn] - g).norm() / g.norm()).item()
        assert err < 1e-5, (fqn, err)


def test_gpt_oss_tp2_run_matches_single_process(tmp_path: Path) -> None:
    ref = run_distributed(train_and_read_metrics, world_size=1, args=(
        [*ARGS, *STEPS, *VAL, *GPT_OSS, "--train.batch_size=4"], str(tmp_path / "ref")))[0]
    got = run_distributed(train_and_read_metrics, world_size=2, args=(
        [*ARGS, *STEPS, *VAL, *GPT_OSS, "--distributed.tp=2", "--train.batch_size=4"], str(tmp_path / "tp")))[0]
    assert_same_run(got, ref)


@pytest.mark.parametrize("args, rel", [
    (["--train.activation_checkpointing=full"], 1e-5),
    (["--train.activation_checkpointing=selective"], 1e-5),
    # Compiled blocks (the dense sink attention, the biased grouped experts eager inside): Inductor reorders fp32 sums.
    (["--train.compile_model=true", "--distributed.ep=2", "--train.batch_size=2"], 1e-4),
], ids=["ac-full", "ac-selective", "compile-ep2"])
def test_gpt_oss_under_ac_and_compile_matches_eager(args: list[str], rel: float, tmp_path: Path) -> None:
    ref = run_distributed(train_and_read_metrics, world_size=1, args=(
        [*ARGS, *STEPS, *GPT_OSS, "--train.batch_size=4"], str(tmp_path / "ref")))[0]
    nproc = 2 if "--distributed.ep=2" in args else 1
    got = run_distributed(train_and_read_metrics, world_size=nproc, args=(
        [*ARGS, *STEPS, *GPT_OSS, "--train.batch_size=4", *args], str(tmp_path / "got")))[0]
    assert_same_run(got, ref, rel=rel)
