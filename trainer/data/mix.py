"""Weighted mixtures of sample sources ([[data.mix]]): Megatron's blend, in closed form.

The loader (trainer/data/loader.py) asks for global sample positions; a `MixtureSource` maps position p to one of its
sources by a schedule of one period, repeated. The weights become integers W_i: their proportions as written where
those sum to at most RESOLUTION (0.7, 0.2, 0.1: 7, 2, 1), else each source's share to 1 part in RESOLUTION
(trainer.config.checks refuses a share below that); S = sum W_i. In each period of S positions, source i's k-th
sample (k < W_i) must take an offset in [floor(k S / W_i), ceil((k + 1) S / W_i) - 1]: exactly the offsets that keep
source i's count in every prefix of t positions within one sample of t W_i / S. Filling the offsets in order, each
with the waiting sample of the earliest last offset (ties: the lower source index), meets every window (earliest
deadline first is optimal for unit jobs, and a schedule within one sample exists: Tijdeman's chairman assignment
theorem). `pattern[r]` is the source of offset r, `rank[r]` its sample's k. Position p = m S + r is then sample
m W_s + rank[r] of source s = pattern[r]. So:

- every prefix of the order holds each source's share to within one sample, whatever the number of sources, and a
  step of G samples draws them in proportion however G is split over ranks and microbatches; integers only (no
  common multiple of the weights, which overflows 64 bits for 16 sources of prime weights);
- any rank computes any position from (seed, position) alone: rank-disjoint as the loader slices positions,
  and a resume needs only the loader's position (what is checked on resume: this order's name `ORDER`, the names,
  integer weights and samples of every source, unless checkpoint.restart_data);
- source i's j-th sample is its sample `perm[j % N_i]` of epoch j // N_i, with perm from
  np.random.default_rng([seed, i, epoch]) (identity without data.shuffle): a source its share exhausts starts
  another epoch in a new order, logged once per epoch.
"""

from __future__ import annotations

import hashlib
import heapq
import logging
import math
from dataclasses import dataclass
from fractions import Fraction
from functools import reduce

import numpy as np

from trainer.config.checks import MIX_RESOLUTION, mix_shares
from trainer.data.sources import SampleSource
from trainer.hooks import StepHook

logger = logging.getLogger(__name__)

RESOLUTION = MIX_RESOLUTION
"""Weights are rounded to 1 part in this many (the config checks refuse a share below it)."""
ORDER = "deadline-v1"
"""The name of this module's order, kept in a checkpoint's data position: an order made another way (the stride order
before it) maps the same position to other samples, so its position cannot be resumed here."""


