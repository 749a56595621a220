"""Profiler traces of a window of train steps (summarized by trainer/metrics/trace_summary.py: did FP8 GEMMs run?)
and CUDA memory snapshots. docs/debug.md says how to read what these write."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import tempfile
from collections.abc import Callable, Iterator

import torch
from torch.profiler import ProfilerAction, ProfilerActivity

from trainer.metrics.trace_summary import (
    TraceSummary, format_summary, fp8_warning, load_trace_events, summarize_events,
)

_log = logging.getLogger(__name__)

# The TensorBoard profiler plugin lists only files matching `<worker>[.<span>].pt.trace.json[.gz]`
# (WORKER_PATTERN in pytorch/kineto tb_plugin/torch_tb_profiler/consts.py); Perfetto and
# chrome://tracing read any name.
TRACE_SUFFIX = ".pt.trace.json.gz"

# ---------------------------------------------------------------------------------------------
# A profiler trace of train steps start_step..end_step.


def _window_action(step: int, *, start_step: int, end_step: int) -> ProfilerAction:
    """What the profiler does during train step `step`: warm up in the step before the window (so
    the profiler's start-up cost lands there, not in the first recorded step), record the window,
    and save the trace as its last step ends."""
    if step == start_step - 1:
        return ProfilerAction.WARMUP
    if start_step <= step < end_step:
        return ProfilerAction.RECORD
    if step == end_step:
        return ProfilerAction.RECORD_AND_SAVE
    return ProfilerAction.NONE


# libkineto writes `USDT:<time> <pid>:<tid> SyncActivityProfilerHandler.cpp:52] profiler_start` (and
# `profiler_stop`) to stderr at every trace start and stop (torch 2.13). They are logged above kineto's
# ERROR level, so KINETO_LOG_LEVEL can only drop them with kineto's errors (6 drops both); instead fd 2
# is captured around the two calls and everything but those lines written back.
_KINETO_MARKER = re.compile(rb"^USDT:[^\n]*\] profiler_(?:start|stop)\r?\n?", re.M)


@contextlib.contextmanager
def _without_kineto_markers() -> Iterator[None]:
    """Drop libkineto's profiler_start/profiler_stop lines from what is written to fd 2 inside."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with tempfile.TemporaryFile() as captured:
            os.dup2(captured.fileno(), 2)
            try:
                yield
            finally:
                sys.stderr.flush()
                os.dup2(saved, 2)
                captured.seek(0)
                rest = memoryview(_KINETO_MARKER.sub(b"", captured.read()))
                while rest:  # anything else said meanwhile (kineto's errors) is kept, in order
                    rest = rest[os.write(2, rest):]
    finally:
        os.close(saved)


class _QuietProfile(torch.profiler.profile):
    """torch.profiler.profile without libkineto's two marker lines on the console."""

    def start_trace(self) -> None:
        with _without_kineto_markers():
            super().start_trace()

    def stop_trace(self) -> None:
        with _without_kineto_markers():
            super().stop_trace()


class _NoProfiler:
    def step(self, step: int) -> None:
        pass


class _WindowProfiler:
    def __init__(self, *, start_step: int, end_step: int, trace_dir: str, rank: int,
                 record_shapes: bool, with_stack: bool, profile_memory: bool, expect_fp8: bool,
                 log: logging.Logger, on_summary: Callable[[TraceSummary, str], None] | None = None):
        self.start_step, self.end_step = start_step, end_step
        self.trace_dir, self.rank, self.expect_fp8, self.log = trace_dir, rank, expect_fp8, log
        self.on_summary = on_summary
        self.first_step: int | None = None
        self.recorded: list[int] = []
        self.crashed = False
        self.trace_path: str | None = None
        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        self.prof = _QuietProfile(
            activities=activities,
            # profile() asks for schedule(0) before any step has run, i.e. for the loop's step 1.
            schedule=lambda step: _window_action(max(step, 1), start_step=start_step, end_step=end_step),
            on_trace_ready=self._on_trace_ready,
            record_shapes=record_shapes,
            with_stack=with_stack,
            profile_memory=profile_memory,
        )
        # profile counts its steps from 0; step() keeps that count equal to the train step about to
        # run, so the schedule sees train steps and the trace's ProfilerStep#N markers are train steps.
        self.prof.step_num = 1

    def step(self, step: int) -> None:
        """Call right after train step `step` (1-based) has finished."""
        if self.first_step is None:
            # Before this call the profiler assumed the loop began at step 1; a run resumed from a
            # checkpoint began later, so its first step was profiled (or not) as step 1 would be.
            self.first_step = step
        if self.prof.current_action in (ProfilerAction.RECORD, ProfilerAction.RECORD_AND_SAVE):
            self.recorded.append(step)
        self.prof.step_num = step  # profile.step() moves on to step + 1 and asks the schedule for it
        self.prof.step()

    def _on_trace_ready(self, prof: torch.profiler.profile) -> None:
        # Called as step end_step ends, or on exit with the window still open: then the trace also
        # holds what ran after the last finished step, and the failing step if the run raised.
        steps = self.recorded + ([prof.step_num] if self.crashed else [])
        if not steps:
            return
        first, last = steps[0], steps[-1]
        os.makedirs(self.trace_dir, exist_ok=True)
        self.trace_path = os.path.join(self.trace_dir, f"rank{self.rank}_step{first}-{last}{TRACE_SUFFIX}")
        prof.export_chrome_trace(self.trace_path)
        if self.crashed or (first, last) != (self.start_step, self.end_step):
            why = (f"; the run failed during step {last}, which is incomplete" if self.crashed
                   else f" only: the run ended after step {last}" if last < self.end_step
                   else f" only: the run resumed at step {self.first_step}")
            self.log.warning(f"profiler trace of window {self.start_step}-{self.end_step} holds steps "
                             f"{first}-{last}{why}")
        self.log.info(f"Profiler trace of steps {first}-{last} written to {self.trace_path} "
                      "(open it in https://ui.perfetto.dev)")
        if self.rank != 0 and self.on_summary is None:
            return  # reading the trace back costs time (seconds for a large model's): only where it is used
        # Summarize the file just written, not prof.events(): the live summary and
        # scripts/summarize_trace.py then read the same events the same way.
        summary = summarize_events(load_trace_events(self.trace_path), num_steps=len(steps),
                                   steps=(first, last))
        if self.rank == 0:
            self._report(summary, first, last)
        if self.on_summary is not None:
            self.on_summary(summary, self.trace_path)

    def _report(self, summary: TraceSummary, first: int, last: int) -> None:
        """Rank 0's summary file and log lines."""
        text = format_summary(summary)
        with open(os.path.join(self.trace_dir, f"summary_step{first}-{last}.txt"), "w") as f:
            f.write(text + "\n")
        self.log.info(text)
        # An fp8 run computes in bf16 around its FP8 GEMMs, and wholly in bf16 without them.
        if self.expect_fp8 and (warning := fp8_warning(summary, compute_dtype="bf16")):
            bar = "!" * 100
            self.log.warning(f"\n{bar}\n{warning}\n{bar}")


@contextlib.contextmanager
def maybe_enable_profiling(*, enable: bool, start_step: int, end_step: int, trace_dir: str, rank: int,
                           record_shapes: bool, with_stack: bool, profile_memory: bool,
                           expect_fp8: bool, logger: logging.Logger | None = None,
                           on_summary: Callable[[TraceSummary, str], None] | None = None) -> Iterator:
    """Yields an object whose step(step) the loop calls right after each train step (1, 2, ...).

    When enabled, train steps start_step..end_step are traced into
    trace_dir/rank{rank}_step{start}-{end}.pt.trace.json.gz, and rank 0 writes the kernel summary
    to trace_dir/summary_step{start}-{end}.txt and logs it (with a warning block when expect_fp8
    and no FP8 GEMM ran). A run that ends inside the window still writes what was recorded.
    With on_summary (the event log's EventLog.on_profile), every rank summarizes its own trace and
    passes the summary and the trace's path to it; without it only rank 0 reads its trace back.
    """
    if not enable:
        yield _NoProfiler()
        return
    # trainer.validate checked the window for the user.
    assert 1 <= start_step <= end_step, (start_step, end_step)
    log = logger or _log
    window = _WindowProfiler(start_step=start_step, end_step=end_step, trace_dir=trace_dir, rank=rank,
                             record_shapes=record_shapes, with_stack=with_stack,
                             profile_memory=profile_memory, expect_fp8=expect_fp8, log=log,
                             on_summary=on_summary)
    log.info(f"Profiling steps {start_step}-{end_step} into {trace_dir} (record_shapes={record_shapes}, "
             f"with_stack={with_stack}, profile_memory={profile_memory})")
    try:
        with window.prof:
            try:
                yield window
            except BaseException:
                window.crashed = True
                raise
    finally:
        if window.trace_path is None:
            why = (f"the run started at step {window.first_step}, after it"
                   if window.first_step is not None and window.first_step > end_step
                   else "the run ended before it finished a step of it")
            log.warning(f"No profiler trace written for profiling window {start_step}-{end_step}: {why}")


# ---------------------------------------------------------------------------------------------
# CUDA memory snapshots.


class _NoMemoryRecorder:
    def dump(self, tag: str) -> str | None:
        return None


class _MemoryRecorder:
    def __init__(self, *, snapshot_dir: str, rank: int):
        self.snapshot_dir, self.rank = snapshot_dir, rank

    def dump(self, tag: str) -> str:
        """Write the allocator history so far to snapshot_dir/rank{rank}_{tag}.pickle."""
        os.makedirs(self.snapshot_dir, exist_ok=True)
        path = os.path.join(self.snapshot_dir, f"rank{self.rank}_{tag}.pickle")
        torch.cuda.memory._dump_snapshot(path)
        return path


@contextlib.contextmanager
def maybe_record_memory_history(*, enable: bool, snapshot_dir: str, rank: int) -> Iterator:
    """Records the CUDA allocator's history; yields an object whose dump(tag) writes a snapshot
    (None when not recording). An OOM inside dumps `oom` and re-raises with the file's path."""
    if not enable:
        yield _NoMemoryRecorder()
        return
    if not torch.cuda.is_available():
        _log.warning("profiling.memory_snapshot=true needs CUDA: this run records no memory snapshot")
        yield _NoMemoryRecorder()
        return
    recorder = _MemoryRecorder(snapshot_dir=snapshot_dir, rank=rank)
    torch.cuda.memory._record_memory_history(max_entries=100_000)
    _log.info(f"Recording CUDA allocator history for memory snapshots in {snapshot_dir}")
    try:
        yield recorder
    except torch.cuda.OutOfMemoryError as e:
        path = recorder.dump("oom")
        raise torch.cuda.OutOfMemoryError(
            f"rank {rank} ran out of CUDA memory; allocator snapshot written to {path}: open it at "
            f"https://pytorch.org/memory_viz and see docs/debug.md#shape-6-out-of-memory\n{e}"
        ) from e
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
