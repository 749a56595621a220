"""Weighted data mixtures (trainer/data/mix.py, [[data.mix]]): the closed-form order against a brute-force count,
the loader over it, repeats of a small source, the resume checks, the config's tables, and a training run whose
tokens per source follow the weights and whose resume reproduces the uninterrupted losses exactly."""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from tests.distributed.spawn import run_distributed, train_and_read_metrics
from tests.helpers import DEBUG_CONFIG, FAST
from trainer.config import ConfigError, load_job_config
from trainer.data import DataError, TokenDataLoader
from trainer.data.mix import MixEntry, MixtureSource, integer_weights
from trainer.data.shards import write_shard
from trainer.data.tokenizer import ByteTokenizer


class Numbered:
    """A source whose sample i is [tag, i, ...]: what was drawn can be read back."""

    permute = True

    def __init__(self, tag: int, size: int):
        self.tag, self.size = tag, size

    def num_samples(self, seq_len: int) -> int:
        return self.size

    def get_sample(self, index: int, seq_len: int) -> np.ndarray:
        assert 0 <= index < self.size
        return np.array([self.tag, index] + [0] * (seq_len - 1), dtype=np.int64)

    def fingerprint(self) -> str:
        return f"numbered:{self.tag}:{self.size}"


def mixture(weights: list[float], sizes: list[int], *, shuffle: bool = True, seed: int = 0) -> MixtureSource:
    entries = [MixEntry(f"s{i}", w, Numbered(i, n)) for i, (w, n) in enumerate(zip(weights, sizes))]
    return MixtureSource(entries, seq_len=4, seed=seed, shuffle=shuffle)


PRIMES = [2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53]
ROUNDED = [1 / 3, 2 / 3, 0.1234567]  # as written, their proportions need a period of 10**16: rounded to 1 in 10,000


@pytest.mark.parametrize("weights", [
    [0.8, 0.2], [3, 2, 1], [0.7, 0.2, 0.1], [0.123, 0.456, 0.421], [1],
    PRIMES, list(range(1, 13)), [1] * 11 + [100], [2.0**i for i in range(12)], ROUNDED,
], ids=["80-20", "3-2-1", "70-20-10", "three-decimals", "one", "16-primes", "12-sources", "11-small-1-large",
        "powers-of-2", "rounded"])
def test_every_prefix_holds_each_share_to_within_one_sample(weights: list[float]) -> None:
    """Round 5: the stride order overflowed int64 for 16 prime weights and strayed 5 samples with 12 sources; the
    earliest-deadline order holds every source within one sample in every prefix, of the weights as written."""
    mix = mixture(weights, [10**6] * len(weights))
    shares = np.array(integer_weights(weights)) / sum(integer_weights(weights))
    assert np.allclose(shares, np.array(weights) / sum(weights), atol=1e-4 if weights == ROUNDED else 0)
    counts, seen = np.zeros(len(weights), dtype=np.int64), [[] for _ in weights]
    for p in range(3 * mix.period + 7):
        assert mix.samples_drawn(p) == counts.tolist()  # the closed form against the count
        assert np.all(np.abs(counts - p * shares) < 1.0), (p, counts, p * shares)
        s, j = mix.locate(p)
        seen[s].append(j)
        counts[s] += 1
    assert all(js == list(range(len(js))) for js in seen)  # each source's samples in order, none skipped


def test_the_loader_splits_the_mixture_like_one_source_and_resumes_at_the_position() -> None:
    def samples(dp: int, batch: int, accum: int, steps: int, loader_state=None) -> list[tuple[int, int]]:
        mix = mixture([0.7, 0.3], [50, 9])
        got = []
        for rank in range(dp):
            loader = TokenDataLoader(mix, seq_len=4, batch_size=batch, grad_accum_steps=accum, dp_rank=rank,
                                     dp_degree=dp, seed=0)
            if loader_state:
                loader.load_state_dict(loader_state)
            for _ in range(steps):
                got += [(int(x[0]), int(x[1])) for inputs, _ in loader.next_batch() for x in inputs]
        return sorted(got)

    one = samples(1, 8, 1, 5)
    assert samples(2, 4, 1, 5) == one and samples(1, 2, 4, 5) == one  # rank-disjoint, any split of the batch
    assert sum(tag == 1 for tag, _ in one) == 12  # 30% of 40 samples
    loader = TokenDataLoader(mixture([0.7, 0.3], [50, 9]), seq_len=4, batch_size=8, grad_accum_steps=1, dp_rank=0,
                             dp_degree=1, seed=0)
    loader.next_batch(), loader.next_batch()
    assert loader.samples_by_source() == {"s0": 11, "s1": 5}
    later = Counter(samples(1, 8, 1, 5)) - Counter(samples(1, 8, 1, 2))  # steps 3-5 (the small source repeats)
    assert samples(1, 8, 1, 3, loader.state_dict()) == sorted(later.elements())


