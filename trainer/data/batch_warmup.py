"""Batch-size warm-up (train.batch_size_warmup_tokens): the global batch ramped up in whole microbatches.

GPT-3 ramps its batch linearly in tokens over the first billions of tokens; Megatron-LM's `rampup_batch_size` and
OLMo-core's batch-size scheduler do the same in steps of whole batches. Here a step accumulates `microbatches(T)`
microbatches of train.batch_size sequences on each data-parallel rank, T being the tokens the run has trained on
before the step (TrainState.tokens, saved in every checkpoint):

    microbatches(T) = start + (final - start) * T // W      while T < W, then final

with start = train.batch_size_warmup_start / train.batch_size, final = train.grad_accum_steps and
W = train.batch_size_warmup_tokens (global tokens, every sequence's seq_len counted). Every microbatch has the shape
of the configured run's, so nothing is compiled again, the memory plan holds, and under pipeline parallelism each
microbatch is one pass of the schedule, as it is without the warm-up. The step's loss is the mean over its own valid
tokens (trainer/run/step.py counts them per step). The learning-rate schedule stays a function of the step, as in
OLMo-core. The data position (samples read) and T are both saved, so a resume continues the same samples and ramp.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BatchWarmup:
    """The ramp of one run (start == final: none)."""

    start: int
    """Microbatches per data-parallel rank of the first step."""
    final: int
    """train.grad_accum_steps: the microbatches of every step after the ramp."""
    tokens: int
    """W, train.batch_size_warmup_tokens (0: no ramp)."""
    microbatch_tokens: int
    """The global tokens of one microbatch on every data-parallel rank: batch_size x seq_len x dp."""
    batch_size: int
    """train.batch_size, for the startup line."""

    def __post_init__(self):
        assert 1 <= self.start <= self.final and self.tokens >= 0, self  # trainer.config.checks checked the keys
        assert (self.start == self.final) == (self.tokens == 0), self

    @classmethod
    def of(cls, *, batch_size: int, seq_len: int, grad_accum_steps: int, dp: int, warmup_tokens: int,
           warmup_start: int) -> BatchWarmup:
        """The ramp of checked train.* keys (trainer.config.checks) on dp data-parallel ranks."""
        start = warmup_start // batch_size if warmup_tokens else grad_accum_steps
        return cls(start=start, final=grad_accum_steps, tokens=warmup_tokens,
                   microbatch_tokens=batch_size * seq_len * dp, batch_size=batch_size)

    def microbatches(self, tokens_seen: int) -> int:
        """The microbatches per rank of the step that follows `tokens_seen` trained tokens (module docstring)."""
        if tokens_seen >= self.tokens:
            return self.final
        return self.start + (self.final - self.start) * tokens_seen // self.tokens

    def step_tokens(self, microbatches: int) -> int:
        """The global tokens of a step of that many microbatches per rank."""
        return microbatches * self.microbatch_tokens

    def levels(self) -> list[tuple[int, int]]:
        """(first step, microbatches) of each batch a fresh run trains with, in order; the last is `final`'s.

        In closed form per level, so a ramp of billions of tokens costs `final` iterations, not one per step: count
        m holds while T < ceil((m + 1 - start) x W / (final - start)), the least T where the next count begins.
        """
        out, step, seen = [], 1, 0
        for m in range(self.start, self.final):
            ends = -(-(m + 1 - self.start) * self.tokens // (self.final - self.start))
            if seen < ends:  # else the previous level's last step passed this one's end as well
                steps = -(-(ends - seen) // self.step_tokens(m))
                out.append((step, m))
                step, seen = step + steps, seen + steps * self.step_tokens(m)
        return [*out, (step, self.final)]

    @property
    def full_tokens(self) -> int:
        """The global tokens of every step after the ramp."""
        return self.step_tokens(self.final)

    @property
    def steps(self) -> int:
        """K: the steps of a fresh run below the final batch."""
        return self.levels()[-1][0] - 1

    def describe(self) -> str:
        """The startup line's part: the tokens per step, and the ramp where there is one."""
        full = f"{self.full_tokens:,} tokens per step"
        if not self.tokens:
            return full
        levels = self.levels()
        return (f"batch-size warm-up from {self.start * self.batch_size} to {self.final * self.batch_size} sequences "
                f"per rank ({self.start} to {self.final} microbatches of {self.batch_size}) over {self.tokens:,} "
                f"tokens, {self.steps} steps of {self.step_tokens(levels[0][1]):,} to "
                f"{self.step_tokens(levels[-2][1]):,} tokens, then {full}")
