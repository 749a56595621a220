"""GPT-OSS against transformers' GptOssForCausalLM (its own modeling code: the independent implementation), both ways.

Export: a small model of ours with every weight random (biases, sinks, router bias included), a sequence longer than
its sliding window and YaRN on, loaded by `AutoModelForCausalLM.from_pretrained`: fp32 logits within 1e-4 relative.
Import: a GptOssForCausalLM that transformers builds and saves, of other shapes (head_dim apart from
hidden / heads, one kv head, another layer pattern, YaRN with truncate, plain RoPE), read by `load_model`.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tests.unit.test_hf_moe import _export, _hf, _relative, _weights
from trainer.checkpoint import RunInfo, load_model, save_model_only
from trainer.hf import ExportError, expected_shapes, read_hf_config, read_hf_weights
from trainer.model_values import GptOssArgs, YarnScaling
from trainer.models import build_model
from trainer.models.counts import num_tensors
from trainer.models.gpt_oss import FLAVORS, GptOssTransformer

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

# debug_gpt_oss with 3 layers and a window of 8: the 40-token rows below cross it on the sliding layers.
BASE = replace(FLAVORS["debug_gpt_oss"], n_layers=3, sliding_window=8, max_seq_len=64)
TOKENS = torch.randint(0, BASE.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))


def _random_model(args: GptOssArgs, *, seed: int = 0) -> GptOssTransformer:
    """Every parameter random (the pretraining init leaves the biases 0, which would test nothing)."""
    with torch.device("meta"):
        model = build_model(args)
    model.to_empty(device="cpu")
    model.tie_weights()  # to_empty gives the tied head a tensor of its own (torch 2.13)
    model.init_weights(seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith("norm.weight"):
                p.copy_(torch.randn(p.shape, generator=gen) * (0.5 if name.endswith(("sinks", "bias", "b13", "b2"))
                                                                else 0.08))
    return model.eval()


def _logits(model, tokens: torch.Tensor = TOKENS) -> torch.Tensor:
    with torch.no_grad():
        return model.logits(tokens) if isinstance(model, GptOssTransformer) else model(tokens).logits


EXPORT_CASES = {
    "debug flavor, yarn, window 8": {},
    "every layer sliding, plain rope": dict(full_attention_interval=4, rope_yarn=None),
    "no window, tied head, 1 kv head": dict(sliding_window=0, full_attention_interval=1, tie_word_embeddings=True,
                                            n_kv_heads=1),
    # cos and sin times the mscale ratio (0.707 ln 4 + 1) / (ln 4 + 1); the softmax scale unchanged, as GptOss has it.
    "yarn with mscales": dict(rope_yarn=YarnScaling(factor=4.0, original_max_seq_len=32, mscale=0.707,
                                                    mscale_all_dim=1.0)),
}


@pytest.mark.parametrize("case", list(EXPORT_CASES))
def test_export_gives_our_logits_in_transformers_and_imports_back(case, tmp_path):
    args = replace(BASE, **EXPORT_CASES[case])
    model = _random_model(args)
    weights = _weights(model)
    ours = _logits(model)
    out = _export(weights, args, tmp_path / "hf")
    hf = _hf(out)
    assert type(hf).__name__ == "GptOssForCausalLM"
    assert _relative(_logits(hf), ours) < 1e-4, case
    back = read_hf_weights(out, args=args)
    assert list(back) == list(expected_shapes(args)) and all(torch.equal(back[k], weights[k]) for k in weights)
    read = read_hf_config(out)
    assert replace(read, max_seq_len=args.max_seq_len) == args
    assert torch.equal(_logits(load_model(out, max_seq_len=args.max_seq_len)), ours)


def test_sinks_window_and_biases_each_change_the_logits():
    """What the parity above pins: each GPT-OSS piece moves the logits (so a mapping that dropped one would fail)."""
    model = _random_model(BASE)
    ours = _logits(model)
    changes = {
        "sinks": lambda m: [b.attention.sinks.fill_(-1e4) for b in m.layers.values()],
        "window": lambda m: [setattr(b.attention, "window", 0) for b in m.layers.values()],
        "expert biases": lambda m: [b.moe.experts.b13.zero_() for b in m.layers.values()],
        "router bias": lambda m: [b.moe.router.gate.bias.zero_() for b in m.layers.values()],
        "clamp": lambda m: [setattr(b.moe.experts, "glu", replace(b.moe.experts.glu, limit=1.0))
                            for b in m.layers.values()],
    }
    for name, change in changes.items():
        other = _random_model(BASE)
        with torch.no_grad():
            change(other)
        assert _relative(_logits(other), ours) > 1e-3, name


IMPORT_CASES = {
    "head_dim 24, 1 kv head, full every 3rd, yarn truncate": dict(
        head_dim=24, num_key_value_heads=1, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters={"rope_type": "yarn", "factor": 8.0, "beta_fast": 16.0, "beta_slow": 2.0, "truncate": True,
                         "original_max_position_embeddings": 16, "rope_theta": 5000.0}),
    "plain rope, swiglu limit 3": dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                                       swiglu_limit=3.0),
}


def _transformers_model(tmp_path: Path, **changes):
    shape = dict(hidden_size=64, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=300, num_local_experts=4, num_experts_per_tok=2,
                 sliding_window=6, max_position_embeddings=256)
    config = transformers.GptOssConfig(**{**shape, **changes})
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(config).float().eval()
    with torch.no_grad():  # transformers' init leaves the biases 0: random here, so the import has to map them
        for name, p in model.named_parameters():
            if name.endswith(("bias", "sinks")):
                p.normal_(0, 0.5)
    model.save_pretrained(str(tmp_path / "theirs"))
    return model, tmp_path / "theirs"


@pytest.mark.parametrize("case", list(IMPORT_CASES))
def test_a_transformers_model_loads_with_its_logits(case, tmp_path):
    theirs, folder = _transformers_model(tmp_path, **IMPORT_CASES[case])
    tokens = TOKENS % 300
    ours = load_model(folder)
    assert isinstance(ours, GptOssTransformer) and len(ours.state_dict()) == num_tensors(ours.args)
    assert _relative(_logits(ours, tokens), _logits(theirs, tokens)) < 1e-4, case
    # Exported again: transformers reads the same model.
    out = _export(_weights(ours), ours.args, tmp_path / "again")
    assert _relative(_logits(_hf(out), tokens), _logits(theirs, tokens)) < 1e-4


def test_shipped_20b_flavor_is_the_published_shape():
    """gpt_oss_20b: openai/gpt-oss-20b's config.json values, in transformers' own config class; 20.9B parameters,
    3.6B active (the model card's 21B and 3.6B)."""
    from trainer.hf import hf_config
    from trainer.models import param_counts

    args = FLAVORS["gpt_oss_20b"]
    config = hf_config(args, dtype=torch.bfloat16)
    hf = transformers.AutoConfig.for_model("gpt_oss", **{k: v for k, v in config.items() if k != "model_type"})
    assert (hf.hidden_size, hf.num_hidden_layers, hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim,
            hf.num_local_experts, hf.num_experts_per_tok, hf.intermediate_size, hf.vocab_size, hf.sliding_window) == (
        2880, 24, 64, 8, 64, 32, 4, 2880, 201088, 128)
    assert hf.layer_types[:2] == ["sliding_attention", "full_attention"] and hf.max_position_embeddings == 131072
    assert hf.rope_parameters["rope_type"] == "yarn" and hf.rope_parameters["factor"] == 32.0
    total, active = param_counts(args)
    assert round(total / 1e9, 2) == 20.91 and round(active / 1e9, 2) == 3.61


def test_quantized_folders_and_a_moved_balancing_bias_are_refused_in_one_line(tmp_path):
    out = _export(_weights(_random_model(BASE)), BASE, tmp_path / "hf")
    config = json.loads((out / "config.json").read_text())
    # MXFP4 experts are read (tests/unit/test_hf_mxfp4.py); another quantization is refused, naming the key.
    (out / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "bitsandbytes"}}))
    with pytest.raises(ExportError) as e:
        read_hf_config(out)
    assert "quantization_config.quant_method='bitsandbytes': a quantized folder" in str(e.value)
    assert "\n" not in str(e.value)
    (out / "config.json").write_text(json.dumps({**config, "layer_types": ["full_attention", "sliding_attention",
                                                                           "full_attention"]}))
    with pytest.raises(ExportError, match="layer_types has no equivalent in this trainer"):
        read_hf_config(out)
    (out / "config.json").write_text(json.dumps({**config, "num_local_experts": 4}))
    with pytest.raises(ExportError, match="num_local_experts gives n_experts=4 but the trainer model has 8"):
        read_hf_weights(out, args=BASE)
    model = _random_model(BASE)
    model.layers["1"].moe.router.expert_bias.fill_(0.01)
    with pytest.raises(ExportError, match=r"layers.1.moe.router.expert_bias is not zero .* moe.bias_update_rate=0"):
        _export(_weights(model), BASE, tmp_path / "biased")


