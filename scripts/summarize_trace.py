"""Print the kernel summary of profiler traces, ending with whether FP8 GEMMs ran.

    python scripts/summarize_trace.py TRACE_DIR_OR_FILE ... [--top 15] [--expect-fp8] [--ranks]

A folder is searched recursively for *.json and *.json.gz traces. --ranks: the traces are the ranks of one job
over the same steps (rank order from `rank<N>` in their names): after the summaries, which rank the others wait
for (trainer/metrics/rank_lag.py). Exit status: 0, 1 when --expect-fp8 and some trace ran no FP8 GEMM, 2 when a
path or a trace cannot be read.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

# The checkout this script is in comes first, even when another copy of trainer is installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.metrics.rank_lag import format_rank_lags, rank_lags  # noqa: E402
from trainer.metrics.trace_summary import (  # noqa: E402
    format_summary, fp8_warning, load_trace_events, summarize_events, trace_steps,
)


def find_traces(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise ValueError(f"no such file or folder: {path}")
    traces = sorted(p for p in path.rglob("*") if p.name.endswith((".json", ".json.gz")) and p.is_file())
    if not traces:
        raise ValueError(f"no trace files (*.json, *.json.gz) under {path}")
    return traces


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", type=Path, nargs="+", help="trace files, or folders of them")
    parser.add_argument("--top", type=int, default=15, help="how many kernels/ops to list")
    parser.add_argument("--expect-fp8", action="store_true",
                        help="warn and exit 1 when a trace ran no FP8 GEMM")
    parser.add_argument("--ranks", action="store_true",
                        help="the traces are one job's ranks over the same steps: say which rank the others wait for")
    args = parser.parse_args(argv)
    status, ranks, num_steps = 0, [], 1
    try:
        traces = [t for path in args.paths for t in find_traces(path)]
        if args.ranks:
            traces.sort(key=lambda t: int(m.group(1)) if (m := re.search(r"rank(\d+)", t.name)) else -1)
        for trace in traces:
            events = load_trace_events(str(trace))
            steps = trace_steps(str(trace), events)
            print(f"== {trace}")
            if steps is None:
                print("  (no step numbers in its name or ProfilerStep#N markers: "
                      "figures per step are for the whole trace)")
            num_steps = steps[1] - steps[0] + 1 if steps else 1
            summary = summarize_events(events, num_steps=num_steps, steps=steps)
            print(format_summary(summary, top=args.top))
            if args.expect_fp8 and (warning := fp8_warning(summary)):
                print(f"WARNING: {warning}")
                status = 1
            if args.ranks:  # only then are the traces kept (one can be hundreds of MB)
                ranks.append(events)
        if args.ranks:
            print(f"== {len(ranks)} ranks")
            print(format_rank_lags(rank_lags(ranks), num_steps=num_steps))
    except ValueError as e:
        print(f"summarize_trace.py: {e}", file=sys.stderr)
        return 2
    return status


if __name__ == "__main__":
    sys.exit(main())
