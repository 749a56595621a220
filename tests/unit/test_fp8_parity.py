"""scripts/fp8_parity.py's functions, loaded in-process: the verdict, the legs and their commands, reuse of a
finished leg, the table and the plot. The script as a command (real FP8 passes, FP8 made wrong on purpose fails):
tests/cli/test_fp8_parity.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.helpers import DEBUG_CONFIG, REPO

sys.path.insert(0, str(REPO / "scripts"))
import fp8_parity  # noqa: E402


def test_one_seed_is_a_draw_that_passes_or_is_inconclusive_never_fails():
    loose = fp8_parity.verdict({"bf16": 2.0, "bf16-seed2": 2.06, "fp8": 2.05}, tolerance=0.01)
    assert loose["noise_floor"] == pytest.approx(0.03) and loose["allowed"] == pytest.approx(0.03)
    assert loose["verdict"] == "PASS" and loose["passed"]
    tight = fp8_parity.verdict({"bf16": 2.0, "bf16-seed2": 2.001, "fp8": 2.5}, tolerance=0.01)
    assert tight["allowed"] == 0.01 and tight["fp8_gap"] == pytest.approx(0.25)
    assert tight["verdict"] == "INCONCLUSIVE" and not tight["passed"]  # 25% off, but one draw measures no noise
    line = fp8_parity.verdict_line("fp8", tight, {"bf16": 2.0, "fp8": 2.5}, 0.01)
    assert line.startswith("INCONCLUSIVE: final validation loss fp8 2.5000 vs bf16 2.0000")
    assert "one seed is a single draw of the noise: --seeds 4 or more decides" in line


def _seeded(bf16: list[float], fp8: list[float]) -> dict[str, float]:
    return {leg: x for group, values in (("bf16", bf16), ("fp8", fp8))
            for leg, x in zip(fp8_parity.group_legs(group, len(values)), values)}


def test_paired_verdict_holds_the_interval_of_the_mean_gap_against_the_seed_spread():
    bf16 = [2.70, 2.80, 2.75, 2.65]
    gaps = [0.010, -0.004, 0.006, 0.000]  # fp8 of each seed against its bf16 twin
    r = fp8_parity.verdict(_seeded(bf16, [b * (1 + g) for b, g in zip(bf16, gaps)]), tolerance=0.005, seeds=4)
    # Written out: the mean paired gap and its 95% interval (t with 3 degrees of freedom: 3.182).
    mean = sum(gaps) / 4
    sd = (sum((g - mean) ** 2 for g in gaps) / 3) ** 0.5
    half = 3.182 * sd / 4 ** 0.5
    assert r["fp8_gap"] == pytest.approx(mean) and r["interval"] == pytest.approx([mean - half, mean + half])
    # The margin: sqrt(2) x the seeds' spread (bf16's and fp8's sample variances pooled, over bf16's mean).
    ref = sum(bf16) / 4
    var = lambda xs: sum((x - sum(xs) / len(xs)) ** 2 for x in xs) / (len(xs) - 1)  # noqa: E731
    spread = ((var(bf16) + var([b * (1 + g) for b, g in zip(bf16, gaps)])) / 2) ** 0.5 / ref
    assert r["spread"] == pytest.approx(spread) and r["allowed"] == pytest.approx(2 ** 0.5 * spread)
    assert r["verdict"] == "PASS" and r["seeds_to_decide"] is None  # [-0.9%, +1.5%] inside +-3.4%


@pytest.mark.parametrize("shift, outcome", [(0.0, "PASS"), (0.013, "INCONCLUSIVE"), (0.20, "FAIL")])
def test_paired_verdict_fails_only_a_gap_measured_beyond_the_margin(shift: float, outcome: str):
    bf16 = [2.70, 2.72, 2.74, 2.76, 2.71, 2.73, 2.75, 2.77]  # spread 0.9%: margin 1.3% (tolerance 0.5%)
    noise = [0.004, -0.003, 0.002, -0.005, 0.006, -0.002, 0.001, -0.004]
    r = fp8_parity.verdict(_seeded(bf16, [b * (1 + shift + e) for b, e in zip(bf16, noise)]), tolerance=0.005,
                           seeds=8)
    assert r["verdict"] == outcome and r["passed"] == (outcome == "PASS")
    low, high = r["interval"]
    assert {"PASS": high <= r["allowed"], "FAIL": low > r["allowed"],
            "INCONCLUSIVE": low <= r["allowed"] < high}[outcome]
    line = fp8_parity.verdict_line("fp8", r, {}, 0.005)
    assert line.startswith(f"{outcome}: final validation loss fp8")
    if outcome == "INCONCLUSIVE":  # and how many seeds would shrink the interval to either side of the margin
        more = r["seeds_to_decide"]
        assert more > 8 and fp8_parity.t_975(more - 1) * (high - low) / 2 / fp8_parity.t_975(7) * (8 / more) ** 0.5 \
            < abs(r["allowed"] - r["fp8_gap"])
        assert f"about {more} seeds would decide it (--seeds {more}; finished legs are reused)" in line


def test_auto_seeds_follow_the_models_size():
    debug, _, _ = fp8_parity.parse_args(["--config", DEBUG_CONFIG])
    assert debug.seeds == "auto" and debug.legs is None  # known once the config is loaded
    cfg = fp8_parity.load_job_config(["--config", DEBUG_CONFIG])
    assert fp8_parity.resolve_seeds("auto", cfg) == 8 and fp8_parity.resolve_seeds(3, cfg) == 3
    big = fp8_parity.load_job_config(["--config", str(REPO / "configs" / "train" / "llama3_1b.toml")])
    assert fp8_parity.resolve_seeds("auto", big) == 4


def test_seeds_run_bf16_and_every_variant_at_each_seed(tmp_path: Path):
    args, overrides, variants = fp8_parity.parse_args(["--config", DEBUG_CONFIG, "--seeds", "3", "--variant", "tw="])
    assert args.legs == ["bf16", "bf16-seed2", "bf16-seed3", "tw", "tw-seed2", "tw-seed3"]
    cmds = fp8_parity.leg_commands(args, overrides, variants, 7, tmp_path)
    for leg, seed, precision in (("bf16-seed3", 9, "bf16"), ("tw", 7, "fp8"), ("tw-seed3", 9, "fp8")):
        assert f"--train.seed={seed}" in cmds[leg] and f"--train.mixed_precision={precision}" in cmds[leg]
        assert f"--job.dump_folder={tmp_path / leg}" in cmds[leg]
    one, _, _ = fp8_parity.parse_args(["--config", DEBUG_CONFIG, "--seeds", "1"])  # one seed: one draw, three legs
    assert one.legs == ["bf16", "bf16-seed2", "fp8"]


def test_variant_names_cannot_look_like_a_seed_leg(capsys):
    with pytest.raises(SystemExit) as e:
        fp8_parity.parse_args(["--config", DEBUG_CONFIG, "--variant", "fp8-seed2="])
    assert e.value.code == 2 and "not ending in -seedN" in capsys.readouterr().err


def test_windows_average_the_logged_steps():
    curve = {1: 6.0, 5: 4.0, 10: 3.0, 15: 2.0, 20: 1.0}
    assert fp8_parity.window_means(curve, 20, 2) == [(1, 10, pytest.approx(13 / 3)), (11, 20, 1.5)]


def test_each_leg_is_checked_as_it_will_run(tmp_path: Path):
    """A variant is an fp8 leg: options valid only in fp8 runs pass, and a leg that would fail is refused."""
    from trainer.config import ConfigError

    moe_config = str(REPO / "configs" / "train" / "debug_moe.toml")
    fp8_experts = "experts=--float8.moe_experts=rowwise --float8.emulate=true"
    args, overrides, variants = fp8_parity.parse_args(["--config", moe_config, "--variant", fp8_experts])
    assert fp8_parity.check_legs(args, overrides, variants, tmp_path).train.seed == 0
    args, overrides, variants = fp8_parity.parse_args(
        ["--config", moe_config, "--variant", f"{fp8_experts} --train.mixed_precision=bf16"])
    with pytest.raises(ConfigError, match="float8.moe_experts='rowwise' applies to fp8 runs only"):
        fp8_parity.check_legs(args, overrides, variants, tmp_path)


@pytest.mark.parametrize("argv, message", [
    (["--variant", "fp8"], "expected NAME=OVERRIDES"),
    (["--variant", "bf16="], "not bf16 or bf16-seed2"),
    (["--variant", "a=", "--variant", "a=--train.seed=3"], "with a new lowercase NAME"),
    (["--variant", "a=train.seed=3"], "overrides are space-separated --section.key=value"),
    (["--seeds", "1", "--legs", "bf16,fp9"], "unknown leg(s) fp9; the legs are bf16, bf16-seed2, fp8"),
    (["--seeds", "0"], "'0' is not 'auto' or a whole number >= 1"),
])
def test_bad_variant_or_leg_is_one_line(argv: list[str], message: str, capsys):
    with pytest.raises(SystemExit) as e:
        fp8_parity.parse_args(["--config", DEBUG_CONFIG, *argv])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_variants_become_fp8_legs_with_their_overrides_last(tmp_path: Path):
    args, overrides, variants = fp8_parity.parse_args(
        ["--config", DEBUG_CONFIG, "--seeds", "1", "--train.steps=5", "--variant", "tw=", "--variant",
         "master=--train.mixed_precision=bf16 --distributed.master_dtype=bf16"])
    assert args.legs == ["bf16", "bf16-seed2", "tw", "master"] and overrides == ["--train.steps=5"]
    cmds = fp8_parity.leg_commands(args, overrides, variants, 7, tmp_path)
    master = cmds["master"][cmds["master"].index("--config"):]
    # The variant's own overrides come last, so its --train.mixed_precision=bf16 wins over the leg's fp8.
    assert master[-3:] == ["--job.dump_folder=" + str(tmp_path / "master"), "--train.mixed_precision=bf16",
                           "--distributed.master_dtype=bf16"]
    assert "--train.mixed_precision=fp8" in master and "--train.seed=7" in master
    assert "--train.seed=8" in cmds["bf16-seed2"] and "--train.mixed_precision=bf16" in cmds["bf16"]


def test_a_finished_leg_is_reused_only_with_the_same_command(tmp_path: Path):
    cmd = [sys.executable, "train.py", "--config", "c.toml", "--train.seed=0", f"--job.dump_folder={tmp_path / 'a'}"]
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / fp8_parity.MARKER).write_text(json.dumps(
        {"command": ["--config", "c.toml", "--train.seed=0", "--job.dump_folder={out}/a"], "finished": True}))
    assert fp8_parity.finished(tmp_path, "a", cmd)
    # Another --out folder (legs run on another machine and copied here) is the same command.
    moved = tmp_path / "moved"
    (moved / "a").mkdir(parents=True)
    (moved / "a" / fp8_parity.MARKER).write_text((tmp_path / "a" / fp8_parity.MARKER).read_text())
    assert fp8_parity.finished(moved, "a", [*cmd[:-1], f"--job.dump_folder={moved / 'a'}"])
    assert not fp8_parity.finished(tmp_path, "a", [*cmd[:4], "--train.seed=1", cmd[-1]])
    marker = json.loads((tmp_path / "a" / fp8_parity.MARKER).read_text())
    (tmp_path / "a" / fp8_parity.MARKER).write_text(json.dumps({**marker, "finished": False}))
    assert not fp8_parity.finished(tmp_path, "a", cmd)


def _fake_legs(out: Path) -> None:
    for leg, shift in (("bf16", 0.0), ("bf16-seed2", 0.01), ("fp8", 0.02)):
        (out / leg).mkdir(parents=True)
        rows = [{"step": s, "loss": 5 - s / 10 + shift, **({"val_loss": 5 - s / 10 + shift} if s % 5 == 0 else {})}
                for s in range(1, 11)]
        (out / leg / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.mark.parametrize("matplotlib_installed", [True, False])
def test_plot_is_matplotlib_and_without_it_one_line_says_so(tmp_path: Path, capsys, monkeypatch,
                                                           matplotlib_installed: bool):
    _fake_legs(tmp_path)
    (tmp_path / "parity.png").write_bytes(b"an earlier run's plot")
    if not matplotlib_installed:
        monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    args = fp8_parity.argparse.Namespace(config=DEBUG_CONFIG, windows=2, tolerance=0.05)
    assert fp8_parity.compare(args, [], ["bf16", "bf16-seed2", "fp8"], 10, tmp_path) == 0
    out = capsys.readouterr().out
    assert json.loads((tmp_path / "parity.json").read_text())["passed"]  # the verdict either way
    assert "PASS: final validation loss fp8" in out
    if matplotlib_installed:
        png = (tmp_path / "parity.png").read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and int.from_bytes(png[16:20], "big") == 1000
        assert "bf16 blue, bf16-seed2 grey, fp8 red" in out and "plot skipped" not in out
    else:
        skipped = [line for line in out.splitlines() if "plot skipped" in line]
        assert skipped == ["plot skipped: matplotlib is not installed (pip install -e '.[plot]' to get parity.png); "
                           "removed the earlier run's parity.png"]
        assert not (tmp_path / "parity.png").exists()


def test_compare_with_seeds_prints_and_plots_the_means(tmp_path: Path, capsys):
    for leg, shift in (("bf16", 0.0), ("bf16-seed2", 0.02), ("fp8", 0.01), ("fp8-seed2", 0.03)):
        (tmp_path / leg).mkdir(parents=True)
        rows = [{"step": s, "loss": 5 - s / 10 + shift, **({"val_loss": 4 + shift} if s % 5 == 0 else {})}
                for s in range(1, 11)]
        (tmp_path / leg / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = fp8_parity.argparse.Namespace(config=DEBUG_CONFIG, windows=2, tolerance=0.001, seeds=2)
    assert fp8_parity.compare(args, [], ["bf16", "bf16-seed2", "fp8", "fp8-seed2"], 10, tmp_path) == 0
    out = capsys.readouterr().out
    summary = json.loads((tmp_path / "parity.json").read_text())
    assert summary["seeds"] == 2 and summary["mean"] == pytest.approx(4.02) and summary["reference_mean"] == 4.01
    assert summary["verdict"] == "PASS" and summary["gaps"] == pytest.approx([0.0025, 0.0025 / 1.005], rel=1e-3)
    assert "PASS: final validation loss fp8 4.0200 vs bf16 4.0100, means of 2 seeds; paired by seed" in out
    assert "    1 |   4.0000 |     4.0100  +0.25%" in out  # the paired table: seed, bf16, fp8 and its gap
    assert "each column the mean of 2 seeds" in out and "bf16 blue, fp8 red" in out


def test_an_inconclusive_verdict_exits_3_and_a_failing_one_1(tmp_path: Path, capsys):
    for gaps, code in (([0.0, 0.03], 3), ([0.20, 0.21], 1)):
        for leg, value in (("bf16", 4.0), ("bf16-seed2", 4.02), ("fp8", 4.0 * (1 + gaps[0])),
                           ("fp8-seed2", 4.02 * (1 + gaps[1]))):
            (tmp_path / leg).mkdir(parents=True, exist_ok=True)
            (tmp_path / leg / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": value, "val_loss": value}))
        args = fp8_parity.argparse.Namespace(config=DEBUG_CONFIG, windows=1, tolerance=0.005, seeds=2)
        assert fp8_parity.compare(args, [], ["bf16", "bf16-seed2", "fp8", "fp8-seed2"], 1, tmp_path) == code
        assert json.loads((tmp_path / "parity.json").read_text())["verdict"] == {3: "INCONCLUSIVE", 1: "FAIL"}[code]


@pytest.mark.parametrize("gpus, cores, nproc, visible, slots", [
    (0, 2, 1, None, [{}, {}]),  # CPU: one single-thread leg per core
    (0, 1, 2, None, [{}]),
    (1, 16, 1, None, [{"CUDA_VISIBLE_DEVICES": "0"}]),  # one GPU: one leg at a time
    (4, 16, 2, None, [{"CUDA_VISIBLE_DEVICES": "0,1"}, {"CUDA_VISIBLE_DEVICES": "2,3"}]),
    (1, 16, 1, "1", [{"CUDA_VISIBLE_DEVICES": "1"}]),  # the caller's GPU 1 stays GPU 1, not the machine's GPU 0
    (2, 16, 1, "3,2", [{"CUDA_VISIBLE_DEVICES": "3"}, {"CUDA_VISIBLE_DEVICES": "2"}]),
])
def test_legs_run_side_by_side_per_gpu_group_or_per_core(monkeypatch, gpus, cores, nproc, visible, slots):
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(fp8_parity.os, "cpu_count", lambda: cores)
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert fp8_parity.leg_slots(nproc) == slots


def _gpu_checks_step(name: str) -> str:
    """scripts/gpu_checks.sh's step `name`: its case branch, up to its `;;`."""
    script = (REPO / "scripts" / "gpu_checks.sh").read_text()
    step = script[script.index(f"  {name})"):]
    return step[:step.index(";;")]


