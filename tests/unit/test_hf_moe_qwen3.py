"""Qwen3-MoE to and from transformers (`Qwen3MoeForCausalLM`, trainer/hf/moe_qwen3.py), both ways by fp32 logits.

Our export of random small MoE models with q/k norms loads with `AutoModelForCausalLM.from_pretrained` (transformers'
own modeling code: the independent implementation) and gives our logits within 1e-4 relative; random transformers
Qwen3-MoE models of any shape (mlp_only_layers, decoder_sparse_step, head_dim, tied head, norm_topk_prob), saved by
`save_pretrained`, load here (`load_model`, no flavor) with transformers' logits. The Ernie / Glm4Moe layouts:
tests/unit/test_hf_moe.py, whose helpers these cases share.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tests.helpers import REPO, env
from tests.unit.test_hf_moe import _export, _hf, _logits, _relative, _weights
from trainer.checkpoint import load_model
from trainer.hf import ExportError, check_exportable, hf_config, read_hf_config, read_hf_weights
from trainer.models.layers import RopeScaling
from trainer.models.moe import MOE_FLAVORS, MoEArgs, MoEBlock, MoETransformer

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

# Every other block MoE (1, 3), head_dim 48 apart from dim / n_heads, renormalized top-2 of 8 experts.
BASE = replace(MOE_FLAVORS["qwen3_moe_debug"], max_seq_len=64)
TOKENS = torch.randint(0, BASE.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))


def _random_qwen3_moe(args: MoEArgs) -> MoETransformer:
    """The pretraining init, with q/k and block norms away from 1 (at 1 a norm mapped to the wrong place would pass)."""
    with torch.device("meta"):
        model = MoETransformer(args)
    model.to_empty(device="cpu")
    model.tie_weights()  # nn.Module.to_empty gives each module its own new Parameter: one table again
    model.init_weights(seed=0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=gen))
    return model.eval()


CASES = {
    "qwen3_moe_debug": dict(),
    "top-k as scored": dict(route_norm=False),
    # mlp_only_layers [0, 2] from our leading dense block and a listed one; blocks 1 and 3 route.
    "n_dense_layers and dense_layers": dict(sparse_step=1, n_dense_layers=1, dense_layers=(2,)),
    "tied, head_dim of dim / n_heads, llama3 rope": dict(
        tie_word_embeddings=True, explicit_head_dim=0, rope_theta=500000.0, max_seq_len=128,
        rope_scaling=RopeScaling(factor=8.0, original_max_seq_len=32)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_qwen3_moe_export_gives_our_logits_in_transformers_and_imports_back(case, tmp_path):
    args = replace(BASE, **CASES[case])
    model = _random_qwen3_moe(args)
    weights = _weights(model)
    ours = _logits(model)
    out = _export(weights, args, tmp_path / "hf")
    hf = _hf(out)
    assert type(hf).__name__ == "Qwen3MoeForCausalLM"
    # transformers builds the same blocks sparse (its own rule, from decoder_sparse_step and mlp_only_layers).
    assert [type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock" for layer in hf.model.layers] == [
        isinstance(block, MoEBlock) for block in model.layers.values()]
    assert _relative(_logits(hf), ours) < 1e-4, case
    # Import back: the same tensors (the expert biases zero, as they were), the same model from config.json alone.
    back = read_hf_weights(out, args=args)
    assert sorted(back) == sorted(weights) and all(torch.equal(back[k], weights[k]) for k in weights)
    read = read_hf_config(out)
    # All but what config.json does not hold (the context of a RoPE-scaled model); the leading dense blocks come back
    # among the listed ones: the same blocks.
    mlp_only = tuple(sorted(set(range(args.n_dense_layers)) | set(args.dense_layers)))
    assert read == replace(args, max_seq_len=read.max_seq_len, n_dense_layers=0, dense_layers=mlp_only)
    assert torch.equal(_logits(load_model(out, max_seq_len=args.max_seq_len)), ours)


def _transformers_qwen3_moe(folder: Path, **config) -> torch.nn.Module:
    """A random Qwen3MoeForCausalLM of transformers' own making, saved as save_pretrained writes it."""
    torch.manual_seed(0)
    shape = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
                 max_position_embeddings=128)
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**{**shape, **config})).eval()
    with torch.no_grad():  # the router starts at zero and the norms at one: random, so each must be mapped right
        for name, p in model.named_parameters():
            p.copy_(1 + 0.3 * torch.randn_like(p) if name.endswith("norm.weight") else 0.1 * torch.randn_like(p))
    model.save_pretrained(str(folder))
    return model


