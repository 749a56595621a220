"""The tables of scripts/gpu_checks.sh's multi-GPU steps, from what the runs wrote (docs/benchmarks.md "Multi-GPU").

    python3 scripts/multigpu_tables.py scaling OUT/scaling.jsonl   # tokens/s per GPU by GPU count, efficiency vs one
    python3 scripts/multigpu_tables.py stall OUT/ckpt_stall.log    # how long each checkpoint save blocked training
    python3 scripts/multigpu_tables.py speed OUT/ckpt_speed.log OUT/ckpt_speed_dd.log   # each save's GB/s per rank,
                                                                   # beside dd's; what it blocked; the buffers' cost
    python3 scripts/multigpu_tables.py rank_bytes OUT/ckpt_speed.log   # the bytes a rank wrote (for that dd)
    python3 scripts/multigpu_tables.py losses REF_DIR OTHER_DIR    # two runs' training losses step by step
    python3 scripts/multigpu_tables.py coldpeer OUT/coldpeer.log   # cold starts beside torchtitan: seconds to step 1

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
PREFIX = r"\[rank0\s+([\d.]+)s\] "  # the log prefix: rank and seconds since the start
# A checkout before trainer/checkpoint/writer.py logs neither the write's speed nor the allocation's parts (a baseline).
SAVED = re.compile(r"saved checkpoint \S+/step-(\d+) \(([\d.]+) MiB, ([\d.]+) s\)(?:; written at [\d.]+ GB/s per rank "
                   r"\(the slowest: ([\d.]+) GB in ([\d.]+) s, (\d+) threads?\))?")
ALLOCATED = re.compile(PREFIX + r"checkpoint: host buffers for ([\d.]+) GiB allocated in the background(?: after the "
                       r"first step)? in ([\d.]+) s(?: \(pages touched in ([\d.]+) s(?:, pinned in ([\d.]+) s)?)?")
STEP = re.compile(PREFIX + r"step +(\d+)/\d+ .*?\| tps ([\d,]+)")
PUBLISHED = re.compile(r"checkpoint step-(\d+): publishing blocked training ([\d.]+) s")
DD = re.compile(r"^(\d+) bytes .* copied, ([\d.]+) s", re.MULTILINE)
COLD_RUN = re.compile(r"^\[coldpeer (\S+) (\d+) (ours|peer)\] launch to step 1: (?:([\d.]+) s|.*?); own: "
                      r"(?:step 1 (?:done|after) ([\d.]+) s)?")
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


def blocked_saves(log: str) -> dict[int, tuple]:
    """{step: (step, blocked s, previous save s, preparing s, staging s)} of each save's slowest rank (the next
    collective waits for it); a synchronous save has no parts (None)."""
    slowest: dict[int, tuple] = {}
    for m in BLOCKED.finditer(log):
        save = (int(m[1]), float(m[2]), *(None if v is None else float(v) for v in m.groups()[2:]))
        if save[0] not in slowest or save[1] > slowest[save[0]][1]:
            slowest[save[0]] = save
    return slowest


def stall_table(log: str) -> str:
    """How long each save blocked training (the slowest rank's: the next collective waits for it), every save, then
    the first and the rest."""
    slowest = blocked_saves(log)
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


def speed_table(log: str, dd: str) -> str:
    """Each save's write speed per rank (its slowest rank's, from the line rank 0 logs when it publishes) and how long
    it blocked training (the save itself: staging; rank 0 publishing it, the next collective waiting), the dd of the
    same bytes per rank into the same folder (one per rank at once), and what the background allocation of the host
    buffers cost the steps it ran beside."""
    saves = written(log)
    if not saves:
        return "no 'saved checkpoint' line in the log"
    blocked = blocked_saves(log)
    published = {int(step): float(seconds) for step, seconds in PUBLISHED.findall(log)}
    lines = ["| save | GB per rank | write s (slowest rank) | GB/s per rank | threads | blocked training s | staging s | "
             "publishing s |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for step, (gb, seconds, threads) in sorted(saves.items()):
        _, stalled, _, _, staging = blocked.get(step, (step, None, None, None, None))
        lines.append(f"| step-{step} | {gb:.2f} | {seconds:.2f}{'' if threads else '*'} | {gb / seconds:.2f} | "
                     f"{threads or ''} | " + " | ".join("" if v is None else f"{v:.2f}"
                                                      for v in (stalled, staging, published.get(step))) + " |")
    if not all(threads for _, _, threads in saves.values()):
        lines.append("\n\\* the whole save, from its start to its publishing (this checkout logs no write time)")
    runs = [(int(n), float(sec)) for n, sec in DD.findall(dd) if int(n) and float(sec)]
    if runs:
        slowest = max(runs, key=lambda r: r[1])
        lines.append(f"\ndd of {slowest[0] / 1e9:.2f} GB per rank, {len(runs)} at once into the same folder "
                     f"(conv=fdatasync): {slowest[0] / slowest[1] / 1e9:.2f} GB/s each (the slowest)")
    return "\n".join(lines + [allocation_cost(log)])


def written(log: str) -> dict[int, tuple[float, float, int | None]]:
    """{step: (GB per rank, seconds, threads)} of each save: its slowest rank's write; where the line does not say (a
    checkout before writer.py), the checkpoint's bytes over the ranks that logged, in the whole save's seconds."""
    ranks = len(set(re.findall(r"^\[rank(\d+)", log, re.MULTILINE))) or 1
    saves = {}
    for m in SAVED.finditer(log):
        if m[4] is None:
            saves[int(m[1])] = (float(m[2]) * 2**20 / 1e9 / ranks, float(m[3]), None)
        else:
            saves[int(m[1])] = (float(m[4]), float(m[5]), int(m[6]))
    return saves


def allocation_cost(log: str) -> str:
    """The steps that ran while the host buffers were allocated in the background (from step 2 to the line saying it
    was done) against the others, saves and the steps after them left out: tokens/s, median."""
    done = ALLOCATED.search(log)
    if done is None:
        return "no background allocation of host buffers in the log (a synchronous save, or a save at step 1)"
    saved = set(blocked_saves(log))
    steps = [(float(t), int(n), float(tps.replace(",", ""))) for t, n, tps in STEP.findall(log)]
    plain = [(t, n, tps) for t, n, tps in steps if n > 1 and n not in saved and n - 1 not in saved]
    during = [tps for t, n, tps in plain if t <= float(done[1])]
    after = [tps for t, n, tps in plain if t > float(done[1])]
    parts = "" if done[4] is None else f" (pages touched in {done[4]} s" + (
        f", pinned in {done[5]} s)" if done[5] else ")")
    line = f"host buffers: {done[2]} GiB allocated in the background in {done[3]} s{parts}"
    if during and after:
        line += (f"; tokens/s of the steps beside it {statistics.median(during):,.0f} (median of {len(during)}), "
                 f"of the others {statistics.median(after):,.0f} (median of {len(after)})")
    return line


def rank_bytes(log: str) -> int:
    """The most bytes a rank wrote in one save (for the dd beside it)."""
    return int(max(gb for gb, _, _ in written(log).values()) * 1e9)


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


def cold_table(log: str) -> tuple[str, list[str]]:
    """gpu_checks.sh coldpeer's runs: per precision, each trainer's seconds to step 1 from the launch (run by run, in
    the order they ran) and from its own training start, and the means; with the runs that never reached step 1."""
    runs: dict[str, dict[str, list[tuple[int, float | None, float | None]]]] = {}
    for line in log.splitlines():
        m = COLD_RUN.match(line)
        if m:
            precision, i, who, launch, own = m.groups()
            runs.setdefault(precision, {}).setdefault(who, []).append(
                (int(i), float(launch) if launch else None, float(own) if own else None))
    lines = ["| precision | trainer | from the launch, s (run: seconds) | mean | from its training start, s | mean |",
             "|---|---|---|---|---|---|"]
    missing = []

    def cells(values: list[tuple[int, float | None]]) -> tuple[str, str]:
        shown = ", ".join(f"{i}: {v:.1f}" if v is not None else f"{i}: -" for i, v in values)
        got = [v for _, v in values if v is not None]
        return shown, f"{statistics.mean(got):.1f}" if got else "-"

    for precision, by_who in runs.items():
        for who in ("ours", "peer"):
            rows = by_who.get(who, [])
            missing += [f"{precision} run {i} ({who})" for i, launch, own in rows if launch is None or own is None]
            if rows:
                launch, launch_mean = cells([(i, launch) for i, launch, _ in rows])
                own, own_mean = cells([(i, own) for i, _, own in rows])
                name = "ours" if who == "ours" else "torchtitan 0.2.2"
                lines.append(f"| {precision} | {name} | {launch} | {launch_mean} | {own} | {own_mean} |")
    return "\n".join(lines), missing


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "scaling":
        runs = [json.loads(line) for line in Path(argv[1]).read_text().splitlines() if line.strip()]
        print(scaling_table(runs))
    elif len(argv) == 2 and argv[0] == "stall":
        print(stall_table(Path(argv[1]).read_text()))
    elif len(argv) == 3 and argv[0] == "speed":
        print(speed_table(Path(argv[1]).read_text(), Path(argv[2]).read_text()))
    elif len(argv) == 2 and argv[0] == "rank_bytes":
        print(rank_bytes(Path(argv[1]).read_text()))
    elif len(argv) == 3 and argv[0] == "losses":
        print(loss_comparison(Path(argv[1]), Path(argv[2])))
    elif len(argv) == 2 and argv[0] == "coldpeer":
        table, missing = cold_table(Path(argv[1]).read_text())
        print(table)
        if missing:
            print(f"not reaching step 1 (see their coldpeer_*.log): {', '.join(missing)}")
            return 1
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
