"""MoE export to transformers: Ernie4_5_MoeForCausalLM (softmax scores) and Glm4MoeForCausalLM (sigmoid scores).

Each case builds a small MoE with random weights and an expert bias that changes routing, exports it,
loads it with `AutoModelForCausalLM.from_pretrained` (transformers' own modeling code: the independent
implementation) and compares fp32 logits to 1e-4 relative; then imports it back. The run-level path
(training with checkpoint.model_only, scripts/convert_checkpoint.py, scripts/generate.py) is in the slow tests of
tests/cli/test_hf_moe.py.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import re
import stat
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tests.helpers import REPO, env
from trainer.checkpoint import RunInfo, load_model, save_model_only
from trainer.hf import (
    ExportError, args_from_hf_config, expected_shapes, hf_config, read_hf_config, read_hf_weights, resolve_tokenizer,
    write_hf_export,
)
from trainer.models.layers import RopeScaling
from trainer.models.moe import MOE_FLAVORS, MoEArgs, MoETransformer, Router

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

# debug_moe's shapes with 3 blocks (the first dense): the shipped layout, cheap.
BASE = replace(MOE_FLAVORS["debug_moe"], n_layers=3, max_seq_len=64)
TOKENS = torch.randint(0, BASE.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))


def _random_moe(args: MoEArgs) -> MoETransformer:
    """The pretraining init, and random expert biases of the size the balancer reaches (it steps by 1e-3)."""
    with torch.device("meta"):
        model = MoETransformer(args)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    gen = torch.Generator().manual_seed(1)
    for module in model.modules():
        if isinstance(module, Router):
            module.expert_bias.copy_(torch.randn(args.n_experts, generator=gen) * 0.05)
    return model.eval()


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _export(weights: dict[str, torch.Tensor], args: MoEArgs, out: Path, **kw) -> Path:
    return write_hf_export(out, args=args, shapes={k: tuple(v.shape) for k, v in weights.items()},
                           fetch=lambda fqns: {k: weights[k] for k in fqns}, **{"dtype": torch.float32, **kw})


def _hf(folder: Path):
    # .float(): transformers 5 loads the config's dtype; bf16 -> fp32 is exact.
    return transformers.AutoModelForCausalLM.from_pretrained(str(folder)).float().eval()


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def _logits(model, tokens: torch.Tensor = TOKENS) -> torch.Tensor:
    """Our model's logits, or a transformers model's."""
    with torch.no_grad():
        return model.logits(tokens) if isinstance(model, MoETransformer) else model(tokens).logits


CASES = {
    # The shipped layout: softmax scores as they are, expert bias, a shared expert, first block dense, GQA.
    "softmax": (dict(), "Ernie4_5_MoeForCausalLM"),
    "softmax route_norm": (dict(route_norm=True), "Ernie4_5_MoeForCausalLM"),
    "softmax, no shared, no dense, llama3 rope": (
        dict(n_shared_experts=0, n_dense_layers=0, rope_theta=500000.0, max_seq_len=128,
             rope_scaling=RopeScaling(factor=8.0, original_max_seq_len=32)),
        "Ernie4_5_MoeForCausalLM"),
    "sigmoid": (dict(score_func="sigmoid"), "Glm4MoeForCausalLM"),
    "sigmoid route_norm, 2 shared": (dict(score_func="sigmoid", route_norm=True, n_shared_experts=2),
                                     "Glm4MoeForCausalLM"),
    "sigmoid, no shared": (dict(score_func="sigmoid", n_shared_experts=0), "Glm4MoeForCausalLM"),
}


# GLM without shared experts: transformers initializes the zero-width MLP it always builds, and says so.
@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors is a no-op")
@pytest.mark.parametrize("case", list(CASES))
def test_moe_export_gives_our_logits_in_transformers_and_imports_back(case, tmp_path):
    changes, architecture = CASES[case]
    args = replace(BASE, **changes)
    model = _random_moe(args)
    weights = _weights(model)
    ours = _logits(model)
    # The bias matters here: without it other experts are chosen and the logits move.
    without_bias = copy.deepcopy(model)
    for router in (m for m in without_bias.modules() if isinstance(m, Router)):
        router.expert_bias.zero_()
    assert _relative(_logits(without_bias), ours) > 1e-3
    out = _export(weights, args, tmp_path / "hf")
    hf = _hf(out)
    assert type(hf).__name__ == architecture
    assert _relative(_logits(hf), ours) < 1e-4, case
    # Import back: the same tensors, and a model built from config.json alone gives the same logits.
    back = read_hf_weights(out, args=args)
    assert list(back) == list(expected_shapes(args)) and all(torch.equal(back[k], weights[k]) for k in weights)
    read = read_hf_config(out)
    assert (read.score_func, read.route_norm, read.ffn_dim) == (args.score_func, args.route_norm, args.ffn_dim)
    # All but what config.json does not hold: the balancer's rate, and the context of a RoPE-scaled model (131072).
    assert replace(read, bias_update_rate=args.bias_update_rate, max_seq_len=args.max_seq_len) == args
    assert torch.equal(_logits(load_model(out, max_seq_len=args.max_seq_len)), ours)


def test_shipped_flavors_map_to_ernie_with_their_shapes():
    for name in ("debug_moe", "moe_small", "moe_16b"):
        args = MOE_FLAVORS[name]
        config = hf_config(args, dtype=torch.bfloat16)
        assert config["architectures"] == ["Ernie4_5_MoeForCausalLM"] and config["moe_norm_min"] == 1.0
        # transformers' own config class reads it with the values we wrote.
        hf = transformers.AutoConfig.for_model(config["model_type"],
                                               **{k: v for k, v in config.items() if k != "model_type"})
        assert (hf.moe_num_experts, hf.moe_k, hf.moe_num_shared_experts, hf.moe_layer_start_index,
                hf.moe_layer_end_index, hf.intermediate_size, hf.moe_intermediate_size, hf.num_key_value_heads) == (
            args.n_experts, args.top_k, args.n_shared_experts, args.n_dense_layers, args.n_layers - 1, args.ffn_dim,
            args.moe_ffn_dim, args.n_kv_heads)
        assert hf.tie_word_embeddings is False and hf.eos_token_id is None
        back = args_from_hf_config(config, where="config.json")
        assert back == replace(args, bias_update_rate=0.0, max_seq_len=back.max_seq_len), name


def test_bf16_sharded_export_keeps_the_expert_bias_fp32_and_files_0644(tmp_path):
    model = _random_moe(BASE)
    weights = _weights(model)
    old = os.umask(0o077)  # even a private umask: the files are 0644 like save_pretrained's (the folder keeps it)
    try:
        out = _export(weights, BASE, tmp_path / "hf", dtype=torch.bfloat16, max_shard_bytes=100_000)
    finally:
        os.umask(old)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and sorted(p.name for p in out.iterdir()) == sorted(
        [*shards, "config.json", "model.safetensors.index.json"])
    assert all(stat.S_IMODE((out / name).stat().st_mode) == 0o644 for name in os.listdir(out))
    from safetensors import safe_open

    bias = "model.layers.1.mlp.moe_statics.e_score_correction_bias"
    with safe_open(str(out / index["weight_map"][bias]), "pt") as f:
        assert f.get_tensor(bias).dtype == torch.float32
        assert torch.equal(f.get_tensor(bias)[0], weights["layers.1.moe.router.expert_bias"])
    # Ours loaded from the bf16 export (bias still fp32) and transformers agree.
    loaded = load_model(out, dtype=torch.bfloat16)
    assert loaded.layers["1"].moe.router.expert_bias.dtype == torch.float32
    assert _relative(_logits(_hf(out)), _logits(load_model(out))) < 1e-4


def test_capacity_factor_warns_and_exports_routing_every_token(tmp_path, caplog):
    args = replace(BASE, capacity_factor=0.5)
    weights = _weights(_random_moe(BASE))
    logger = logging.getLogger("trainer.hf")
    logger.addHandler(caplog.handler)  # directly: trainer.log's setup_logging stops propagation to the root
    try:
        out = _export(weights, args, tmp_path / "hf")
    finally:
        logger.removeHandler(caplog.handler)
    assert "capacity_factor=0.5 (token dropping) has no counterpart in Ernie4_5_MoeForCausalLM" in caplog.text
    assert _relative(_logits(_hf(out)), _logits(_random_moe(BASE))) < 1e-4  # = ours without dropping
    assert load_model(out).args.capacity_factor == 0.0


def test_routing_without_an_exact_target_is_refused_in_one_line(tmp_path):
    args = replace(BASE, score_func="sigmoid", n_experts=1, top_k=1)
    weights = _weights(_random_moe(args))
    with pytest.raises(ExportError) as e:
        _export(weights, args, tmp_path / "hf")
    assert "score_func='sigmoid' with n_experts=1 has no Hugging Face target" in str(e.value)
    assert "\n" not in str(e.value) and not (tmp_path / "hf").exists()


def test_import_checks_config_against_the_flavor(tmp_path):
    out = _export(_weights(_random_moe(BASE)), BASE, tmp_path / "hf")
    with pytest.raises(ExportError, match="config.json: moe_num_experts=8 but the trainer model has 4"):
        read_hf_weights(out, args=replace(BASE, n_experts=4))
    with pytest.raises(ExportError, match="model_type='ernie4_5_moe', but the trainer model scores experts with "
                                          "sigmoid, whose layout is 'glm4_moe'"):
        read_hf_weights(out, args=replace(BASE, score_func="sigmoid"))
    from trainer.models.llama import FLAVORS

    with pytest.raises(ExportError, match="model_type='ernie4_5_moe' is a MoE layout, but the trainer model is dense"):
        read_hf_weights(out, args=FLAVORS["debug"])
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "moe_norm_min": 0.5}))
    with pytest.raises(ExportError, match="moe_norm_min=0.5 has no equivalent in this trainer's MoE"):
        read_hf_config(out)
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
    (out / "config.json").write_text(json.dumps({**config, "rope_scaling": yarn}))
    with pytest.raises(ExportError, match="rope_type='yarn' has no equivalent in this trainer"):
        read_hf_config(out)  # not read as plain RoPE: its positions would be rotated otherwise than it was trained


def test_load_model_returns_moe_models_from_dcp_checkpoints(tmp_path):
    args = replace(BASE, max_seq_len=48)
    model = _random_moe(args)
    weights = _weights(model)
    save_model_only(tmp_path / "ckpt", weights, run=RunInfo(flavor="debug_moe", model_args=args,
                                                            mixed_precision="fp32"), source="test")
    loaded = load_model(tmp_path / "ckpt")
    assert isinstance(loaded, MoETransformer) and loaded.args == args and not loaded.training
    assert all(torch.equal(v, weights[k]) for k, v in loaded.state_dict().items())
    assert torch.equal(_logits(loaded), _logits(model))
    half = load_model(tmp_path / "ckpt", dtype=torch.bfloat16)
    assert half.tok_embeddings.weight.dtype == torch.bfloat16
    assert half.layers["2"].moe.router.expert_bias.dtype == torch.float32  # as in training: bf16 would reroute


# -- the tokenizer and generation ------------------------------------------------


def _tokenizer_json(path: Path) -> Path:
    """A small word-level tokenizer.json with the end-of-text token the trainer looks for."""
    tokenizers = pytest.importorskip("tokenizers")
    words = ["<|endoftext|>", "[UNK]", "the", "experts", "route", "tokens", "to", "a", "model"]
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.decoder = tokenizers.decoders.WordPiece(prefix="##")
    tok.add_special_tokens(["<|endoftext|>"])
    tok.save(str(path))
    return path


def test_export_copies_the_tokenizer_and_transformers_reads_it(tmp_path):
    path = _tokenizer_json(tmp_path / "tok.json")
    tok = resolve_tokenizer(str(path))
    assert (tok.eos_id, tok.eos_token, tok.bos_id) == (0, "<|endoftext|>", None)
    out = _export(_weights(_random_moe(BASE)), BASE, tmp_path / "hf", tokenizer=tok)
    assert (out / "tokenizer.json").read_bytes() == path.read_bytes()
    assert stat.S_IMODE((out / "tokenizer_config.json").stat().st_mode) == 0o644
    config = json.loads((out / "config.json").read_text())
    assert (config["eos_token_id"], config["bos_token_id"]) == (0, None)
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(out))
    from trainer.data import build_tokenizer

    text = "the experts route tokens to a model"
    assert hf_tok(text)["input_ids"] == build_tokenizer(str(path)).encode(text) and hf_tok.eos_token_id == 0
    byte = resolve_tokenizer("byte")
    assert (byte.bos_id, byte.eos_id, byte.is_file) == (256, 257, False)
    # The transformers snippet of docs/checkpointing.md#generating-text runs on this export as written.
    page = (REPO / "docs" / "checkpointing.md").read_text()
    snippet = next(b for b in page.split("```python\n")[1:] if "AutoTokenizer.from_pretrained(folder)" in b)
    snippet = re.sub(r'folder = "[^"]*"', f"folder = {str(out)!r}", snippet.split("```")[0])
    proc = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, env=env(), cwd=REPO,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]


# Every byte that valid UTF-8 holds: code points 0-0x7ff (1- and 2-byte forms, all continuation bytes),
# one per 3-byte lead 0xe0-0xef (0xd000, not a surrogate) and the 4-byte leads 0xf0-0xf4; then the kinds of text.
EVERY_UTF8_BYTE = "".join(map(chr, [*range(0x800), 0x800, *range(0x1000, 0x10000, 0x1000), 0x10000, 0x40000,
                                    0x80000, 0xc0000, 0x10ffff]))
BYTE_TEXTS = [EVERY_UTF8_BYTE, "The Python ", "  two  spaces\n\nnewlines\r\n\ttab ", "héllo wörld — “quoted”",
              "日本語のテキスト", "emoji 🎉 and a family 👩‍👩‍👧", ""]


def test_byte_tokenizer_export_gives_our_ids_in_transformers(tmp_path):
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    from trainer.data import ByteTokenizer
    from trainer.hf.tokenizer import is_byte_tokenizer_json

    out = _export(_weights(_random_moe(BASE)), BASE, tmp_path / "hf", tokenizer=resolve_tokenizer("byte"))
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json",
                                                     "tokenizer_config.json"]
    assert stat.S_IMODE((out / "tokenizer.json").stat().st_mode) == 0o644 and is_byte_tokenizer_json(
        out / "tokenizer.json")
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(out))
    config = json.loads((out / "config.json").read_text())
    assert (hf_tok.bos_token_id, hf_tok.eos_token_id, len(hf_tok)) == (256, 257, 258)
    assert (config["bos_token_id"], config["eos_token_id"]) == (256, 257)
    # id b is GPT-2's character for byte b (transformers' own table), so every byte decodes as itself.
    assert hf_tok.convert_ids_to_tokens(list(range(256))) == [bytes_to_unicode()[b] for b in range(256)]
    ours = ByteTokenizer()
    for text in BYTE_TEXTS:
        ids = hf_tok(text)["input_ids"]
        assert ids == ours.encode(text), text[:40]
        assert hf_tok.decode(ids) == text == ours.decode(ids), text[:40]
    # The docs' prompt: the EOS token's text is the special id, then bytes.
    assert hf_tok(hf_tok.eos_token + "Hi")["input_ids"] == [257, ord("H"), ord("i")]
    # The trainer's own tokenizer.json reader (the tokenizers package) finds the same ids and BOS/EOS.
    pytest.importorskip("tokenizers")
    from trainer.data import build_tokenizer

    theirs = build_tokenizer(str(out / "tokenizer.json"))
    assert (theirs.vocab_size, theirs.bos_id, theirs.eos_id) == (258, 256, 257)
    assert all(theirs.encode(text) == ours.encode(text) for text in BYTE_TEXTS)


def _checkpoint_with_tokenizer(tmp_path: Path) -> tuple[Path, Path]:
    from trainer.checkpoint import run_tokenizer

    path = _tokenizer_json(tmp_path / "tok.json")
    assert run_tokenizer("synthetic", str(path)) == {}  # random tokens: no tokenizer made them
    run = RunInfo(flavor="debug_moe", model_args=BASE, mixed_precision="fp32", **run_tokenizer("shards", str(path)))
    ckpt = save_model_only(tmp_path / "ckpt", _weights(_random_moe(BASE)), run=run, source="test")
    return ckpt, path


def test_checkpoint_holds_the_tokenizer_and_an_export_checks_it(tmp_path):
    from trainer.checkpoint.tokenizer import recorded_tokenizer
    from trainer.data import tokenizer_fingerprint

    ckpt, path = _checkpoint_with_tokenizer(tmp_path)
    info = json.loads((ckpt / "checkpoint.json").read_text())
    assert info["tokenizer"] == {"spec": "tokenizer.json", "fingerprint": tokenizer_fingerprint(str(path))}
    assert (ckpt / "tokenizer.json").read_bytes() == path.read_bytes() and "tokenizer.json" in info["files"]
    path.unlink()  # the checkpoint's own copy is what an export reads
    spec, fingerprint = recorded_tokenizer(ckpt, info)
    assert spec == str(ckpt / "tokenizer.json") and resolve_tokenizer(spec, fingerprint=fingerprint).eos_id == 0
    copy = ckpt / "tokenizer.json"
    copy.write_text(copy.read_text().replace("experts", "expert"))
    with pytest.raises(ExportError, match=f"tokenizer {copy} has changed since the run"):
        resolve_tokenizer(spec, fingerprint=fingerprint)
    copy.unlink()
    with pytest.raises(ExportError, match="does not exist; pass --tokenizer=PATH of the run's tokenizer.json, or "
                                          "--no-tokenizer"):
        resolve_tokenizer(spec)


def test_generate_greedy_matches_transformers_generate(tmp_path):
    from trainer.models.generate import generate

    model = _random_moe(BASE)
    out = _export(_weights(model), BASE, tmp_path / "hf")
    prompt = TOKENS[0, :7].tolist()
    ours = generate(model, prompt, max_new_tokens=12, temperature=0)
    with torch.no_grad():
        theirs = _hf(out).generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, top_k=None,
                                   top_p=None, eos_token_id=None, pad_token_id=0)
    assert ours == theirs[0, len(prompt):].tolist()
    # Sampling: the same seed gives the same tokens; top_k=1 is greedy whatever the temperature.
    assert generate(model, prompt, max_new_tokens=8, seed=3) == generate(model, prompt, max_new_tokens=8, seed=3)
    assert generate(model, prompt, max_new_tokens=8, temperature=5.0, top_k=1) == ours[:8]