@pytest.mark.parametrize("config", [
    dict(),
    dict(decoder_sparse_step=2, norm_topk_prob=True, head_dim=24),
    dict(mlp_only_layers=[0, 3], norm_topk_prob=True, tie_word_embeddings=True),
    dict(decoder_sparse_step=3, mlp_only_layers=[2], rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
], ids=["defaults", "sparse-step-2-head-dim", "mlp-only-tied", "sparse-step-3-mlp-only"])
def test_a_transformers_qwen3_moe_of_any_shape_loads_with_its_logits(config, tmp_path):
    theirs = _transformers_qwen3_moe(tmp_path / "hf", **config)
    saved = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert "num_local_experts" in saved  # transformers 5's name for num_experts: read as that
    ours = load_model(tmp_path / "hf")
    assert isinstance(ours, MoETransformer) and ours.args.qk_norm and ours.args.n_shared_experts == 0
    assert [isinstance(block, MoEBlock) for block in ours.layers.values()] == [
        type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock" for layer in theirs.model.layers]
    tokens = TOKENS % 300
    assert _relative(_logits(ours, tokens), _logits(theirs, tokens)) < 1e-4
    # And out again: our export of it is what transformers saved, to the config.json keys that select the model.
    out = _export(_weights(ours), ours.args, tmp_path / "again")
    assert _relative(_logits(_hf(out), tokens), _logits(theirs, tokens)) < 1e-4


def test_generate_script_samples_from_a_transformers_qwen3_moe(tmp_path):
    """scripts/generate.py on a folder transformers saved: our greedy tokens are transformers' own."""
    theirs = _transformers_qwen3_moe(tmp_path / "hf", decoder_sparse_step=2)
    prompt = "The "
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "generate.py"), str(tmp_path / "hf"),
                           f"--prompt={prompt}", "--max-new-tokens=8", "--temperature=0", "--tokenizer=byte"],
                          capture_output=True, text=True, env=env(), cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    from trainer.data import ByteTokenizer

    tok = ByteTokenizer()
    ids = [tok.eos_id, *tok.encode(prompt)]  # the prompt follows the end-of-document token, as in training
    with torch.no_grad():
        greedy = theirs.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, top_k=None, top_p=None,
                                 eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    assert proc.stdout.rstrip("\n") == prompt + tok.decode(greedy)


def test_what_qwen3_moe_has_no_place_for_is_refused_in_one_line(tmp_path):
    for changes, message in [
        (dict(bias_update_rate=1e-3), "moe.bias_update_rate=0.001 has no mapping in Qwen3MoeForCausalLM"),
        (dict(n_shared_experts=1), "moe.n_shared_experts=1 has no mapping in Qwen3MoeForCausalLM"),
        (dict(score_func="sigmoid"), "moe.score_func='sigmoid' has no mapping in Qwen3MoeForCausalLM"),
        # Without q/k norms the export is Ernie's, which has no place for Qwen3-MoE's rule.
        (dict(qk_norm=False, explicit_head_dim=0), "moe.sparse_step=2 has no mapping in this trainer's MoE export "
                                                   "(Ernie4_5_MoeForCausalLM)"),
    ]:
        with pytest.raises(ExportError, match=message.replace("(", r"\(").replace(")", r"\)")):
            check_exportable(replace(BASE, **changes))
    # Biases a balancer moved, in a model whose args no longer say so: refused before a wrong export is published.
    weights = _weights(_random_qwen3_moe(BASE))
    weights["layers.1.moe.router.expert_bias"][0] = 0.5
    with pytest.raises(ExportError, match="an expert bias is not zero .* Qwen3MoeForCausalLM has none") as e:
        _export(weights, BASE, tmp_path / "hf")
    assert "\n" not in str(e.value) and not (tmp_path / "hf").exists()


