"""The syntax of `train.precision_schedule`: its phases, parsed and checked (a leaf: the config checks import it).

Syntax: a list of "precision:last_step" strings, the last without a step (it runs to
train.steps): ["bf16:2000", "fp8:9500", "bf16"] trains steps 1-2000 in bf16, 2001-9500 in
fp8 and 9501-train.steps in bf16. Strings rather than a list of tables, so the same value
works on the command line (`--train.precision_schedule=bf16:2000,fp8:9500,bf16`) and in
the `config.toml` the run writes. `trainer.run.precision_schedule` runs the phases.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainer.errors import ConfigError

KEY = "train.precision_schedule"
PRECISIONS = ("fp32", "fp16", "bf16", "fp8")


@dataclass(frozen=True)
class Phase:
    precision: str
    first_step: int
    last_step: int

    def __str__(self) -> str:
        return f"{self.precision} steps {self.first_step}-{self.last_step}"


def parse_precision_schedule(entries: list[str], *, total_steps: int) -> list[Phase]:
    """The phases of `train.precision_schedule`; each way it can be wrong is one ConfigError line naming the key."""
    if len(entries) == 1:
        precision = entries[0].partition(":")[0].strip()
        raise ConfigError(f"{KEY}={entries!r} has a single phase: set train.mixed_precision={precision!r} instead")
    phases: list[Phase] = []
    first = 1
    for i, entry in enumerate(entries):
        where = f"{KEY}[{i}]={entry!r}"
        precision, colon, step_text = (s.strip() for s in entry.partition(":"))
        if precision not in PRECISIONS:
            raise ConfigError(f"{where}: {precision!r} is not one of {', '.join(repr(p) for p in PRECISIONS)}")
        last = i == len(entries) - 1
        if last and colon:
            raise ConfigError(f"{where}: the last entry has no step, it runs to train.steps={total_steps}; "
                              f"write {precision!r}")
        if not last and not colon:
            raise ConfigError(f"{where}: every entry but the last needs its last step, e.g. '{precision}:1000'")
        if last:
            step = total_steps
        else:
            try:
                step = int(step_text.replace("_", ""))
            except ValueError:
                raise ConfigError(f"{where}: the step {step_text!r} must be an integer") from None
            if step < first:
                after = f"after the previous entry's step {first - 1}" if i else ">= 1"
                raise ConfigError(f"{where}: steps must increase; step {step} must be {after}")
            if step >= total_steps:
                raise ConfigError(f"{where}: step {step} must be < train.steps={total_steps} "
                                  "(the last entry, without a step, runs to train.steps)")
        if phases and phases[-1].precision == precision:
            raise ConfigError(f"{where}: the same precision as the entry before it; merge the two entries")
        phases.append(Phase(precision, first, step))
        first = step + 1
    return phases


def phase_index(phases: list[Phase], step: int) -> int:
    """The phase that trains the step after `step` (the last phase once the run is complete)."""
    for k, phase in enumerate(phases):
        if step < phase.last_step:
            return k
    return len(phases) - 1