def test_the_gpu_checks_parity_step_parses(tmp_path: Path):
    """scripts/gpu_checks.sh's parity1b step: every --variant it passes is one fp8_parity accepts (a rule for names
    once refused the recorded -seed1 legs there, on the GPU, after the lease had started)."""
    import re

    step = _gpu_checks_step("parity1b")
    variants = [f"--variant={quoted or bare}" for quoted, bare in re.findall(r'--variant (?:"([^"]*)"|(\S+))', step)]
    assert len(variants) >= 10 and "--seeds 1 " in step  # the recorded legs: one seed each
    args, _, parsed = fp8_parity.parse_args(["--config", DEBUG_CONFIG, "--seeds", "1", *variants])
    assert {"fp8-bf16-master-seed1", "bf16-master-seed1", "tensorwise"} <= set(parsed)
    fp8_parity.check_legs(args, [], parsed, tmp_path)  # every leg's overrides load as a config
    seed1 = fp8_parity.leg_commands(args, [], parsed, 0, Path("/tmp/x"))["fp8-bf16-master-seed1"]
    assert seed1[-1] == "--train.seed=1" and "--train.seed=0" in seed1  # its own seed comes last and wins


def test_the_gpu_checks_dispatch_parity_step_loads_every_leg(tmp_path: Path):
    """scripts/gpu_checks.sh's parity_dispatch step, as the shell would pass it: two processes a leg at ep=2, the
    dispatch variants fp8 compute with moe.dispatch_dtype fp8 and bf16, every leg's config loads."""
    import re
    import shlex

    step = _gpu_checks_step("parity_dispatch")
    command = step[step.index("python3 scripts/fp8_parity.py"):step.index("2>&1")].replace("\\\n", " ")
    command = re.sub(r"\$\{PARITY_LEGS:\+[^}]*\}", "", command.replace("${PARITY_MOE_STEPS:-500}", "500"))
    argv = shlex.split(command.replace('"$OUT/parity_dispatch"', str(tmp_path)))[2:]
    args, overrides, variants = fp8_parity.parse_args(argv)
    assert args.nproc_per_leg == 2 and args.seeds == 1 and "--distributed.ep=2" in overrides
    assert variants == {"dispatch-fp8": ["--moe.dispatch_dtype=fp8"], "dispatch-bf16": ["--moe.dispatch_dtype=bf16"]}
    cfg = fp8_parity.check_legs(args, overrides, variants, tmp_path)
    assert cfg.model.flavor == "moe_small" and cfg.train.steps == 500
