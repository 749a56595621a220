"""GPT-OSS through the commands: a GptOssForCausalLM that transformers saves is imported by
scripts/convert_checkpoint.py, trained from (checkpoint.initial_load_path, the model's shape from the checkpoint) with
its export at the end (checkpoint.model_only), and that export loads in transformers with the logits of the run's
checkpoint. The mapping itself, against transformers: tests/unit/test_hf_gpt_oss.py."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tests.helpers import REPO, env, launch
from trainer.checkpoint import load_model

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

CONVERT = str(REPO / "scripts" / "convert_checkpoint.py")


@pytest.mark.slow
def test_a_transformers_gpt_oss_imports_trains_and_exports(tmp_path):
    config = transformers.GptOssConfig(
        hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=258, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
        max_position_embeddings=256)
    torch.manual_seed(0)
    transformers.GptOssForCausalLM(config).save_pretrained(str(tmp_path / "hf"))
    proc = subprocess.run([sys.executable, CONVERT, "import", str(tmp_path / "hf"), str(tmp_path / "ckpt")],
                          capture_output=True, text=True, env=env(), cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    dump = tmp_path / "run"
    proc = launch(["--config", str(REPO / "configs" / "train" / "debug_moe.toml"), "--model.flavor=debug_gpt_oss",
                   f"--checkpoint.initial_load_path={tmp_path / 'ckpt'}", "--data.tokenizer=byte", "--train.steps=3",
                   "--train.seq_len=32", "--train.batch_size=2", "--metrics.enable_tensorboard=false",
                   "--checkpoint.enable=true", "--checkpoint.interval=3", "--checkpoint.model_only=true",
                   f"--job.dump_folder={dump}"], timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    trained = load_model(dump / "checkpoint" / "step-3")
    assert trained.args.dim == 64 and trained.args.sliding_window == 8  # the imported model's shape, trained
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(dump / "checkpoint" / "step-3-hf")).float().eval()
    tokens = torch.randint(0, 258, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = trained.logits(tokens), hf(tokens).logits
    # The export is bf16: its logits are the checkpoint's to bf16 rounding of the weights.
    assert ((ours - theirs).abs().max() / ours.abs().max()).item() < 2e-2
