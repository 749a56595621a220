"""The per-rank event log (metrics.event_log): what each rank did and when, to find the rank that holds a run back.

    {job.dump_folder}/events/rank-00000.jsonl     one file per global rank, one JSON object a line

Every record has "event", "time" (unix seconds, this host's wall clock) and "rank":

    run_start         versions (python, torch, torchao, trainer and its git commit where the checkout has one),
                      layout (dp_replicate, dp_shard, tp, ep, pp, cp, world_size), device, config_hash (sha256 of the
                      resolved config: `config_hash`), resumed_step
    step              step, data_s, forward_backward_s, optimizer_s, step_s, comm_s ("time": when its batch was ready)
    profile           step (the window's last), steps ([first, last]), num_steps, trace (its file), device, wall_s,
                      comm_s, exposed_comm_s (seconds per step of the profiler window's trace), reason (why comm_s
                      and exposed_comm_s are null: a CPU trace, which times no communication kernels; else null)
    checkpoint_begin  step, path
    checkpoint_end    step, path, seconds (begin to saved: a background save ends when it is complete), error (or null)
    stop              step, reason ("signal" with "signal", "nonfinite" with "message")
    error             step, type, message (the exception's first line)
    run_end           step (the run reached its stop step)

The step times come from marks taken where the loop already is, never from a host sync of their own: at the start and
end of the data fetch (`next_batch`), after forward/backward (`after_forward_backward`) and after the optimizer step
and every hook's (`after_optimizer_step`). On CPU the marks are the host's clock; on CUDA they are CUDA events on the
current stream, read at log steps (`on_log`, after the loop's own sync) and at the end, so step records are buffered
and written at log steps. On CUDA each time is the device's: data_s is how long the device waited for the batch (0
when the host fetched it while the device was still busy: the wait that was exposed), step_s from the data fetch's
start to the optimizer's end on the device. comm_s is the exposed communication (the device waiting on a collective
that no compute hides): with one rank there is none (0.0); otherwise it cannot be known from these marks (a
collective's wait is inside forward/backward and the optimizer), so it is null. With the profiler window on as well
([profiling] enable), every rank summarizes its own trace (trainer/metrics/trace_summary.py) and writes a profile
record: the exposed communication the kernels' own times give, per step of the window. Everything else is written and
flushed when it happens, so a crash leaves the file readable up to it.

A fresh run (resumed_step 0) moves each rank's earlier file aside (rank-00000.jsonl.prev-N); a resumed run appends,
after a run_start of its own. `trainer/metrics/event_summary.py` reads the files (scripts/summarize_events.py).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import json
import platform
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

import torch

from trainer.hooks import StepHook
from trainer.metrics.logger import set_aside
from trainer.metrics.trace_summary import TraceSummary

EVENTS_FOLDER = "events"
# The two clocks, by name so tests can put their own in: the host's monotonic timer for CPU marks, the wall clock
# for the records' "time".
perf_counter, wall_clock = time.perf_counter, time.time


def events_file(dump_folder: str | Path, rank: int) -> Path:
    return Path(dump_folder) / EVENTS_FOLDER / f"rank-{rank:05d}.jsonl"


def config_hash(config: dict[str, Any]) -> str:
    """sha256 of the resolved config (resolved.toml's tables) as canonical JSON: keys sorted, no spaces."""
    text = json.dumps(config, sort_keys=True, separators=(",", ":"), ensure_ascii=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.cache
def versions() -> dict[str, str | None]:
    """What ran: python, torch, torchao, the trainer's package version and git commit (None outside a checkout)."""
    checkout = Path(__file__).resolve().parents[2]
    commit = None
    if (checkout / ".git").exists():  # a checkout (a worktree's .git is a file); an installed wheel has none
        try:
            out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=checkout, capture_output=True, text=True,
                                 timeout=10)
            commit = (out.stdout.strip() or None) if out.returncode == 0 else None
        except (OSError, subprocess.TimeoutExpired):
            commit = None
    return {"python": platform.python_version(), "torch": torch.__version__, "torchao": _version("torchao"),
            "trainer": _version("trainer"), "git_commit": commit}


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


CPU_TRACE = "a CPU trace: it times aten ops on the host, not the communication kernels"


def profile_record(summary: TraceSummary, trace: str) -> dict[str, Any]:
    """The profile record of one rank's trace summary: its microseconds as seconds per step of the window."""
    n = summary.num_steps
    timed = summary.device == "cuda"  # a CPU trace has no kernels: its comm_us is 0 because nothing timed it

    def per_step(us: float) -> float | None:
        return us / 1e6 / n if timed else None

    return {"event": "profile", "step": summary.steps[1] if summary.steps else None,
            "steps": list(summary.steps) if summary.steps else None, "num_steps": n, "trace": trace,
            "device": summary.device, "wall_s": summary.wall_us / 1e6 / n, "comm_s": per_step(summary.comm_us),
            "exposed_comm_s": per_step(summary.exposed_comm_us), "reason": None if timed else CPU_TRACE}


class _RunState(Protocol):
    """What `EventLog.recording` reads of the run (trainer.run.train_state.TrainState)."""

    step: int
    preempted: bool
    stopped_by: str | None


Mark = float | torch.cuda.Event


class EventLog(StepHook):
    """One rank's event log; with `enabled` False every method does nothing (and it is no hook: `hooks` is empty).

    The loop fetches its batch through `next_batch`, the step calls the hooks' `after_forward_backward`, and
    `recording` surrounds the run: the run_start record at its start, the stop, error or run_end at its end.
    """

    def __init__(self, enabled: bool, *, dump_folder: str, rank: int, device: torch.device, layout: dict[str, int],
                 config: dict[str, Any]):
        self.enabled, self.rank, self.device, self.layout = enabled, rank, device, layout
        self.path = events_file(dump_folder, rank)
        self.config_hash = config_hash(config) if enabled else ""
        self.cuda = device.type == "cuda"
        self.file = None
        self._marks: list[Mark] | None = None  # this step's marks so far
        self._ready = 0.0  # the wall clock when this step's batch was ready
        self._pending: list[tuple[int, float, list[Mark]]] = []  # (step, time, 4 marks) not yet written

    @property
    def hooks(self) -> list[StepHook]:
        return [self] if self.enabled else []

    # -- the marks ---------------------------------------------------------

    def _mark(self) -> Mark:
        if not self.cuda:
            return perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()  # queued on the current stream: no sync
        return event

    @staticmethod
    def _seconds(a: Mark, b: Mark, *, wait: bool) -> float | None:
        """b - a; None where `wait` is False and the device has not reached b."""
        if isinstance(a, float):
            return b - a
        if not wait and not b.query():
            return None
        b.synchronize()  # at a log step the device is already past it (the loop synced), so this waits for nothing
        return a.elapsed_time(b) / 1000

    def next_batch(self, loader: Any, *args: Any) -> Any:
        """`loader.next_batch(*args)`, with the fetch's start and end marked."""
        if not self.enabled:
            return loader.next_batch(*args)
        start = self._mark()
        batch = loader.next_batch(*args)
        self._marks, self._ready = [start, self._mark()], wall_clock()
        return batch

    def after_forward_backward(self, step: int) -> None:
        if self._marks is not None and len(self._marks) == 2:
            self._marks.append(self._mark())

    def after_optimizer_step(self, step: int, found_inf: torch.Tensor) -> None:
        """Last of the hooks: the step's record waits here, unresolved, for the next log step."""
        marks, self._marks = self._marks, None
        if marks is not None and len(marks) == 3:  # a step not fetched through next_batch (a benchmark's) is not one
            self._pending.append((step, self._ready, [*marks, self._mark()]))

    def on_log(self, step: int) -> dict[str, float]:
        self._write_steps()
        return {}

    def _write_steps(self, *, wait: bool = True) -> None:
        """The buffered steps' records. wait=False (a run ending with an error): a step the device has not finished
        gets null times, since waiting for it could hang on a collective that a failed rank never joins."""
        pending, self._pending = self._pending, []
        comm = 0.0 if self.layout.get("world_size") == 1 else None
        for step, when, (data, fetched, backward, done) in pending:
            pairs = {"data_s": (data, fetched), "forward_backward_s": (fetched, backward),
                     "optimizer_s": (backward, done), "step_s": (data, done)}
            try:
                times = {name: self._seconds(a, b, wait=wait) for name, (a, b) in pairs.items()}
            except RuntimeError:  # the device failed (the run is ending with its error): the step's times are lost
                times = dict.fromkeys(pairs)
            self._write({"event": "step", "time": when, "step": step, **times, "comm_s": comm}, flush=False)
        if self.file is not None:
            self.file.flush()

    # -- records written at once -------------------------------------------

    @property
    def on_profile(self) -> Callable[[TraceSummary, str], None] | None:
        """maybe_enable_profiling's on_summary: every rank then summarizes its trace into a profile record. None when
        the log is off (only rank 0 summarizes: reading a trace of a large model takes a while)."""
        return self.profile if self.enabled else None

    def profile(self, summary: TraceSummary, trace: str) -> None:
        self._write(profile_record(summary, trace))

    def _write(self, record: dict[str, Any], *, flush: bool = True) -> None:
        if self.file is None:
            return
        when = record.pop("time") if "time" in record else wall_clock()
        self.file.write(json.dumps({"event": record.pop("event"), "time": when, "rank": self.rank, **record}) + "\n")
        if flush:
            self.file.flush()

    def checkpoint(self, event: str, step: int, path: Path | str, *, seconds: float | None = None,
                   error: str | None = None) -> None:
        """checkpoint_begin, or checkpoint_end with the seconds since the begin (or the error): the checkpoint
        manager's `save_events`."""
        if event == "checkpoint_begin":
            self._write({"event": event, "step": step, "path": str(path)})
        else:
            self._write({"event": event, "step": step, "path": str(path), "seconds": seconds, "error": error})

    @contextlib.contextmanager
    def recording(self, state: _RunState, *, nonfinite: type[BaseException]) -> Iterator[None]:
        """Around the run: run_start, then what ended it (a stop, an error, run_end). `nonfinite`: the error of
        train.on_nonfinite='stop' (a stop, not an error)."""
        if not self.enabled:
            yield
            return
        self._open(resumed_step=state.step)
        try:
            yield
        except BaseException as e:
            self._write_steps(wait=False)
            self._write(self._ending(state, e, nonfinite=nonfinite))
            raise
        self._write_steps()
        self._write(self._ending(state, None, nonfinite=nonfinite))

    def _open(self, *, resumed_step: int) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resumed_step == 0:
            set_aside([self.path])  # a fresh run: the file is this run's alone
        self.file = open(self.path, "a")
        self._write({"event": "run_start", "versions": versions(), "layout": self.layout,
                     "device": device_name(self.device), "config_hash": self.config_hash,
                     "resumed_step": resumed_step})

    @staticmethod
    def _ending(state: _RunState, error: BaseException | None, *, nonfinite: type[BaseException]) -> dict[str, Any]:
        message = next(iter(str(error).splitlines()), "")[:1000] if error is not None else ""
        if isinstance(error, nonfinite):
            return {"event": "stop", "step": state.step, "reason": "nonfinite", "message": message}
        # A stop signal's exit: none, or StoppedBeforeFirstStep (a BaseException, raised once the state says so). An
        # Exception during a stop (its save failed) is an error.
        if error is not None and (isinstance(error, Exception) or not state.preempted):
            return {"event": "error", "step": state.step, "type": type(error).__name__, "message": message}
        if state.preempted:
            return {"event": "stop", "step": state.step, "reason": "signal", "signal": state.stopped_by}
        return {"event": "run_end", "step": state.step}

    def close(self) -> None:
        """After the checkpoint manager's close (a background save's checkpoint_end comes before this)."""
        if self.file is not None:
            self._write_steps()
            self.file.close()
            self.file = None
