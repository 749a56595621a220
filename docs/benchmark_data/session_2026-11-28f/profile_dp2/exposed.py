"""Each NCCL kernel of a trace: when it started (ms from the trace's first kernel), how long it ran and how much of
it no other kernel overlapped (exposed). python3 exposed.py trace_rank0.json.gz"""
import gzip
import json
import sys

events = json.load(gzip.open(sys.argv[1]))["traceEvents"]
kernels = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") == "kernel"), key=lambda e: e["ts"])
t0 = kernels[0]["ts"]
compute = [(e["ts"], e["ts"] + e["dur"]) for e in kernels if "nccl" not in e["name"]]
for c in (e for e in kernels if "nccl" in e["name"]):
    start, end = c["ts"], c["ts"] + c["dur"]
    covered = sum(max(0, min(b, end) - max(a, start)) for a, b in compute if b >= start and a <= end)
    print(f"{(start - t0) / 1000:8.1f} ms  ran {c['dur'] / 1000:6.2f}  exposed ~{max(0, c['dur'] - covered) / 1000:6.2f}  "
          f"{c['name'][:48]}")
