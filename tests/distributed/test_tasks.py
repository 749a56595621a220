"""[[validation.tasks]] in every layout (2 spawned gloo ranks, then rank 0 alone as one process): the logged accuracies
equal the one-process run's, and every choice's summed loss (its minus log-likelihood, scored again after the run on
the final weights) equals one process's to fp32 rounding, the same on every rank. The scorer against a float64 loop:
tests/unit/test_tasks.py."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from tests.distributed.spawn import run_distributed
from tests.helpers import FAST, REPO

EXAMPLE = REPO / "tests" / "data" / "tasks_example.jsonl"
MOE_CONFIG = str(REPO / "configs" / "train" / "debug_moe.toml")
# Every layout's global batch is 4 rows (train.batch_size x data-parallel ranks): the same 19 choices in 5 batches.
ARGS = [*FAST, "--train.steps=2", "--validation.enable=true", "--validation.freq=1", "--validation.steps=1",
        f"--validation.tasks=example={EXAMPLE}"]
KEYS = ("val/acc_norm/example", "val/acc/example")


def _run(args: list[str], dump: str) -> tuple[list[dict], np.ndarray]:
    """A whole run in this process; (rank 0's metrics rows with task metrics, else [], every row's summed loss scored
    again on the final weights)."""
    from trainer.config import load_job_config
    from trainer.distributed import destroy_distributed
    from trainer.run.tasks import TaskScorer
    from trainer.run.train import build_trainer

    trainer = build_trainer(load_job_config([*args, f"--job.dump_folder={dump}"]))
    try:
        trainer.run()
        (scorer,) = [hook for hook in trainer.hooks if isinstance(hook, TaskScorer)]
        scores = scorer.score(trainer.model)
    finally:
        trainer.close()
        destroy_distributed()
    rows = [json.loads(line) for line in (Path(dump) / "metrics.jsonl").read_text().splitlines()]
    return ([{k: r[k] for k in ("step", *KEYS) if k in r} for r in rows] if os.environ["RANK"] == "0" else []), scores


def layout_then_one_process(args: list[str], ref_args: list[str], dump: str
                            ) -> tuple[list[dict], np.ndarray, list[dict], np.ndarray]:
    """_run(args) on every rank, then on rank 0 alone _run(ref_args), the one-process run."""
    got, scores = _run(args, str(Path(dump) / "layout"))
    if os.environ["RANK"] != "0":
        return got, scores, [], np.zeros(0)
    for key in ("MASTER_ADDR", "MASTER_PORT"):  # no peers: trainer.distributed makes a 1-process group
        os.environ.pop(key)
    os.environ.update({"WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0"})
    return (got, scores, *_run(ref_args, str(Path(dump) / "one")))


@pytest.mark.parametrize("args", [
    ["--distributed.dp_shard=2", "--train.batch_size=2"],
    ["--distributed.tp=2", "--train.batch_size=4"],
    ["--distributed.pp=2", "--distributed.pipeline_schedule=1F1B", "--train.batch_size=4",
     "--distributed.pp_microbatch_size=2"],
    # 2 stages per rank, 4 microbatches: the last stage's row sums come in microbatch order here too.
    ["--distributed.pp=2", "--distributed.pipeline_schedule=Interleaved1F1B", "--train.batch_size=4",
     "--distributed.pp_microbatch_size=1"],
    ["--distributed.cp=2", "--train.batch_size=4"],
    ["--config", MOE_CONFIG, "--distributed.ep=2", "--train.batch_size=2"],  # the experts' all-to-all
], ids=["dp_shard2", "tp2", "pp2", "pp2-interleaved", "cp2", "moe-ep2"])
def test_every_layout_scores_as_one_process(args: list[str], tmp_path: Path) -> None:
    config = args[:2] if args[0] == "--config" else []  # the last --config wins: the one process runs the same model
    (got, scores, ref, ref_scores), (_, other_scores, _, _) = run_distributed(
        layout_then_one_process, world_size=2,
        args=([*ARGS, *args], [*ARGS, *config, "--train.batch_size=4"], str(tmp_path)))
    assert len(ref_scores) == 19 and np.all(ref_scores > 0)
    np.testing.assert_array_equal(scores, other_scores)  # every rank picks from the same numbers
    np.testing.assert_allclose(scores, ref_scores, rtol=2e-5)
    assert [r["step"] for r in got if KEYS[0] in r] == [1, 2]
    assert [{k: r.get(k) for k in KEYS} for r in got] == [{k: r.get(k) for k in KEYS} for r in ref]
