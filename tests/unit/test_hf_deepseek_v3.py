"""DeepSeek-V3 to and from transformers' DeepseekV3ForCausalLM, both directions, by fp32 logits to 1e-4 relative.

Export: a small random model of ours (MLA with and without q LoRA, v_head_dim apart from the query's, group-limited
routing with a routing-changing expert bias, routed_scaling_factor) written and loaded with
`AutoModelForCausalLM.from_pretrained` (transformers' own modeling code: the independent implementation).
Import: a random transformers model saved by `save_pretrained` (its own writer, with MTP tensors added as DeepSeek's
checkpoints hold them) read by `load_model`; then greedy generation against transformers' `generate`. YaRN RoPE as
DeepSeek-V3/R1's config.json gives it (and with mscale apart from mscale_all_dim): imported, generated from, exported
back with its rope_scaling.
"""

from __future__ import annotations

import copy
import json
import logging
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.unit.test_hf_moe import _hf, _relative, _weights
from trainer.checkpoint import load_model
from trainer.hf import ExportError, expected_shapes, read_hf_config, read_hf_weights, write_hf_export
from trainer.model_values import DeepseekV3Args, YarnScaling
from trainer.models.deepseek_v3 import FLAVORS, DeepseekV3, GroupRouter
from trainer.models.layers import rope_cache

transformers = pytest.importorskip("transformers")

# debug_deepseek_v3's shapes with 3 blocks (the first dense) and no MTP module: MLA with q LoRA, 2 expert groups.
BASE = replace(FLAVORS["debug_deepseek_v3"], n_layers=3, max_seq_len=64, mtp_layers=0)
TOKENS = torch.randint(0, BASE.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))


def _random(args: DeepseekV3Args) -> DeepseekV3:
    """The pretraining init, with random expert biases of the size the balancer reaches."""
    with torch.device("meta"):
        model = DeepseekV3(args)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    gen = torch.Generator().manual_seed(1)
    for module in model.modules():
        if isinstance(module, GroupRouter):
            module.expert_bias.copy_(torch.randn(args.n_experts, generator=gen) * 0.05)
    return model.eval()


def _export(weights: dict[str, torch.Tensor], args: DeepseekV3Args, out: Path) -> Path:
    shapes = expected_shapes(args)
    return write_hf_export(out, args=args, shapes=shapes, fetch=lambda fqns: {k: weights[k] for k in fqns},
                           dtype=torch.float32)


def _logits(model, tokens: torch.Tensor = TOKENS) -> torch.Tensor:
    with torch.no_grad():
        return model.logits(tokens) if isinstance(model, DeepseekV3) else model(tokens).logits


CASES = {
    # q LoRA, 2 groups of 4 experts (1 chosen), scaled weights, a shared expert, v heads as wide as the nope part.
    "q lora, groups": dict(),
    # A plain q_proj, 4 groups (2 chosen), top-3, v heads wider than the query's, 2 shared experts, no dense block.
    "plain q, wide v": dict(q_lora_rank=0, n_group=4, topk_group=2, top_k=3, v_head_dim=64, n_shared_experts=2,
                            n_dense_layers=0, routed_scaling_factor=1.0),
    # One group, no renormalization, v heads narrower, no shared experts (transformers' zero-width ones).
    "one group, narrow v, no shared": dict(n_group=1, topk_group=1, route_norm=False, v_head_dim=16,
                                           n_shared_experts=0),
}


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors is a no-op")
@pytest.mark.parametrize("case", list(CASES))
def test_export_gives_our_logits_in_transformers_and_imports_back(case, tmp_path):
    args = replace(BASE, **CASES[case])
    model = _random(args)
    weights = _weights(model)
    ours = _logits(model)
    without_bias = copy.deepcopy(model)  # the bias changes routing here, so the export must carry it
    for router in (m for m in without_bias.modules() if isinstance(m, GroupRouter)):
        router.expert_bias.zero_()
    assert _relative(_logits(without_bias), ours) > 1e-3
    hf = _hf(_export(weights, args, tmp_path / "hf"))
    assert type(hf).__name__ == "DeepseekV3ForCausalLM"
    assert _relative(_logits(hf), ours) < 1e-4, case
    back = read_hf_weights(tmp_path / "hf", args=args)
    assert all(torch.equal(back[k], weights[k]) for k in back) and set(back) == set(weights)
    read = read_hf_config(tmp_path / "hf")
    assert replace(read, bias_update_rate=args.bias_update_rate, max_seq_len=args.max_seq_len) == args
    assert torch.equal(_logits(load_model(tmp_path / "hf", max_seq_len=args.max_seq_len)), ours)