def test_a_small_source_repeats_in_a_new_order_each_epoch(caplog) -> None:
    mix = mixture([0.5, 0.5], [1000, 7], seed=3)
    with caplog.at_level(logging.INFO, logger="trainer"):
        drawn = [mix.get_sample(p, 4)[:2].tolist() for p in range(42)]
    small = [index for tag, index in drawn if tag == 1]
    epochs = [small[i:i + 7] for i in range(0, 21, 7)]
    assert all(sorted(e) == list(range(7)) for e in epochs) and epochs[0] != epochs[1]
    assert [r.message for r in caplog.records if "starts its epoch" in r.message] == [
        "data.mix: source 's1' starts its epoch 2 (its 7 samples again, in a new order)",
        "data.mix: source 's1' starts its epoch 3 (its 7 samples again, in a new order)"]


def test_a_resume_with_another_mixture_is_refused_in_one_line() -> None:
    def loader(weights, sizes) -> TokenDataLoader:
        return TokenDataLoader(mixture(weights, sizes), seq_len=4, batch_size=2, grad_accum_steps=1, dp_rank=0,
                               dp_degree=1, seed=0)

    state = loader([0.8, 0.2], [50, 9]).state_dict()
    loader([0.8, 0.2], [50, 9]).load_state_dict(state)  # the same mixture resumes
    with pytest.raises(DataError, match=r"^cannot resume data loader: the checkpoint's data mixture is s0 \(weight 4, "
                                        r"50 samples\), s1 \(weight 1, 9 samples\) but this run's is s0 \(weight 7.*"
                                        r"checkpoint.restart_data=true"):
        loader([0.7, 0.3], [50, 9]).load_state_dict(state)
    single = TokenDataLoader(Numbered(0, 50), seq_len=4, batch_size=2, grad_accum_steps=1, dp_rank=0, dp_degree=1,
                             seed=0)
    with pytest.raises(DataError, match="the checkpoint's data mixture is one source but this run's is s0"):
        loader([0.8, 0.2], [50, 9]).load_state_dict(single.state_dict())
    with pytest.raises(DataError, match="the checkpoint's data mixture is unreadable"):
        loader([0.8, 0.2], [50, 9]).load_state_dict({**state, "mix": [[1, 2]]})
    # A position drawn in the stride order of earlier versions holds other samples in this order.
    old = {k: v for k, v in state.items() if k != "mix_order"}
    with pytest.raises(DataError, match=r"^cannot resume data loader: the checkpoint's data mixture was drawn in the "
                                        r"stride order of earlier versions, this trainer draws it in deadline-v1 .*"
                                        r"set checkpoint.restart_data=true"):
        loader([0.8, 0.2], [50, 9]).load_state_dict(old)


