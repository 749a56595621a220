"""checkpoint.export_interval's parts that need no process group: what an export holds in rank 0's host memory (the
startup line and the dry run say it), and which older exports export_keep_latest_k removes. Whole runs:
tests/cli/test_hf_export_interval.py (one process), tests/distributed/test_hf_export_interval.py (two ranks)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from trainer.checkpoint.exports import prune_exports
from trainer.config import load_job_config
from trainer.hf import export_bytes, export_dtypes
from trainer.models import model_args_for
from trainer.models.counts import param_count
from trainer.run.dry_run import dry_run
from trainer.validate.plan import human_size

REPO = Path(__file__).resolve().parents[2]


def test_an_export_holds_every_parameter_once_in_its_dtype() -> None:
    dense = model_args_for("debug")
    assert export_bytes(dense, torch.bfloat16) == 2 * param_count(dense)
    assert export_bytes(dense, torch.float32) == 4 * param_count(dense)
    tied = dataclasses.replace(dense, tie_word_embeddings=True)  # one table, written once
    assert export_bytes(tied, torch.bfloat16) == 2 * param_count(tied) == export_bytes(dense, torch.bfloat16) - 2 * (
        dense.vocab_size * dense.dim)
    moe = model_args_for("debug_moe")  # the expert biases stay float32: 2 bytes more each than in bf16
    kept = [fqn for fqn, dtype in export_dtypes(moe, torch.bfloat16).items() if dtype == torch.float32]
    assert kept and all(fqn.endswith("router.expert_bias") for fqn in kept)
    assert export_bytes(moe, torch.bfloat16) == 2 * param_count(moe) + 2 * len(kept) * moe.n_experts


def test_the_dry_run_says_what_an_export_holds_in_rank_0s_host_memory() -> None:
    config = str(REPO / "configs" / "train" / "llama3_8b.toml")
    text, _ = dry_run(load_job_config(["--config", config, "--checkpoint.export_interval=500"]), world_size=8)
    args = model_args_for("8b")
    line = (f"host memory: checkpoint.export_interval=500 gathers the whole model ({human_size(2 * param_count(args))} "
            "in bfloat16) into rank 0's host memory at each export, held while it is written")
    assert line in text.splitlines()
    assert "host memory" not in dry_run(load_job_config(["--config", config]), world_size=8)[0]


def _export(folder: Path, *names: str) -> Path:
    folder.mkdir()
    for name in names:
        (folder / name).write_text("{}")
    return folder


def test_prune_exports_keeps_the_newest_and_touches_nothing_else(tmp_path: Path) -> None:
    for step in (2, 4, 6, 8):
        _export(tmp_path / f"step-{step}-hf", "config.json", "model.safetensors", "tokenizer.json")
    _export(tmp_path / "step-10-hf", "config.json", "model.safetensors")  # a later trajectory's: never removed
    _export(tmp_path / "step-1-hf", "config.json", "notes.txt")  # not only an export's files: left alone
    _export(tmp_path / "step-3-hf.tmp", ".partial", "model.safetensors")  # an interrupted export (the marker)
    _export(tmp_path / "step-5-hf.tmp", "model.safetensors")  # without the marker: not provably ours, left alone
    _export(tmp_path / "step-9-hf.tmp", ".partial")  # a later step's: not superseded
    _export(tmp_path / "step-2", "checkpoint.json", ".metadata")  # a checkpoint
    assert prune_exports(tmp_path, newest=8, keep_latest_k=0) == [tmp_path / "step-3-hf.tmp"]  # 0 keeps all exports
    removed = prune_exports(tmp_path, newest=8, keep_latest_k=2)
    assert removed == [tmp_path / "step-2-hf", tmp_path / "step-4-hf"]  # oldest first, by step (not by name)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step-1-hf", "step-10-hf", "step-2", "step-5-hf.tmp", "step-6-hf", "step-8-hf", "step-9-hf.tmp"]
    assert prune_exports(tmp_path, newest=8, keep_latest_k=2) == []  # idempotent
