"""Logging with a rank and elapsed-time prefix; rank 0 logs at INFO, others at WARNING."""

from __future__ import annotations

import logging
import sys
import time

_START = time.monotonic()


class _Formatter(logging.Formatter):
    def __init__(self, rank: int):
        super().__init__()
        self.rank = rank

    def format(self, record: logging.LogRecord) -> str:
        elapsed = time.monotonic() - _START
        level = "" if record.levelno == logging.INFO else f"{record.levelname}: "
        return f"[rank{self.rank} {elapsed:7.1f}s] {level}{record.getMessage()}"


def setup_logging(rank: int) -> None:
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(_Formatter(rank))
    root = logging.getLogger("trainer")
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    root.propagate = False
