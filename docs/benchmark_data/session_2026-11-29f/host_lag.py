"""Where one rank of ep=2 waits for the other, from the two ranks' profiler traces of the same steps:
each rank's device gaps (no kernel running for over 0.3 ms), the all-to-all kernels (ncclDevKernel_SendRecv) side by
side in launch order (a long one on one rank and a short one on the other: the first waited for the second's launch),
the host threads' busy time, and the host cost of common ATen ops per call.

    python3 host_lag.py TRACE_RANK0.json.gz TRACE_RANK1.json.gz
"""
import collections
import gzip
import json
import sys

traces = [json.load(gzip.open(p))["traceEvents"] for p in sys.argv[1:3]]
t0 = min(min(e["ts"] for e in ev if e.get("cat") == "kernel") for ev in traces)
sendrecv = []
for rank, ev in enumerate(traces):
    kernels = sorted((e for e in ev if e.get("ph") == "X" and e.get("cat") == "kernel"), key=lambda e: e["ts"])
    gaps, end = [], kernels[0]["ts"] + kernels[0]["dur"]
    for k in kernels[1:]:
        if k["ts"] - end > 300:
            gaps.append((k["ts"] - end, k["name"]))
        end = max(end, k["ts"] + k["dur"])
    before = collections.Counter(name.split("(")[0][:40] for _, name in gaps)
    print(f"rank {rank}: {len(gaps)} device gaps over 0.3 ms, {sum(g for g, _ in gaps) / 1e3:.1f} ms in all; "
          f"the kernel after them: {dict(before.most_common(3))}")
    sendrecv.append([k for k in kernels if "SendRecv" in k["name"]])
    ops = [e for e in ev if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation", "python_function")]
    for tid in sorted({e["tid"] for e in ops}):
        mine = sorted((e for e in ops if e["tid"] == tid), key=lambda e: (e["ts"], -e["dur"]))
        busy, end = 0.0, -1.0
        for e in mine:  # top-level events only
            if e["ts"] >= end:
                busy += e["dur"]
                end = e["ts"] + e["dur"]
        print(f"  host thread {tid}: busy {busy / 1e3:.1f} ms")
    per_call = collections.defaultdict(list)
    for e in ops:
        if e["name"] in ("aten::empty", "aten::view", "aten::copy_", "aten::_to_copy", "aten::mul"):
            per_call[e["name"]].append(e["dur"])
    print("  host us per call: " + ", ".join(f"{n} {sum(d) / len(d):.1f}" for n, d in sorted(per_call.items())))
print("all-to-all kernels in launch order: start (ms from the first kernel) and length on each rank")
for i, (a, b) in enumerate(zip(*sendrecv)):
    print(f"{i:3d}  rank 0 {(a['ts'] - t0) / 1e3:8.2f} {a['dur'] / 1e3:6.2f}   rank 1 {(b['ts'] - t0) / 1e3:8.2f} "
          f"{b['dur'] / 1e3:6.2f}")
