"""metrics.event_log on 2 gloo ranks (FSDP2, dp_shard=2) with rank 1's data fetch slowed by 0.3 s a batch: each rank
writes its own file, and the summary (trainer/metrics/event_summary.py) names rank 1 the straggler, late by its data
wait, while rank 0 waits for it inside forward/backward (a collective's wait, which no mark tells from compute)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.distributed.spawn import run_distributed
from tests.helpers import FAST

DELAY_S = 0.3
ARGS = [*FAST, "--train.steps=4", "--train.seq_len=32", "--train.batch_size=2", "--distributed.dp_shard=2",
        "--metrics.log_freq=2", "--metrics.event_log=true"]


def _train_with_a_slow_rank(dump: str) -> None:
    import os
    import time

    import trainer.run.train as train_module
    from trainer.config import load_job_config

    build = train_module.build_data_loader

    def slow_on_rank_1(*args, **kwargs):  # this forked rank's own copy of the module: no other test sees it
        loader = build(*args, **kwargs)
        if os.environ["RANK"] == "1":
            fetch = loader.next_batch

            def next_batch(*args):  # the microbatch count (train.batch_size_warmup_tokens' ramp) passes through
                time.sleep(DELAY_S)
                return fetch(*args)

            loader.next_batch = next_batch
        return loader

    train_module.build_data_loader = slow_on_rank_1
    train_module.train(load_job_config([*ARGS, f"--job.dump_folder={dump}"]))


def test_two_ranks_write_their_files_and_the_summary_names_the_slow_one(tmp_path: Path) -> None:
    from trainer.metrics.event_summary import format_summary, read_run, summarize

    run_distributed(_train_with_a_slow_rank, world_size=2, args=(str(tmp_path),), timeout=180)
    files = sorted((tmp_path / "events").iterdir())
    assert [f.name for f in files] == ["rank-00000.jsonl", "rank-00001.jsonl"]
    runs = [[json.loads(line) for line in f.read_text().splitlines()] for f in files]
    for rank, records in enumerate(runs):
        assert [r["event"] for r in records] == ["run_start", *["step"] * 4, "run_end"]
        assert all(r["rank"] == rank for r in records)
        assert records[0]["layout"]["world_size"] == 2 and records[0]["layout"]["dp_shard"] == 2
        assert all(r["comm_s"] is None for r in records[1:5])  # 2 ranks: the exposed communication is not known
    assert runs[0][0]["config_hash"] == runs[1][0]["config_hash"]
    assert all(r["data_s"] >= DELAY_S for r in runs[1][1:5]) and all(r["data_s"] < DELAY_S / 3 for r in runs[0][1:5])

    summary = summarize(read_run(tmp_path), skip_first=1)
    assert [(s.rank, s.steps) for s in summary.ranks] == [(0, 3), (1, 3)]
    fast, slow = summary.ranks
    assert slow.late > 0.8 * DELAY_S and fast.late == 0.0
    assert summary.straggler == 1 and summary.gap.startswith("against rank 0 it loses most in data wait")
    # Rank 0 waited for rank 1's batch in its forward/backward's first collective.
    assert fast.medians["forward_backward_s"] > slow.medians["forward_backward_s"] + 0.5 * DELAY_S
    text = format_summary(summary)
    assert "straggler: rank 1" in text and "world size 2 (dp_replicate=1 dp_shard=2" in text
