"""The straggler table of a run's event log (trainer/metrics/events.py): read every rank's file, compare the ranks.

    summary = summarize(read_run(dump_folder), skip_first=1)
    print(format_summary(summary))

Per rank: the median, p90 and max step time, the medians of data wait, forward/backward, optimizer and exposed
communication, how far its median step is behind the fastest rank's, and how late its batches are ready: for each step
the rank ran, the seconds between the first rank's batch being ready and its own (the step records' wall clocks). The
straggler is the rank latest at the median step: under synchronous collectives every rank's step takes about as long
(the others wait for the straggler inside their forward/backward, a wait no mark can tell from compute), so the step
time alone does not name it; the lateness does, with the phase where it spends most beside the rank first ready.
With one rank, or no step in common, there is no straggler: the rank whose median step is longest is named instead.
Where a rank wrote a profile record (its profiler window's trace summary: metrics.event_log with profiling.enable), its
comm column is the trace's exposed communication per step of that window, marked with a footnote naming the steps,
and the rank with the most of it is named (step marks cannot time it: the step records' comm_s is null off one rank).
The run-start facts are printed once (the lowest rank's latest run_start), with a note where the ranks' config hashes
or devices differ; then every stop and error, and each launch that ended without a record (killed, or still running).

Tolerated, each with a note: a last line cut short (the run crashed while writing it) and any other line that is no
event record are skipped; a file of a rank outside the latest launch's world size (an earlier, larger run's) is left
out. A missing folder or one without event files is an `EventLogError` (one line). torch-free, as
scripts/summarize_events.py reads it.
"""

from __future__ import annotations

import re
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.files.confine import special_file_problem
from trainer.files.json_object import json_lines

PHASES = ("data_s", "forward_backward_s", "optimizer_s", "comm_s")
_FILE = re.compile(r"rank-(\d+)\.jsonl")


class EventLogError(ValueError):
    """A folder that holds no event log: one line."""


@dataclass
class RankLog:
    rank: int
    records: list[dict[str, Any]]


@dataclass
class RunLog:
    ranks: list[RankLog]
    notes: list[str] = field(default_factory=list)


def event_files(dump: Path) -> dict[int, Path]:
    """rank -> its file, from the run's dump folder (or its events/ folder itself)."""
    if not dump.is_dir():
        raise EventLogError(f"no such folder: {dump}")
    folder = dump / "events" if (dump / "events").is_dir() else dump
    files = {int(m.group(1)): p for p in folder.iterdir() if (m := _FILE.fullmatch(p.name))}
    if not files:
        raise EventLogError(f"no event files (rank-NNNNN.jsonl) in {folder}: was the run started with "
                            "--metrics.event_log=true?")
    return dict(sorted(files.items()))


def read_events(path: Path, notes: list[str]) -> list[dict[str, Any]]:
    """The event records of one file, in order; a line that is none is skipped with a note."""
    if problem := special_file_problem(path, what="an event log"):
        notes.append(f"{problem}: left out")
        return []
    records = []
    for line in json_lines(path, what="an event record"):
        value = line.value
        if line.problem is None and isinstance(value.get("event"), str):
            records.append(value)
        elif not line.ended:
            notes.append(f"{path} line {line.number} is cut short (a write the run's end interrupted): skipped")
        else:
            notes.append(f"{line.problem or f'{path} line {line.number} has no event name'}: skipped")
    return records


def read_run(dump: Path) -> RunLog:
    """Every rank's records; the files of ranks outside the latest launch's world size are left out, with a note."""
    notes: list[str] = []
    ranks = [RankLog(rank, read_events(path, notes)) for rank, path in event_files(dump).items()]
    starts = [r for log in ranks for r in log.records if r["event"] == "run_start"]
    latest = max(starts, key=lambda r: _number(r.get("time")) or 0.0, default=None)
    world = (latest or {}).get("layout", {}).get("world_size")
    if isinstance(world, int):
        for log in [log for log in ranks if log.rank >= world]:
            notes.append(f"rank {log.rank}'s file is from an earlier run (the latest launch has {world} ranks): "
                         "left out")
            ranks.remove(log)
    return RunLog(ranks, notes)


