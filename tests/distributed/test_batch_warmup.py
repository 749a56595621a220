"""train.batch_size_warmup_tokens over 2 spawned gloo ranks (FSDP2 dp_shard=2; a 1F1B pipeline of 2 stages), against
one process training the same global batches: the same tokens per step (the ramp counts global tokens, so dp=2 with
batch_size=2 ramps as one process with batch_size=4) and the same losses to fp32 rounding (the ranks' microbatches
hold the one process's samples; they sum in another order: test_parallel.py's bound, 1e-5 relative). And a short
step's loss and gradients are the mean over its own valid tokens: a warm-up step of 2 of 4 microbatches equals one
microbatch of the same 4 sequences (test_token_mean.py's reference, documents of uneven valid labels)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.distributed.spawn import gathered_gradients, run_distributed
from tests.distributed.test_ema_resume import _one_process, _train
from tests.distributed.test_token_mean import write_short_documents
from tests.helpers import FAST

# A microbatch is 256 global tokens either way (2 sequences x 2 ranks, or 4 x 1, of 64 tokens); from 1 microbatch to
# 4 over 1024 tokens: count = 1 + 3 x T // 1024: T = 0 -> 1, 256 -> 1, 512 -> 2, 1024 -> 4.
ARGS = [*FAST, "--train.steps=6", "--train.grad_accum_steps=4", "--train.batch_size_warmup_tokens=1024"]
TOKENS = [256, 256, 512, 1024, 1024, 1024]


LAYOUTS = {
    "dp_shard2": ["--distributed.dp_shard=2", "--train.batch_size=2", "--train.batch_size_warmup_start=2"],
    # Each accumulation microbatch is one pass of the 1F1B schedule, whose own 4 microbatches stay fixed.
    "pp2-1F1B": ["--distributed.pp=2", "--distributed.dp_shard=1", "--distributed.pipeline_schedule=1F1B",
                 "--distributed.pp_microbatch_size=1", "--train.batch_size=4", "--train.batch_size_warmup_start=4"],
}


def _runs(folder: str, layout: list[str]) -> None:
    """The two-rank run on both ranks, then rank 0 alone: the one-process run of the same global batches."""
    import os

    root = Path(folder)
    _train([*ARGS, *layout], root / "two")
    if os.environ["RANK"] == "0":
        _one_process()
        _train([*ARGS, "--train.batch_size=4", "--train.batch_size_warmup_start=4"], root / "one")


def _metrics(dump: Path) -> list[dict]:
    return [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_a_ramp_over_two_ranks_trains_as_one_process_with_the_same_global_batches(layout: list[str],
                                                                                    tmp_path: Path) -> None:
    run_distributed(_runs, world_size=2, args=(str(tmp_path), layout), timeout=240)
    two, one = _metrics(tmp_path / "two"), _metrics(tmp_path / "one")
    assert [r["tokens"] for r in two] == [r["tokens"] for r in one] == TOKENS
    assert [r["step"] for r in two] == list(range(1, 7))
    for a, b in zip(two, one):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), (a["step"], a["loss"], b["loss"])
    assert len({r["loss"] for r in one}) == 6  # not vacuous: the runs train


def _first_step(args: list[str], dump: str) -> tuple[dict, float, int, list[int]]:
    """The first step's forward and backward with the microbatches the ramp gives it: every gradient, the loss, the
    microbatch count and each microbatch's valid labels."""
    from trainer.config import load_job_config
    from trainer.distributed import destroy_distributed
    from trainer.loss import IGNORE_INDEX
    from trainer.run.train import build_trainer

    trainer = build_trainer(load_job_config([*args, f"--job.dump_folder={dump}"]))
    try:
        batch = trainer.data_loader.next_batch(trainer.job.batch_warmup.microbatches(trainer.state.tokens))
        loss = trainer.step_fn.forward_backward(batch)
        return (gathered_gradients(trainer.model), loss.item(), len(batch),
                [int((labels != IGNORE_INDEX).sum()) for _, labels in batch])
    finally:
        trainer.close()
        destroy_distributed()


def test_a_short_step_takes_the_mean_over_its_own_valid_tokens(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    data = [*FAST, "--data.source=shards", f"--data.path={write_short_documents(tmp_path / 'data', seed=1)}",
            "--data.eod_mask_loss=true"]
    ref_grads, ref_loss, _, _ = run_distributed(_first_step, world_size=1, args=(
        [*data, "--train.batch_size=4"], str(tmp_path / "ref")))[0]
    grads, loss, count, valid = run_distributed(_first_step, world_size=1, args=(
        [*data, "--train.batch_size=2", "--train.grad_accum_steps=4", "--train.batch_size_warmup_start=4",
         "--train.batch_size_warmup_tokens=100000"], str(tmp_path / "warm")))[0]
    assert count == 2 and valid[0] != valid[1]  # a short step, of microbatches with uneven valid labels
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    errors = {fqn: ((grads[fqn] - g).norm() / g.norm()).item() for fqn, g in ref_grads.items()}
    assert max(errors.values()) < 1e-5, sorted(errors.items(), key=lambda kv: -kv[1])[:5]
