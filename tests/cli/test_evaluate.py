"""Validation in whole runs: the loss equals a plain loop and does not disturb training, and a resumed run gives
the same validation loss (the trainer as a command for the comparison runs). The held-out split and the config
errors: tests/unit/test_evaluate.py."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.helpers import DEBUG_CONFIG, FAST, column, train
from tests.unit.test_evaluate import _source
from trainer.config import load_job_config
from trainer.distributed import destroy_distributed
from trainer.models import Llama
from trainer.run.train import build_trainer


VAL = ["--validation.enable=true", "--validation.steps=3", "--train.batch_size=4"]


def run_in_process(args: list[str], dump: Path) -> tuple[list[dict], dict]:
    """(metrics.jsonl's records, the final weights gathered whole) of a run trained in this process."""
    trainer = build_trainer(load_job_config([*args, f"--job.dump_folder={dump}"]))
    try:
        trainer.run()
        weights = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in trainer.model.state_dict().items()}
    finally:
        trainer.close()
        destroy_distributed()
    model = Llama(trainer.model_args)
    model.init_weights(seed=1)  # builds the RoPE table; every weight is then overwritten
    model.load_state_dict(weights)
    return [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()], model


def held_out_loss(model: Llama) -> float:
    """An independent loop: the unsharded model, the held-out samples 0..11 in order, logits then cross-entropy
    (in fp32; the logits in the model's dtype)."""
    source = _source("validation")
    losses = []
    with torch.no_grad():
        for b in range(3):
            rows = torch.from_numpy(np.stack([source.get_sample(i, 64) for i in range(4 * b, 4 * b + 4)]))
            logits = model.logits(rows[:, :-1]).float()
            losses.append(F.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten()).item())
    return sum(losses) / len(losses)


def test_validation_loss_equals_a_plain_loop_and_does_not_disturb_training(tmp_path: Path):
    args = ["--config", DEBUG_CONFIG, "--train.steps=4", "--train.seq_len=64", "--train.mixed_precision=fp32",
            "--metrics.log_freq=1", "--metrics.enable_tensorboard=false", *VAL, "--validation.freq=2"]
    records, model = run_in_process(args, tmp_path)
    assert [r["step"] for r in records if "val_loss" in r] == [2, 4]
    expected = held_out_loss(model)
    assert records[-1]["val_loss"] == pytest.approx(expected, rel=1e-5)
    assert records[-1]["val_ppl"] == pytest.approx(math.exp(expected), rel=1e-5)
    # Evaluating changed nothing about training: the same run without validation has the same losses.
    plain = train([a for a in args if not a.startswith("--validation")], tmp_path / "plain")
    assert column(plain, "loss") == [r["loss"] for r in records]


def test_resume_gives_the_same_validation_loss(tmp_path: Path):
    args = [*FAST, "--train.steps=4", *VAL, "--validation.freq=2", "--checkpoint.enable=true",
            "--checkpoint.interval=2"]
    full = train(args, tmp_path / "full")
    train(args, tmp_path / "resumed")  # writes step-2 and step-4
    resumed = train([*args, "--checkpoint.load_step=2"], tmp_path / "resumed")
    assert [r.get("val_loss") for r in resumed] == [r.get("val_loss") for r in full]
    assert full[-1]["val_loss"] is not None and full[1]["val_loss"] is not None


def test_fp8_run_evaluated_in_bf16_equals_a_bf16_loop_and_trains_the_same(tmp_path: Path):
    """validation.mixed_precision='bf16': the held-out loss of an fp8 run is the bf16 model's on the same weights."""
    args = ["--config", DEBUG_CONFIG, "--train.steps=2", "--train.seq_len=64", "--train.mixed_precision=fp8",
            "--metrics.log_freq=1", "--metrics.enable_tensorboard=false", *VAL, "--validation.freq=2"]
    records, model = run_in_process([*args, "--validation.mixed_precision=bf16"], tmp_path)
    # The same bf16 ops as the loop's (on the bf16 master weights); only the fp32 sums of the loss over tokens run in
    # another order.
    assert records[-1]["val_loss"] == pytest.approx(held_out_loss(model.to(torch.bfloat16)), rel=1e-5)
    # The default evaluates in fp8: another loss on the same weights, and the training is the same either way.
    fp8_eval = train(args, tmp_path / "fp8_eval")
    assert column(fp8_eval, "loss") == [r["loss"] for r in records]
    assert fp8_eval[-1]["val_loss"] != records[-1]["val_loss"]