def test_yarn_rope_equals_transformers_tables():
    """Our YaRN inverse frequencies and attention factor are transformers' (the "yarn" rope_type)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from trainer.models.layers import rope_cache, rope_inv_freq

    for yarn in (YarnScaling(), YarnScaling(factor=8.0, beta_fast=16.0, beta_slow=2.0, original_max_seq_len=512,
                                            truncate=True),
                 YarnScaling(factor=40.0, truncate=True, mscale=0.707, mscale_all_dim=1.0)):  # DeepSeek's ratio
        args = replace(FLAVORS["gpt_oss_20b"], rope_yarn=yarn)
        config = transformers.GptOssConfig(head_dim=64, rope_parameters={
            "rope_type": "yarn", "rope_theta": args.rope_theta, "factor": yarn.factor, "beta_fast": yarn.beta_fast,
            "beta_slow": yarn.beta_slow, "original_max_position_embeddings": yarn.original_max_seq_len,
            "truncate": yarn.truncate, **({"mscale": yarn.mscale, "mscale_all_dim": yarn.mscale_all_dim}
                                          if yarn.mscale else {})})
        inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
        assert torch.allclose(rope_inv_freq(args), inv_freq, rtol=1e-6, atol=0)
        assert yarn.attention_factor == pytest.approx(factor)
        assert rope_cache(args, 4)[0, 0, 0].item() == pytest.approx(factor)  # cos(0) times the factor


def test_load_model_and_generation_match_transformers(tmp_path):
    from trainer.models.generate import generate

    model = _random_model(BASE)
    weights = _weights(model)
    save_model_only(tmp_path / "ckpt", weights, run=RunInfo(flavor="debug_gpt_oss", model_args=BASE,
                                                            mixed_precision="fp32"), source="test")
    loaded = load_model(tmp_path / "ckpt")
    assert isinstance(loaded, GptOssTransformer) and loaded.args == BASE
    assert torch.equal(_logits(loaded), _logits(model))
    out = _export(weights, BASE, tmp_path / "hf")
    prompt = TOKENS[0, :7].tolist()
    ours = generate(model, prompt, max_new_tokens=12, temperature=0)  # 19 tokens: past the window of 8
    with torch.no_grad():
        theirs = _hf(out).generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, top_k=None,
                                   top_p=None, eos_token_id=None, pad_token_id=0)
    assert ours == theirs[0, len(prompt):].tolist()


def test_an_import_into_a_flavor_takes_the_folders_top_k(tmp_path):
    """scripts/convert_checkpoint.py import --flavor: the flavor's args with the folder's routing (top_k)."""
    from trainer.hf import family
    from trainer.hf.folder import read_config

    out = _export(_weights(_random_model(BASE)), replace(BASE, top_k=3), tmp_path / "hf")
    routed = family(BASE).with_routing_of(BASE, read_config(out), where="config.json")
    assert routed == replace(BASE, top_k=3)
