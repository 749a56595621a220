"""Did FP8 hurt the model? Train the same job in bf16 (two seeds) and in fp8, compare the losses.

    python scripts/fp8_parity.py --config configs/train/debug_model.toml [--section.key=value ...]
    python scripts/fp8_parity.py --config configs/train/llama3_1b.toml --out parity/1b --tolerance 0.005 \
        --train.steps=1000 --data.source=shards --data.path=... --validation.path=... \
        --variant tensorwise= --variant rowwise=--float8.recipe=rowwise

Legs (each a normal `scripts/train.py` run with validation on, checkpointing off):
  bf16          train.seed = S       the reference
  bf16-seed2    train.seed = S + 1   same data order, another init: the noise floor
  fp8           train.seed = S       same init and data order as the reference

`--variant NAME=OVERRIDES` (repeatable) replaces the one `fp8` leg by one leg per variant: each
runs with train.mixed_precision = "fp8" and then its own space-separated overrides (which may
set bf16 again, e.g. to compare an optimizer setting instead of a precision).

The verdict compares the final validation losses, paired by seed: `--seeds N` runs bf16 and every variant at
N seeds (S .. S+N-1: legs bf16, bf16-seed2 .. bf16-seedN, fp8, fp8-seed2 .. fp8-seedN; a leg and its bf16 twin
share the init and the data order), and each pair gives one relative gap (x - bf16) / bf16. Their mean, with a
95% interval (t distribution, N - 1 degrees of freedom), is held against a margin: max(--tolerance, sqrt(2) x
the seeds' spread), where the spread is the sample sd of the final losses over seeds (bf16's and the variant's,
pooled), so sqrt(2) x spread is the root-mean-square gap between two bf16 seeds: FP8 passes when it moves the
loss less than changing the seed does.
  PASS          the whole interval lies inside +-margin
  FAIL          the whole interval lies outside it: a difference beyond the margin, measured, not a draw
  INCONCLUSIVE  the interval reaches across the margin; the line says about how many seeds would decide it
The default `--seeds auto` is 8 seeds for a model under 100M parameters (the CPU debug model: its seeds' final
losses differ by ~1.2%, its paired gaps by ~0.7%; 8 seeds gave PASS in 9 of 9 seed offsets on 16 measured seeds,
docs/fp8.md) and 4 from there on (legs that take GPU hours; INCONCLUSIVE then names how many more would decide).
Fewer seeds widen the interval: the verdict leans to INCONCLUSIVE, never to FAIL. `--seeds 1` (one bf16 pair and
one leg per variant) is a single draw of the noise: PASS when the gap is at most max(|bf16-seed2 - bf16| / bf16,
--tolerance), else INCONCLUSIVE. Exit code 0 = every variant PASS, 1 = a variant FAIL (or a leg failed),
2 = bad arguments/config, 3 = INCONCLUSIVE (and no FAIL).

Writes to --out: each leg's dump folder and log (--out/LEG.log; a line says when each leg starts,
with its log's path, and when it ends, with its exit code and seconds), parity.json (per-window
losses, the verdicts) and parity.png (train loss as lines, validation loss as dots: bf16 blue,
bf16-seed2 grey, variants red, orange, green, purple, ...). The plot needs matplotlib
(pip install -e '.[plot]'); without it one line says the plot was skipped, and the rest is the same.
A leg that already finished in --out with the same command is reused, not rerun, so `--legs a,b`
can spread the legs over several machines or sittings; the verdict comes once every leg has
finished. With enough GPUs for --nproc-per-leg, legs run side by side (CUDA_VISIBLE_DEVICES
split); on a machine without a GPU, one leg per core at a time (a CPU leg trains on one thread);
otherwise one after another.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

# The checkout this script is in comes first, even when another copy of trainer is installed.
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from trainer.config import ConfigError, load_job_config  # noqa: E402
from trainer.models.counts import param_count  # noqa: E402

REFERENCE, NOISE = "bf16", "bf16-seed2"
PALETTE = [(214, 39, 40), (255, 127, 14), (44, 160, 44), (148, 103, 189), (140, 86, 75), (227, 119, 194),
           (188, 189, 34), (23, 190, 207), (0, 0, 0), (255, 215, 0)]
COLOR_NAMES = {(31, 119, 180): "blue", (150, 150, 150): "grey", (214, 39, 40): "red", (255, 127, 14): "orange",
               (44, 160, 44): "green", (148, 103, 189): "purple", (140, 86, 75): "brown", (227, 119, 194): "pink",
               (188, 189, 34): "olive", (23, 190, 207): "cyan", (0, 0, 0): "black", (255, 215, 0): "gold"}
MARKER = "parity_leg.json"  # in each leg's folder: the leg's command and whether it finished


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str], dict[str, list[str]]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--config", required=True, help="the job's TOML config")
    parser.add_argument("--out", default="outputs/fp8_parity", help="folder for the legs, parity.json, parity.png")
    parser.add_argument("--tolerance", type=float, default=0.005,
                        help="relative gap of the final validation loss always accepted (default 0.005 = 0.5%%)")
    parser.add_argument("--windows", type=int, default=10, help="rows of the training-loss table")
    parser.add_argument("--nproc-per-leg", type=int, default=1, help="processes (GPUs) per leg, torchrun when > 1")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=OVERRIDES",
                        help="an fp8 leg with its own overrides (repeatable); default: one leg 'fp8'")
    parser.add_argument("--legs", help="comma-separated legs to run now (default: all); finished legs are reused")
    parser.add_argument("--seeds", type=_seeds, default="auto",
                        help="seeds per leg (default auto: 8 for a model under 100M parameters, else 4); the verdict "
                             "pairs each variant's seeds with bf16's (module docstring); 1 = one draw")
    args, overrides = parser.parse_known_args(argv)
    bad = [o for o in overrides if not o.startswith("--") or "=" not in o]
    if bad:
        parser.error(f"unrecognised arguments {bad}: config overrides are --section.key=value")
    if args.tolerance < 0 or args.windows < 1 or args.nproc_per_leg < 1:
        parser.error("--tolerance must be >= 0, --windows and --nproc-per-leg >= 1")
    variants: dict[str, list[str]] = {}
    for spec in args.variant or ["fp8="]:
        name, sep, rest = spec.partition("=")
        extra = shlex.split(rest)
        if (not sep or not re.fullmatch(r"[a-z0-9][a-z0-9_.-]*", name) or name in (REFERENCE, NOISE, *variants)
                or SEED_SUFFIX.search(name)):
            parser.error(f"--variant {spec!r}: expected NAME=OVERRIDES with a new lowercase NAME "
                         f"(letters, digits, _ . -; not {REFERENCE} or {NOISE}, not ending in -seedN for N >= 2)")
        if any(not o.startswith("--") or "=" not in o for o in extra):
            parser.error(f"--variant {spec!r}: overrides are space-separated --section.key=value")
        variants[name] = extra
    args.legs = args.legs.split(",") if args.legs else None
    if args.seeds != "auto":  # with auto, main checks --legs once the config says how many seeds
        try:
            args.legs = chosen_legs(args.legs, variants, args.seeds)
        except ValueError as e:
            parser.error(str(e))
    return args, overrides, variants


def _seeds(text: str) -> int | str:
    if text == "auto":
        return text
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not 'auto' or a whole number >= 1")
    return int(text)


def chosen_legs(chosen: list[str] | None, variants: dict[str, list[str]], seeds: int) -> list[str]:
    """The legs --legs picks (all of them without it); ValueError naming a leg this run does not have."""
    legs = [leg for group in (REFERENCE, *variants) for leg in group_legs(group, seeds)]
    unknown = [leg for leg in chosen or [] if leg not in legs]
    if unknown:
        raise ValueError(f"--legs: unknown leg(s) {', '.join(unknown)}; the legs are {', '.join(legs)}")
    return chosen or legs


# --seeds auto: a model this small trains on a CPU in seconds, so 8 seeds (a verdict that does not flip between
# machines and seed offsets on the debug model, docs/fp8.md); larger ones take GPU hours a leg: 4.
AUTO_SEEDS_SMALL, AUTO_SEEDS, SMALL_MODEL_PARAMS = 8, 4, 100_000_000


def resolve_seeds(seeds: int | str, cfg) -> int:
    """--seeds: a number stays; auto by the model's size (its parameters, from the validated config)."""
    if seeds != "auto":
        return seeds
    from trainer.validate.resolve import resolve_model_args

    return AUTO_SEEDS_SMALL if param_count(resolve_model_args(cfg)) < SMALL_MODEL_PARAMS else AUTO_SEEDS


