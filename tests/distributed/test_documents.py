"""Document masking (data.document_masking) in every layout that composes with it: FSDP2 over 2 ranks, TP 2
(heads split, the mask whole on every rank), torch.compile, activation checkpointing and fp8 give the gradients
and loss of one process with the same masking (spawned gloo ranks, fp32; 1e-5 relative as in
test_parallel.py). Packed rows against documents one at a time: tests/unit/test_documents.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.spawn import run_distributed
from tests.distributed.test_token_mean import gradients_and_loss, write_short_documents
from tests.helpers import FAST


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
], ids=["dp_shard2", "tp2", "compile-selective-ac", "full-ac"])
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
