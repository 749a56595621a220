"""JobConfig: the sections (trainer.config.sections), checked when built.

Its `__post_init__` runs the checks on the config alone (trainer.config.checks), so a bad TOML file or override fails
while it is parsed; `trainer.validate.validate_job` adds what needs the world size, the model's shapes and the data.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainer.config.checks import check_config
from trainer.config.sections import Sections


@dataclass
class JobConfig(Sections):
    """The TOML file's sections, checked when built: every combination that the config alone makes wrong is one
    `ConfigError` line naming the key (`JobConfig.__post_init__` rejects FP8 with tensor parallelism, among others)."""

    def __post_init__(self) -> None:
        check_config(self)
