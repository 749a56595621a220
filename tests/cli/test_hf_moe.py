"""MoE export through the commands: scripts/convert_checkpoint.py copies the recorded tokenizer, and a debug_moe
run (checkpoint.model_only) exports and converts to a model transformers loads with our logits, which
scripts/generate.py samples from. The export itself, against transformers: tests/unit/test_hf_moe.py.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests.helpers import REPO, env, launch
from tests.unit.test_hf_moe import _checkpoint_with_tokenizer, _hf, _logits, _relative
from trainer.checkpoint import load_full_model_weights, load_model

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")


CONVERT = str(REPO / "scripts" / "convert_checkpoint.py")
GENERATE = str(REPO / "scripts" / "generate.py")


@pytest.mark.slow
def test_convert_export_copies_the_recorded_tokenizer(tmp_path):
    ckpt, path = _checkpoint_with_tokenizer(tmp_path)

    def export(out: str, *flags: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, CONVERT, "export", str(ckpt), str(tmp_path / out), *flags],
                              capture_output=True, text=True, env=env(), cwd=REPO, timeout=120)

    proc = export("hf")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == path.read_bytes()
    assert transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf")).eos_token == "<|endoftext|>"
    assert export("bare", "--no-tokenizer").returncode == 0 and not (tmp_path / "bare" / "tokenizer.json").exists()
    # The checkpoint holds its own copy: editing the original afterwards changes no export.
    original = path.read_bytes()
    path.write_text(path.read_text().replace("experts", "expert"))
    assert export("later").returncode == 0 and (tmp_path / "later" / "tokenizer.json").read_bytes() == original
    # Editing the checkpoint's copy is a corrupt checkpoint: one line, nothing exported.
    copy = ckpt / "tokenizer.json"
    copy.write_text(copy.read_text().replace("experts", "expert"))
    bad = export("changed")
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0, bad.stderr[-2000:]
    assert f"{copy} is truncated or corrupted" in bad.stderr and not (tmp_path / "changed").exists()


# -- the run: checkpoint.model_only, convert_checkpoint.py, generate.py ------------------------------------------


@pytest.fixture(scope="module")
def trained_moe(tmp_path_factory):
    """debug_moe, 3 fp32 steps (the balancer moves the expert biases), a checkpoint and the final bf16 export."""
    dump = tmp_path_factory.mktemp("trained_moe")
    proc = launch(["--config", str(REPO / "configs" / "train" / "debug_moe.toml"), "--train.steps=3",
                   "--train.seq_len=32", "--train.batch_size=2", "--metrics.enable_tensorboard=false",
                   "--checkpoint.enable=true", "--checkpoint.interval=3", "--checkpoint.model_only=true",
                   f"--job.dump_folder={dump}"], timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return dump / "checkpoint"


@pytest.mark.slow
def test_trained_moe_export_and_convert_load_in_transformers(trained_moe, tmp_path):
    checkpoint = load_model(trained_moe / "step-3")
    biases = {k: v for k, v in checkpoint.state_dict().items() if k.endswith("expert_bias")}
    assert all(b.abs().sum() > 0 for b in biases.values())  # the balancer moved them
    # The run's final export: bf16 weights, fp32 expert biases (bit-equal to the checkpoint's), byte tokenizer ids.
    final = trained_moe / "step-3-hf"
    assert sorted(p.name for p in final.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json",
                                                       "tokenizer_config.json"]  # the byte tokenizer, written out
    assert json.loads((final / "config.json").read_text())["eos_token_id"] == 257
    exported = load_model(final)
    assert all(torch.equal(exported.state_dict()[k], v) for k, v in biases.items())
    assert _relative(_logits(_hf(final)), _logits(exported)) < 1e-4
    # scripts/convert_checkpoint.py export: fp32, sharded, our logits; then import back.
    out = tmp_path / "hf"
    proc = subprocess.run([sys.executable, CONVERT, "export", str(trained_moe), str(out), "--dtype=float32",
                           "--max-shard-size=200KB"], capture_output=True, text=True, env=env(), cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "as Ernie4_5_MoeForCausalLM" in proc.stdout + proc.stderr
    assert len(set(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"].values())) > 1
    assert _relative(_logits(_hf(out)), _logits(checkpoint)) < 1e-4
    imported = tmp_path / "imported"
    proc = subprocess.run([sys.executable, CONVERT, "import", str(out), str(imported), "--flavor=debug_moe"],
                          capture_output=True, text=True, env=env(), cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    _, weights = load_full_model_weights(trained_moe / "step-3")
    _, back = load_full_model_weights(imported)
    assert sorted(back) == sorted(weights) and all(torch.equal(back[k], weights[k]) for k in weights)


@pytest.mark.slow
def test_generate_script_samples_from_checkpoint_and_export(trained_moe, tmp_path):
    def generate(*args):
        return subprocess.run([sys.executable, GENERATE, *args, "--prompt=The ", "--max-new-tokens=16",
                               "--temperature=0"], capture_output=True, text=True, env=env(), cwd=REPO, timeout=120)

    from_checkpoint = generate(str(trained_moe))  # the latest checkpoint; its run recorded the byte tokenizer
    assert from_checkpoint.returncode == 0, from_checkpoint.stderr[-2000:]
    from_export = generate(str(trained_moe / "step-3-hf"))  # its tokenizer.json: the byte tokenizer's
    assert from_export.returncode == 0, from_export.stderr[-2000:]
    for proc in (from_checkpoint, from_export):  # stdout is the text alone: the prompt and 16 bytes at most
        assert proc.stdout.startswith("The ") and len(proc.stdout.encode()) > len("The \n"), proc.stdout
    # Greedy, and "--tokenizer=byte" names the same tokenizer: the same text.
    assert generate(str(trained_moe / "step-3-hf"), "--tokenizer=byte").stdout == from_export.stdout
    assert "greedy" in from_export.stderr and "top-" not in from_export.stderr
    # Greedy decoding in bf16, the export's dtype: the checkpoint's weights rounded to bf16 are the exported ones,
    # so both sample the same text; a weight exported under the wrong name, transposed or unrounded would not.
    bf16 = [generate(*where, "--dtype=bfloat16") for where in ([str(trained_moe)], [str(trained_moe / "step-3-hf")])]
    assert [proc.returncode for proc in bf16] == [0, 0], bf16[1].stderr[-2000:]
    assert bf16[0].stdout == bf16[1].stdout and bf16[0].stdout.startswith("The ")
    # An export without tokenizer files (--no-tokenizer) names no tokenizer: one line, exit 2.
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        (bare / name).write_bytes((trained_moe / "step-3-hf" / name).read_bytes())
    bad = generate(str(bare))
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0 and "--tokenizer=byte" in bad.stderr


@pytest.mark.slow
def test_trained_qwen3_moe_exports_as_qwen3_moe_with_our_logits(tmp_path):
    """qwen3_moe_debug trained 3 steps (the aux loss moves the routers; no expert bias): the run's final export is a
    Qwen3MoeForCausalLM whose logits are the checkpoint's, and scripts/generate.py samples from it."""
    proc = launch(["--config", str(REPO / "configs" / "train" / "qwen3_moe_debug.toml"), "--train.steps=3",
                   "--train.seq_len=32", "--train.batch_size=2", "--metrics.enable_tensorboard=false",
                   "--checkpoint.enable=true", "--checkpoint.interval=3", "--checkpoint.model_only=true",
                   f"--job.dump_folder={tmp_path}"], timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    final = tmp_path / "checkpoint" / "step-3-hf"
    config = json.loads((final / "config.json").read_text())
    assert (config["architectures"], config["decoder_sparse_step"], config["mlp_only_layers"]) == (
        ["Qwen3MoeForCausalLM"], 2, [])
    # The export holds the checkpoint's weights rounded to bf16, and transformers gives its logits.
    trained, exported = load_model(tmp_path / "checkpoint" / "step-3").state_dict(), load_model(final).state_dict()
    assert sorted(trained) == sorted(exported)
    assert all(torch.equal(exported[k].float(), v.to(torch.bfloat16).float()) for k, v in trained.items())
    assert _relative(_logits(load_model(final), _TOKENS), _logits(_hf(final), _TOKENS)) < 1e-4
    sample = subprocess.run([sys.executable, GENERATE, str(final), "--prompt=The ", "--max-new-tokens=8",
                             "--temperature=0"], capture_output=True, text=True, env=env(), cwd=REPO, timeout=120)
    assert sample.returncode == 0 and sample.stdout.startswith("The "), sample.stderr[-2000:]


_TOKENS = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
