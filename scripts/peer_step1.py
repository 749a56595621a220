"""The peer's cold start from its log: seconds from torchtitan's first "Training starts at step 1" line to its first
"step:  1" line, as our train.py's `step 1 done N s after training started` counts ours (scripts/gpu_checks.sh's
peer8b prints it beside coldstart's lines). With --launched EPOCH, also the seconds from the launch to the first
step-1 line of either trainer (ours or torchtitan), read from the "@EPOCH " stamp that gpu_checks.sh's `stamped` puts
on each line as it arrives: the whole cold start, imports and startup included, which each trainer's own clock leaves
out in part.

    python scripts/peer_step1.py LOG [--launched EPOCH]
"""

from __future__ import annotations

import re
import sys
from datetime import datetime

_STAMP = re.compile(r"\[titan\] (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})")
_STEP1 = re.compile(r"step:\s+1\s")
_COLOUR = re.compile(r"\x1b\[[0-9;]*m")  # torchtitan's log colours its step lines
_ARRIVED = re.compile(r"^@(\d+(?:\.\d+)?) ")
_OURS_STEP1 = re.compile(r"\] step 1 done ")


def step1_seconds(lines: list[str]) -> float | None:
    """Seconds between the first "Training starts at step 1" and the first step-1 line; None without both."""
    start = None
    for line in lines:
        stamp = _STAMP.search(line)
        if stamp is None:
            continue
        when = datetime.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S,%f")
        if start is None and "Training starts at step 1" in line:
            start = when
        elif start is not None and _STEP1.search(_COLOUR.sub("", line)):
            return (when - start).total_seconds()
    return None


def launch_to_step1(lines: list[str], launched: float) -> float | None:
    """Seconds from `launched` (epoch) to the arrival of the first step-1 line, ours or torchtitan's; None without one."""
    for line in lines:
        arrived = _ARRIVED.match(line)
        if arrived is None:
            continue
        plain = _COLOUR.sub("", line)
        if _OURS_STEP1.search(plain) or (_STAMP.search(plain) and _STEP1.search(plain)):
            return float(arrived.group(1)) - launched
    return None


def report(lines: list[str], launched: float | None) -> list[str]:
    """What main prints: the launch-to-step-1 line (with `launched`), the peer's step-1 line (a log with torchtitan's
    stamps), or one line saying the log has neither."""
    out = []
    if launched is not None:
        seconds = launch_to_step1(lines, launched)
        out.append(f"launch to step 1: {seconds:.1f} s" if seconds is not None else "launch to step 1: not reached")
    if any(_STAMP.search(line) for line in lines):
        seconds = step1_seconds(lines)
        out.append(f"step 1 after {seconds:.1f} s" if seconds is not None else "step 1 not reached")
    return out or ["no torchtitan line ('[titan] <date> <time>') in this log: for our trainer's log read its "
                   "'step 1 done' line, or pass --launched EPOCH with a log that gpu_checks.sh stamped"]


def main() -> int:
    args = sys.argv[1:]
    launched = None
    if "--launched" in args:
        i = args.index("--launched")
        launched, args = float(args[i + 1]), args[:i] + args[i + 2:]
    if len(args) != 1:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    with open(args[0], errors="replace") as f:
        print("\n".join(report(f.readlines(), launched)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
