"""The syntax of `train.precision_schedule`: its phases, parsed and checked (a leaf: the config checks import it).

Syntax: a list of "precision:last_step" strings, the last without a step (it runs to
train.steps): ["bf16:2000", "fp8:9500", "bf16"] trains steps 1-2000 in bf16, 2001-9500 in
fp8 and 9501-train.steps in bf16. Strings rather than a list of tables, so the same value
works on the command line (`--train.precision_schedule=bf16:2000,fp8:9500,bf16`) and in
the `config.toml` the run writes. `trainer.run.precision_schedule` runs the phases.

A step may be "decay": the scheduler's decay onset, the last step before the learning rate decays
(`decay_onset`: scheduler.warmup_steps for cosine and linear, wsd's constant stretch's end), resolved
once here; ["fp8:decay", "bf16"] trains in fp8 until the decay, then bf16. Besides the precisions,
"fp8-fwd" (FP8 forward, bf16 backward) and "fp8-bwd" (bf16 forward, FP8 backward) are fp8 phases with
float8.forward / float8.backward set (`ROLES`); "fp8" keeps the [float8] section's.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainer.errors import ConfigError

KEY = "train.precision_schedule"
PRECISIONS = ("fp32", "fp16", "bf16", "fp8", "fp8-fwd", "fp8-bwd")
# The fp8 phases that set float8.forward and float8.backward: (forward, backward).
ROLES = {"fp8-fwd": ("fp8", "bf16"), "fp8-bwd": ("bf16", "fp8")}
DECAY = "decay"


@dataclass(frozen=True)
class Phase:
    precision: str
    first_step: int
    last_step: int
    at_decay: bool = False
    """Its last step was written "decay" (the scheduler's decay onset)."""

    def __str__(self) -> str:
        return (f"{self.precision} steps {self.first_step}-{self.last_step}"
                + (" (to the learning rate's decay onset)" if self.at_decay else ""))

    @property
    def mixed_precision(self) -> str:
        """train.mixed_precision of the phase: "fp8" for fp8-fwd and fp8-bwd."""
        return "fp8" if self.precision in ROLES else self.precision

    @property
    def is_fp8(self) -> bool:
        return self.mixed_precision == "fp8"


@dataclass(frozen=True)
class DecayOnset:
    """The scheduler's decay onset: the last step at the peak learning rate (1-based, as the log counts), or None
    with why there is none."""

    step: int | None
    why: str = ""


def decay_onset(*, warmup_steps: int, decay_type: str, wsd_decay_ratio: float, total_steps: int) -> DecayOnset:
    """Where trainer.optim.schedule.lr_lambda's decay starts (its describe_schedule's "decay over steps N+1-T"):
    cosine and linear after the warm-up, wsd after its constant stretch; constant never decays."""
    if decay_type == "constant":
        return DecayOnset(None, "scheduler.decay_type='constant' never decays")
    if warmup_steps >= total_steps:
        return DecayOnset(None, f"the run ends inside the warm-up (scheduler.warmup_steps={warmup_steps} >= "
                                f"train.steps={total_steps})")
    if decay_type == "wsd":
        return DecayOnset(max(warmup_steps, total_steps - max(1, int(total_steps * wsd_decay_ratio))))
    return DecayOnset(warmup_steps)


def schedule_phases(cfg) -> list[Phase]:
    """The phases of a config's train.precision_schedule (`cfg`: a JobConfig or its sections), "decay" resolved
    from its [scheduler]."""
    t, s = cfg.train, cfg.scheduler
    onset = decay_onset(warmup_steps=s.warmup_steps, decay_type=s.decay_type, wsd_decay_ratio=s.wsd_decay_ratio,
                        total_steps=t.steps)
    return parse_precision_schedule(t.precision_schedule, total_steps=t.steps, decay=onset)


def resolved_entries(phases: list[Phase]) -> list[str]:
    """The schedule with every step a number ("fp8:decay" -> "fp8:900"): resolved.toml's and the startup line's."""
    return [f"{p.precision}:{p.last_step}" for p in phases[:-1]] + [phases[-1].precision]


def parse_precision_schedule(entries: list[str], *, total_steps: int,
                             decay: DecayOnset = DecayOnset(None, "no scheduler given")) -> list[Phase]:
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
            step = _decay_step(where, decay) if step_text == DECAY else _step(where, step_text)
            if step < first:
                after = f"after the previous entry's step {first - 1}" if i else ">= 1"
                raise ConfigError(f"{where}: steps must increase; step {step} must be {after}")
            if step >= total_steps:
                raise ConfigError(f"{where}: step {step} must be < train.steps={total_steps} "
                                  "(the last entry, without a step, runs to train.steps)")
        if phases and phases[-1].precision == precision:
            raise ConfigError(f"{where}: the same precision as the entry before it; merge the two entries")
        phases.append(Phase(precision, first, step, at_decay=step_text == DECAY and not last))
        first = step + 1
    return phases


def _step(where: str, step_text: str) -> int:
    try:
        return int(step_text.replace("_", ""))
    except ValueError:
        raise ConfigError(f"{where}: the step {step_text!r} must be an integer or 'decay' (the learning rate's "
                          "decay onset)") from None


def _decay_step(where: str, decay: DecayOnset) -> int:
    if decay.step is None:
        raise ConfigError(f"{where}: 'decay' names the learning rate's decay onset, but {decay.why}; write a step")
    if decay.step < 1:
        raise ConfigError(f"{where}: the learning rate decays from step 1 (scheduler.warmup_steps=0), so no step "
                          "comes before its onset; write a step, or set scheduler.warmup_steps")
    return decay.step


def phase_index(phases: list[Phase], step: int) -> int:
    """The phase that trains the step after `step` (the last phase once the run is complete)."""
    for k, phase in enumerate(phases):
        if step < phase.last_step:
            return k
    return len(phases) - 1
