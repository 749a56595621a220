"""train.batch_size_warmup_tokens (trainer/data/batch_warmup.py), one process: the ramp's microbatch counts per step
by hand and against a step-by-step simulation, the loader's samples of a short step, the train state's token count
through a save, and the keys' one-line errors. Whole runs: tests/cli/test_batch_warmup.py; dp=2:
tests/distributed/test_batch_warmup.py."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from tests.helpers import FAST
from trainer.config import load_job_config
from trainer.data.batch_warmup import BatchWarmup
from trainer.data.loader import TokenDataLoader
from trainer.data.sources import SyntheticSource
from trainer.errors import ConfigError
from trainer.run.train_state import TrainState
from trainer.validate import validate_job


def _simulated(warmup: BatchWarmup, steps: int) -> list[int]:
    """The microbatches of each step of a fresh run, one step at a time: the definition, not the closed form."""
    counts, seen = [], 0
    for _ in range(steps):
        counts.append(warmup.microbatches(seen))
        seen += warmup.step_tokens(counts[-1])
    return counts


def test_the_ramp_by_hand() -> None:
    """batch_size=2, seq_len=4, dp=1: 8 tokens a microbatch; from 2 sequences (1 microbatch) to 4 microbatches over 64
    tokens: count = 1 + 3 x T // 64 with T the tokens before the step. T = 0, 8, 16 -> 1; 24 -> 1 + 72 // 64 = 2;
    40 -> 1 + 120 // 64 = 2; 56 -> 1 + 168 // 64 = 3; 80 >= 64 -> 4."""
    warmup = BatchWarmup.of(batch_size=2, seq_len=4, grad_accum_steps=4, dp=1, warmup_tokens=64, warmup_start=2)
    assert _simulated(warmup, 9) == [1, 1, 1, 2, 2, 3, 4, 4, 4]
    assert warmup.levels() == [(1, 1), (4, 2), (6, 3), (7, 4)]
    assert warmup.steps == 6
    assert warmup.full_tokens == 32
    assert warmup.describe() == ("batch-size warm-up from 2 to 8 sequences per rank (1 to 4 microbatches of 2) over "
                                 "64 tokens, 6 steps of 8 to 24 tokens, then 32 tokens per step")
    off = BatchWarmup.of(batch_size=2, seq_len=4, grad_accum_steps=4, dp=1, warmup_tokens=0, warmup_start=0)
    assert _simulated(off, 3) == [4, 4, 4] and off.steps == 0 and off.describe() == "32 tokens per step"


@pytest.mark.parametrize("batch_size, seq_len, accum, dp, tokens, start", [
    (2, 64, 4, 1, 512, 2),      # the CLI test's ramp
    (1, 16, 8, 2, 1000, 3),     # a start of 3 of 8; dp=2 doubles a microbatch's tokens
    (4, 8, 16, 1, 100, 4),      # one step of 32 tokens passes several counts' ends at once: levels skipped
    (1, 1, 64, 1, 10**6, 1),    # a long ramp: thousands of steps
])
def test_the_closed_form_levels_are_the_step_by_step_ramp(batch_size, seq_len, accum, dp, tokens, start) -> None:
    warmup = BatchWarmup.of(batch_size=batch_size, seq_len=seq_len, grad_accum_steps=accum, dp=dp,
                            warmup_tokens=tokens, warmup_start=start)
    counts = _simulated(warmup, warmup.steps + 3)
    expanded = []
    for (first, count), (nxt, _) in zip(warmup.levels(), warmup.levels()[1:]):
        expanded += [count] * (nxt - first)
    assert counts == [*expanded, accum, accum, accum]
    assert counts == sorted(counts) and counts[0] == start // batch_size
    # K is the first step at the final batch less one: the tokens before it reach W, those before K do not.
    assert sum(map(warmup.step_tokens, counts[:warmup.steps])) >= tokens
    assert sum(map(warmup.step_tokens, counts[:warmup.steps - 1])) < tokens


