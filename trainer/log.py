"""Logging with a rank and elapsed-time prefix; rank 0 logs at INFO, each warning text once.

A warning is about the job (a config, a checkpoint, FP8 without compile), which every rank meets
alike: other ranks log errors only, unless a record says it is this rank's own
(`logger.warning(..., extra=EVERY_RANK)`), so 8 ranks or 4 pipeline stages print it once.

Also the one place where library warnings a user cannot act on are filtered out
(`KNOWN_WARNINGS`): each is dropped on every rank, and where it needs a word, rank 0
says once, in our own terms, what it meant.
"""

from __future__ import annotations

import contextlib
import logging
import re
import sys
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

_START = time.monotonic()

logger = logging.getLogger(__name__)


class _Formatter(logging.Formatter):
    def __init__(self, rank: int):
        super().__init__()
        self.rank = rank

    def format(self, record: logging.LogRecord) -> str:
        elapsed = time.monotonic() - _START
        level = "" if record.levelno == logging.INFO else f"{record.levelname}: "
        return f"[rank{self.rank} {elapsed:7.1f}s] {level}{record.getMessage()}"


EVERY_RANK = {"every_rank": True}
"""`extra=` of a warning that only this rank meets (every rank logs it, not only rank 0)."""


class _OncePerJob(logging.Filter):
    """Rank 0: each warning text once per process. Other ranks: errors, and warnings marked EVERY_RANK."""

    def __init__(self, rank: int):
        super().__init__()
        self.rank = rank
        self.seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.WARNING or getattr(record, "every_rank", False):
            return True
        if self.rank != 0:
            return False
        message = record.getMessage()
        if message in self.seen:
            return False
        self.seen.add(message)
        return True


@contextlib.contextmanager
def info_silenced() -> Iterator[None]:
    """Drop the trainer's INFO lines (warnings still show): for work repeated alike, e.g. building the
    second pipeline stage of a rank, whose lines the first stage's already said."""
    root = logging.getLogger("trainer")
    level = root.level
    root.setLevel(max(level, logging.WARNING))
    try:
        yield
    finally:
        root.setLevel(level)


def setup_logging(rank: int) -> None:
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(_Formatter(rank))
    handler.addFilter(_OncePerJob(rank))
    root = logging.getLogger("trainer")
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    root.propagate = False
    install_warning_filters(rank)


@dataclass(frozen=True)
class KnownWarning:
    """A library log message that says nothing a user of this trainer can act on."""

    logger: str
    """The library's logger (records are dropped there, before any handler sees them)."""
    pattern: str
    """Regex searched in the formatted message."""
    explanation: str | None
    """What rank 0 logs instead, once per process; None when the message needs no word."""


KNOWN_WARNINGS: tuple[KnownWarning, ...] = (
    # Logged by every rank as dynamo traces a block checkpointed with our selective-AC policy
    # (torch/_higher_order_ops/wrap.py). The policy is ours and the blocks' forward holds no in-place
    # op (trainer/models/llama.py; only init_weights writes in place), so the advice is followed. The one
    # exception, float8.scaling='delayed''s amax buffer update (trainer/parallel/float8/tensorwise.py), is a
    # max of values a recompute computes again: written twice, it holds the same value
    # (tests/unit/test_float8_scaling_compile.py).
    KnownWarning(
        "torch._higher_order_ops.wrap",
        r"Detected that context_fn is passed to torch\.utils\.checkpoint under torch\.compile",
        "selective activation checkpointing under torch.compile: the checkpointed blocks must hold no "
        "in-place op; ours hold none (delayed FP8 scaling's amax buffer keeps a max, which a recompute "
        "leaves as it was), so torch's reminder about it is not shown (trainer/log.py)",
    ),
    # torchao registers its KernelPreference enum with the old pytree API; torch deprecates that
    # call. Nothing for a user to change: it goes away with a newer torchao.
    KnownWarning(
        "torch.utils._pytree",
        r"KernelPreference'> is an Enum subclass .* register_constant\(\) on Enum subclasses is deprecated",
        None,
    ),
    # A CUDA build of torch on a machine without a GPU, when inductor looks for CUDA headers.
    # The "parallelism: ... on cpu" startup line already says so (trainer.distributed.describe_device).
    KnownWarning("torch.utils.cpp_extension", r"No CUDA runtime is found, using CUDA_HOME=", None),
    # torchao's optional compiled kernels (MX formats, CUTLASS) that do not load on this machine
    # (a CPU-only torch, another CUDA version): our float8 recipes never call them (their matmuls
    # are torch._scaled_mm), so there is nothing to say.
    KnownWarning("torchao", r"Failed to load \S*torchao[/\\]_C", None),
)


class KnownWarningFilter(logging.Filter):
    """Drops the records that match one of `known`; with `explain`, logs its explanation once."""

    def __init__(self, known: list[KnownWarning], *, explain: bool):
        super().__init__()
        self.known = [(k, re.compile(k.pattern, re.S)) for k in known]
        self.explain = explain
        self.explained: set[KnownWarning] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        for known, pattern in self.known:
            if pattern.search(message):
                if self.explain and known.explanation and known not in self.explained:
                    self.explained.add(known)
                    logger.info(known.explanation)
                return False
        return True


# torchao 0.18's quantization/quant_api.py has a docstring with an invalid escape sequence ('\.').
# Python 3.12+ says so with a SyntaxWarning (3.10-3.11: a DeprecationWarning, hidden by default) when
# it compiles the file, i.e. on the first import without a cached .pyc: at every start on a machine
# whose site-packages holds no .pyc (a fresh container). It is torchao's source, nothing a user can
# change. A compile-time warning's "module" is the file's path without .py, so the regex matches
# torchao's folder anywhere in it (a bare 'torchao' would not match: filters match from the start).
# Only filters installed before the import can catch it.
_TORCHAO_SOURCE = r".*[/\\]torchao[/\\]"


def ignore_torchao_escape_warnings() -> None:
    """Drop the "invalid escape sequence" warnings Python gives when it compiles torchao's sources."""
    for category in (SyntaxWarning, DeprecationWarning):
        warnings.filterwarnings("ignore", message="invalid escape sequence", category=category,
                                module=_TORCHAO_SOURCE)


def install_warning_filters(rank: int, known: tuple[KnownWarning, ...] = KNOWN_WARNINGS) -> None:
    """Attach a KnownWarningFilter to each library logger named in `known` (again: replaces the last one),
    and drop torchao's compile-time escape warnings.

    Install before torchao is imported (its extension-loading messages and those warnings come at import).
    """
    ignore_torchao_escape_warnings()
    by_logger: dict[str, list[KnownWarning]] = {}
    for k in known:
        by_logger.setdefault(k.logger, []).append(k)
    for name, entries in by_logger.items():
        library_logger = logging.getLogger(name)
        for old in [f for f in library_logger.filters if isinstance(f, KnownWarningFilter)]:
            library_logger.removeFilter(old)
        library_logger.addFilter(KnownWarningFilter(entries, explain=rank == 0))
