"""The kernel summary's host waits (trainer/metrics/trace_summary.py): the host's blocking CUDA syncs, summed by the
ops they were called from, so that a profile says whether a step's idle device time comes from the host waiting
on `.item()` / `.tolist()` (MoE split sizes) or from a host too slow to keep the device fed."""

from __future__ import annotations

from trainer.metrics.trace_summary import format_summary, host_wait_site, summarize_events


def _event(name, cat, ts, dur, tid=1, pid=0):
    return {"name": name, "cat": cat, "ts": ts, "dur": dur, "pid": pid, "tid": tid, "external_id": None}


def _trace() -> list[dict]:
    """Two steps of 1,000 us: per step a kernel, a `.tolist()` that blocks 300 us, an `.item()` that blocks 50 us;
    the first step also ends in the script's own sync (100 us). Launches and another thread's ops are no waits."""
    events = []
    for step, t0 in ((1, 0), (2, 1000)):
        events += [
            _event(f"ProfilerStep#{step}", "user_annotation", t0, 1000),
            _event("nvjet_sm90_tst_128x64_64x8_1x2_h_bz_NNT", "kernel", t0 + 10, 400, tid=7),
            _event("aten::to", "cpu_op", t0 + 100, 320),
            _event("aten::_to_copy", "cpu_op", t0 + 105, 310),
            _event("aten::copy_", "cpu_op", t0 + 110, 305),
            _event("cudaMemcpyAsync", "cuda_runtime", t0 + 112, 3),
            _event("cudaStreamSynchronize", "cuda_runtime", t0 + 115, 300),
            _event("aten::item", "cpu_op", t0 + 500, 60),
            _event("aten::_local_scalar_dense", "cpu_op", t0 + 502, 56),
            _event("cudaStreamSynchronize", "cuda_runtime", t0 + 505, 50),
            _event("cudaLaunchKernel", "cuda_runtime", t0 + 600, 5),  # not a wait
            # another thread's op spans the same time: not where the wait was called from
            _event("aten::mul", "cpu_op", t0 + 0, 900, tid=2),
        ]
    events.append(_event("cudaDeviceSynchronize", "cuda_runtime", 900, 100))
    return events


def test_host_waits_are_summed_by_the_ops_that_called_them():
    summary = summarize_events(_trace(), num_steps=2)
    waits = {w.name: (w.calls, w.total_us) for w in summary.host_waits}
    assert waits == {"aten::to > aten::_to_copy > aten::copy_": (2, 600),
                     "aten::item > aten::_local_scalar_dense": (2, 100),
                     "(no op: the script's own sync)": (1, 100)}
    assert [w.name for w in summary.host_waits][0] == "aten::to > aten::_to_copy > aten::copy_"  # longest first
    assert summary.host_wait_us == 800
    line = next(x for x in format_summary(summary).splitlines() if x.startswith("  host blocked"))
    assert line == ("  host blocked on the device 0.40 ms/step in 2.5 syncs/step: 0.30 ms aten::to > aten::_to_copy >"
                    " aten::copy_ (1.0/step); 0.05 ms aten::item > aten::_local_scalar_dense (1.0/step); 0.05 ms"
                    " (no op: the script's own sync) (0.5/step)")


def test_the_site_is_the_innermost_ops_on_the_waits_own_thread():
    ops = [_event("outer", "cpu_op", 0, 100), _event("middle", "cpu_op", 10, 80), _event("inner", "cpu_op", 20, 10),
           _event("sibling", "cpu_op", 40, 10), _event("elsewhere", "cpu_op", 0, 100, tid=2),
           _event("other process", "cpu_op", 0, 100, pid=1)]
    wait = _event("cudaStreamSynchronize", "cuda_runtime", 22, 5)
    assert host_wait_site(wait, ops) == "outer > middle > inner"
    assert host_wait_site(wait, ops, depth=2) == "middle > inner"
    assert host_wait_site(_event("cudaStreamSynchronize", "cuda_runtime", 60, 5), ops) == "outer > middle"
    # a wait that outlasts the op it started in is not inside it
    assert host_wait_site(_event("cudaStreamSynchronize", "cuda_runtime", 25, 50), ops) == "outer > middle"


def test_a_trace_without_syncs_or_a_cpu_trace_prints_no_host_line():
    events = [e for e in _trace() if e["name"] not in ("cudaStreamSynchronize", "cudaDeviceSynchronize")]
    summary = summarize_events(events, num_steps=2)
    assert summary.host_waits == () and summary.host_wait_us == 0
    assert "host blocked" not in format_summary(summary)
    cpu = summarize_events([e for e in _trace() if e["cat"] != "kernel"], num_steps=2)
    assert cpu.device == "cpu" and cpu.host_waits == ()