def test_weights_keep_their_proportions_however_large_and_a_share_below_the_resolution_is_refused() -> None:
    """Round 5: weights summing past the float maximum (inf) became equal; a share rounded to 0 was raised to 1 part in
    10,000 without a word."""
    assert integer_weights([1e308, 1e308, 5e307]) == [2, 2, 1]
    cfg = load_job_config(["--data.mix=a:1e308,b:1e308,c:5e307"])
    assert [m.weight for m in cfg.data.mix] == [1e308, 1e308, 5e307]
    for argv, message in [
        (["--data.mix=a:1,b:20000"], r"^data.mix\[0\].weight=1.0 is 5e-05 of the mixture, less than the 1 part in "
                                     r"10,000 it keeps its weights to; raise it or leave the source out$"),
        (["--data.mix=a:1e308,b:1e-300"], r"^data.mix\[1\].weight=1e-300 is 0 of the mixture"),  # 1e-608: below floats
        (["--data.mix=a:inf"], r"^data.mix\[0\].weight=inf must be a finite number"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_job_config(argv)


def test_mixture_tables_in_toml_and_on_the_command_line(tmp_path: Path) -> None:
    toml = tmp_path / "mix.toml"
    toml.write_text('[[data.mix]]\npath = "web"\nweight = 0.8\n\n[[data.mix]]\npath = "code/*.bin"\nweight = 0.2\n'
                    'name = "code"\n')
    cfg = load_job_config(["--config", str(toml)])
    assert cfg.data.source == "shards" and [(m.path, m.weight, m.name) for m in cfg.data.mix] == [
        ("web", 0.8, ""), ("code/*.bin", 0.2, "code")]
    again = tmp_path / "again.toml"
    again.write_text(cfg.to_toml())  # what config.toml and resolved.toml hold reads back as the same mixture
    assert load_job_config(["--config", str(again)]).data.mix == cfg.data.mix
    assert load_job_config(["--data.mix=web=a/web:4,b/code:1"]).data.mix == load_job_config(
        ["--config", str(toml), "--data.mix=web=a/web:4,b/code:1"]).data.mix
    for argv, message in [
        (["--data.mix=a:x"], r"^data.mix\[0\].weight='x' must be a number$"),
        (["--data.mix=a:1,a:2"], r"^data.mix\[1\] is named 'a' like data.mix\[0\]"),
        (["--data.mix=a:1", "--data.path=b"], r"^data.mix replaces data.path"),
        (["--data.mix=a:0"], r"^data.mix\[0\].weight=0.0 must be a positive number"),
        (["--data.mix=a:1", "--data.source=default"], r"^data.mix holds shard sources, but data.source='default'"),
        (["--data.mix=a:1", "--validation.enable=true"], r"^validation.enable=true with data.mix needs "),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_job_config(argv)
    bad = tmp_path / "bad.toml"
    bad.write_text('[[data.mix]]\npath = "a"\nwieght = 1\n')
    with pytest.raises(ConfigError, match=r"^unknown key data.mix\[0\].wieght \(did you mean weight\?\)$"):
        load_job_config(["--config", str(bad)])


@pytest.fixture(scope="module")
def two_sources(tmp_path_factory) -> tuple[Path, Path]:
    """Byte-token shards: 'web' (bytes below 128) and 'code' (128 and up), documents ended by EOS; and held-out
    shards of each ('web_val', 'code_val')."""
    root = tmp_path_factory.mktemp("mix")
    rng = np.random.default_rng(0)
    for name, low, size in (("web", 0, 60_000), ("code", 128, 6_000), ("web_val", 0, 3_000), ("code_val", 128, 3_000)):
        tokens = rng.integers(low, low + 128, size)
        tokens[::97] = ByteTokenizer.eos_id
        (root / name).mkdir()
        write_shard(root / name / "a.bin", tokens, vocab_size=ByteTokenizer.vocab_size,
                    tokenizer_fingerprint=ByteTokenizer.fingerprint)
    return root / "web", root / "code"


@pytest.mark.slow
def test_a_mixture_trains_in_proportion_and_resumes_exactly(two_sources, tmp_path: Path) -> None:
    """0.8 / 0.2 over 300 steps: the tokens per source in metrics.jsonl follow the weights (the small source
    repeats); the held-out loss per source and weighted; a run stopped at step 150 and resumed gives the
    uninterrupted run's losses exactly."""
    web, code = two_sources
    toml = tmp_path / "mix.toml"  # the debug model's config and the mixture
    tables = [f'[[data.mix]]\nname = "{n}"\npath = "{p}"\nweight = {w}\nvalidation_path = "{p}_val"\n\n'
              for n, p, w in (("web", web, 0.8), ("code", code, 0.2))]
    toml.write_text(Path(DEBUG_CONFIG).read_text() + "\n" + "".join(tables))
    assert FAST[:2] == ["--config", DEBUG_CONFIG]
    args = [*FAST[2:], "--config", str(toml), "--data.source=shards", "--train.batch_size=4", "--metrics.log_freq=50",
            "--validation.enable=true", "--validation.freq=150", "--validation.steps=2",
            "--checkpoint.enable=true", "--checkpoint.interval=150",
            "--scheduler.decay_type=constant"]  # the learning rate at a step does not depend on train.steps

    def run(steps: int, folder: str) -> list[dict]:
        return run_distributed(train_and_read_metrics, world_size=1,
                               args=([*args, f"--train.steps={steps}"], str(tmp_path / folder)))[0]

    whole = run(300, "whole")
    last = whole[-1]
    assert last["data/tokens/web"] + last["data/tokens/code"] == 300 * 4 * 64
    assert abs(last["data/tokens/code"] / (300 * 4 * 64) - 0.2) < 0.02 * 0.2  # within 2% of its weight
    assert last["val_loss"] == pytest.approx(0.8 * last["val/loss/web"] + 0.2 * last["val/loss/code"], rel=1e-6)
    assert last["val/loss/web"] != last["val/loss/code"]
    run(150, "resumed")
    resumed = run(300, "resumed")  # resumes the step-150 checkpoint
    logged = {r["step"]: r["loss"] for r in resumed}  # the resumed process also logs its first step, 151
    assert [(step, logged[step]) for step in (200, 250, 300)] == [
        (r["step"], r["loss"]) for r in whole if r["step"] > 150]
