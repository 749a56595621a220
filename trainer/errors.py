"""The one user-error type: what the command line prints as one line, without a traceback.

Every error a user can fix (a config key, a data file, a checkpoint folder, FP8
that cannot run) derives from `UserError` and carries a one-line message saying
what is wrong and how to fix it. Anything else is a bug or an environment failure
and keeps its traceback: `trainer.cli` catches `UserError` and nothing broader.
"""

from __future__ import annotations


class UserError(Exception):
    """A problem the user can fix; its message is one line that says how."""


class ConfigError(UserError, ValueError):
    """A bad value or combination in the job configuration."""
