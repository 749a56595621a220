"""Sample sources: sequences of fixed-length token windows.

A source has `num_samples(seq_len)` and `get_sample(index, seq_len)`, which returns seq_len + 1
int64 tokens (inputs = [:-1], labels = [1:]), and `fingerprint()`, a short string that differs where
the tokens differ (compared across ranks at startup: trainer.validate.ranks). Window k of a token
stream covers tokens [k * seq_len, k * seq_len + seq_len + 1): windows do not overlap as inputs,
and the extra token is the label of the last input.
"""

import functools
import hashlib
import sysconfig
from collections.abc import Sequence
from pathlib import Path
from pydoc_data.topics import topics
from typing import Protocol

import numpy as np

from trainer.data.shards import DataError, open_shard, scan_shard_tokens
from trainer.data.tokenizer import ByteTokenizer


class SampleSource(Protocol):
    """What every source here and a mixture (trainer.data.mix) has: the module docstring's three methods, and whether
    the loader may permute its samples (a mixture and synthetic data order their own)."""

    permute: bool

    def num_samples(self, seq_len: int) -> int: ...

    def get_sample(self, index: int, seq_len: int) -> np.ndarray: ...

    def fingerprint(self) -> str: ...


def _num_windows(num_tokens: int, seq_len: int) -> int:
    return max(num_tokens - 1, 0) // seq_len


def _window(tokens: np.ndarray, k: int, seq_len: int) -> np.ndarray:
    return np.asarray(tokens[k * seq_len: k * seq_len + seq_len + 1], dtype=np.int64)


def _hash(*parts) -> str:
    """A digest of `parts`: arrays by their bytes (every element: an array's repr elides all but six), tuples and
    lists by their items, anything else by its repr; each part's length first, so no two sequences of parts meet."""
    h = hashlib.sha256()

    def add(part) -> None:
        if isinstance(part, (tuple, list)):
            h.update(f"({len(part)}:".encode())
            for item in part:
                add(item)
            return
        data = part.tobytes() if isinstance(part, np.ndarray) else repr(part).encode()
        h.update(f"{len(data)}:".encode() + data)

    add(parts)
    return h.hexdigest()[:16]


# A shard's fingerprint (`ShardSource.fingerprint`): its header's facts, its size, the checksum of every byte that the
# token-id scan computes in the pass over the file it makes anyway (shards.scan_shard_tokens), and FINGERPRINT_WINDOWS
# windows of FINGERPRINT_WINDOW_BYTES spread evenly from its first byte to its last (the middle one among them),
# hashed: a byte changed anywhere changes the checksum, tokens reordered (another shuffle) change the windows. The
# cost, from the page cache on the 2-core CI machine (1 GiB shard): the scan 100-150 s per TB, the checksum 70-120 s
# per TB more, the windows 0.3 ms a shard (docs/distributed.md, "Every rank runs the same job").
FINGERPRINT_WINDOWS = 65
FINGERPRINT_WINDOW_BYTES = 4096


