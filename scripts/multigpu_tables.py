"""The tables of scripts/gpu_checks.sh's multi-GPU steps, from what the runs wrote (docs/benchmarks.md "Multi-GPU").

    python3 scripts/multigpu_tables.py scaling OUT/scaling.jsonl   # tokens/s per GPU by GPU count, efficiency vs one
    python3 scripts/multigpu_tables.py stall OUT/ckpt_stall.log    # how long each checkpoint save blocked training
    python3 scripts/multigpu_tables.py losses REF_DIR OTHER_DIR    # two runs' training losses step by step

scaling reads benchmark.py's --json lines (one per run and precision, with its world_size and overrides); a run
with --float8.enable_fsdp_float8_all_gather=false is its own column. Efficiency: tokens/s per GPU at N GPUs over
the same column's at one GPU (fp8 at one GPU has no all-gather: both fp8 columns are held against it).
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path

from fp8_parity import read_curves

AG_OFF = "--float8.enable_fsdp_float8_all_gather=false"
BLOCKED = re.compile(r"checkpoint step-(\d+): blocked training ([\d.]+) s(?: \(previous save ([\d.]+) s, "
                     r"preparing ([\d.]+) s, staging ([\d.]+) s\))?")


def column(run: dict) -> str:
    if run["precision"] == "bf16" or run["world_size"] == 1:
        return run["precision"]
    return f"{run['precision']}, all-gather " + ("bf16" if AG_OFF in run.get("overrides", []) else "fp8")


def scaling_table(runs: list[dict]) -> str:
    """Markdown: a row per GPU count, tokens/s per GPU and efficiency against one GPU per column."""
    cells = {(r["world_size"], column(r)): r["tokens_per_s_per_gpu"] for r in runs}
    columns = list(dict.fromkeys(column(r) for r in sorted(runs, key=lambda r: r["world_size"])))
    if "fp8" in columns:  # one GPU's fp8 is the base of the all-gather columns: show it first of them
        columns.remove("fp8")
        columns.insert(1 if "bf16" in columns else 0, "fp8")
    base_of = {c: cells.get((1, c.split(",")[0])) for c in columns}
    lines = ["| GPUs | " + " | ".join(f"{c}: tokens/s per GPU (efficiency)" for c in columns) + " |",
             "| --- |" + " --- |" * len(columns)]
    for n in sorted({n for n, _ in cells}):
        row = []
        for c in columns:
            tps, base = cells.get((n, c)), base_of[c]
            row.append("" if tps is None else f"{tps:,.0f}" + (f" ({tps / base:.1%})" if base else ""))
        lines.append(f"| {n} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def stall_table(log: str) -> str:
    """How long each save blocked training (the slowest rank's: the next collective waits for it), every save, then
    the first and the rest."""
    slowest: dict[int, tuple] = {}
    for m in BLOCKED.finditer(log):
        save = (int(m[1]), float(m[2]), *(None if v is None else float(v) for v in m.groups()[2:]))
        if save[0] not in slowest or save[1] > slowest[save[0]][1]:
            slowest[save[0]] = save
    saves = [slowest[step] for step in sorted(slowest)]
    if not saves:
        return "no 'checkpoint step-N: blocked training' line in the log"
    lines = ["| save | blocked training s | waiting for the previous save s | preparing s | staging s (GPU idle) |",
             "| --- | --- | --- | --- | --- |"]
    lines += [f"| step-{step} | {blocked:.2f} | " + " | ".join("" if v is None else f"{v:.2f}" for v in parts) + " |"
              for step, blocked, *parts in saves]
    stalls = [staging if staging is not None else blocked for _, blocked, _, _, staging in saves]
    rest = stalls[1:]
    lines.append(f"\nGPU idle (staging; a synchronous save: all of it): first save {stalls[0]:.2f} s"
                 + (f"; the others median {statistics.median(rest):.2f} s, max {max(rest):.2f} s" if rest else ""))
    return "\n".join(lines)


def loss_comparison(ref: Path, other: Path) -> str:
    """The two runs' training losses at their common steps: the largest difference and the last step's."""
    a, b = read_curves(ref)[0], read_curves(other)[0]
    steps = sorted(set(a) & set(b))
    if not steps:
        return f"no common logged step in {ref}/metrics.jsonl and {other}/metrics.jsonl"
    worst = max(steps, key=lambda s: abs(a[s] - b[s]) / abs(a[s]))
    last = steps[-1]
    return (f"{len(steps)} common steps; largest difference at step {worst}: {a[worst]:.4f} vs {b[worst]:.4f} "
            f"({(b[worst] - a[worst]) / a[worst]:+.3%}); step {last}: {a[last]:.4f} vs {b[last]:.4f} "
            f"({(b[last] - a[last]) / a[last]:+.3%})")


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "scaling":
        runs = [json.loads(line) for line in Path(argv[1]).read_text().splitlines() if line.strip()]
        print(scaling_table(runs))
    elif len(argv) == 2 and argv[0] == "stall":
        print(stall_table(Path(argv[1]).read_text()))
    elif len(argv) == 3 and argv[0] == "losses":
        print(loss_comparison(Path(argv[1]), Path(argv[2])))
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
