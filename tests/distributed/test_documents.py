"""Document masking (data.document_masking) in every layout: FSDP2 over 2 ranks, TP 2 (heads split, the mask whole
on every rank), torch.compile, activation checkpointing, pipeline parallelism (every stage reads its microbatch's
documents from the rows' tokens; 1F1B, Interleaved1F1B, ZBV) and context parallelism (each rank's queries against
the gathered keys, with the whole rows' documents and positions) give the gradients and loss of one process with
the same masking (spawned gloo ranks, fp32; 1e-5 relative as in test_parallel.py), for the dense, MoE (the
Qwen3-MoE layer rule too), DeepSeek-V3 (MLA; with its MTP module under pp) and GPT-OSS (sinks and windows) families.
Packed rows against documents one at a time: tests/unit/test_documents.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.spawn import run_distributed
from tests.distributed.test_token_mean import gradients_and_loss, write_short_documents
from tests.helpers import FAST, REPO

MODEL = ["--train.seq_len=64", "--train.mixed_precision=fp32", "--metrics.enable_tensorboard=false"]
# Each family's debug shapes; the MoE ones without token dropping (debug_moe.toml's moe.capacity_factor=0).
FAMILIES = {
    "moe": ["--config", str(REPO / "configs" / "train" / "debug_moe.toml"), *MODEL],
    "qwen3_moe": ["--config", str(REPO / "configs" / "train" / "qwen3_moe_debug.toml"), *MODEL],
    "deepseek_v3": ["--config", str(REPO / "configs" / "train" / "debug_moe.toml"), *MODEL,
                    "--model.flavor=debug_deepseek_v3", "--deepseek_v3.mtp_layers=0"],
    # With its MTP module: on the last pipeline stage, beside the rows' ids (cp: test_deepseek_v3_layouts.py).
    "deepseek_v3_mtp": ["--config", str(REPO / "configs" / "train" / "debug_moe.toml"), *MODEL,
                        "--model.flavor=debug_deepseek_v3"],
    # Sinks and sliding windows (16 keys, shorter than some documents) under the mask; under cp each rank's queries
    # (chunks of 16, which documents cross) take the window at their global positions.
    "gpt_oss": ["--config", str(REPO / "configs" / "train" / "debug_moe.toml"), *MODEL, "--model.flavor=debug_gpt_oss"],
}
PP2 = ["--distributed.pp=2", "--train.batch_size=4"]
CP2 = ["--distributed.cp=2", "--train.batch_size=4"]


@pytest.fixture(scope="module")
def documents(tmp_path_factory) -> list[str]:
    folder = write_short_documents(tmp_path_factory.mktemp("documents"), seed=1)
    return [*FAST, "--data.source=shards", f"--data.path={folder}", "--data.document_masking=true"]


@pytest.fixture(scope="module")
def reference(documents: list[str], tmp_path_factory) -> tuple[dict, float]:
    grads, loss, _ = run_distributed(gradients_and_loss, world_size=1, args=(
        [*documents, "--train.batch_size=4"], str(tmp_path_factory.mktemp("ref"))))[0]
    return grads, loss


@pytest.mark.parametrize("nproc, layout, tolerance", [
    (2, ["--distributed.dp_shard=2", "--train.batch_size=2"], 1e-5),
    (2, ["--distributed.tp=2", "--train.batch_size=4"], 1e-5),
    (1, ["--train.batch_size=4", "--train.compile_model=true", "--train.activation_checkpointing=selective"], 1e-5),
    (1, ["--train.batch_size=4", "--train.activation_checkpointing=full"], 1e-5),
    (2, [*PP2, "--distributed.pipeline_schedule=1F1B"], 1e-5),
    (2, [*PP2, "--distributed.pipeline_schedule=Interleaved1F1B"], 1e-5),
    (2, [*PP2, "--distributed.pipeline_schedule=ZBVZeroBubble"], 1e-5),
    (2, CP2, 1e-5),
    (4, [*PP2, *CP2, "--distributed.pipeline_schedule=Interleaved1F1B"], 1e-5),
    (2, [*CP2, "--train.compile_model=true", "--train.activation_checkpointing=selective"], 1e-5),
], ids=["dp_shard2", "tp2", "compile-selective-ac", "full-ac", "pp2-1f1b", "pp2-interleaved1f1b", "pp2-zbv", "cp2",
        "cp2-x-pp2", "cp2-compile-selective-ac"])
def test_document_masking_matches_one_process(nproc: int, layout: list[str], tolerance: float, documents, reference,
                                               tmp_path: Path) -> None:
    ref_grads, ref_loss = reference
    grads, loss, _ = run_distributed(gradients_and_loss, world_size=nproc, args=([*documents, *layout],
                                                                                 str(tmp_path)))[0]
    assert loss == pytest.approx(ref_loss, rel=tolerance)
    errors = {fqn: ((grads[fqn] - g).norm() / g.norm()).item() for fqn, g in ref_grads.items()}
    assert max(errors.values()) < tolerance, sorted(errors.items(), key=lambda kv: -kv[1])[:5]


def test_masking_changes_the_loss(documents, reference, tmp_path: Path) -> None:
    """The same first step without document masking: another loss (the packed documents see each other)."""
    _, unmasked, _ = run_distributed(gradients_and_loss, world_size=1, args=(
        [*documents, "--train.batch_size=4", "--data.document_masking=false"], str(tmp_path)))[0]
    assert abs(unmasked / reference[1] - 1) > 1e-3


LAYOUTS = {"pp2-1f1b": [*PP2, "--distributed.pipeline_schedule=1F1B"],
           "pp2-interleaved1f1b": [*PP2, "--distributed.pipeline_schedule=Interleaved1F1B"], "cp2": CP2}


@pytest.mark.parametrize("family, layout", [
    pytest.param(family, layout, id=f"{name}-{family}") for name, layout in LAYOUTS.items() for family in FAMILIES
    if (family, name) != ("deepseek_v3_mtp", "cp2")])
def test_every_family_with_document_masking_matches_one_process(family: str, layout: list[str], documents,
                                                                 tmp_path: Path) -> None:
    """The MoE families' routers, aux losses (over whole sequences under cp) and MLA's attention under the mask."""
    model = [*FAMILIES[family], *documents[len(FAST):]]
    ref_grads, ref_loss, _ = run_distributed(gradients_and_loss, world_size=1, args=(
        [*model, "--train.batch_size=4"], str(tmp_path / "ref")))[0]
    grads, loss, _ = run_distributed(gradients_and_loss, world_size=2, args=([*model, *layout], str(tmp_path / "got")))[0]
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    assert grads.keys() == ref_grads.keys()
    errors = {fqn: ((grads[fqn] - g).norm() / g.norm().clamp(min=1e-30)).item() for fqn, g in ref_grads.items()}
    assert max(errors.values()) < 1e-5, sorted(errors.items(), key=lambda kv: -kv[1])[:5]
