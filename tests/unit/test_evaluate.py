"""Validation: a held-out split training never reads, one-line config errors (a loss equal to a plain loop, in
whole runs: tests/cli/test_evaluate.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.helpers import DEBUG_CONFIG
from trainer.config import load_job_config
from trainer.data.loader import build_source
from trainer.data.sources import HELD_OUT_BLOCK, HELD_OUT_EVERY, _default_tokens
from trainer.errors import ConfigError
from trainer.validate import validate_job


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
