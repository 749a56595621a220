"""What the config's seeds become, and so the range each must stay in (a leaf: the config checks import it).

torch generators take a 64-bit seed (above 2**64 - 1, `manual_seed` fails with "Overflow when
unpacking long long"); numpy's `default_rng([seed, ...])` takes any integer >= 0. The weight
init seeds each parameter's generator with `param_seed(train.seed, fqn)`, so train.seed must
leave room for that arithmetic: `trainer.config.checks` refuses seeds outside these
ranges, and the code below only asserts them.
"""

from __future__ import annotations

import zlib

_TORCH_SEED_MAX = 2**64 - 1
_PARAM_SEED_STRIDE = 1_000_003  # a prime, so (seed, fqn) pairs of nearby seeds do not collide
_CRC32_MAX = 2**32 - 1

MAX_TRAIN_SEED = (_TORCH_SEED_MAX - _CRC32_MAX) // _PARAM_SEED_STRIDE
"""The largest train.seed whose per-parameter init seeds still fit torch's 64-bit generator seed."""
MAX_DATA_SEED = _TORCH_SEED_MAX
"""numpy would take more; a 64-bit bound keeps data.seed a seed any RNG takes."""
MAX_TORCH_SEED = _TORCH_SEED_MAX
"""The largest seed a torch generator takes (`scripts/generate.py --seed`)."""


def param_seed(seed: int, fqn: str) -> int:
    """The seed of one parameter's init generator: the same for every sharding and process."""
    assert 0 <= seed <= MAX_TRAIN_SEED, f"train.seed={seed} outside [0, {MAX_TRAIN_SEED}] (checked by the config)"
    return seed * _PARAM_SEED_STRIDE + zlib.crc32(fqn.encode())