def _number(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def quantile(xs: list[float], percent: int) -> float:
    """Linear interpolation between the closest ranks (numpy's default), `percent` in 0..100."""
    s = sorted(xs)
    pos = (len(s) - 1) * percent / 100
    lo = int(pos)
    return s[lo] if lo + 1 >= len(s) else s[lo] + (pos - lo) * (s[lo + 1] - s[lo])


@dataclass
class RankStats:
    rank: int
    steps: int
    step: tuple[float, float, float] | None
    """(median, p90, max) of step_s."""
    medians: dict[str, float | None]
    """PHASES -> the median, None where a step has none (comm_s off one rank)."""
    behind: float | None = None
    """Median step seconds behind the fastest rank's."""
    late: float | None = None
    """Median seconds its batch was ready after the first rank's, over the steps two ranks or more ran."""
    endings: list[str] = field(default_factory=list)
    """The stops and errors of its launches, one line each."""
    checkpoints: str = ""
    profile: dict[str, Any] | None = None
    """Its last profile record (the profiler window's trace summary), if it wrote one."""

    @property
    def exposed_comm(self) -> float | None:
        """Exposed communication seconds per step of the profiled window; None without a timed trace."""
        return _number((self.profile or {}).get("exposed_comm_s"))


@dataclass
class Summary:
    run_start: dict[str, Any] | None
    ranks: list[RankStats]
    skip_first: int
    fastest: int | None = None
    straggler: int | None = None
    gap: str = ""
    """Where the straggler's median step loses most against the fastest's."""
    most_exposed: int | None = None
    """The rank with the most exposed communication in its profiled window (None: no rank's trace timed it)."""
    notes: list[str] = field(default_factory=list)


def _steps(records: list[dict[str, Any]], skip_first: int) -> list[dict[str, Any]]:
    """The step records, less the first `skip_first` of each launch."""
    out, seen = [], 0
    for r in records:
        if r["event"] == "run_start":
            seen = 0
        elif r["event"] == "step":
            seen += 1
            if seen > skip_first and _number(r.get("step_s")) is not None:
                out.append(r)
    return out


def _endings(records: list[dict[str, Any]]) -> list[str]:
    lines, launch, ended = [], 0, True
    for r in records:
        event, step = r["event"], r.get("step")
        if event == "run_start":
            if not ended:
                lines.append(f"launch {launch} has no end record (killed: SIGKILL, out of memory, a lost node)")
            launch, ended = launch + 1, False
        elif event in ("stop", "error", "run_end"):
            ended = True
            if event == "stop":
                why = f"by {r.get('signal')}" if r.get("reason") == "signal" else f"non-finite: {r.get('message')}"
                lines.append(f"launch {launch} stopped at step {step} {why}")
            elif event == "error":
                lines.append(f"launch {launch} failed at step {step}: {r.get('type')}: {r.get('message')}")
    if not ended:
        lines.append(f"launch {launch} has no end record (still running, or killed: SIGKILL, out of memory)")
    return lines


def _checkpoints(records: list[dict[str, Any]]) -> str:
    ends = [r for r in records if r["event"] == "checkpoint_end"]
    saved = [s for r in ends if r.get("error") is None and (s := _number(r.get("seconds"))) is not None]
    if not ends:
        return ""
    failed = len(ends) - len(saved)
    return (f"{len(saved)} saved" + (f" (max {max(saved):.3f} s)" if saved else "")
            + (f", {failed} failed" if failed else ""))


def rank_stats(log: RankLog, skip_first: int) -> RankStats:
    steps = _steps(log.records, skip_first)
    times = [float(r["step_s"]) for r in steps]
    medians: dict[str, float | None] = {}
    for phase in PHASES:
        values = [_number(r.get(phase)) for r in steps]
        medians[phase] = statistics.median(values) if values and None not in values else None
    step = (statistics.median(times), quantile(times, 90), max(times)) if times else None
    profile = next((r for r in reversed(log.records) if r["event"] == "profile"), None)
    return RankStats(log.rank, len(steps), step, medians, endings=_endings(log.records),
                     checkpoints=_checkpoints(log.records), profile=profile)


def _lateness(run: RunLog, skip_first: int) -> dict[int, float]:
    """rank -> its median lateness (RankStats.late), for the ranks that share a step with another."""
    ready: dict[int, dict[int, float]] = {}  # step -> rank -> when its batch was ready (a replayed step: the last)
    for log in run.ranks:
        for r in _steps(log.records, skip_first):
            if (when := _number(r.get("time"))) is not None and isinstance(r.get("step"), int):
                ready.setdefault(r["step"], {})[log.rank] = when
    lags: dict[int, list[float]] = {}
    for times in ready.values():
        if len(times) > 1:
            first = min(times.values())
            for rank, when in times.items():
                lags.setdefault(rank, []).append(when - first)
    return {rank: statistics.median(xs) for rank, xs in lags.items()}


def summarize(run: RunLog, *, skip_first: int = 1) -> Summary:
    ranks = [rank_stats(log, skip_first) for log in run.ranks]
    for rank, late in _lateness(run, skip_first).items():
        next(s for s in ranks if s.rank == rank).late = late
    starts = [(log.rank, r) for log in run.ranks for r in log.records if r["event"] == "run_start"]
    first = min(starts, key=lambda x: (x[0], -(_number(x[1].get("time")) or 0.0)), default=(None, None))[1]
    summary = Summary(run_start=first, ranks=ranks, skip_first=skip_first, notes=list(run.notes))
    if exposed := [s for s in ranks if s.exposed_comm is not None]:
        summary.most_exposed = max(exposed, key=lambda s: (s.exposed_comm, -s.rank)).rank
    for key in ("config_hash", "device"):
        latest = {}
        for rank, r in starts:  # in file order: the last run_start of each rank wins
            latest[rank] = r.get(key)
        if len(set(map(str, latest.values()))) > 1:
            summary.notes.append(f"the ranks' {key} differ: " + ", ".join(f"rank {k}: {v}" for k, v in latest.items()))
    timed = [s for s in ranks if s.step is not None]
    if not timed:
        return summary
    fastest = min(timed, key=lambda s: (s.step[0], s.rank))
    for s in timed:
        s.behind = s.step[0] - fastest.step[0]
    summary.fastest = fastest.rank
    if len(timed) < 2:
        return summary
    late = [s for s in timed if s.late is not None]
    if late:  # the rank the others wait for, against the rank first ready
        slowest, base = max(late, key=lambda s: (s.late, -s.rank)), min(late, key=lambda s: (s.late, s.rank))
    else:
        slowest, base = max(timed, key=lambda s: (s.step[0], -s.rank)), fastest
    summary.straggler = slowest.rank
    gaps = {p: slowest.medians[p] - base.medians[p] for p in PHASES
            if slowest.medians[p] is not None and base.medians[p] is not None}
    if gaps and max(gaps.values()) > 0:
        phase = max(gaps, key=lambda p: gaps[p])
        summary.gap = f"against rank {base.rank} it loses most in {_PHASE_NAMES[phase]} (median +{gaps[phase]:.3f} s)"
    return summary


_PHASE_NAMES = {"data_s": "data wait", "forward_backward_s": "forward/backward", "optimizer_s": "the optimizer",
                "comm_s": "exposed communication"}


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def _window(profile: dict[str, Any]) -> str:
    steps = profile.get("steps")
    ok = isinstance(steps, list) and len(steps) == 2 and all(isinstance(x, int) for x in steps)
    return f"steps {steps[0]}-{steps[1]}" if ok else "the profiled steps"


def _comm(r: RankStats) -> str:
    """The comm column: the profiled window's exposed communication (marked *) where the rank's trace timed it."""
    return _fmt(r.medians["comm_s"]) if r.exposed_comm is None else f"{r.exposed_comm:.3f}*"


def _by_window(ranks: list[RankStats]) -> str:
    """"steps 3-5" where the ranks share the window, else "steps 3-5 (ranks 0, 1), steps 7-9 (rank 2)"."""
    windows: dict[str, list[int]] = {}
    for r in ranks:
        windows.setdefault(_window(r.profile or {}), []).append(r.rank)
    if len(windows) == 1:
        return next(iter(windows))
    return ", ".join(f"{w} (rank{'s' * (len(rs) > 1)} {', '.join(map(str, rs))})" for w, rs in windows.items())


def _profile_lines(s: Summary) -> list[str]:
    """The comm column's footnote, the rank with the most exposed communication, and the traces that time none."""
    lines, timed = [], [r for r in s.ranks if r.exposed_comm is not None]
    if timed:
        lines.append(f"*comm: exposed communication per step (no other kernel running beside it) in the profiler trace "
                     f"of {_by_window(timed)}, not a median of the step records")
    if s.most_exposed is not None:
        top = next(r for r in s.ranks if r.rank == s.most_exposed)
        wall = _number(top.profile.get("wall_s"))
        share = f", {100 * top.exposed_comm / wall:.1f}% of its wall" if wall else ""
        lines.append(f"most exposed communication: rank {top.rank}, {top.exposed_comm:.3f} s/step in "
                     f"{_window(top.profile)}'s trace{share}")
    untimed = [r for r in s.ranks if r.profile is not None and r.exposed_comm is None]
    for reason in dict.fromkeys(str(r.profile.get("reason")) for r in untimed):
        same = [r for r in untimed if str(r.profile.get("reason")) == reason]
        lines.append(f"the profiler trace of {_by_window(same)} times no communication: {reason}")
    return lines


def format_run_start(r: dict[str, Any]) -> list[str]:
    layout, v = r.get("layout") or {}, r.get("versions") or {}
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(_number(r.get("time")) or 0.0))
    degrees = " ".join(f"{k}={layout.get(k)}" for k in ("dp_replicate", "dp_shard", "tp", "ep", "pp", "cp"))
    commit = f" (git {str(v['git_commit'])[:12]})" if v.get("git_commit") else ""
    return [f"run start (rank {r.get('rank')}, {when}): world size {layout.get('world_size')} ({degrees}) on "
            f"{r.get('device')}, resumed_step {r.get('resumed_step')}",
            f"  python {v.get('python')}, torch {v.get('torch')}, torchao {v.get('torchao')}, trainer "
            f"{v.get('trainer')}{commit}; config sha256 {r.get('config_hash')}"]