# The 97.5% quantile of Student's t by degrees of freedom (a 95% two-sided interval of the mean paired gap); past
# the table, the largest entry below (a slightly wider interval: never a verdict the data do not support).
T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
         12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042, 60: 2.000, 120: 1.980}


def t_975(df: int) -> float:
    return T_975[max(k for k in T_975 if k <= df)]
# The legs --seeds adds: NAME-seed2, NAME-seed3, ... (never -seed1, which a variant may be named: the recorded
# 1B legs fp8-bf16-master-seed1 and bf16-master-seed1 set train.seed=1 themselves).
SEED_SUFFIX = re.compile(r"-seed([2-9]|[1-9][0-9]+)$")


def group_legs(group: str, seeds: int) -> list[str]:
    """The legs of bf16 or of one variant: NAME (seed S) and NAME-seedK (seed S + K - 1). With one seed, bf16
    still runs twice (bf16, bf16-seed2: the noise floor) and a variant once."""
    count = max(seeds, 2) if group == REFERENCE else seeds
    return [group] + [f"{group}-seed{k}" for k in range(2, count + 1)]


def leg_group(leg: str) -> tuple[str, int]:
    """(bf16 or the variant's name, the leg's seed offset)."""
    m = SEED_SUFFIX.search(leg)
    return (leg[:m.start()], int(m.group(1)) - 1) if m else (leg, 0)


