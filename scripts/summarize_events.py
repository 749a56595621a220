"""Print the straggler table of a run's event log (metrics.event_log=true): every rank's step times side by side.

    python scripts/summarize_events.py DUMP_FOLDER [--skip-first 1]

DUMP_FOLDER is the run's job.dump_folder (or its events/ folder). Per rank: the median, p90 and max step time, the
medians of data wait, forward/backward, optimizer and exposed communication (from the profiler window's trace where
the run had profiling.enable too: marked *, with the rank that has the most of it), and how far behind the fastest
rank it is; then the run's start facts, checkpoints, stops and errors (trainer/metrics/event_summary.py). A last
line that a crash cut short is skipped with a note. Exit status: 0, or 2 when the folder holds no event log.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# The checkout this script is in comes first, even when another copy of trainer is installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.metrics.event_summary import EventLogError, format_summary, read_run, summarize  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dump", type=Path, help="the run's job.dump_folder (or its events/ folder)")
    parser.add_argument("--skip-first", type=int, default=1,
                        help="leave out the first N steps of each launch (compilation and warm-up); default 1")
    args = parser.parse_args(argv)
    if args.skip_first < 0:
        parser.error(f"--skip-first={args.skip_first} must be >= 0")
    try:
        print(format_summary(summarize(read_run(args.dump), skip_first=args.skip_first)))
    except EventLogError as e:
        print(f"summarize_events.py: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
