"""Continue pretraining a Hugging Face model of its own shape (issues 33, 47): scripts/convert_checkpoint.py imports a
SmolLM2-shaped (tied) and a Qwen3-shaped (q/k norms, its own head_dim) folder without a flavor; a run with a config
that sets no shape key takes the model's whole shape from it and says so, starts from those weights (its step-1
loss is theirs on the first batch), trains, and exports the same architecture, which transformers loads with the
final checkpoint's logits. Contradicting shape keys, in-process: tests/unit/test_initial_shape.py."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

from tests.helpers import REPO, env, first_batch_loss, launch_ok, losses_by_step
from tests.unit.test_hf_models import hf_model, make_hf_folder
from trainer.checkpoint import load_model

pytestmark = pytest.mark.slow

CONVERT = str(REPO / "scripts" / "convert_checkpoint.py")
ARGS = ["--config", str(REPO / "configs" / "train" / "debug_model.toml"), "--train.seq_len=32",
        "--train.batch_size=2", "--metrics.log_freq=1", "--metrics.enable_tensorboard=false",
        "--train.mixed_precision=fp32", "--train.deterministic=true"]


@pytest.mark.parametrize("name", ["smollm2", "qwen3"])
def test_an_imported_model_of_its_own_shape_trains_and_exports_back(name: str, tmp_path: Path) -> None:
    folder = make_hf_folder(name, tmp_path / "hf", vocab=512)  # the default data's byte tokens fit
    imported = tmp_path / "imported"
    proc = subprocess.run([sys.executable, CONVERT, "import", str(folder), str(imported)], capture_output=True,
                          text=True, env=env(), cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    said = proc.stdout + proc.stderr
    keys = said.split("continue from it with ", 1)[1].split()
    assert keys[0] == f"--checkpoint.initial_load_path={imported}", keys  # the one key a run needs
    assert not any(key.startswith("--model.") for key in keys)
    config = json.loads((folder / "config.json").read_text())

    dump = tmp_path / "run"  # debug_model.toml sets no shape key (its flavor is the defaults the checkpoint replaces)
    run = launch_ok([*ARGS, keys[0], "--train.steps=3", "--checkpoint.enable=true", "--checkpoint.interval=3",
                     "--checkpoint.model_only=true", "--checkpoint.export_dtype=float32"], dump, timeout=180)
    assert f"loaded model weights from {imported}" in run.stdout
    assert f"model shape: checkpoint.initial_load_path={imported}'s, with its vocabulary (imported from {folder}" \
        in run.stdout
    used = tomllib.loads((dump / "resolved.toml").read_text())["model"]
    assert (used["dim"], used["n_layers"], used["head_dim"], used["ffn_dim"], used["vocab_size"]) == (
        config["hidden_size"], config["num_hidden_layers"], config.get("head_dim") or 32, config["intermediate_size"],
        512)
    assert used["tie_word_embeddings"] and used["qk_norm"] == (name == "qwen3")
    # Step 1's loss is the imported model's on the first batch.
    inputs, first = first_batch_loss(imported, vocab_size=512)
    assert abs(losses_by_step(dump)[1] - first) < 1e-5
    # The export at the end: the source's architecture, transformers' logits equal the final checkpoint's.
    export = dump / "checkpoint" / "step-3-hf"
    back = json.loads((export / "config.json").read_text())
    assert (back["architectures"], back["tie_word_embeddings"]) == (config["architectures"], True)
    tokens = inputs[:, :16]
    with torch.no_grad():
        ours = load_model(dump / "checkpoint" / "step-3").logits(tokens)
        theirs = hf_model(export)(tokens).logits
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-5)
