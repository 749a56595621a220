"""The loss is the mean over every valid token of the step (trainer/run/step.py), in every layout.

Short documents and data.eod_mask_loss=true leave each sequence a different number of valid labels (the token
after each EOS is not trained on). One process with the whole batch of 4 sequences in one microbatch is the
reference: its loss is F.cross_entropy's mean over the batch's valid labels. Every layout that splits the batch
(data-parallel ranks, accumulation, pipeline microbatches, context-parallel chunks) must give its gradients and
logged loss; the old average of per-microbatch means would not, since the halves hold different counts (checked).
fp32: the layouts differ only in the order of sums (see test_parallel.py's bound: 1e-5 relative)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.distributed.spawn import gathered_gradients, run_distributed
from tests.helpers import FAST
from trainer.data.shards import write_shard
from trainer.data.tokenizer import ByteTokenizer


@pytest.fixture(scope="module")
def short_documents(tmp_path_factory) -> Path:
    """Byte tokens in documents of 2-40 tokens, each ended by EOS."""
    return write_short_documents(tmp_path_factory.mktemp("short_documents"), seed=1)


def write_short_documents(folder: Path, *, seed: int) -> Path:
    """A byte-token shard in `folder` of documents of 2-40 tokens, each ended by EOS (seed 1: a first batch that
    splits unevenly every way test_every_layout_takes_the_mean_over_the_steps_valid_tokens splits it)."""
    rng = np.random.default_rng(seed)
    parts = []
    while sum(len(p) for p in parts) < 20_000:
        parts.append(np.append(rng.integers(0, 256, rng.integers(1, 40)), ByteTokenizer.eos_id))
    write_shard(folder / "a.bin", np.concatenate(parts), vocab_size=ByteTokenizer.vocab_size,
                tokenizer_fingerprint=ByteTokenizer.fingerprint)
    return folder


def gradients_and_loss(args: list[str], dump: str) -> tuple[dict, float, list[list[int]]]:
    """The first step's forward and backward in this rank's layout: every full gradient (rank 0), the loss as the
    log line reports it (averaged over the dp x cp ranks), and the valid labels of each of this rank's sequences
    in each quarter of the sequence (the chunks of cp=2)."""
    import torch.distributed as dist

    from trainer.config import load_job_config
    from trainer.distributed import destroy_distributed
    from trainer.loss import IGNORE_INDEX
    from trainer.run.train import build_trainer

    trainer = build_trainer(load_job_config([*args, f"--job.dump_folder={dump}"]))
    try:
        batch = trainer.data_loader.next_batch()
        valid = [[int((quarter != IGNORE_INDEX).sum()) for quarter in row.chunk(4)] for _, labels in batch
                 for row in labels]
        loss = trainer.step_fn.forward_backward(batch)
        dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=trainer.parallel_dims.mesh("dp_cp").get_group())
        return gathered_gradients(trainer.model), loss.item(), valid
    finally:
        trainer.close()
        destroy_distributed()


@pytest.fixture(scope="module")
def reference(short_documents: Path, tmp_path_factory) -> tuple[dict, float, list[int]]:
    args = [*FAST, "--data.source=shards", f"--data.path={short_documents}", "--data.eod_mask_loss=true",
            "--train.batch_size=4"]
    return run_distributed(gradients_and_loss, world_size=1, args=(args, str(tmp_path_factory.mktemp("ref"))))[0]


@pytest.mark.parametrize("nproc, layout", [
    (2, ["--distributed.dp_shard=2", "--train.batch_size=2"]),
    (1, ["--train.grad_accum_steps=2", "--train.batch_size=2"]),
    (2, ["--distributed.pp=2", "--distributed.dp_shard=1", "--distributed.pipeline_schedule=1F1B",
         "--train.batch_size=4", "--distributed.pp_microbatch_size=1"]),
    (2, ["--distributed.cp=2", "--distributed.dp_shard=1", "--train.batch_size=4"]),
], ids=["dp_shard2", "accum2", "pp2-1F1B", "cp2"])
def test_every_layout_takes_the_mean_over_the_steps_valid_tokens(nproc: int, layout: list[str], reference,
                                                                  short_documents: Path, tmp_path: Path) -> None:
    ref_grads, ref_loss, valid = reference
    rows = [sum(row) for row in valid]
    quarters = [sum(row[q] for row in valid) for q in range(4)]
    # The split really is uneven: the dp ranks' and microbatches' halves of the batch, the pipeline's sequences,
    # and the cp ranks' chunks (rank 0 holds quarters 0 and 3).
    assert sum(rows[:2]) != sum(rows[2:]) and len(set(rows)) > 1
    assert quarters[0] + quarters[3] != quarters[1] + quarters[2]
    args = [*FAST, "--data.source=shards", f"--data.path={short_documents}", "--data.eod_mask_loss=true", *layout]
    ranks = run_distributed(gradients_and_loss, world_size=nproc, args=(args, str(tmp_path)))
    grads, loss, _ = ranks[0]
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    assert grads.keys() == ref_grads.keys()
    errors = {fqn: ((grads[fqn] - g).norm() / g.norm()).item() for fqn, g in ref_grads.items()}
    assert max(errors.values()) < 1e-5, sorted(errors.items(), key=lambda kv: -kv[1])[:5]