def leg_overrides(leg: str, seed: int, out: Path, variants: dict[str, list[str]]) -> list[str]:
    group, offset = leg_group(leg)
    precision = "bf16" if group == REFERENCE else "fp8"
    # An empty precision_schedule: a schedule in the config would override the leg's precision.
    return [f"--train.mixed_precision={precision}", "--train.precision_schedule=",
            f"--train.seed={seed + offset}", "--checkpoint.enable=false",
            "--validation.enable=true", f"--job.dump_folder={out / leg}", *variants.get(group, [])]


def check_legs(args: argparse.Namespace, overrides: list[str], variants: dict[str, list[str]], out: Path):
    """The reference leg's JobConfig, after loading every leg's config as it will run (its precision, seed and
    overrides): a bad leg stops the check before any leg starts."""
    cfg = load_job_config(["--config", args.config, *overrides, "--validation.enable=true"])
    for leg in (REFERENCE, NOISE, *variants):  # each group's seeds differ only in train.seed
        load_job_config(["--config", args.config, *overrides, *leg_overrides(leg, cfg.train.seed, out, variants)])
    return cfg


def leg_commands(args: argparse.Namespace, overrides: list[str], variants: dict[str, list[str]], seed: int,
                 out: Path) -> dict[str, list[str]]:
    train = str(REPO / "scripts" / "train.py")
    launcher = [sys.executable, train] if args.nproc_per_leg == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc_per_leg}", train]
    legs = [leg for group in (REFERENCE, *variants) for leg in group_legs(group, args.seeds)]
    return {leg: [*launcher, "--config", args.config, *overrides, *leg_overrides(leg, seed, out, variants)]
            for leg in legs}


def _portable(cmd: list[str], out: Path) -> list[str]:
    """The command without interpreter, launcher and --out paths, to compare runs across machines."""
    return [a.replace(str(out), "{out}") for a in cmd[cmd.index("--config"):]]


