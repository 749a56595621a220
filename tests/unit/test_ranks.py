"""trainer.validate.ranks: what every rank must agree on, and the line that names the first difference. The
2-process runs whose ranks differ: tests/distributed/test_ranks_agree.py."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from tests.helpers import DEBUG_CONFIG, REPO
from trainer.config import load_job_config
from trainer.data import ByteTokenizer, DefaultTextSource, ShardSource, SyntheticSource, write_shard
from trainer.data.sources import StdlibTextSource
from trainer.validate import validate_job
from trainer.validate.ranks import code_version, first_difference, job_values

BYTE = ByteTokenizer.fingerprint


def _values(*overrides: str) -> dict:
    return job_values(validate_job(load_job_config(["--config", DEBUG_CONFIG, *overrides]), world_size=2))


def test_the_values_are_resolved_tomls_plus_the_code_and_the_data() -> None:
    values = _values("--train.seq_len=64", "--validation.enable=true")
    assert values["train.seq_len"] == 64 and values["optimizer.lr"] == 3e-3
    assert values["distributed.dp_shard"] == 2  # resolved from -1: the value used, not the placeholder
    assert values["model_args.dim"] > 0  # the model's whole shape
    # Every source file of the package, by its bytes (an uncommitted edit counts): not the git commit.
    sources = {k: v for k, v in values.items() if k.startswith("trainer.source.")}
    assert len(sources) == len(list((REPO / "trainer").rglob("*.py"))) > 100 and "trainer.commit" not in values
    train_py = (REPO / "trainer" / "run" / "train.py").read_bytes()
    assert sources["trainer.source.run/train.py"] == hashlib.sha256(train_py).hexdigest()[:16]
    assert code_version()[1]["run/train.py"] == sources["trainer.source.run/train.py"]
    assert values["data_contents.train"].startswith("default:train:")
    assert values["data_contents.validation"].startswith("default:validation:")
    assert list(values)[:2] == ["job.dump_folder", "job.description"]  # resolved.toml's order: the first key first
    assert _values("--train.seq_len=64", "--validation.enable=true") == values  # a pure function of the job
    assert _values("--train.seq_len=32", "--validation.enable=true")["train.seq_len"] == 32


def test_data_fingerprints_differ_where_the_tokens_differ(tmp_path) -> None:
    def shards(folder: str, tokens: np.ndarray) -> ShardSource:
        (tmp_path / folder).mkdir()
        path = write_shard(tmp_path / folder / "s0.bin", tokens, vocab_size=256, tokenizer_fingerprint=BYTE)
        return ShardSource([path], vocab_size=256, tokenizer_fingerprint=BYTE)

    tokens = np.arange(1_000_000) % 251
    a, same = shards("a", tokens), shards("same", tokens)
    assert a.fingerprint() == same.fingerprint()  # where the files live does not matter, what they hold does
    # Round 5: only the first and last 4,096 tokens counted (and of those, the six an array's repr shows). A token
    # changed anywhere, the shard shortened, two words traded or the tokens reordered: each is seen.
    for k in (0, 3, 100_000, 500_000, 777_777, 999_999):
        edited = tokens.copy()
        edited[k] = (edited[k] + 1) % 251
        assert shards(f"edit{k}", edited).fingerprint() != a.fingerprint(), k
    assert shards("short", tokens[:-1]).fingerprint() != a.fingerprint()
    shuffled = tokens.copy()
    np.random.default_rng(0).shuffle(shuffled)
    assert shards("shuffled", shuffled).fingerprint() != a.fingerprint()
    default = DefaultTextSource(vocab_size=258)
    assert default.fingerprint() == DefaultTextSource(vocab_size=258).fingerprint()
    assert len({default.fingerprint(), DefaultTextSource(vocab_size=258, split="validation").fingerprint(),
                StdlibTextSource(vocab_size=258).fingerprint()}) == 3
    synthetic = [SyntheticSource(vocab_size=256, seed=seed).fingerprint() for seed in (1, 2)]
    assert synthetic[0] != synthetic[1]


def test_the_first_differing_key_in_order_names_the_ranks() -> None:
    ref = {"job.dump_folder": "out", "train.steps": 4, "train.seq_len": 256}
    assert first_difference([ref, {**ref, "train.seq_len": 64}]) == (
        "rank 1's train.seq_len = 64 differs from rank 0's 256 (every rank must run the same job)")
    # The first key in rank 0's order wins; every rank that differs there is named.
    four = [ref, {**ref, "train.seq_len": 64, "train.steps": 3}, ref, {**ref, "train.steps": 5}]
    assert first_difference(four) == ("rank 1's train.steps = 3 differs from rank 0's 4 (every rank must run the "
                                       "same job; so do ranks 3)")
    assert first_difference([ref, {**ref, "job.dump_folder": "/elsewhere"}]) == (
        "rank 1's job.dump_folder = \"/elsewhere\" differs from rank 0's \"out\" (every rank must run the same job)")
    assert first_difference([ref, {**ref, "extra.key": 1}]) == (
        "rank 1's extra.key = 1 differs from rank 0's (unset) (every rank must run the same job)")
    step = "trainer.source.run/step.py"
    line = first_difference([{**ref, step: "abc"}, {**ref, step: "def"}])
    assert line == ("rank 1's trainer.source.run/step.py = \"def\" differs from rank 0's \"abc\" (every rank must run "
                    "the same code: this file differs between the ranks' checkouts (an uncommitted edit, another "
                    "commit); check out the same tree on every node)")
    with pytest.raises(AssertionError):
        first_difference([ref, dict(ref)])
