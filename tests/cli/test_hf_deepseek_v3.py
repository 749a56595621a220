"""DeepSeek-V3 through the commands: a transformers DeepseekV3ForCausalLM (with an MTP module's tensors, as DeepSeek's
checkpoints hold them) imported by scripts/convert_checkpoint.py, trained from with checkpoint.initial_load_path and
exported by the run (checkpoint.model_only) to a folder transformers loads with our logits. The mapping itself,
against transformers: tests/unit/test_hf_deepseek_v3.py."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests.helpers import REPO, env, launch
from tests.unit.test_hf_deepseek_v3 import _hf, _hf_config, _logits, _random_hf, _relative
from trainer.checkpoint import load_model

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")


@pytest.mark.slow
def test_import_train_and_export_a_deepseek_v3_model(tmp_path):
    hf = _random_hf(_hf_config(vocab_size=512))
    hf.save_pretrained(tmp_path / "hf")
    file = next((tmp_path / "hf").glob("*.safetensors"))
    tensors = safetensors_torch.load_file(file)
    tensors["model.layers.3.eh_proj.weight"] = torch.zeros(96, 192)  # the MTP module: skipped with a note
    safetensors_torch.save_file(tensors, file, metadata={"format": "pt"})
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "convert_checkpoint.py"), "import",
                           str(tmp_path / "hf"), str(tmp_path / "ckpt")], capture_output=True, text=True, env=env(),
                          cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "skipped 1 tensors of MTP modules" in proc.stderr + proc.stdout
    tokens = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    assert _relative(_logits(load_model(tmp_path / "ckpt"), tokens), _logits(hf, tokens)) < 1e-4
    dump = tmp_path / "run"
    proc = launch(["--config", str(REPO / "configs" / "train" / "debug_moe.toml"), "--train.steps=3",
                   "--train.seq_len=32", "--train.batch_size=2", "--metrics.enable_tensorboard=false",
                   f"--checkpoint.initial_load_path={tmp_path / 'ckpt'}", "--checkpoint.enable=true",
                   "--checkpoint.interval=3", "--checkpoint.model_only=true", f"--job.dump_folder={dump}"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    resolved = (dump / "resolved.toml").read_text()
    assert "[deepseek_v3]" in resolved and "n_group = 4" in resolved and "mtp_layers = 0" in resolved
    final = dump / "checkpoint" / "step-3-hf"
    config = json.loads((final / "config.json").read_text())
    assert (config["model_type"], config["n_group"], config["q_lora_rank"]) == ("deepseek_v3", 4, 40)
    trained = load_model(final)
    assert not torch.equal(trained.tok_embeddings.weight.float(), hf.model.embed_tokens.weight)  # it trained
    assert _relative(_logits(_hf(final), tokens), _logits(trained.float(), tokens)) < 1e-4
