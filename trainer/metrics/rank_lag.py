"""Which rank the others wait for, from every rank's profiler trace of the same steps.

A collective kernel runs until the last rank of its group has launched its own: on the rank that launched first
it is long, on the last one short. So for the n-th collective kernel of each rank (the ranks launch the same
collectives in the same order), what a rank's kernel took beyond the shortest rank's is time it waited for another
rank. The rank the others wait for shows why in its own trace: gaps where its device ran nothing (its host
launching late: slower Python, a host sync, the data) or no gaps (it had more device work). Pure functions over
`trace_summary.load_trace_events`' events; `scripts/summarize_trace.py --ranks` prints them
(docs/debug.md, "which rank holds the others back").
"""

from __future__ import annotations

import dataclasses

from trainer.metrics.trace_summary import classify, merged_intervals, union_us

GAP_US = 300.0
"""A device gap counts from 0.3 ms: shorter ones are the launch latency between kernels a busy host keeps up with."""


@dataclasses.dataclass(frozen=True)
class RankLag:
    rank: int
    waited_us: float
    """In collective kernels, beyond the shortest rank's same kernel (the n-th of that name on every rank): waiting
    for other ranks to launch theirs."""
    gaps: int
    gap_us: float
    """Device gaps of at least GAP_US between one kernel's end (of all running) and the next kernel's start."""
    host_busy_us: float
    """The busiest host thread's time inside its outermost CPU ops and annotations."""


def rank_lags(ranks: list[list[dict]]) -> list[RankLag]:
    """One RankLag per rank, from each rank's trace events (their collectives matched in launch order)."""
    if len(ranks) < 2:
        raise ValueError(f"comparing ranks takes two or more traces, got {len(ranks)}")
    kernels = [sorted((e for e in events if e["cat"] == "kernel"), key=lambda e: e["ts"]) for events in ranks]
    if not all(kernels):
        raise ValueError("a trace holds no GPU kernels: compare GPU traces of the same steps")
    # By kernel name: collectives on different streams (FSDP's all-gathers, the all-to-alls) may start in another
    # order on each rank, those of one kind run in one stream's order.
    collectives = [_collectives_by_name(ks) for ks in kernels]
    waited = [0.0] * len(ranks)
    for name in set.intersection(*(set(c) for c in collectives)):
        for durs in zip(*(c[name] for c in collectives)):
            for rank, d in enumerate(durs):
                waited[rank] += d - min(durs)
    lags = []
    for rank, ks in enumerate(kernels):
        gaps = _device_gaps(ks)
        lags.append(RankLag(rank=rank, waited_us=waited[rank], gaps=len(gaps), gap_us=sum(gaps),
                            host_busy_us=_busiest_thread_us(ranks[rank])))
    return lags


def _collectives_by_name(kernels: list[dict]) -> dict[str, list[float]]:
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        if classify(e["name"]) == "communication":
            by_name.setdefault(e["name"], []).append(e["dur"])
    return by_name


def _device_gaps(kernels: list[dict]) -> list[float]:
    busy = merged_intervals([(e["ts"], e["ts"] + e["dur"]) for e in kernels])
    return [gap for (_, end), (start, _) in zip(busy, busy[1:]) if (gap := start - end) >= GAP_US]


def _busiest_thread_us(events: list[dict]) -> float:
    by_thread: dict = {}
    for e in events:
        if e["cat"] in ("cpu_op", "user_annotation", "python_function"):
            by_thread.setdefault(e["tid"], []).append((e["ts"], e["ts"] + e["dur"]))
    return max(map(union_us, by_thread.values()), default=0.0)


def format_rank_lags(lags: list[RankLag], *, num_steps: int = 1) -> str:
    """A line per rank (ms per step) and the verdict: which rank the others wait for, and whether its device idled."""
    n = num_steps * 1e3
    lines = [f"ranks compared (ms per step, over {num_steps} step{'s' if num_steps > 1 else ''}):"]
    for lag in lags:
        lines.append(f"  rank {lag.rank}: waited for other ranks in collectives {lag.waited_us / n:.1f}; device gaps "
                     f"over {GAP_US / 1e3:.1f} ms: {lag.gaps / num_steps:.0f}, {lag.gap_us / n:.1f}; busiest host "
                     f"thread {lag.host_busy_us / n:.1f}")
    late = min(lags, key=lambda lag: lag.waited_us)
    others = max(lag.waited_us for lag in lags if lag is not late)
    if others < GAP_US * num_steps:
        lines.append("  no rank waits for another for long: the ranks keep in step")
    else:
        idle_elsewhere = max(lag.gap_us for lag in lags if lag is not late)
        why = (f"its device idles {late.gap_us / n:.1f} ms a step in gaps (its host launches late)"
               if late.gap_us > idle_elsewhere + GAP_US * num_steps
               else "its device has no more idle time than the others' (more device work)")
        lines.append(f"  the others wait for rank {late.rank} (up to {others / n:.1f} ms a step): {why}")
    return "\n".join(lines)
