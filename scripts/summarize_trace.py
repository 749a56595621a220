"""Print the kernel summary of profiler traces, ending with whether FP8 GEMMs ran.

    python scripts/summarize_trace.py TRACE_DIR_OR_FILE [--top 15] [--expect-fp8]

A folder is searched recursively for *.json and *.json.gz traces. Exit status: 0, 1 when
--expect-fp8 and some trace ran no FP8 GEMM, 2 when the path or a trace cannot be read.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# The checkout this script is in comes first, even when another copy of trainer is installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

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
    parser.add_argument("path", type=Path, help="a trace file, or a folder of them")
    parser.add_argument("--top", type=int, default=15, help="how many kernels/ops to list")
    parser.add_argument("--expect-fp8", action="store_true",
                        help="warn and exit 1 when a trace ran no FP8 GEMM")
    args = parser.parse_args(argv)
    status = 0
    try:
        for trace in find_traces(args.path):
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
    except ValueError as e:
        print(f"summarize_trace.py: {e}", file=sys.stderr)
        return 2
    return status


if __name__ == "__main__":
    sys.exit(main())
