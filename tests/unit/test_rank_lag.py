"""trainer/metrics/rank_lag.py and summarize_trace.py --ranks: which rank the others wait for, from GPU traces of two
ranks built here (Chrome-trace events as the profiler writes them: times in microseconds)."""

import gzip
import json

import pytest

from tests.helpers import load_script
from trainer.metrics.rank_lag import GAP_US, format_rank_lags, rank_lags
from trainer.metrics.trace_summary import load_trace_events

A2A, GATHER = "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", "ncclDevKernel_AllGather_RING_LL(x)"


def _kernel(name, ts, dur, stream=7):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": stream}


def _op(name, ts, dur, tid=1):
    return {"ph": "X", "cat": "cpu_op", "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid}


def _ranks(late_gap_us: float) -> list[list[dict]]:
    """Two ranks run 3 layers of [GEMM 1000 us, all-to-all], and an all-gather on another stream beside the first
    GEMM. Rank 1's host launches each layer's GEMM late_gap_us after the last kernel ended (its device idles), rank
    0's back to back; so rank 0's collectives run until rank 1 launches its own: late_gap_us longer."""
    traces = []
    for rank in (0, 1):
        t, events = 0.0, []
        for layer in range(3):
            if rank == 1:
                t += late_gap_us
            events.append(_kernel("nvjet_sm90_tst_gemm", t, 1000.0))
            if layer == 0:
                events.append(_kernel(GATHER, t + 100.0, 100.0 + (late_gap_us if rank == 0 else 0.0), stream=9))
            t += 1000.0
            wait = late_gap_us if rank == 0 else 0.0
            events.append(_kernel(A2A, t, 50.0 + wait))
            t += 50.0 + wait
        events += [_op("aten::mm", 0.0, 900.0), _op("aten::mm", 100.0, 50.0), _op("aten::cat", 2000.0, 300.0 * rank)]
        traces.append(events)
    return traces


def test_the_rank_whose_device_idles_is_the_one_the_other_waits_for() -> None:
    lags = rank_lags(_ranks(late_gap_us=2000.0))
    # Rank 0 waited 2000 us at each of the 3 all-to-alls and at the all-gather (matched by name, not by start time:
    # the all-gather starts before the first all-to-all, on another stream); rank 1 was the shortest every time.
    assert [lag.waited_us for lag in lags] == [4 * 2000.0, 0.0]
    assert [(lag.gaps, lag.gap_us) for lag in lags] == [(0, 0.0), (2, 4000.0)]  # the first lag is before the trace
    assert [lag.host_busy_us for lag in lags] == [900.0, 1200.0]  # outermost ops only: the nested mm is inside
    text = format_rank_lags(lags)
    assert text.splitlines()[1] == ("  rank 0: waited for other ranks in collectives 8.0; device gaps over 0.3 ms: "
                                    "0, 0.0; busiest host thread 0.9")
    assert text.splitlines()[-1] == ("  the others wait for rank 1 (up to 8.0 ms a step): its device idles 4.0 ms "
                                     "a step in gaps (its host launches late)")
    assert format_rank_lags(lags, num_steps=2).splitlines()[-1].startswith("  the others wait for rank 1 (up to 4.0")


def test_ranks_in_step_and_a_rank_with_more_device_work() -> None:
    in_step = rank_lags(_ranks(late_gap_us=GAP_US / 8))  # below the gap threshold: launch latency, not lag
    assert in_step[1].gaps == 0
    assert format_rank_lags(in_step).splitlines()[-1] == "  no rank waits for another for long: the ranks keep in step"
    busy = _ranks(late_gap_us=0.0)
    busy[1] = [dict(e, dur=e["dur"] + 3000.0) if e["name"] == "nvjet_sm90_tst_gemm" else e for e in busy[1]]
    for e in busy[0]:  # rank 0 launches its all-to-all on time and waits for rank 1's longer GEMM
        if e["name"] == A2A:
            e["dur"] += 3000.0
    assert format_rank_lags(rank_lags(busy)).splitlines()[-1].endswith(
        "its device has no more idle time than the others' (more device work)")


def test_one_trace_or_a_cpu_trace_is_refused() -> None:
    with pytest.raises(ValueError, match="two or more traces, got 1"):
        rank_lags(_ranks(1000.0)[:1])
    with pytest.raises(ValueError, match="holds no GPU kernels"):
        rank_lags([[_op("aten::mm", 0.0, 5.0)], [_op("aten::mm", 0.0, 5.0)]])


def test_summarize_trace_ranks_orders_the_files_by_rank(tmp_path, capsys) -> None:
    traces = _ranks(late_gap_us=2000.0)
    for rank, number in ((1, 10), (0, 2)):  # by name trace_rank10 comes before trace_rank2, by number after it
        with gzip.open(tmp_path / f"trace_rank{number}.json.gz", "wt") as f:
            json.dump({"traceEvents": traces[rank]}, f)
    assert len(load_trace_events(str(tmp_path / "trace_rank10.json.gz"))) == len(traces[1])
    assert load_script("summarize_trace").main([str(tmp_path), "--ranks", "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert out.index("trace_rank2.json.gz") < out.index("trace_rank10.json.gz")
    assert out.splitlines()[-1].startswith("  the others wait for rank 1 (up to 8.0 ms a step)")
