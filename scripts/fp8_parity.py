"""Did FP8 hurt the model? Train the same job in bf16 (two seeds) and in fp8, compare the losses.

    python scripts/fp8_parity.py --config configs/train/debug_model.toml [--section.key=value ...]
    python scripts/fp8_parity.py --config configs/train/llama3_1b.toml --out parity/1b --tolerance 0.005 \
        --train.steps=1000 --data.source=shards --data.path=... --validation.path=...

Legs (each a normal `scripts/train.py` run with validation on):
  bf16          train.seed = S       the reference
  bf16-seed2    train.seed = S + 1   same data order, another init: the noise floor
  fp8           train.seed = S       same init and data order as the reference

The verdict compares the final validation losses: the fp8 gap |fp8 - bf16| / bf16 must be
at most max(noise floor |bf16-seed2 - bf16| / bf16, --tolerance). Exit code 0 = pass,
1 = fp8 further from bf16 than that (or a leg failed), 2 = bad arguments/config.

Writes to --out: each leg's dump folder, parity.json (per-window losses, the verdict) and
parity.png (train loss solid, validation loss as dots: bf16 blue, bf16-seed2 grey, fp8 red).
With several GPUs and --nproc-per-leg that leaves room for three legs, they run side by
side (CUDA_VISIBLE_DEVICES split); otherwise one after another.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import zlib
from pathlib import Path

# The checkout this script is in comes first, even when another copy of trainer is installed.
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from trainer.config import ConfigError, load_job_config  # noqa: E402

LEGS = ("bf16", "bf16-seed2", "fp8")
COLORS = {"bf16": (31, 119, 180), "bf16-seed2": (150, 150, 150), "fp8": (214, 39, 40)}


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--config", required=True, help="the job's TOML config")
    parser.add_argument("--out", default="outputs/fp8_parity", help="folder for the legs, parity.json, parity.png")
    parser.add_argument("--tolerance", type=float, default=0.005,
                        help="relative gap of the final validation loss always accepted (default 0.005 = 0.5%%)")
    parser.add_argument("--windows", type=int, default=10, help="rows of the training-loss table")
    parser.add_argument("--nproc-per-leg", type=int, default=1, help="processes (GPUs) per leg, torchrun when > 1")
    args, overrides = parser.parse_known_args(argv)
    bad = [o for o in overrides if not o.startswith("--") or "=" not in o]
    if bad:
        parser.error(f"unrecognised arguments {bad}: config overrides are --section.key=value")
    if args.tolerance < 0 or args.windows < 1 or args.nproc_per_leg < 1:
        parser.error("--tolerance must be >= 0, --windows and --nproc-per-leg >= 1")
    return args, overrides


def leg_overrides(leg: str, seed: int, out: Path) -> list[str]:
    precision = "fp8" if leg == "fp8" else "bf16"
    # An empty precision_schedule: a schedule in the config would override the leg's precision.
    return [f"--train.mixed_precision={precision}", "--train.precision_schedule=",
            f"--train.seed={seed + 1 if leg == 'bf16-seed2' else seed}",
            "--validation.enable=true", f"--job.dump_folder={out / leg}"]


def leg_commands(args: argparse.Namespace, overrides: list[str], seed: int, out: Path) -> dict[str, list[str]]:
    train = str(REPO / "scripts" / "train.py")
    launcher = [sys.executable, train] if args.nproc_per_leg == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc_per_leg}", train]
    return {leg: [*launcher, "--config", args.config, *overrides, *leg_overrides(leg, seed, out)] for leg in LEGS}


def gpu_groups(nproc: int) -> list[str] | None:
    """CUDA_VISIBLE_DEVICES for each leg when the GPUs fit all three side by side, else None."""
    try:
        import torch

        count = torch.cuda.device_count()
    except ImportError:
        count = 0
    if count < nproc * len(LEGS):
        return None
    return [",".join(str(i * nproc + j) for j in range(nproc)) for i in range(len(LEGS))]


def run_legs(commands: dict[str, list[str]], out: Path, nproc: int) -> dict[str, int]:
    groups = gpu_groups(nproc)
    procs, codes = {}, {}
    for i, (leg, cmd) in enumerate(commands.items()):
        env = dict(os.environ)
        if groups:
            env["CUDA_VISIBLE_DEVICES"] = groups[i]
        log = open(out / f"{leg}.log", "w")
        print(f"[{leg}] {' '.join(cmd)}" + (f"  (CUDA_VISIBLE_DEVICES={groups[i]})" if groups else ""), flush=True)
        procs[leg] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO), log)
        if not groups:  # one after another
            codes[leg] = procs[leg][0].wait()
            log.close()
    for leg, (proc, log) in procs.items():
        if leg not in codes:
            codes[leg] = proc.wait()
            log.close()
    return codes


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


def verdict(final: dict[str, float], tolerance: float) -> dict:
    ref = final["bf16"]
    gap, noise = abs(final["fp8"] - ref) / ref, abs(final["bf16-seed2"] - ref) / ref
    allowed = max(noise, tolerance)
    return {"fp8_gap": gap, "noise_floor": noise, "tolerance": tolerance, "allowed": allowed,
            "passed": gap <= allowed}


def main(argv: list[str]) -> int:
    args, overrides = parse_args(argv)
    try:
        cfg = load_job_config(["--config", args.config, *overrides, "--validation.enable=true"])
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    codes = run_legs(leg_commands(args, overrides, cfg.train.seed, out), out, args.nproc_per_leg)
    failed = {leg: code for leg, code in codes.items() if code != 0}
    if failed:
        for leg, code in failed.items():
            tail = (out / f"{leg}.log").read_text().splitlines()[-5:]
            print(f"leg {leg} failed with exit code {code}; {out / (leg + '.log')} ends:\n  " + "\n  ".join(tail),
                  file=sys.stderr)
        return 1
    curves = {leg: read_curves(out / leg) for leg in LEGS}
    steps = cfg.train.steps
    table = {leg: window_means(curves[leg][0], steps, args.windows) for leg in LEGS}
    final = {leg: curves[leg][1][max(curves[leg][1])] for leg in LEGS}
    result = verdict(final, args.tolerance)

    print(f"\ntraining loss (mean of logged steps per window), {steps} steps")
    print(f"{'steps':>13} | {'bf16':>8} | {'bf16-seed2':>10} | {'fp8':>8} | {'fp8 vs bf16':>11}")
    for (a, b, ref), (_, _, other), (_, _, fp8) in zip(*(table[leg] for leg in LEGS)):
        print(f"{f'{a}-{b}':>13} | {ref:8.4f} | {other:10.4f} | {fp8:8.4f} | {100 * (fp8 - ref) / ref:+10.2f}%")
    print("\nvalidation loss")
    print(f"{'step':>13} | {'bf16':>8} | {'bf16-seed2':>10} | {'fp8':>8} | {'fp8 vs bf16':>11}")
    for step in sorted(curves["bf16"][1]):
        ref, other, fp8 = (curves[leg][1].get(step, math.nan) for leg in LEGS)
        print(f"{step:>13} | {ref:8.4f} | {other:10.4f} | {fp8:8.4f} | {100 * (fp8 - ref) / ref:+10.2f}%")
    word = "PASS" if result["passed"] else "FAIL"
    print(f"\n{word}: final validation loss fp8 {final['fp8']:.4f} vs bf16 {final['bf16']:.4f} "
          f"({100 * result['fp8_gap']:.2f}% apart); allowed {100 * result['allowed']:.2f}% = max(noise floor "
          f"{100 * result['noise_floor']:.2f}% between bf16 seeds, tolerance {100 * args.tolerance:.2f}%)")
    summary = {"config": args.config, "overrides": overrides, "steps": steps, "final_val_loss": final,
               **result, "windows": {leg: table[leg] for leg in LEGS},
               "validation": {leg: curves[leg][1] for leg in LEGS}}
    (out / "parity.json").write_text(json.dumps(summary, indent=2) + "\n")
    write_plot(out / "parity.png", curves)
    print(f"wrote {out / 'parity.json'} and {out / 'parity.png'} (train solid, validation dots; "
          "bf16 blue, bf16-seed2 grey, fp8 red)")
    return 0 if result["passed"] else 1


# -- a dependency-free PNG line plot ---------------------------------------------


def write_plot(path: Path, curves: dict[str, tuple[dict[int, float], dict[int, float]]],
               size: tuple[int, int] = (800, 500)) -> None:
    import numpy as np

    width, height = size
    margin = 40
    img = np.full((height, width, 3), 255, dtype=np.uint8)
    points = [(s, v) for train, val in curves.values() for c in (train, val) for s, v in c.items() if math.isfinite(v)]
    steps = [s for s, _ in points]
    values = sorted(v for _, v in points)
    x0, x1 = min(steps), max(max(steps), min(steps) + 1)
    # Clip the first steps' high loss so the region where the curves differ is readable.
    y0, y1 = values[0], values[min(len(values) - 1, int(0.95 * len(values)))]
    y1 = y1 if y1 > y0 else y0 + 1

    def xy(step: float, value: float) -> tuple[int, int]:
        x = margin + (step - x0) / (x1 - x0) * (width - 2 * margin)
        y = height - margin - (min(value, y1) - y0) / (y1 - y0) * (height - 2 * margin)
        return int(round(x)), int(round(y))

    img[margin:height - margin + 1, margin] = img[height - margin, margin:width - margin + 1] = 0  # axes
    for k in range(1, 5):  # light grid
        img[margin + k * (height - 2 * margin) // 5, margin + 1:width - margin] = 225
    for leg, (train, val) in curves.items():
        color = COLORS[leg]
        line = [xy(s, v) for s, v in sorted(train.items()) if math.isfinite(v)]
        for (ax, ay), (bx, by) in zip(line, line[1:]):
            n = max(abs(bx - ax), abs(by - ay), 1)
            for t in np.linspace(0, 1, n + 1):
                img[int(round(ay + t * (by - ay))), int(round(ax + t * (bx - ax)))] = color
        for s, v in val.items():
            x, y = xy(s, v)
            img[max(0, y - 3):y + 4, max(0, x - 3):x + 4] = color
    _write_png(path, img)


def _write_png(path: Path, rgb) -> None:
    height, width, _ = rgb.shape
    raw = b"".join(b"\x00" + rgb[row].tobytes() for row in range(height))  # filter type 0 per row

    def chunk(kind: bytes, data: bytes) -> bytes:
        return len(data).to_bytes(4, "big") + kind + data + zlib.crc32(kind + data).to_bytes(4, "big")

    header = width.to_bytes(4, "big") + height.to_bytes(4, "big") + bytes([8, 2, 0, 0, 0])  # 8-bit RGB
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 9))
                     + chunk(b"IEND", b""))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
