"""The one user-error type: what the command line prints as one line, without a traceback.

Every error a user can fix (a config key, a data file, a checkpoint folder, FP8
that cannot run) derives from `UserError` and carries a one-line message saying
what is wrong and how to fix it. Anything else is a bug or an environment failure
and keeps its traceback: `trainer.cli` catches `UserError` and nothing broader.

The command line prints a user error from the rank that raised it. An error that every rank
raises alike, because all ranks found it from the same values (a decision broadcast by a
collective), says so with `every_rank`, and only local rank 0 prints it: one line per node
instead of one per rank. What each rank found alone before the process group existed (the
validation pass: its own config, data, GPU) is compared once the group exists
(trainer.validate.ranks.agree_to_start), which sets `speaker` on each rank: every distinct
error is printed once per node, by the lowest rank of the node that holds it, with its rank
where the other ranks do not hold it.
"""

from __future__ import annotations

from typing import TypeVar


class UserError(Exception):
    """A problem the user can fix; its message is one line that says how."""

    every_rank: bool = False
    """Every rank raises this same error (see the module's docstring)."""
    speaker: bool | None = None
    """Whether this rank prints it, where the ranks compared their errors; None: by `every_rank`."""

    def __str__(self) -> str:
        # Messages quote the bad value, which can be megabytes (a value nested thousands deep, a garbage line):
        # the line keeps its start, which names the key, and its end, which says what to do.
        text = super().__str__()
        if len(text) <= MAX_MESSAGE_CHARS:
            return text
        head, tail = MAX_MESSAGE_CHARS * 2 // 3, MAX_MESSAGE_CHARS // 3
        return f"{text[:head]} ... [{len(text) - head - tail:,} characters not shown] ... {text[-tail:]}"


MAX_MESSAGE_CHARS = 1500


class ConfigError(UserError, ValueError):
    """A bad value or combination in the job configuration (every rank validates the same job, alike unless its own
    device or files differ: see the module's docstring)."""

    every_rank = True


E = TypeVar("E", bound=UserError)


def on_every_rank(error: E) -> E:
    """`error`, marked as raised alike on every rank (a collective's result): local rank 0 prints it."""
    error.every_rank = True
    return error
