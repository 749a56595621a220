"""What a run's stop and resume need besides the model: the step, the precision, how it stopped, exit codes.

TrainState is saved in every checkpoint (trainer.checkpoint.CheckpointState); a stop by SIGTERM or Ctrl-C
exits with the signal's code (STOP_SIGNALS), and writes PREEMPTED_MARKER for requeue scripts.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# Exit code of a run stopped by SIGTERM before its last step (after saving, when checkpoints are on):
# what a shell reports for a SIGTERM death (128 + 15), so SLURM requeue scripts can tell
# preemption (143) from completion (0) and from failure (1, 2). Ctrl-C (SIGINT) stops the same way
# and exits 130 (128 + 2); a second Ctrl-C quits at once, saving nothing.
EXIT_PREEMPTED = 143
EXIT_INTERRUPTED = 130
STOP_SIGNALS = {signal.SIGTERM: EXIT_PREEMPTED, signal.SIGINT: EXIT_INTERRUPTED}
# Written to the dump folder by such a stop (and removed when the next run starts): under torchrun,
# whose own exit code is 1 when its workers fail or it gets SIGTERM itself, this file is the signal.
PREEMPTED_MARKER = "preempted.json"


def note_torchrun_exit(marker: Path) -> None:
    """Under torchrun, what its own lines after a stop mean (they follow ours and read like a failure), and where the
    stop's record is: logged by rank 0 after `marker` (preempted.json) is written."""
    if "TORCHELASTIC_RUN_ID" in os.environ:  # set by torchrun for its workers
        logger.warning("under torchrun: its exit status is 1 whatever its workers return, and a signal sent to "
                       "torchrun itself ends in torch's SignalException traceback; %s is this stop's record "
                       "(docs/cluster.md#9-a-stopped-jobs-log)", marker)


def write_preempted(dump_folder: str | Path, *, step: int, of_steps: int, saved: bool, signal_name: str | None) -> None:
    """Rank 0's record of a stop (PREEMPTED_MARKER): torchrun exits 1 whatever its workers return, so requeue scripts
    read this file instead."""
    marker = Path(dump_folder) / PREEMPTED_MARKER
    marker.write_text(json.dumps({"step": step, "of_steps": of_steps, "checkpoint_saved": saved,
                                  "signal": signal_name}) + "\n")
    note_torchrun_exit(marker)


class StoppedBeforeFirstStep(BaseException):
    """SIGTERM or Ctrl-C before this process finished a step: raised by the signal handler, so the run stops now.

    A stop otherwise waits for the current step to end and saves it; the first step may be minutes of
    compilation away, and until it ends there is nothing the latest checkpoint (if any) does not hold. The
    command line exits with the signal's code (143 or 130) and no traceback. A BaseException, as
    KeyboardInterrupt is: raised wherever the signal lands, it must pass the `except Exception` of the code
    it interrupts (logging swallowed it when the signal came while a line was being written).
    """

    def __init__(self, signal_name: str):
        super().__init__(signal_name)
        self.signal_name = signal_name
        self.exit_code = STOP_SIGNALS[signal.Signals[signal_name]]


@dataclass
class TrainState:
    """Everything besides model/optimizer/scheduler/data that a resume needs."""

    step: int = 0
    mixed_precision: str = ""  # this run's train.mixed_precision, saved so a resume can say what changed
    resumed_mixed_precision: str = ""  # what the loaded checkpoint was written with ("" = not resumed)
    preempted: bool = False  # stopped by SIGTERM or Ctrl-C before the last step (not saved: a resume clears it)
    stopped_by: str = ""  # the signal that stopped it: "SIGTERM" or "SIGINT"
    tokens: int = 0
    """The global tokens trained on so far (every sequence's seq_len): the batch-size warm-up's position
    (trainer/data/batch_warmup.py) and metrics.jsonl's tokens_seen."""
    step_tokens: int = 0  # the last step's global tokens (not saved)
    full_step_tokens: int = 0
    """This run's tokens per step after any warm-up: a checkpoint written before `tokens` was saved (no warm-up
    then) had trained on step x this (the same batch assumed)."""

    @property
    def exit_code(self) -> int:
        return STOP_SIGNALS[signal.Signals[self.stopped_by]] if self.preempted else 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "mixed_precision": self.mixed_precision, "tokens": self.tokens}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.step = int(sd["step"])
        self.resumed_mixed_precision = str(sd.get("mixed_precision", ""))
        self.tokens = int(sd.get("tokens", self.step * self.full_step_tokens))

    @property
    def batch(self) -> tuple[int, int, bool]:
        """(the last step's global tokens, all steps', whether it was a step of the batch-size warm-up): StepStats."""
        return self.step_tokens, self.tokens, self.step_tokens < self.full_step_tokens

    def advance(self, tokens: int) -> None:
        """One step of `tokens` global tokens trained."""
        self.step, self.tokens, self.step_tokens = self.step + 1, self.tokens + tokens, tokens


@dataclass
class Interval:
    """The loop's steps and tokens since the last log line, and when it began (trainer/run/train.py)."""

    start: float = field(default_factory=time.perf_counter)
    steps: int = 0
    tokens: float = 0

    def add(self, tokens: float) -> None:
        self.steps += 1
        self.tokens += tokens