def _hf_config(**changes) -> "transformers.DeepseekV3Config":
    values = dict(vocab_size=300, hidden_size=96, intermediate_size=160, moe_intermediate_size=48,
                  num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
                  n_routed_experts=8, routed_scaling_factor=2.0, kv_lora_rank=24, q_lora_rank=40,
                  qk_rope_head_dim=8, v_head_dim=20, qk_nope_head_dim=12, n_group=4, topk_group=2,
                  num_experts_per_tok=3, first_k_dense_replace=1, norm_topk_prob=True, max_position_embeddings=64,
                  rope_interleave=True, rms_norm_eps=1e-6, tie_word_embeddings=False)
    return transformers.DeepseekV3Config(**(values | changes))


def _random_hf(config) -> "transformers.PreTrainedModel":
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():  # transformers inits the router and the bias to 0: random ones, so routing is exercised
        for name, p in model.named_parameters():
            p.normal_(0, 0.3 if "gate" in name else 0.05) if "norm" not in name else p.uniform_(0.8, 1.2)
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.normal_(0, 0.05)
    return model


@pytest.mark.parametrize("q_lora_rank", [40, None])
def test_import_of_a_transformers_model_gives_its_logits_and_skips_mtp(q_lora_rank, tmp_path, caplog):
    hf = _random_hf(_hf_config(q_lora_rank=q_lora_rank))
    hf.save_pretrained(tmp_path / "hf")
    # DeepSeek's checkpoints hold the MTP module as model.layers.{num_hidden_layers}.*: add one such tensor.
    files = sorted((tmp_path / "hf").glob("*.safetensors"))
    assert len(files) == 1
    tensors = load_file(files[0])
    tensors["model.layers.3.eh_proj.weight"] = torch.zeros(96, 192)
    save_file(tensors, files[0], metadata={"format": "pt"})
    with caplog.at_level(logging.INFO, logger="trainer.hf"):
        ours = load_model(tmp_path / "hf")
    assert "skipped 1 tensors of MTP modules (model.layers.3 and after)" in caplog.text
    assert isinstance(ours, DeepseekV3) and ours.args.q_lora_rank == (q_lora_rank or 0)
    assert (ours.args.n_group, ours.args.topk_group, ours.args.routed_scaling_factor) == (4, 2, 2.0)
    tokens = TOKENS % 300
    assert _relative(_logits(ours, tokens), _logits(hf, tokens)) < 1e-4
    # Greedy generation: the same tokens as transformers' generate.
    from trainer.models.generate import generate

    prompt = tokens[0, :6].tolist()
    mine = generate(ours, prompt, max_new_tokens=8, temperature=0)
    with torch.no_grad():
        theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, top_k=None, top_p=None,
                             eos_token_id=None, pad_token_id=0)
    assert mine == theirs[0, len(prompt):].tolist()


def test_mtp_modules_are_left_out_of_the_export_with_a_note(tmp_path, caplog):
    args = replace(BASE, mtp_layers=1)
    model = _random(args)
    weights = _weights(model)
    with caplog.at_level(logging.WARNING, logger="trainer.hf"):
        out = _export(weights, args, tmp_path / "hf")
    assert "the 1 MTP modules (layers.3..) are not exported" in caplog.text
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 0
    assert _relative(_logits(_hf(out)), _logits(model)) < 1e-4  # the MTP module plays no part in the logits
    # As a run's export and convert_checkpoint.py give it: every tensor of the model, the MTP module's too (these
    # were refused as "unexpected layers.3..." before the export left them out itself).
    assert any(k.startswith("layers.3.") for k in weights)
    whole = write_hf_export(tmp_path / "whole", args=args, shapes={k: tuple(v.shape) for k, v in weights.items()},
                            fetch=lambda fqns: {k: weights[k] for k in fqns}, dtype=torch.float32)
    written, expected = load_file(str(whole / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert written.keys() == expected.keys() and all(torch.equal(written[k], expected[k]) for k in expected)


@pytest.mark.parametrize("change, message", [
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0}},
     "rope_type='dynamic': this trainer's DeepSeek-V3 takes plain RoPE or 'yarn'"),
    ({"rope_scaling": {"type": "yarn", "factor": 4.0, "attention_factor": 1.2}},
     "rope attention_factor=1.2 has no equivalent in this trainer's YaRN"),
    ({"rope_scaling": {"type": "yarn", "factor": -4.0}}, "rope_scaling.factor=-4.0 must be in (0, 1e"),
    ({"rope_interleave": False}, "rope_interleave=False has no equivalent"),
    ({"n_group": 3}, "n_routed_experts=8 must be a multiple of n_group=3"),
    ({"topk_group": 5}, "topk_group=5 must be at most n_group=2"),
])
def test_unsupported_configs_are_refused_in_one_line(change, message, tmp_path):
    args = BASE
    out = _export(_weights(_random(args)), args, tmp_path / "hf")
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ExportError, match=message.replace("(", r"\(").replace(")", r"\)")):
        read_hf_config(out)


