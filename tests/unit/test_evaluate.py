"""Validation: a held-out split training never reads, a loss equal to a plain loop, one-line config errors."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.helpers import DEBUG_CONFIG, FAST, column, train
from trainer.config import load_job_config
from trainer.data.loader import build_source
from trainer.data.sources import HELD_OUT_BLOCK, HELD_OUT_EVERY, _default_tokens
from trainer.distributed import destroy_distributed
from trainer.errors import ConfigError
from trainer.models import Llama
from trainer.train import build_trainer
from trainer.validate import validate_job

VAL = ["--validation.enable=true", "--validation.steps=3", "--train.batch_size=4"]


def _source(split: str, source: str = "default"):
    return build_source(source=source, path="", tokenizer="byte", seed=0, vocab_size=512, seq_len=64, split=split)


def test_held_out_split_is_disjoint_from_training_and_covers_the_text():
    everything = _default_tokens()
    train_part, held_out = _source("train").tokens, _source("validation").tokens
    assert len(train_part) + len(held_out) == len(everything)
    assert len(held_out) == pytest.approx(len(everything) / HELD_OUT_EVERY, rel=0.1)
    # Rebuild both parts by block position: the held-out blocks are exactly every HELD_OUT_EVERY-th one.
    blocks = [everything[i:i + HELD_OUT_BLOCK] for i in range(0, len(everything), HELD_OUT_BLOCK)]
    assert np.array_equal(held_out, np.concatenate(blocks[HELD_OUT_EVERY - 1::HELD_OUT_EVERY]))
    kept = [b for k, b in enumerate(blocks) if k % HELD_OUT_EVERY != HELD_OUT_EVERY - 1]
    assert np.array_equal(train_part, np.concatenate(kept))


def test_synthetic_validation_is_another_stream():
    train_source, val_source = _source("train", "synthetic"), _source("validation", "synthetic")
    assert not np.array_equal(train_source.get_sample(0, 64), val_source.get_sample(0, 64))
    assert np.array_equal(val_source.get_sample(3, 64), _source("validation", "synthetic").get_sample(3, 64))


def test_validation_loss_equals_a_plain_loop_and_does_not_disturb_training(tmp_path: Path):
    args = ["--config", DEBUG_CONFIG, "--train.steps=4", "--train.seq_len=64", "--train.mixed_precision=fp32",
            "--metrics.log_freq=1", "--metrics.enable_tensorboard=false", *VAL, "--validation.freq=2",
            f"--job.dump_folder={tmp_path}"]
    cfg = load_job_config(args)
    trainer = build_trainer(cfg)
    try:
        trainer.run()
        weights = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in trainer.model.state_dict().items()}
    finally:
        trainer.close()
        destroy_distributed()
    records = [r for r in map(__import__("json").loads, (tmp_path / "metrics.jsonl").read_text().splitlines())]
    assert [r["step"] for r in records if "val_loss" in r] == [2, 4]
    # An independent loop: the unsharded model, the held-out samples 0..11 in order, logits then cross-entropy.
    model = Llama(trainer.model_args)
    model.init_weights(seed=1)  # builds the RoPE table; every weight is then overwritten
    model.load_state_dict(weights)
    source = _source("validation")
    losses = []
    with torch.no_grad():
        for b in range(3):
            rows = torch.from_numpy(np.stack([source.get_sample(i, 64) for i in range(4 * b, 4 * b + 4)]))
            logits = model.logits(rows[:, :-1])
            losses.append(F.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten()).item())
    expected = sum(losses) / len(losses)
    assert records[-1]["val_loss"] == pytest.approx(expected, rel=1e-5)
    assert records[-1]["val_ppl"] == pytest.approx(math.exp(expected), rel=1e-5)
    # Evaluating changed nothing about training: the same run without validation has the same losses.
    plain = train([a for a in args[:-1] if not a.startswith("--validation")], tmp_path / "plain")
    assert column(plain, "loss") == [r["loss"] for r in records]


def test_resume_gives_the_same_validation_loss(tmp_path: Path):
    args = [*FAST, "--train.steps=4", *VAL, "--validation.freq=2", "--checkpoint.enable=true",
            "--checkpoint.interval=2"]
    full = train(args, tmp_path / "full")
    train(args, tmp_path / "resumed")  # writes step-2 and step-4
    resumed = train([*args, "--checkpoint.load_step=2"], tmp_path / "resumed")
    assert [r.get("val_loss") for r in resumed] == [r.get("val_loss") for r in full]
    assert full[-1]["val_loss"] is not None and full[1]["val_loss"] is not None


@pytest.mark.parametrize("override, message", [
    (["--validation.steps=0"], "validation.steps=0 must be >= 1"),
    (["--validation.freq=0"], "validation.freq=0 must be >= 1"),
    (["--data.source=shards", "--data.path=/x"], "validation.enable=true with data.source='shards' needs validation.path"),
])
def test_bad_validation_config_is_one_line_naming_the_key(override, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        load_job_config(["--config", DEBUG_CONFIG, "--validation.enable=true", *override])


def test_too_few_held_out_samples_names_the_keys(tmp_path: Path):
    cfg = load_job_config(["--config", DEBUG_CONFIG, "--validation.enable=true", "--validation.steps=1000",
                           "--train.seq_len=512"])
    with pytest.raises(ConfigError, match=r"validation.steps=1000 x train.batch_size=8 x 2 data-parallel ranks needs "
                                          r"16000 held-out samples of seq_len 512, but .* has \d+; lower validation.steps"):
        validate_job(cfg, world_size=2)
    with pytest.raises(Exception, match="no shard files found at validation.path='/nonexistent'"):
        validate_job(load_job_config(["--config", DEBUG_CONFIG, "--validation.enable=true",
                                      "--validation.path=/nonexistent"]), world_size=1)