def test_a_short_step_reads_the_next_samples_in_the_full_steps_order() -> None:
    """A step of 2 of 4 microbatches reads the next 2 x dp x batch_size positions, each rank its own, and the step
    after it continues there: the positions a fresh loader at that consumed count reads."""
    source = SyntheticSource(vocab_size=64, seed=0)

    def loader(rank: int) -> TokenDataLoader:
        return TokenDataLoader(source, seq_len=8, batch_size=2, grad_accum_steps=4, dp_rank=rank, dp_degree=2, seed=3)

    ranks = [loader(0), loader(1)]
    short = [r.next_batch(2) for r in ranks]
    assert [len(b) for b in short] == [2, 2] and all(r.consumed_samples == 8 for r in ranks)
    full = [loader(0), loader(1)]
    reference = [r.next_batch() for r in full]  # 4 microbatches: the short step's 2 are its first 2
    for got, ref in zip(short, reference):
        assert all(np.array_equal(a[0], b[0]) for a, b in zip(got, ref[:2]))
    after = [r.next_batch(3) for r in ranks]
    fresh = [loader(0), loader(1)]
    for r in fresh:
        r.consumed_samples = 8
    for got, ref in zip(after, [r.next_batch(3) for r in fresh]):
        assert all(np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]) for a, b in zip(got, ref))


def test_the_train_state_saves_its_tokens_and_an_older_checkpoint_counts_full_steps() -> None:
    state = TrainState(full_step_tokens=32)
    state.advance(8)
    state.advance(16)
    assert (state.step, state.tokens, state.batch) == (2, 24, (16, 24, True))
    resumed = TrainState(full_step_tokens=32)
    resumed.load_state_dict(state.state_dict())
    assert (resumed.step, resumed.tokens) == (2, 24)
    older = TrainState(full_step_tokens=32)
    older.load_state_dict({"step": 5, "mixed_precision": "fp32"})  # written before train_state.tokens existed
    assert older.tokens == 5 * 32


def _config(*overrides: str):
    return load_job_config([*FAST, "--train.batch_size=2", "--train.grad_accum_steps=4", *overrides])


@pytest.mark.parametrize("overrides, message", [
    (["--train.batch_size_warmup_tokens=-1"], "train.batch_size_warmup_tokens=-1 must be >= 0"),
    (["--train.batch_size_warmup_tokens=100", "--train.batch_size_warmup_start=-2"],
     "train.batch_size_warmup_start=-2 must be >= 0"),
    (["--train.batch_size_warmup_start=2"], "train.batch_size_warmup_start=2 has no effect with "
                                            "train.batch_size_warmup_tokens=0"),
    (["--train.batch_size_warmup_tokens=100", "--train.batch_size_warmup_start=3"],
     "train.batch_size_warmup_start=3 must be a whole number of microbatches: a positive multiple of "
     "train.batch_size=2"),
    (["--train.batch_size_warmup_tokens=100"], "train.batch_size_warmup_start=0 must be a whole number"),
    (["--train.batch_size_warmup_tokens=100", "--train.batch_size_warmup_start=8"],
     "train.batch_size_warmup_start=8 must be below the configured batch of 8 sequences per rank"),
    (["--train.batch_size_warmup_tokens=100", "--train.batch_size_warmup_start=2", "--train.grad_accum_steps=1"],
     "train.batch_size_warmup_tokens=100 needs train.grad_accum_steps >= 2"),
])
def test_bad_keys_are_refused_in_one_line_naming_the_key(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as e:
        _config(*overrides)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_validation_resolves_the_ramp_and_warns_of_a_run_that_ends_inside_it(caplog) -> None:
    job = validate_job(_config("--train.batch_size_warmup_tokens=512", "--train.batch_size_warmup_start=2",
                               "--train.steps=8"), world_size=1)
    assert job.batch_warmup == BatchWarmup(start=1, final=4, tokens=512, microbatch_tokens=2 * 64, batch_size=2)
    assert "never trains with the configured batch" not in caplog.text
    with caplog.at_level(logging.WARNING):
        validate_job(_config("--train.batch_size_warmup_tokens=512", "--train.batch_size_warmup_start=2",
                             "--train.steps=3"), world_size=1)
    assert "ramps the batch over 3 steps" in caplog.text and "never trains with the configured batch" in caplog.text
    assert validate_job(_config(), world_size=1).batch_warmup.start == 4  # off: every step the configured batch


def test_the_dry_run_says_the_ramp_and_plans_the_same_memory() -> None:
    """Every microbatch keeps the configured shape: the memory plan is the run's without the warm-up, byte for byte."""
    from trainer.run.dry_run import dry_run

    warm = _config("--train.batch_size_warmup_tokens=512", "--train.batch_size_warmup_start=2")
    text, _ = dry_run(warm, world_size=1)
    assert "batch-size warm-up from 2 to 8 sequences per rank (1 to 4 microbatches of 2) over 512 tokens" in text
    plain_text, _ = dry_run(_config(), world_size=1)
    assert "warm-up" not in plain_text
    assert validate_job(warm, world_size=1).memory_plan == validate_job(_config(), world_size=1).memory_plan