def _edited(out: Path, **changes) -> Path:
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, **changes}))
    return out


@pytest.mark.parametrize("changes, message", [
    (dict(mlp_only_layers=[1, 7]), "mlp_only_layers holds 7, not a block of num_hidden_layers=4"),
    (dict(mlp_only_layers=["1"]), "mlp_only_layers[0]='1' must be an integer"),
    (dict(decoder_sparse_step=0), "decoder_sparse_step=0 must be an integer in [1,"),
    (dict(num_local_experts=4), "num_experts=8 but num_local_experts=4 (two names of one count)"),
    (dict(use_sliding_window=True), "use_sliding_window=True has no equivalent"),
    # Qwen3's long-context setting: refused, not read as plain RoPE.
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}),
     "rope_type='yarn' has no equivalent in this trainer"),
])
def test_a_config_json_ours_cannot_hold_is_one_line_naming_the_key(changes, message, tmp_path):
    out = _edited(_export(_weights(_random_qwen3_moe(BASE)), BASE, tmp_path / "hf"), **changes)
    with pytest.raises(ExportError) as e:
        read_hf_config(out)
    assert message in str(e.value) and str(e.value).startswith(str(out / "config.json"))


def test_import_checks_which_blocks_route_against_the_flavor(tmp_path):
    out = _export(_weights(_random_qwen3_moe(BASE)), BASE, tmp_path / "hf")
    with pytest.raises(ExportError, match=r"config.json: decoder_sparse_step=2 and mlp_only_layers=\[\] make blocks "
                                          r"\[1, 3\] MoE, but the trainer model's MoE blocks are \[1, 2, 3\]"):
        read_hf_weights(out, args=replace(BASE, sparse_step=1, dense_layers=(0,)))
    with pytest.raises(ExportError, match="config.json: num_experts=8 but the trainer model has 4"):
        read_hf_weights(out, args=replace(BASE, n_experts=4))
    with pytest.raises(ExportError, match="model_type='qwen3_moe', but the trainer model scores experts with "
                                          "softmax, whose layout is 'ernie4_5_moe'"):
        read_hf_weights(out, args=MOE_FLAVORS["debug_moe"])
    # An Ernie folder read as a model with Qwen3-MoE's rule but no q/k norms: the rule is what it cannot hold.
    ernie = replace(MOE_FLAVORS["debug_moe"], max_seq_len=64)
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in MoETransformer(ernie).state_dict().items()}
    folder = _export({k: torch.zeros(s) for k, s in shapes.items()}, ernie, tmp_path / "ernie")
    with pytest.raises(ExportError, match=r"the trainer model has moe.sparse_step=2 and moe.dense_layers=\[\], "
                                          "which ernie4_5_moe has no place for"):
        read_hf_weights(folder, args=replace(ernie, sparse_step=2))


def test_qwen3_30b_a3b_config_is_the_published_one():
    """The flavor's config.json holds Qwen/Qwen3-30B-A3B's values (its published config.json, the keys that shape or
    route the model), and transformers' own config class reads them as such."""
    published = {"hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
                 "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
                 "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
                 "vocab_size": 151936, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
                 "max_position_embeddings": 40960, "tie_word_embeddings": False, "router_aux_loss_coef": 0.001,
                 "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"]}
    config = hf_config(MOE_FLAVORS["qwen3_30b_a3b"], dtype=torch.bfloat16)
    assert {k: config[k] for k in published} == published
    hf = transformers.AutoConfig.for_model("qwen3_moe", **{k: v for k, v in config.items() if k != "model_type"})
    assert (hf.num_experts, hf.head_dim, hf.mlp_only_layers, hf.decoder_sparse_step) == (128, 128, [], 1)