def integer_weights(weights: list[float]) -> list[int]:
    """The smallest integers in the proportions of the weights as written (0.7, 0.2, 0.1: 7, 2, 1; primes: themselves)
    where those sum to at most RESOLUTION, else of their shares rounded to 1 part in RESOLUTION (each at least 1)."""
    written = [Fraction(repr(float(w))) for w in weights]  # the shortest decimal that reads back as the float
    scale = reduce(math.lcm, (f.denominator for f in written))
    ints = [int(f * scale) for f in written]
    if sum(ints) // reduce(math.gcd, ints) > RESOLUTION:
        ints = [max(1, round(share * RESOLUTION)) for share in mix_shares(weights)]
    g = reduce(math.gcd, ints)
    return [w // g for w in ints]


def period_pattern(weights: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(source, rank) of each offset of one period: each source's k-th sample at the free offset of the earliest
    deadline among those released (module docstring); integer arithmetic, no common multiple."""
    period = sum(weights)
    # (release, deadline, source, k): source i's k-th sample may take offsets floor(k S / W_i) to
    # ceil((k + 1) S / W_i) - 1.
    jobs = sorted((k * period // w, -(-(k + 1) * period // w) - 1, i, k)
                  for i, w in enumerate(weights) for k in range(w))
    sources, ranks = np.empty(period, dtype=np.int64), np.empty(period, dtype=np.int64)
    waiting: list[tuple[int, int, int]] = []
    j = 0
    for r in range(period):
        while j < len(jobs) and jobs[j][0] <= r:
            heapq.heappush(waiting, jobs[j][1:])
            j += 1
        deadline, sources[r], ranks[r] = heapq.heappop(waiting)
        assert deadline >= r, (weights, r)  # a schedule within one sample exists, and EDF finds it
    return sources, ranks


@dataclass(frozen=True)
class MixEntry:
    name: str
    weight: float
    source: SampleSource


@dataclass(frozen=True)
class HeldOutMixture:
    """A mixture's held-out sources, one per training source (data.mix[].validation_path): validation reports each
    source's loss and their mean weighted as the training mixture is (trainer/run/evaluate.py)."""

    entries: tuple[MixEntry, ...]

    def num_samples(self, seq_len: int) -> int:
        return min(e.source.num_samples(seq_len) for e in self.entries)

    def fingerprint(self) -> str:
        return "held-out mix:" + hashlib.sha256(repr([(e.name, e.weight, e.source.fingerprint())
                                                      for e in self.entries]).encode()).hexdigest()[:16]

    def __repr__(self) -> str:
        return "HeldOutMixture(" + ", ".join(f"{e.name}: {e.source!r}" for e in self.entries) + ")"


class MixtureSource:
    """Samples of several sources drawn in proportion to their weights (module docstring); a sample source itself.

    `num_samples` is the virtual length of the mixed order (sources repeat as their shares need), so the loader
    never wraps it; the loader must not permute it (`permute = False`): each source shuffles its own samples."""

    permute = False

    def __init__(self, entries: list[MixEntry], *, seq_len: int, seed: int, shuffle: bool):
        self.entries, self.seq_len, self.seed, self.shuffle = entries, seq_len, seed, shuffle
        self.names = [e.name for e in entries]
        self.weights = integer_weights([e.weight for e in entries])
        self.period = sum(self.weights)
        self.pattern, self.ranks = period_pattern(self.weights)
        # prefix[r, i]: source i's samples among the first r offsets of a period.
        onehot = np.zeros((self.period + 1, len(entries)), dtype=np.int64)
        onehot[np.arange(1, self.period + 1), self.pattern] = 1
        self.prefix = np.cumsum(onehot, axis=0)
        self.sizes = [e.source.num_samples(seq_len) for e in entries]
        self._perms: dict[int, tuple[int, np.ndarray]] = {}
        self._epochs_seen = [0] * len(entries)

    def num_samples(self, seq_len: int) -> int:
        assert seq_len == self.seq_len, (seq_len, self.seq_len)
        return 2**40 // seq_len

    def locate(self, position: int) -> tuple[int, int]:
        """(source index, that source's sample number j) of global position `position`."""
        m, r = divmod(position, self.period)
        s = int(self.pattern[r])
        return s, m * self.weights[s] + int(self.ranks[r])

    def get_sample(self, index: int, seq_len: int) -> np.ndarray:
        s, j = self.locate(index)
        epoch, offset = divmod(j, self.sizes[s])
        if epoch > self._epochs_seen[s]:
            self._epochs_seen[s] = epoch
            logger.info("data.mix: source %r starts its epoch %d (its %d samples again, in a new order)",
                        self.names[s], epoch + 1, self.sizes[s])
        return self.entries[s].source.get_sample(int(self._permutation(s, epoch)[offset]) if self.shuffle else offset,
                                                 seq_len)

    def _permutation(self, s: int, epoch: int) -> np.ndarray:
        cached = self._perms.get(s)
        if cached is None or cached[0] != epoch:
            cached = (epoch, np.random.default_rng([self.seed, s, epoch]).permutation(self.sizes[s]))
            self._perms[s] = cached
        return cached[1]

    def samples_drawn(self, positions: int) -> list[int]:
        """Samples each source has given to the global positions [0, positions)."""
        m, r = divmod(positions, self.period)
        return [m * w + int(self.prefix[r, i]) for i, w in enumerate(self.weights)]

    def identity(self) -> list[list]:
        """What a resume must find unchanged: each source's name, integer weight and number of samples."""
        return [[name, w, n] for name, w, n in zip(self.names, self.weights, self.sizes)]

    def fingerprint(self) -> str:
        h = hashlib.sha256(repr((self.identity(), [e.source.fingerprint() for e in self.entries])).encode())
        return "mix:" + h.hexdigest()[:16]

    def __repr__(self) -> str:
        total = sum(self.weights)
        parts = ", ".join(f"{name} {w / total:.1%} ({e.source!r})" for name, w, e in
                          zip(self.names, self.weights, self.entries))
        return f"MixtureSource({parts})"


class MixtureTokens(StepHook):
    """`data/tokens/NAME` on every log line: the tokens each source of the mixture has given the run so far (every
    rank's; the loader's position counts them in closed form)."""

    def __init__(self, loader):
        self.loader = loader

    @classmethod
    def of(cls, loader) -> list[MixtureTokens]:
        """The hook for `loader` when it reads a mixture; none otherwise."""
        return [cls(loader)] if isinstance(loader.source, MixtureSource) else []

    def on_log(self, step: int) -> dict[str, float]:
        return {f"data/tokens/{name}": float(samples * self.loader.seq_len)
                for name, samples in self.loader.samples_by_source().items()}
