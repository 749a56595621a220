"""scripts/benchmark.py run as a command (1 process and torchrun): consistent numbers and one-line errors.
Its functions, loaded in-process: tests/unit/test_benchmark.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import DEBUG_CONFIG, REPO, dense_param_counts, env, fp8_linear_counts, new_tag, reap
from trainer.metrics.trace_summary import load_trace_events, trace_steps
from trainer.models import FLAVORS, flops_per_token, model_args_for


def test_benchmark_reports_throughput_flops_and_ratio(tmp_path: Path) -> None:
    out = tmp_path / "bench.jsonl"
    # A training run of the same config in the same directory (its job.dump_folder, relative to the cwd).
    training = tmp_path / "outputs" / "debug"
    (training / "tb").mkdir(parents=True)
    (training / "metrics.jsonl").write_text('{"step": 1}\n')
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "benchmark.py"), "--config", DEBUG_CONFIG, "--precisions", "bf16,fp8",
         "--warmup", "1", "--steps", "2", "--json", str(out), "--profile-dir", str(tmp_path / "prof"), "--",
         "--data.source=synthetic", "--train.seq_len=64", "--train.batch_size=2"],
        capture_output=True, text=True, env=env(), cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # The benchmark ran in a folder of its own and left the training run's metrics where they were.
    assert (tmp_path / "outputs" / "benchmark" / "debug_model").is_dir()
    assert sorted(p.name for p in training.iterdir()) == ["metrics.jsonl", "tb"]
    assert (training / "metrics.jsonl").read_text() == '{"step": 1}\n'
    bf16, fp8 = [json.loads(line) for line in out.read_text().splitlines()]
    assert (bf16["precision"], fp8["precision"]) == ("bf16", "fp8")
    assert bf16["float8_converted"] == 0 and fp8["float8_converted"] == fp8_linear_counts(FLAVORS["debug"])[0]
    for r in (bf16, fp8):
        assert r["tokens_per_s_per_gpu"] * r["step_s"] == pytest.approx(2 * 64)
        per_token = flops_per_token(model_args_for("debug", max_seq_len=64), 64)
        assert r["model_tflops_per_gpu"] == pytest.approx(r["tokens_per_s_per_gpu"] * per_token / 1e12)
        assert r["mfu_pct"] is None  # a CPU has no entry in the peak table: no made-up MFU
    assert fp8["speedup"] == pytest.approx(fp8["tokens_per_s_per_gpu"] / bf16["tokens_per_s_per_gpu"])
    assert "vs bf16" in proc.stdout
    table = [line for line in proc.stdout.splitlines() if line.split()[:1] in (["bf16"], ["fp8"])]
    assert [line.split()[4] for line in table if "optimizer step" not in line] == ["n/a", "n/a"]
    # The optimizer step, timed alone, next to torch's fused AdamW on plain tensors of the same shapes: bf16
    # and fp8 runs keep bf16 master weights by default ("auto"), so both move 2 bytes per value.
    numel = dense_param_counts(FLAVORS["debug"])[1]
    for r in (bf16, fp8):
        assert r["master_dtype"] == "bfloat16" and r["optimizer_ms"] > 0 and r["reference_optimizer_ms"] > 0
        for key in ("optimizer", "reference_optimizer"):
            assert r[f"{key}_gbps"] == pytest.approx(numel * 2 * 8 / (r[f"{key}_ms"] / 1e3) / 1e9)
    assert sum("optimizer step (bfloat16 master weights)" in line for line in table) == 2
    # --profile-dir: 2 more steps traced per precision, each marked, so a later summary counts them as 2 steps.
    for precision in ("bf16", "fp8"):
        trace = str(tmp_path / "prof" / precision / "trace.json.gz")
        assert trace_steps(trace, load_trace_events(trace)) == (1, 2), precision


def test_a_recipe_with_a_bad_override_is_a_config_error_before_any_run() -> None:
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "benchmark.py"), "--config", DEBUG_CONFIG,
                           "--precisions", "bf16,fp8:blockwise", "--", "--float8.enable_fsdp_float8_all_gather=true"],
                          capture_output=True, text=True, env=env(), cwd=REPO)
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("config error: float8.enable_fsdp_float8_all_gather=true only works with "
                                          "float8.recipe='tensorwise' (got recipe='blockwise')")


def test_benchmark_refuses_a_dump_folder_override() -> None:
    # --job.dump_folder could name a training run's folder, whose metrics a fresh Trainer would move aside.
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "benchmark.py"), "--config", DEBUG_CONFIG, "--",
                           "--job.dump_folder=outputs/debug"], capture_output=True, text=True, env=env(), cwd=REPO)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].endswith(
        "error: the benchmark's folder is --dump-folder DIR, not the override --job.dump_folder")


def test_a_bad_inductor_option_is_refused_before_any_run() -> None:
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "benchmark.py"), "--config", DEBUG_CONFIG,
                           "--inductor", "triton.prefer_nd_tilling=true"], capture_output=True, text=True, env=env(),
                          cwd=REPO)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].endswith(
        "error: --inductor triton.prefer_nd_tilling=true: inductor has no option 'triton.prefer_nd_tilling' (did you "
        "mean triton.prefer_nd_tiling?)")


def test_benchmark_config_error_is_one_line() -> None:
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "benchmark.py"), "--config", DEBUG_CONFIG, "--",
                           "--train.bach_size=2"], capture_output=True, text=True, env=env(), cwd=REPO)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "config error: unknown key [train].bach_size (did you mean batch_size?)"


@pytest.mark.slow
def test_benchmark_under_torchrun_keeps_one_process_group_for_every_precision(tmp_path: Path) -> None:
    out = tmp_path / "bench.jsonl"
    tag = new_tag()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
             str(REPO / "scripts" / "benchmark.py"), "--config", DEBUG_CONFIG, "--precisions", "bf16,fp8,bf16",
             "--warmup", "1", "--steps", "2", "--json", str(out), "--dump-folder", str(tmp_path / "bench"), "--",
             "--data.source=synthetic", "--train.seq_len=64", "--train.batch_size=2"],
            capture_output=True, text=True, env=env(tag), cwd=REPO, timeout=600)
    finally:
        reap(tag)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in out.read_text().splitlines()]
    # Rank 0 writes one line per precision; each precision ran over both ranks (2 x 2 x 64 tokens per step).
    assert [r["precision"] for r in records] == ["bf16", "fp8", "bf16"]
    for r in records:
        assert r["tokens_per_s_per_gpu"] * r["step_s"] == pytest.approx(2 * 64)
        # every rank's own peak (NaN on a CPU), and one plan without a pipeline: the job's
        assert len(r["peak_memory_gib_ranks"]) == 2
        assert r["plan_memory_gib_pp_ranks"] == [pytest.approx(r["plan_memory_gib"])]
    assert records[1]["float8_converted"] == fp8_linear_counts(FLAVORS["debug"])[0]


def test_emulating_gpus_without_a_gpu_is_one_line() -> None:
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "benchmark.py"), "--config", DEBUG_CONFIG,
                           "--emulate-gpus", "16"], capture_output=True, text=True, env=env(), cwd=REPO)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].endswith(
        "error: --emulate-gpus caps CUDA memory: it needs a GPU")


FULL_8B = ["--config", str(REPO / "configs" / "train" / "llama3_8b.toml")]
FULL_8B_OVERRIDES = ["--train.batch_size=4", "--train.seq_len=4096", "--data.source=synthetic",
                     "--train.activation_checkpointing=none"]


def test_dry_run_plans_each_precision_as_train_py_does() -> None:
    """--dry-run runs nothing: each precision's job is validated for --world-size ranks and gets train.py --dry-run's
    plan (all but the last line, which names the benchmark's own folder); with --emulate-gpus, for the emulated job."""
    plan = ["--dry-run", "--world-size", "4", "--gpu-memory-gib", "139.8"]
    bench = subprocess.run([sys.executable, str(REPO / "scripts" / "benchmark.py"), *FULL_8B, "--precisions", "bf16,fp8",
                            "--label", "full 8B", "--", *FULL_8B_OVERRIDES, *plan],
                           capture_output=True, text=True, env=env(), cwd=REPO)
    assert bench.returncode == 0, bench.stderr[-2000:]
    sections = bench.stdout.split("== full 8B, ")
    assert [s.split(":")[0] for s in sections[1:]] == ["bf16", "fp8"]
    train = subprocess.run([sys.executable, str(REPO / "scripts" / "train.py"), *FULL_8B, *FULL_8B_OVERRIDES,
                            "--train.mixed_precision=fp8", *plan], capture_output=True, text=True, env=env(), cwd=REPO)
    assert train.returncode == 0, train.stderr[-2000:]
    expected = train.stdout.strip().splitlines()
    assert expected[0] == "dry run for 4 ranks: nothing was started"
    assert sections[2].strip().splitlines()[1:-1] == expected[:-1]
    assert sections[2].strip().splitlines()[-1].startswith("OK: outputs/benchmark/llama3_8b would train")
    emulated = subprocess.run([sys.executable, str(REPO / "scripts" / "benchmark.py"), "--emulate-gpus", "16",
                               "--config", str(REPO / "configs" / "train" / "7b_16gpu_fp8.toml"), "--precisions", "fp8",
                               "--", "--data.source=synthetic", "--dry-run", "--world-size", "2"],
                              capture_output=True, text=True, env=env(), cwd=REPO)
    assert emulated.returncode == 0, emulated.stderr[-2000:]
    assert "dry run for 16 ranks" in emulated.stdout and "fits a 79.6 GiB GPU" in emulated.stdout
