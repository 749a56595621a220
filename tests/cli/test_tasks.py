"""[[validation.tasks]] in a whole run (the trainer in this process, as tests/cli/test_evaluate.py runs it): the logged
accuracies are a plain float64 loop's on the run's final weights, in metrics.jsonl, TensorBoard and the log line.
The scorer and the errors: tests/unit/test_tasks.py; other layouts: tests/distributed/test_tasks.py."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest

from tests.cli.test_evaluate import run_in_process
from tests.helpers import DEBUG_CONFIG, REPO
from tests.unit.test_tasks import reference_log_likelihoods

EXAMPLE = REPO / "tests" / "data" / "tasks_example.jsonl"
ARGS = ["--config", DEBUG_CONFIG, "--train.steps=4", "--train.seq_len=64", "--train.mixed_precision=fp32",
        "--train.batch_size=4", "--metrics.log_freq=1", "--validation.enable=true", "--validation.steps=1",
        "--validation.freq=2", f"--validation.tasks=example={EXAMPLE}"]


def reference_accuracies(model, items: list[dict], seq_len: int) -> dict[str, float]:
    """acc and acc_norm of a float64 loop over each choice's tokens (lm-evaluation-harness's definitions)."""
    lls = reference_log_likelihoods(model, items, seq_len)
    answers = [item["answer"] for item in items]
    picks = [int(np.argmax(ll)) for ll in lls]
    norm = [int(np.argmax(np.array(ll) / [len(c) for c in item["choices"]])) for ll, item in zip(lls, items)]
    return {"acc": float(np.mean(np.equal(picks, answers))), "acc_norm": float(np.mean(np.equal(norm, answers)))}


def test_logged_accuracy_is_a_float64_loop_on_the_final_weights(tmp_path: Path, caplog) -> None:
    items = [json.loads(line) for line in EXAMPLE.read_text(encoding="utf-8").splitlines()]
    assert any(len((i["context"] + c).encode()) > 65 for i in items for c in i["choices"])  # one row is truncated
    # Each item once per answer: exactly one copy of each is right whatever the weights, so both accuracies are
    # 7 items / 19 copies.
    every = tmp_path / "every_answer.jsonl"
    every.write_text("".join(json.dumps(item | {"answer": a}) + "\n" for item in items
                             for a in range(len(item["choices"]))), encoding="utf-8")
    with caplog.at_level(logging.INFO):
        records, model = run_in_process([*ARGS[:-1], f"{ARGS[-1]},every={every}"], tmp_path / "run")
    assert records[-1]["val/acc_norm/every"] == records[-1]["val/acc/every"] == 7 / 19
    assert [r["step"] for r in records if "val/acc_norm/example" in r] == [2, 4]
    expected = reference_accuracies(model, items, 64)
    assert records[-1]["val/acc_norm/example"] == expected["acc_norm"]  # k / 7: exact
    assert records[-1]["val/acc/example"] == expected["acc"]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = EventAccumulator(str(tmp_path / "run" / "tb"))
    tb.Reload()
    assert [(e.step, e.value) for e in tb.Scalars("val/acc_norm/example")] == [
        (r["step"], pytest.approx(r["val/acc_norm/example"])) for r in records if "val/acc_norm/example" in r]
    assert [e.step for e in tb.Scalars("val/acc/example")] == [2, 4]
    lines = [r.getMessage() for r in caplog.records]
    assert any(f"example acc_norm {expected['acc_norm']:.3f}" in line and "step      4/4" in line for line in lines)
    assert any("validation.tasks 'example': 7 items, 19 choices scored every 2 steps (acc_norm: by characters); "
               "3 row(s) longer than train.seq_len lost context tokens on the left" in line for line in lines)