# DeepSeek-V3/R1's rope_scaling as their config.json spells it (transformers 4's key, "type"), at an original context
# of 4 so that 24 tokens run far past it; then one with mscale apart from mscale_all_dim (cos and sin scaled too).
YARN_CASES = {
    "deepseek-v3's": ({"type": "yarn", "factor": 40, "original_max_position_embeddings": 4, "beta_fast": 32,
                       "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
                      YarnScaling(factor=40.0, original_max_seq_len=4, truncate=True, mscale=1.0, mscale_all_dim=1.0)),
    "mscale apart, no truncation": ({"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 6,
                                     "beta_fast": 16.0, "beta_slow": 2.0, "mscale": 0.707, "mscale_all_dim": 0.5,
                                     "truncate": False},
                                    YarnScaling(factor=8.0, beta_fast=16.0, beta_slow=2.0, original_max_seq_len=6,
                                                mscale=0.707, mscale_all_dim=0.5)),
}


@pytest.mark.parametrize("case", list(YARN_CASES))
def test_yarn_imports_with_transformers_logits_generates_and_exports_back(case, tmp_path):
    from trainer.models.generate import generate

    rope, yarn = YARN_CASES[case]
    _random_hf(_hf_config(max_position_embeddings=160)).save_pretrained(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config.pop("rope_parameters", None)
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "rope_scaling": rope, "rope_theta": 10000.0}))
    hf = _hf(tmp_path / "hf")  # transformers reads the folder as DeepSeek's is read
    mscale2 = (0.1 * yarn.mscale_all_dim * math.log(yarn.factor) + 1) ** 2
    assert hf.model.layers[0].self_attn.scaling == pytest.approx(20**-0.5 * mscale2)  # qk_head_dim 12 + 8
    ours = load_model(tmp_path / "hf")
    assert ours.args.rope_yarn == yarn and ours.args.max_seq_len == 160
    tokens = TOKENS % 300
    assert _relative(_logits(ours, tokens), _logits(hf, tokens)) < 1e-4
    # Each part of YaRN changes these logits: the softmax scale's mscale, and the frequencies with cos/sin's factor.
    unscaled = copy.deepcopy(ours)
    for block in unscaled.layers.values():
        block.attention.softmax_factor = 1.0
    assert _relative(_logits(unscaled, tokens), _logits(hf, tokens)) > 1e-3
    plain = copy.deepcopy(ours)
    plain.rope = rope_cache(replace(ours.args, rope_yarn=None), ours.args.max_seq_len)
    assert _relative(_logits(plain, tokens), _logits(hf, tokens)) > 1e-3
    prompt = tokens[0, :6].tolist()
    with torch.no_grad():
        theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, top_k=None, top_p=None,
                             eos_token_id=None, pad_token_id=0)
    assert generate(ours, prompt, max_new_tokens=10, temperature=0) == theirs[0, len(prompt):].tolist()
    # Export: rope_scaling written back (the mscales as given), read back equal, transformers' logits again.
    out = _export(_weights(ours), ours.args, tmp_path / "out")
    written = json.loads((out / "config.json").read_text())
    assert {k: written["rope_scaling"].get(k) for k in ("rope_type", "factor", "mscale", "mscale_all_dim")} == {
        "rope_type": "yarn", "factor": yarn.factor, "mscale": yarn.mscale, "mscale_all_dim": yarn.mscale_all_dim}
    assert written["max_position_embeddings"] == 160 and read_hf_config(out).rope_yarn == yarn
    assert _relative(_logits(_hf(out), tokens), _logits(ours, tokens)) < 1e-4