def format_summary(s: Summary) -> str:
    lines = format_run_start(s.run_start) if s.run_start else ["no run_start record"]
    lines.append(f"steps: the first {s.skip_first} of each launch left out (compilation and warm-up); seconds, "
                 "medians unless named; comm: exposed communication (n/a: not measured, *: from the profiler "
                 "window); late: after the first rank's batch was ready")
    header = ("rank", "steps", "step", "p90", "max", "data", "fwd+bwd", "optimizer", "comm", "late", "behind fastest")
    rows = [header]
    base = next((x.step[0] for x in s.ranks if x.rank == s.fastest and x.step), None)
    for r in s.ranks:
        step, behind = r.step or (None, None, None), ""
        if r.behind is not None and base is not None:
            behind = f"+{r.behind:.3f}" + (f" (+{100 * r.behind / base:.1f}%)" if base > 0 else "")
            behind += "  fastest" if r.rank == s.fastest else ""
        behind += "  straggler" if r.rank == s.straggler else ""
        parts = (_fmt(r.medians[p]) for p in PHASES if p != "comm_s")
        rows.append((str(r.rank), str(r.steps), *map(_fmt, step), *parts, _comm(r), _fmt(r.late), behind))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header) - 1)]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) + "  " + row[-1] for row in rows]
    if s.straggler is not None:
        slow = next(x for x in s.ranks if x.rank == s.straggler)
        when = (f"its batch ready a median {slow.late:.3f} s after the first rank's" if slow.late is not None
                else f"median step +{slow.behind:.3f} s behind rank {s.fastest}")
        lines.append(f"straggler: rank {s.straggler}, {when}" + (f"; {s.gap}" if s.gap else ""))
    elif not any(r.step for r in s.ranks):
        lines.append("no step records (the run ended before its first step was written)")
    lines += _profile_lines(s)
    if ckpt := [f"  rank {r.rank}: {r.checkpoints}" for r in s.ranks if r.checkpoints]:
        lines += ["checkpoints:", *ckpt]
    if ends := [f"  rank {r.rank}: {e}" for r in s.ranks for e in r.endings]:
        lines += ["stops and errors:", *ends]
    if s.notes:
        lines += ["notes:", *(f"  {n}" for n in s.notes)]
    return "\n".join(lines)