def _windows(tokens: np.ndarray) -> list[np.ndarray]:
    """FINGERPRINT_WINDOWS windows of the token array, evenly spaced from its start to its end (all of it if short)."""
    width = max(1, FINGERPRINT_WINDOW_BYTES // tokens.itemsize)
    if len(tokens) <= width * FINGERPRINT_WINDOWS:
        return [np.asarray(tokens)]
    last = len(tokens) - width
    return [np.asarray(tokens[k * last // (FINGERPRINT_WINDOWS - 1):][:width]) for k in range(FINGERPRINT_WINDOWS)]


def _check_index(index: int, num_samples: int) -> None:
    if not 0 <= index < num_samples:
        raise IndexError(f"sample index {index} out of range [0, {num_samples})")


class ShardSource:
    """Windows inside each memory-mapped shard; shards are ordered by sorted path."""

    permute = True

    def __init__(self, paths: Sequence[str | Path], *, vocab_size: int, tokenizer_fingerprint: str):
        if not paths:
            raise DataError("ShardSource needs at least one shard path")
        self.shards = [open_shard(p) for p in sorted(map(Path, paths))]
        self._checksums = []
        for shard in self.shards:
            self._checksums.append(scan_shard_tokens(shard))
            if shard.tokenizer_fingerprint != tokenizer_fingerprint:
                raise DataError(f"shard {shard.path} was written with tokenizer {shard.tokenizer_fingerprint} "
                                f"but data.tokenizer is {tokenizer_fingerprint}; re-run scripts/prepare_data.py "
                                "with the configured tokenizer or point data.tokenizer at the one used")
            if shard.max_token_id >= vocab_size:
                raise DataError(f"shard {shard.path} has token id {shard.max_token_id} but the model's vocabulary "
                                f"has {vocab_size} entries; set --model.vocab_size={max(shard.vocab_size, shard.max_token_id + 1)} "
                                "(the tokenizer's vocabulary size)")
        self.num_tokens = sum(s.num_tokens for s in self.shards)
        self._cumulative: dict[int, np.ndarray] = {}

    def _cumulative_windows(self, seq_len: int) -> np.ndarray:
        if seq_len in self._cumulative:
            return self._cumulative[seq_len]
        counts = [_num_windows(s.num_tokens, seq_len) for s in self.shards]
        if sum(counts) == 0:
            raise DataError(f"shards hold no full sample of seq_len {seq_len}: each sample needs seq_len+1 = "
                            f"{seq_len + 1} tokens inside one shard, the largest shard has "
                            f"{max(s.num_tokens for s in self.shards)}; add data or lower seq_len")
        return self._cumulative.setdefault(seq_len, np.cumsum(counts))

    def num_samples(self, seq_len: int) -> int:
        return int(self._cumulative_windows(seq_len)[-1])

    def get_sample(self, index: int, seq_len: int) -> np.ndarray:
        cumulative = self._cumulative_windows(seq_len)
        _check_index(index, int(cumulative[-1]))
        # cumulative[i] is the first global index past shard i, so side="right" finds the owner.
        i = int(np.searchsorted(cumulative, index, side="right"))
        local = index - (int(cumulative[i - 1]) if i else 0)
        return _window(self.shards[i].tokens, local, seq_len)

    def fingerprint(self) -> str:
        """Each shard's name, token count, tokenizer, checksum of every byte and evenly spaced windows (the comment
        on FINGERPRINT_WINDOWS)."""
        return "shards:" + _hash(*((s.path.name, s.num_tokens, s.tokenizer_fingerprint, checksum, *_windows(s.tokens))
                                   for s, checksum in zip(self.shards, self._checksums)))

    def __repr__(self) -> str:
        folders = sorted({str(s.path.parent) for s in self.shards})
        where = folders[0] if len(folders) == 1 else f"{len(folders)} folders"
        return f"ShardSource({len(self.shards)} shards in {where}, {self.num_tokens:,} tokens)"


@functools.cache
def _default_tokens() -> np.ndarray:
    # Ships with every CPython, so the default run needs no download.
    return _byte_documents(topics[key] for key in sorted(topics))


@functools.lru_cache(maxsize=1)
def _stdlib_tokens() -> np.ndarray:
    """pydoc topics plus every standard-library .py file outside the test packages (~13 MB).

    About 27x the default corpus: enough that a few hundred steps of a 1B model
    see each token about once, instead of memorizing the topics.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        f for f in root.rglob("*.py")
        if not {"site-packages", "dist-packages", "test", "tests", "idle_test"} & set(f.relative_to(root).parts)
    )
    texts = (f.read_text(encoding="utf-8", errors="replace") for f in files)
    return np.concatenate([_default_tokens(), _byte_documents(texts)])


# The embedded text's held-out split: block k of HELD_OUT_BLOCK tokens is validation text when
# k % HELD_OUT_EVERY == HELD_OUT_EVERY - 1, training text otherwise. Training never reads it.
HELD_OUT_BLOCK = 4096
HELD_OUT_EVERY = 10
SPLITS = ("train", "validation")


def split_tokens(tokens: np.ndarray, split: str) -> np.ndarray:
    """The train or validation part of a token stream (every HELD_OUT_EVERY-th block is validation)."""
    assert split in SPLITS, split
    block = np.arange(len(tokens)) // HELD_OUT_BLOCK
    held_out = block % HELD_OUT_EVERY == HELD_OUT_EVERY - 1
    part = tokens[held_out if split == "validation" else ~held_out]
    part.flags.writeable = False
    return part


def _byte_documents(texts) -> np.ndarray:
    tok = ByteTokenizer()
    parts = []
    for text in texts:
        parts.append(np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16))
        parts.append(np.array([tok.eos_id], dtype=np.uint16))
    tokens = np.concatenate(parts)
    tokens.flags.writeable = False  # shared by every source built from it
    return tokens


class DefaultTextSource:
    """Python's documentation topics (pydoc_data), byte-tokenized, EOS after each topic.

    split='train' is the text minus the held-out blocks (see split_tokens); split='validation' is those blocks.
    """

    permute = True
    name = "default"

    def __init__(self, *, vocab_size: int, split: str = "train"):
        if vocab_size < ByteTokenizer.vocab_size:
            raise DataError(f"data.source='{self.name}' is byte-tokenized and needs a vocabulary of at least "
                            f"{ByteTokenizer.vocab_size} entries, got {vocab_size}; set --model.vocab_size="
                            f"{ByteTokenizer.vocab_size} (or more) or --data.source=synthetic")
        self.split = split
        self.tokens = split_tokens(self._all_tokens(), split)
        self.num_tokens = len(self.tokens)

    @staticmethod
    def _all_tokens() -> np.ndarray:
        return _default_tokens()

    def num_samples(self, seq_len: int) -> int:
        num = _num_windows(self.num_tokens, seq_len)
        if num == 0:
            raise DataError(f"the {self.split} split of data.source='{self.name}' has {self.num_tokens} tokens, "
                            f"fewer than seq_len+1 = {seq_len + 1}; lower --train.seq_len or use --data.source=shards")
        return num

    def get_sample(self, index: int, seq_len: int) -> np.ndarray:
        _check_index(index, self.num_samples(seq_len))
        return _window(self.tokens, index, seq_len)

    def fingerprint(self) -> str:
        """Every token: the text comes with this machine's Python (pydoc_data, the standard library)."""
        return f"{self.name}:{self.split}:" + _hash(self.tokens)

    def __repr__(self) -> str:
        return f"DefaultTextSource(pydoc topics, {self.split} split, {self.num_tokens:,} byte tokens)"


class StdlibTextSource(DefaultTextSource):
    """The default corpus plus the standard library's source; byte-tokenized, no download."""

    name = "stdlib"

    @staticmethod
    def _all_tokens() -> np.ndarray:
        return _stdlib_tokens()

    def __repr__(self) -> str:
        return f"StdlibTextSource(pydoc topics + stdlib source, {self.split} split, {self.num_tokens:,} byte tokens)"


class SyntheticSource:
    """Uniform random tokens; sample i depends only on (seed, i), so any rank can make any sample."""

    # Samples are already i.i.d., and a permutation of an effectively infinite range cannot be built.
    permute = False

    def __init__(self, *, vocab_size: int, seed: int, split: str = "train"):
        if vocab_size < 1:
            raise DataError(f"SyntheticSource needs vocab_size >= 1, got {vocab_size}")
        assert split in SPLITS, split
        self.vocab_size = vocab_size
        self.seed = seed
        self.split = split
        # The validation stream's generator keys have a third word, so no validation sample equals a training one.
        self._stream = () if split == "train" else (1,)

    def num_samples(self, seq_len: int) -> int:
        return 2**40 // seq_len

    def get_sample(self, index: int, seq_len: int) -> np.ndarray:
        _check_index(index, self.num_samples(seq_len))
        rng = np.random.default_rng([self.seed, index, *self._stream])
        return rng.integers(0, self.vocab_size, seq_len + 1, dtype=np.int64)

    def fingerprint(self) -> str:
        return f"synthetic:{self.split}:{self.vocab_size}:{self.seed}"

    def __repr__(self) -> str:
        split = "" if self.split == "train" else ", validation stream"
        return f"SyntheticSource(vocab_size={self.vocab_size}, seed={self.seed}{split})"