def finished(out: Path, leg: str, cmd: list[str]) -> bool:
    try:
        marker = json.loads((out / leg / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("command") == _portable(cmd, out) and marker.get("finished") is True


def leg_slots(nproc: int) -> list[dict[str, str]]:
    """The environment of each leg that may run at the same time: CUDA_VISIBLE_DEVICES of each group of nproc
    GPUs; on a machine without a GPU one slot per nproc cores (a CPU rank trains on one thread)."""
    try:
        import torch

        count = torch.cuda.device_count()
    except ImportError:
        count = 0
    if count == 0:
        return [{}] * max(1, (os.cpu_count() or 1) // nproc)
    # the GPUs this process may use, by the names the caller gave (CUDA_VISIBLE_DEVICES=1: the leg runs on GPU 1)
    visible = [g for g in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g] or [str(i) for i in range(count)]
    return [{"CUDA_VISIBLE_DEVICES": ",".join(visible[i * nproc + j] for j in range(nproc))}
            for i in range(max(1, count // nproc))]


def run_legs(commands: dict[str, list[str]], out: Path, nproc: int) -> dict[str, int]:
    """Run the given legs, side by side in waves when GPUs allow, and mark each finished one."""
    slots = leg_slots(nproc)
    names = list(commands)
    waves = [names[i:i + len(slots)] for i in range(0, len(names), len(slots))]
    codes = {}
    for wave in waves:
        running = {leg: start_leg(leg, commands[leg], out, slots[slot]) for slot, leg in enumerate(wave)}
        while running:  # report each leg when it ends, not in start order
            for leg, (proc, log, started) in list(running.items()):
                if proc.poll() is None:
                    continue
                log.close()
                del running[leg]
                codes[leg] = proc.returncode
                if codes[leg] == 0:
                    (out / leg / MARKER).write_text(json.dumps({"command": _portable(commands[leg], out),
                                                                "finished": True}))
                print(f"[{leg}] {'done' if codes[leg] == 0 else 'FAILED'}: exit code {codes[leg]} after "
                      f"{time.monotonic() - started:.1f} s; log {out / (leg + '.log')}", flush=True)
            time.sleep(0.2)
    return codes


def start_leg(leg: str, cmd: list[str], out: Path, slot: dict[str, str]) -> tuple[subprocess.Popen, object, float]:
    """Start one leg in a fresh folder, its output to --out/LEG.log; say so (the log is where to watch it)."""
    folder = out / leg
    if folder.exists():  # an unfinished or different earlier run of this leg (main checked the marker)
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    (folder / MARKER).write_text(json.dumps({"command": _portable(cmd, out), "finished": False}))
    env = {**os.environ, **slot}
    log = open(out / f"{leg}.log", "w")
    gpus = slot.get("CUDA_VISIBLE_DEVICES")
    print(f"[{leg}] started: log {out / (leg + '.log')}" + (f" (CUDA_VISIBLE_DEVICES={gpus})" if gpus else ""),
          flush=True)
    print(f"[{leg}] {shlex.join(cmd)}", flush=True)
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO), log, time.monotonic()


def read_curves(folder: Path) -> tuple[dict[int, float], dict[int, float]]:
    train, val = {}, {}
    for line in (folder / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        train[r["step"]] = r["loss"]
        if "val_loss" in r:
            val[r["step"]] = r["val_loss"]
    return train, val


def window_means(curve: dict[int, float], steps: int, windows: int) -> list[tuple[int, int, float]]:
    """(first step, last step, mean logged training loss) per window of the run."""
    size = max(1, math.ceil(steps / windows))
    rows = []
    for start in range(1, steps + 1, size):
        values = [v for s, v in curve.items() if start <= s < start + size]
        if values:
            rows.append((start, min(start + size - 1, steps), sum(values) / len(values)))
    return rows


PASS, FAIL, INCONCLUSIVE = "PASS", "FAIL", "INCONCLUSIVE"
EXIT_CODES = {PASS: 0, FAIL: 1, INCONCLUSIVE: 3}


def verdict(final: dict[str, float], tolerance: float, leg: str = "fp8", seeds: int = 1) -> dict:
    """Does `leg` (a variant's group) track bf16? PASS, FAIL or INCONCLUSIVE by the module docstring's rule."""
    if seeds == 1:  # one draw: no estimate of the noise, so never FAIL
        ref = final[REFERENCE]
        gap, noise = abs(final[leg] - ref) / ref, abs(final[NOISE] - ref) / ref
        allowed = max(noise, tolerance)
        return {"verdict": PASS if gap <= allowed else INCONCLUSIVE, "passed": gap <= allowed, "fp8_gap": gap,
                "noise_floor": noise, "tolerance": tolerance, "allowed": allowed}
    refs = [final[x] for x in group_legs(REFERENCE, seeds)]
    values = [final[x] for x in group_legs(leg, seeds)]
    gaps = [(x - r) / r for r, x in zip(refs, values)]
    ref = statistics.fmean(refs)
    mean_gap, sd_gap = statistics.fmean(gaps), statistics.stdev(gaps)
    half = t_975(seeds - 1) * sd_gap / math.sqrt(seeds)
    # The seeds' spread, bf16's and the variant's pooled (each about its own mean), relative to bf16's mean.
    spread = math.sqrt((statistics.variance(refs) + statistics.variance(values)) / 2) / ref
    margin = max(tolerance, math.sqrt(2) * spread)
    low, high = mean_gap - half, mean_gap + half
    outcome = PASS if max(-low, high) <= margin else FAIL if low > margin or high < -margin else INCONCLUSIVE
    return {"verdict": outcome, "passed": outcome == PASS, "seeds": seeds, "mean": statistics.fmean(values),
            "reference_mean": ref, "gaps": gaps, "fp8_gap": mean_gap, "interval": [low, high], "spread": spread,
            "noise_floor": math.sqrt(2) * spread, "tolerance": tolerance, "allowed": margin,
            "seeds_to_decide": None if outcome != INCONCLUSIVE else seeds_to_decide(mean_gap, sd_gap, margin, seeds)}


def seeds_to_decide(mean_gap: float, sd_gap: float, margin: float, seeds: int) -> int | None:
    """About how many seeds would shrink the interval enough for a PASS or FAIL, if the paired gaps keep their mean
    and spread; None past 1,000 (a gap at the margin itself: no number of seeds decides it)."""
    room = abs(margin - abs(mean_gap))
    for n in range(seeds + 1, 1001):
        if t_975(n - 1) * sd_gap / math.sqrt(n) < room:
            return n
    return None


def main(argv: list[str]) -> int:
    args, overrides, variants = parse_args(argv)
    out = Path(args.out)
    try:
        cfg = check_legs(args, overrides, variants, out)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    args.seeds = resolve_seeds(args.seeds, cfg)
    try:
        args.legs = chosen_legs(args.legs, variants, args.seeds)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    commands = leg_commands(args, overrides, variants, cfg.train.seed, out)
    todo = {leg: commands[leg] for leg in args.legs if not finished(out, leg, commands[leg])}
    foreign = [str(out / leg) for leg in todo if (out / leg).exists() and not (out / leg / MARKER).exists()]
    if foreign:
        print(f"error: {', '.join(foreign)} exist(s) but are not parity legs; choose another --out", file=sys.stderr)
        return 2
    for leg in args.legs:
        if leg not in todo:
            print(f"[{leg}] reused: {out / leg} finished with the same command", flush=True)
    codes = run_legs(todo, out, args.nproc_per_leg)
    failed = {leg: code for leg, code in codes.items() if code != 0}
    if failed:
        for leg, code in failed.items():
            tail = (out / f"{leg}.log").read_text().splitlines()[-5:]
            print(f"leg {leg} failed with exit code {code}; {out / (leg + '.log')} ends:\n  " + "\n  ".join(tail),
                  file=sys.stderr)
        return 1
    missing = [leg for leg in commands if not finished(out, leg, commands[leg])]
    if missing:
        print(f"\nlegs not run yet: {', '.join(missing)}; run again with them (finished legs are reused) "
              "for the verdict")
        return 0
    return compare(args, overrides, list(commands), cfg.train.steps, out)


def compare(args: argparse.Namespace, overrides: list[str], legs: list[str], steps: int, out: Path) -> int:
    seeds = getattr(args, "seeds", 1)
    curves = {leg: read_curves(out / leg) for leg in legs}
    final = {leg: curves[leg][1][max(curves[leg][1])] for leg in legs}
    groups = list(dict.fromkeys(leg_group(leg)[0] for leg in legs))
    variants = groups[1:]
    results = {group: verdict(final, args.tolerance, group, seeds) for group in variants}
    if seeds > 1:  # the tables and the plot show each group's mean over its seeds
        curves = {g: mean_curves([curves[x] for x in group_legs(g, seeds)]) for g in groups}
    columns = list(curves)
    table = {col: window_means(curves[col][0], steps, args.windows) for col in columns}
    shown = columns[len(columns) - len(variants):]  # the columns compared with bf16

    width = max(10, *map(len, columns))
    head = f"{'steps':>11} | " + " | ".join(f"{c:>{width}}" for c in columns) + " | " + " | ".join(
        f"{'d ' + c:>{width + 2}}" for c in shown)
    means = f", each column the mean of {seeds} seeds" if seeds > 1 else ""
    print(f"\ntraining loss (mean of logged steps per window), {steps} steps{means}; d X = (X - bf16) / bf16\n{head}")
    for rows in zip(*(table[c] for c in columns)):
        values = [r[2] for r in rows]
        print(f"{f'{rows[0][0]}-{rows[0][1]}':>11} | " + " | ".join(f"{v:>{width}.4f}" for v in values) + " | "
              + " | ".join(f"{100 * (v - values[0]) / values[0]:>+{width + 1}.2f}%" for v in values[-len(shown):]))
    print(f"\nvalidation loss{means}\n{head.replace('steps', ' step', 1)}")
    for step in sorted(curves[REFERENCE][1]):
        values = [curves[c][1].get(step, math.nan) for c in columns]
        print(f"{step:>11} | " + " | ".join(f"{v:>{width}.4f}" for v in values) + " | "
              + " | ".join(f"{100 * (v - values[0]) / values[0]:>+{width + 1}.2f}%" for v in values[-len(shown):]))
    print()
    if seeds > 1:
        print(paired_table(final, variants, seeds, results))
    for group, r in results.items():
        print(verdict_line(group, r, final, args.tolerance))
    outcomes = {r["verdict"] for r in results.values()}
    overall = FAIL if FAIL in outcomes else INCONCLUSIVE if INCONCLUSIVE in outcomes else PASS
    summary = {"config": args.config, "overrides": overrides, "steps": steps, "seeds": seeds,
               "final_val_loss": final, "variants": results, "verdict": overall, "passed": overall == PASS,
               "windows": table, "validation": {c: curves[c][1] for c in columns}}
    if len(variants) == 1:  # the one-variant summary keeps its flat keys
        summary.update({k: v for k, v in results[variants[0]].items() if k not in ("passed", "verdict")})
    (out / "parity.json").write_text(json.dumps(summary, indent=2) + "\n")
    colors = legend(columns, variants)
    key = ", ".join(f"{c} {COLOR_NAMES[rgb]}" for c, rgb in colors.items())
    if write_plot(out / "parity.png", curves, colors, title=f"FP8 parity: {Path(args.config).name}, {steps} steps"
                  + (f", means of {seeds} seeds" if seeds > 1 else "")):
        print(f"wrote {out / 'parity.json'} and {out / 'parity.png'} (train lines, validation dots; {key})")
    else:
        print(f"wrote {out / 'parity.json'}")
        # An older plot beside a new parity.json would show curves the verdict no longer describes.
        stale = (out / "parity.png").exists()
        (out / "parity.png").unlink(missing_ok=True)
        print("plot skipped: matplotlib is not installed (pip install -e '.[plot]' to get parity.png)"
              + ("; removed the earlier run's parity.png" if stale else ""))
    return EXIT_CODES[overall]


def paired_table(final: dict[str, float], variants: list[str], seeds: int, results: dict[str, dict]) -> str:
    """Each seed's final validation losses and each variant's gap to its bf16 twin: what the verdict is made of."""
    ref_legs = group_legs(REFERENCE, seeds)
    lines = [f"final validation loss by seed (a leg and its bf16 twin share the init and the data order); "
             f"gap = (x - bf16) / bf16\n{'seed':>5} | {'bf16':>8} | "
             + " | ".join(f"{v:>10} {'gap':>7}" for v in variants)]
    for k in range(seeds):
        lines.append(f"{k + 1:>5} | {final[ref_legs[k]]:>8.4f} | " + " | ".join(
            f"{final[group_legs(v, seeds)[k]]:>10.4f} {100 * results[v]['gaps'][k]:>+6.2f}%" for v in variants))
    return "\n".join(lines) + "\n"


def _pct(x: float) -> str:
    return f"{100 * x:+.2f}%"


def verdict_line(group: str, r: dict, final: dict[str, float], tolerance: float) -> str:
    word = r["verdict"]
    if "seeds" not in r:
        line = (f"{word}: final validation loss {group} {final[group]:.4f} vs bf16 {final[REFERENCE]:.4f} "
                f"({100 * r['fp8_gap']:.2f}% apart); allowed {100 * r['allowed']:.2f}% = max(noise floor "
                f"{100 * r['noise_floor']:.2f}% between bf16 seeds, tolerance {100 * tolerance:.2f}%); one seed is a "
                "single draw of the noise")
        return line + ("" if r["passed"] else f": --seeds {AUTO_SEEDS} or more decides (finished legs are reused)")
    n, (low, high), margin = r["seeds"], r["interval"], r["allowed"]
    where = {PASS: "inside", FAIL: "wholly outside", INCONCLUSIVE: "reaches past"}[word]
    line = (f"{word}: final validation loss {group} {r['mean']:.4f} vs bf16 {r['reference_mean']:.4f}, means of {n} "
            f"seeds; paired by seed, the gap is {_pct(r['fp8_gap'])}, 95% interval [{_pct(low)}, {_pct(high)}] "
            f"{where} the margin +-{100 * margin:.2f}% = max(tolerance {100 * tolerance:.2f}%, sqrt(2) x the seeds' "
            f"spread {100 * r['spread']:.2f}%: the typical gap between two bf16 seeds)")
    if word == INCONCLUSIVE:
        more = r["seeds_to_decide"]
        line += (f"; about {more} seeds would decide it (--seeds {more}; finished legs are reused)" if more else
                 "; the gap sits at the margin, so no number of seeds decides it: a --tolerance sets the margin")
    return line


def mean_curves(runs: list[tuple[dict[int, float], dict[int, float]]]) -> tuple[dict[int, float], dict[int, float]]:
    """The step-wise mean of several runs' (train, validation) curves, over the steps all of them logged."""
    return tuple({s: statistics.fmean(run[i][s] for run in runs) for s in sorted(set.intersection(
        *(set(run[i]) for run in runs)))} for i in (0, 1))


def legend(columns: list[str], variants: list[str]) -> dict[str, tuple[int, int, int]]:
    colors = {REFERENCE: (31, 119, 180)}
    if NOISE in columns:
        colors[NOISE] = (150, 150, 150)
    colors.update({v: PALETTE[i % len(PALETTE)] for i, v in enumerate(variants)})
    return colors


def write_plot(path: Path, curves: dict[str, tuple[dict[int, float], dict[int, float]]],
               colors: dict[str, tuple[int, int, int]], *, title: str) -> bool:
    """Draw the legs' losses to `path` (PNG); False, writing nothing, when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")  # a file, no display (a GPU machine has none)
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 6), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    for leg, (train, val) in curves.items():
        color = tuple(c / 255 for c in colors[leg])
        ax.plot(sorted(train), [train[s] for s in sorted(train)], color=color, linewidth=1.2, label=leg)
        ax.plot(sorted(val), [val[s] for s in sorted(val)], "o", color=color, markersize=5)
    # Clip the first steps' high loss so the region where the curves differ is readable.
    values = sorted(v for train, val in curves.values() for c in (train, val) for v in c.values() if math.isfinite(v))
    low, high = values[0], values[min(len(values) - 1, int(0.95 * len(values)))]
    pad = 0.05 * (high - low) or 0.5
    ax.set_ylim(low - pad, high + pad)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.legend(loc="outside right upper", title="train: lines\nvalidation: dots", fontsize="small")
    fig.savefig(path)
    return True


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
