"""Validation: a held-out split training never reads, one-line config errors (a loss equal to a plain loop, in
whole runs: tests/cli/test_evaluate.py)."""

from __future__ import annotations

from pathlib import Path

import logging

import numpy as np
import pytest
import torch

from tests.helpers import DEBUG_CONFIG
from trainer.config import load_job_config
from trainer.data import DataError
from trainer.data.loader import build_source
from trainer.data.mix import HeldOutMixture, MixEntry
from trainer.data.sources import HELD_OUT_BLOCK, HELD_OUT_EVERY, _default_tokens
from trainer.errors import ConfigError
from trainer.loss import IGNORE_INDEX
from trainer.run.evaluate import Evaluator
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


class _Tokens:
    """A held-out source whose every sample is `row` (seq_len + 1 tokens)."""

    def __init__(self, row: list[int]):
        self.row = np.array(row)

    def num_samples(self, seq_len: int) -> int:
        return 100

    def get_sample(self, index: int, seq_len: int) -> np.ndarray:
        return self.row[:seq_len + 1]


def _evaluator(source, **kwargs):
    """An Evaluator of `source` (eod id 257) whose loss is 2 per valid label."""
    def batch_loss(inputs, labels):
        valid = int((labels != IGNORE_INDEX).sum())
        return torch.tensor(2.0 * valid), valid

    return Evaluator(source, model=torch.nn.Linear(1, 1), batch_loss=batch_loss, seq_len=4, batch_size=2, steps=2,
                     freq=10, last_step=10, dp_rank=0, dp_degree=1, device=torch.device("cpu"), eod_mask_id=257,
                     **kwargs)


TEXT, EOS_ONLY = _Tokens([1, 2, 257, 3, 4]), _Tokens([257] * 5)


def test_a_held_out_source_with_no_valid_label_is_left_out_of_val_loss_in_one_warning(caplog) -> None:
    """A mixture's held-out source of end-of-document tokens alone, under data.eod_mask_loss: its loss was averaged in
    as 0 (halving val_loss here); now it is left out, named once when the run starts."""
    with caplog.at_level(logging.WARNING, logger="trainer"):
        evaluator = _evaluator(HeldOutMixture((MixEntry("web", 0.5, TEXT), MixEntry("code", 0.5, EOS_ONLY))))
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and warnings[0].startswith(
        "validation: held-out source(s) 'code' have no valid label (2 batch(es) of 2 x 1 rank(s), every label masked "
        "by data.eod_mask_loss"), warnings
    assert "left out of val_loss, the weighted mean of the other sources" in warnings[0]
    result = evaluator.evaluate(evaluator.model)
    assert result["loss"] == 2.0 and result["by_source"] == {"web": 2.0}  # not (2.0 + 0) / 2
    assert evaluator.on_log(10).keys() == {"val_loss", "val_ppl", "val/loss/web"}


def test_a_held_out_set_with_no_valid_label_stops_the_run_before_its_first_step() -> None:
    with pytest.raises(DataError, match=r"^validation: the held-out data \(.*\) has no valid label to compute a loss "
                                        r"on \(2 batch\(es\) of 2 x 1 rank\(s\), every label masked by "
                                        r"data.eod_mask_loss .*\); .* or set validation.enable=false$"):
        _evaluator(EOS_ONLY)
    with pytest.raises(DataError, match=r"^validation: the held-out data"):
        _evaluator(HeldOutMixture((MixEntry("web", 0.5, EOS_ONLY), MixEntry("code", 0.5, EOS_ONLY))))
    assert _evaluator(TEXT).evaluate(torch.nn.Linear(1, 1))["loss"] == 2.0  # a held-out set with labels: as before
