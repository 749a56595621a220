"""End-to-end runs of the debug config, the trainer run as a command (the LR schedule: tests/unit/test_optim.py;
non-finite steps: tests/unit/test_step.py; a compiled CPU run's optimizer, in-process: tests/unit/test_train.py)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tests.helpers import (
    DEBUG_CONFIG, REPO, column, dense_param_counts, fp8_linear_counts, launch, lines_before_step_1, run_cli_cases,
    train,
)
from trainer.config import load_job_config
from trainer.models import FLAVORS


def test_debug_run_learns_and_writes_metrics(tmp_path: Path) -> None:
    proc = launch(["--config", DEBUG_CONFIG, "--train.steps=30", f"--job.dump_folder={tmp_path}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "slower than 'fp32'" not in proc.stdout + proc.stderr  # the debug config trains in fp32: no hint
    from tests.helpers import read_metrics

    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 5, 10, 15, 20, 25, 30]
    for key in ("step", "loss", "grad_norm", "lr", "tps", "mfu", "memory_peak_gib"):
        assert key in records[0]
    losses = column(records, "loss")
    assert losses[0] == pytest.approx(math.log(512), rel=0.1)  # starts near uniform over the vocab
    assert losses[-1] < losses[0] - 2.5  # byte-level text is learnable fast
    assert all(r["tps"] > 0 for r in records)
    assert records[0]["mfu"] is None  # no known peak on CPU
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    saved = load_job_config(["--config", str(tmp_path / "config.toml")])
    assert saved.train.steps == 30 and saved.job.dump_folder == str(tmp_path)
    assert "step     30/30" in proc.stdout


def test_tensorboard_has_the_scalars(tmp_path: Path) -> None:
    train(["--config", DEBUG_CONFIG, "--train.steps=2", "--train.seq_len=32", "--metrics.log_freq=1"], tmp_path)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/grad_norm", "train/lr", "perf/tokens_per_second", "memory/peak_gib"} <= tags
    assert [e.step for e in acc.Scalars("train/loss")] == [1, 2]


PRECISION_RUN = ["--config", DEBUG_CONFIG, "--train.steps=12", "--train.seq_len=64", "--metrics.log_freq=1",
                 "--metrics.enable_tensorboard=false"]


@pytest.fixture(scope="module")
def fp32_losses(tmp_path_factory) -> list[float]:
    return column(train([*PRECISION_RUN, "--train.mixed_precision=fp32"], tmp_path_factory.mktemp("fp32")), "loss")


@pytest.mark.parametrize("precision, dtype", [("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_precisions_train_and_round_fp32s_losses(precision: str, dtype: torch.dtype, fp32_losses: list[float],
                                                  tmp_path: Path) -> None:
    # fp32 master weights, as the fp32 run's: bf16's default bf16 master weights would make the first loss differ
    # from fp32's by the weights' rounding even where the compute stayed in fp32.
    losses = column(train([*PRECISION_RUN, f"--train.mixed_precision={precision}", "--distributed.master_dtype=fp32"],
                          tmp_path), "loss")
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0] - 1.0
    # The same weights and data as fp32: the first step differs only by the compute dtype's rounding. Each step's
    # loss is a mean over 512 tokens (8 x 64), whose roundings average out: well within the dtype's eps of fp32's.
    # Over the warmup (the lr still ramping up) the runs have not yet drifted apart; a wrong loss scale, an update
    # in the wrong dtype or a master weight lost moves a loss by far more than an eps.
    warmup = load_job_config(PRECISION_RUN).scheduler.warmup_steps
    eps = torch.finfo(dtype).eps
    assert losses[:warmup] == pytest.approx(fp32_losses[:warmup], rel=eps)
    assert losses[0] != fp32_losses[0]  # it really computed in its own dtype


def test_fused_clipping_matches_explicit_clipping(tmp_path: Path) -> None:
    # The fused AdamW applies the clip factor as grad_scale; foreach clips the gradients first.
    args = ["--config", DEBUG_CONFIG, "--train.steps=6", "--train.seq_len=32", "--metrics.log_freq=1",
            "--train.mixed_precision=fp32", "--train.max_norm=0.5", "--metrics.enable_tensorboard=false"]
    fused = train([*args, "--optimizer.implementation=fused"], tmp_path / "fused")
    foreach = train([*args, "--optimizer.implementation=foreach"], tmp_path / "foreach")
    assert max(column(fused, "grad_norm")) > 0.5  # clipping was active
    assert column(fused, "loss") == pytest.approx(column(foreach, "loss"), rel=1e-5)
    assert column(fused, "grad_norm") == pytest.approx(column(foreach, "grad_norm"), rel=1e-4)


def test_startup_lines_follow_the_fp8_page(tmp_path: Path) -> None:
    """`Applied Float8 training`, then `Optimizer groups`, then `Model`, as the FP8 page shows them."""
    proc = launch(["--config", DEBUG_CONFIG, "--train.steps=1", "--train.seq_len=32", "--train.mixed_precision=fp8",
                   f"--job.dump_folder={tmp_path}", "--metrics.enable_tensorboard=false"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    order = [next(i for i, line in enumerate(lines) if key in line)
             for key in ("Applied Float8 training:", "Optimizer groups:", "Model:")]
    assert order == sorted(order)
    groups = lines[order[1]]
    # fp8 keeps bf16 master weights by default (distributed.master_dtype="auto"), with stochastic rounding.
    tensors, params, non_embedding = dense_param_counts(FLAVORS["debug"])
    assert (f"AdamW (bf16 master weights, stochastic rounding), 1 group: {tensors} tensors, {params:,} parameters"
            in groups)
    assert groups.endswith("; lr 0.003 peak, warmup 5 steps linear (train.steps=1 ends inside it)"), groups
    assert f"Model: debug, {params:,} parameters ({non_embedding:,} non-embedding)" in lines[order[2]]


def test_console_is_a_short_header_and_the_values_used_go_to_files(tmp_path: Path) -> None:
    """No config dump on the console: config.toml as given (relaunchable), resolved.toml with the real values."""
    import json
    import tomllib

    proc = launch(["--config", str(REPO / "configs" / "train" / "debug_moe.toml"), "--train.steps=1",
                   "--train.seq_len=32", "--train.mixed_precision=fp8", "--float8.emulate=true",
                   f"--job.dump_folder={tmp_path}", "--metrics.enable_tensorboard=false"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    header = lines_before_step_1(proc.stdout + proc.stderr)
    assert len(header) <= 30, "\n".join(header)
    text = "\n".join(header)
    converted, linears = fp8_linear_counts(FLAVORS["debug_moe"])
    for what in ("job: ", "parallelism: ", "data: ", f"converted {converted}/{linears} Linear layers", "precision: ",
                 "Model: ",
                 "MoE: ", f"outputs: {tmp_path} (config.toml, resolved.toml, fp8_layers.json, metrics.jsonl)"):
        assert what in text, what
    assert "[train]" not in text and "vocab_size = 0" not in text
    # The memory plan of a small model is in MiB, not "about 0.0 GiB".
    plan = next(line for line in header if "memory plan: about " in line)
    assert plan.split("memory plan: about ")[1].split()[1] == "MiB", plan
    # No advice to compile on a CPU: fp8 there is for tests, and compiling it costs minutes before step 1 (docs/fp8.md).
    assert "compile_model" not in text, text
    # fp8 on CPU is several times slower than fp32: said once, in the header.
    assert text.count("on CPU, train.mixed_precision='fp8' runs several times slower than 'fp32'") == 1
    given = tomllib.loads((tmp_path / "config.toml").read_text())
    assert "vocab_size" not in given["model"] and given["distributed"]["master_dtype"] == "auto"
    used = tomllib.loads((tmp_path / "resolved.toml").read_text())
    assert used["model"]["vocab_size"] == 512 and used["model"]["n_layers"] == 4
    assert used["moe"]["top_k"] == 2 and used["moe"]["aux_loss_coef"] == 0.01
    assert used["distributed"]["dp_shard"] == 1 and used["distributed"]["master_dtype"] == "bf16"
    assert used["model_args"]["dim"] == 128 and used["model_args"]["n_experts"] == 8
    fp8 = json.loads((tmp_path / "fp8_layers.json").read_text())
    assert (fp8["recipe"], fp8["format"]) == ("tensorwise", "hybrid")
    fates = fp8["layers"]
    assert fates["layers.0.attention.q_proj"] == "converted" and fates["layers.1.moe.router.gate"] == "MoE router"
    assert sum(fate == "converted" for fate in fates.values()) == converted and len(fates) == linears
    # The step line on a CPU leaves out model TFLOP/s and MFU (no peak to compare with).
    step_line = next(line for line in proc.stdout.splitlines() if "step      1/1" in line)
    assert "tflops" not in step_line and "mfu" not in step_line


def test_the_header_says_how_documents_are_treated_when_it_is_not_the_default(tmp_path: Path) -> None:
    """data.document_masking and data.eod_mask_loss get a line beside the data line (and in the dry run) when on;
    with both off (attention crosses documents, every token trained on: the default) there is none."""
    base = ["--config", DEBUG_CONFIG, "--train.steps=1", "--train.seq_len=32", "--train.mixed_precision=fp32",
            "--metrics.enable_tensorboard=false"]
    proc = launch([*base, "--data.document_masking=true", "--data.eod_mask_loss=true",
                   f"--job.dump_folder={tmp_path / 'on'}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    header = lines_before_step_1(proc.stdout)
    data = next(i for i, line in enumerate(header) if "] data: " in line)
    assert header[data + 1].split("] ", 1)[1] == (
        "documents: attention stays inside each document of a packed row and RoPE positions restart at each "
        "(data.document_masking; a document ends at EOS id 257); the token after each EOS (id 257) is not trained "
        "on, in training and validation (data.eod_mask_loss)")
    dry = run_cli_cases({"masking": [*base, "--data.document_masking=true", "--dry-run"],
                         "eod": [*base, "--data.eod_mask_loss=true", "--dry-run"],
                         "off": [*base, "--dry-run"]})

    def documents(name: str) -> list[str]:
        return [line for line in dry[name]["stdout"].splitlines() if line.startswith("documents: ")]

    assert documents("masking") == ["documents: attention stays inside each document of a packed row and RoPE "
                                    "positions restart at each (data.document_masking; a document ends at EOS id 257)"]
    assert documents("eod") == ["documents: the token after each EOS (id 257) is not trained on, in training and "
                                "validation (data.eod_mask_loss)"]
    assert documents("off") == []


def test_fresh_run_sets_old_metrics_aside_and_resume_drops_rerun_rows(tmp_path: Path) -> None:
    args = ["--config", DEBUG_CONFIG, "--train.seq_len=32", "--metrics.log_freq=1", "--train.mixed_precision=fp32"]
    first = train([*args, "--train.steps=3"], tmp_path)
    assert column(first, "step") == [1, 2, 3]
    # A second fresh run (no checkpoint) starts a new file; the first one is kept aside.
    again = train([*args, "--train.steps=2"], tmp_path)
    assert column(again, "step") == [1, 2]
    assert [r["step"] for r in map(__import__("json").loads, (tmp_path / "metrics.jsonl.prev-1").read_text().splitlines())] == [1, 2, 3]
    assert (tmp_path / "tb.prev-1").is_dir()
    # Checkpoints at 2 and 4 (the last); resuming from step 2 re-runs 3 and 4: each step once, same losses.
    ckpt = tmp_path / "ckpt"
    full = train([*args, "--train.steps=4", "--checkpoint.enable=true", "--checkpoint.interval=2"], ckpt)
    resumed = train([*args, "--train.steps=4", "--checkpoint.enable=true", "--checkpoint.interval=2",
                     "--checkpoint.load_step=2"], ckpt)
    assert column(resumed, "step") == [1, 2, 3, 4]
    assert column(resumed, "loss") == column(full, "loss")
    assert not list(ckpt.glob("metrics.jsonl.prev-*"))
