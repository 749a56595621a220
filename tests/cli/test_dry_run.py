"""`scripts/train.py --config ... --dry-run [--world-size N] [--gpu-memory-gib G]`: the whole validation pass for N
ranks on this CPU machine, its plan printed, nothing started or written, and a verdict: `OK` and exit 0 only for a plan
that fits, `DOES NOT FIT` and exit 3 for one that does not; or the one-line error the real run would give (exit 2).
The plan's numbers: tests/unit/test_memory_plan.py."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from tests.helpers import REPO, launch, run_cli_cases
from trainer.config import load_job_config
from trainer.errors import ConfigError
from trainer.validate import validate_job

RECIPE = "configs/train/7b_16gpu_fp8.toml"


def test_the_16_gpu_recipe_plans_on_this_machine() -> None:
    dump = REPO / "outputs" / "7b_16gpu_fp8"
    existed = dump.exists()
    proc = launch(["--config", RECIPE, "--dry-run", "--world-size", "16"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert "dry run for 16 ranks: nothing was started" in out
    assert "layout: dp_replicate=1, dp_shard=16, tp=1 (world size 16)" in out
    assert "8,030,261,248 parameters" in out and "FP8 tensorwise matmuls in 225 Linear layers" in out
    assert "1,048,576 tokens per step" in out  # 8 x 4096 x 2 accumulation steps x 16 ranks
    assert "data.path='data/shards' not on this machine: not checked" in out  # the recipe's data is not here
    weights = next(line for line in out.splitlines() if line.strip().startswith("weights (sharded)"))
    assert f"{8_030_261_248 // 16 * 2 / 2**20:.1f} MiB" in weights  # bf16 master weights, 16 shards
    assert "fits a 79.2 GiB GPU" in out and "Traceback" not in proc.stderr
    assert dump.exists() == existed  # nothing written


def test_the_deepseek_v3_recipe_plans_16_gpus_with_expert_parallelism() -> None:
    """configs/train/deepseek_v3_16b_16gpu_fp8.toml: MLA + one MTP module, group-limited routing, FP8, ep=8 over 16
    ranks, planned for a 16x H100 job on this machine."""
    from trainer.models import FLAVORS
    from trainer.models.counts import num_params_for

    recipe = "configs/train/deepseek_v3_16b_16gpu_fp8.toml"
    proc = launch(["--config", recipe, "--dry-run", "--world-size", "16"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert "layout: dp_replicate=1, dp_shard=16, tp=1, ep=8 (world size 16)" in out
    total, _ = num_params_for(replace(FLAVORS["deepseek_v3_16b"], n_group=8, topk_group=4))
    assert f"{total:,} parameters" in out
    # 27 blocks' q_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj; the dense block's MLP; the MTP module's 4 and its
    # eh_proj; the head. The experts, shared experts and routers stay bf16.
    assert f"FP8 tensorwise matmuls in {27 * 4 + 3 + 5 + 1} Linear layers" in out
    assert "64 routed experts top-6 in 4 of 8 groups (sigmoid scores, renormalized, x2.5)" in out
    assert "1 MTP modules, loss weight 0.3" in out and "4,096-token chunks" in out
    assert "1,048,576 tokens per step" in out and "fits a 79.2 GiB GPU" in out and "Traceback" not in proc.stderr


def test_dry_run_answers_as_the_real_run_would(tmp_path: Path) -> None:
    bad_shards = tmp_path / "shards"
    bad_shards.mkdir()
    (bad_shards / "a.bin").write_bytes(b"not a shard")
    dump = tmp_path / "run"
    debug = ["--config", "configs/train/debug_model.toml", f"--job.dump_folder={dump}"]
    big = ["--config", "configs/train/llama3_8b.toml", "--data.source=synthetic", "--model.n_layers=8"]
    results = run_cli_cases({
        "tp-4-on-6": [*debug, "--distributed.tp=4", "--dry-run", "--world-size=6"],
        "not-a-number": [*debug, "--dry-run", "--world-size=abc"],
        "without-dry-run": [*debug, "--world-size", "4"],
        "broken-shards": [*debug, "--data.source=shards", f"--data.path={bad_shards}", "--dry-run"],
        "gpu-kernels": [*debug, "--train.attention_backend=cudnn", "--optimizer.implementation=triton", "--dry-run"],
        "too-small": [*big, "--dry-run", "--gpu-memory-gib", "30"],
        "state-too-big": [*big, "--dry-run", "--gpu-memory-gib=10"],
        "pipeline": ["--config", "configs/train/debug_pp.toml", f"--job.dump_folder={dump}", "--dry-run",
                     "--world-size=2"],
        "moe": ["--config", "configs/train/debug_moe.toml", f"--job.dump_folder={dump}", "--dry-run"],
    })
    expected = validate_error([*debug, "--distributed.tp=4"], world_size=6)
    assert results["tp-4-on-6"]["rc"] == 2 and results["tp-4-on-6"]["stderr"] == f"config error: {expected}\n"
    assert results["not-a-number"]["stderr"] == "config error: --world-size='abc' is not an integer\n"
    assert results["without-dry-run"]["rc"] == 2
    assert "--world-size only go with --dry-run" in results["without-dry-run"]["stderr"]
    broken = results["broken-shards"]
    assert broken["rc"] == 2 and str(bad_shards / "a.bin") in broken["stderr"]
    assert len(broken["stderr"].splitlines()) == 1
    # Planned for GPUs: GPU kernels are fine there, while this CPU machine's own validation refuses them.
    assert results["gpu-kernels"]["rc"] == 0, results["gpu-kernels"]["stderr"]
    assert "this machine has no GPU" in validate_error([*debug, "--train.attention_backend=cudnn"], world_size=1)
    too_small = results["too-small"]["stdout"].splitlines()
    assert results["too-small"]["rc"] == 3 and "MORE than a 30 GiB GPU by" in results["too-small"]["stdout"]
    assert too_small[-1].startswith("DOES NOT FIT: ") and "more than a 30 GiB GPU: lower train.batch_size" in too_small[-1]
    assert not any(line.startswith("OK") for line in too_small)
    state = results["state-too-big"]
    assert state["rc"] == 2 and "more than the 10.0 GiB of a 10 GiB GPU, before any activation" in state["stderr"]
    pipeline = results["pipeline"]["stdout"]
    assert "pipeline Interleaved1F1B, 4 stages, 8 microbatches" in pipeline and "(pipeline rank 0" in pipeline
    assert "active" in results["moe"]["stdout"]  # the MoE family's line: active parameters per token
    # A plan under a GiB is in MiB, not "0.0 GiB".
    assert results["moe"]["rc"] == 0 and "0.0 GiB" not in results["moe"]["stdout"]
    peak = next(line for line in results["moe"]["stdout"].splitlines() if "peak (estimate)" in line)
    assert peak.split()[3] == "MiB", peak
    assert not dump.exists()


def test_a_plan_that_does_not_fit_says_so_last_and_exits_3() -> None:
    """The issue's case: the 16-GPU recipe with selective AC is 34.4 GiB over an H100; the verdict is the last line, no
    `OK` anywhere, exit 3. Selective AC equals none there, and the plan says why (compiled fp8 recomputes the rest)."""
    recipe = ["--config", RECIPE, "--dry-run", "--world-size=16"]
    results = run_cli_cases({
        "selective": [*recipe, "--train.activation_checkpointing=selective"],
        "none": [*recipe, "--train.activation_checkpointing=none"],
        "selective-bf16": [*recipe, "--train.activation_checkpointing=selective", "--train.mixed_precision=bf16"],
        "fits": recipe,
    })
    selective = results["selective"]["stdout"].splitlines()
    assert results["selective"]["rc"] == 3, results["selective"]
    assert any("MORE than a 79.2 GiB GPU by 34.4 GiB" in line for line in selective)
    assert selective[-1].startswith("DOES NOT FIT: ./outputs/7b_16gpu_fp8 would need about 113.6 GiB per GPU, "
                                    "34.4 GiB more than a 79.2 GiB GPU"), selective[-1]
    assert not any(line.startswith("OK") for line in selective)

    def activations(name: str) -> str:
        return next(line for line in results[name]["stdout"].splitlines() if line.strip().startswith("activations"))

    # 92.12 and 92.13 GiB: the 8 bytes per token of the norms' rstd apart
    assert abs(float(activations("selective").split()[1]) - float(activations("none").split()[1])) <= 0.01
    note = "selective AC saves no memory here: compiled with fp8 linears"
    assert sum(note in line for line in selective) == 1
    assert note not in results["none"]["stdout"] and note not in results["selective-bf16"]["stdout"]
    assert results["fits"]["rc"] == 0 and results["fits"]["stdout"].splitlines()[-1].startswith("OK: ")


def validate_error(argv: list[str], *, world_size: int) -> str:
    try:
        validate_job(load_job_config(argv), world_size=world_size)
    except ConfigError as e:
        return str(e)
    raise AssertionError(f"{argv} validated for {world_size} ranks")
