"""Hugging Face models of any shape in and out (issue 33): Llama-family folders (SmolLM2-, TinyLlama- and
Llama-3.2-1B-shaped, tied or untied) and a Qwen3 one (per-head q/k norms, its own head_dim), made here with
transformers' config classes and random weights. Imported without a flavor, our model gives transformers' logits
(fp32, 1e-4 relative) and the same greedy text; exported back, the folder is the same architecture and transformers
gives our logits. What has no mapping is refused in one line naming the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from trainer.checkpoint.offline import build_model as model_with_weights
from trainer.hf import ExportError, open_hf_folder, read_hf_config, read_hf_weights, write_hf_export
from trainer.hf.config_values import rope_fields
from trainer.models.generate import generate

transformers = pytest.importorskip("transformers")

# Small versions of the published shapes (the ratios that matter: heads to kv heads, head_dim, tying, RoPE).
SHAPES = {
    # SmolLM2-135M: 9 heads over 3 kv heads, head_dim 64, tied, rope_theta 1e5.
    "smollm2": ("LlamaConfig", dict(hidden_size=96, intermediate_size=256, num_hidden_layers=2, num_attention_heads=3,
                                    num_key_value_heads=1, tie_word_embeddings=True, rope_theta=100000.0)),
    # TinyLlama-1.1B: 32 heads over 4 kv heads, intermediate 2.75 x hidden, untied.
    "tinyllama": ("LlamaConfig", dict(hidden_size=128, intermediate_size=352, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False,
                                      rope_theta=10000.0)),
    # Llama-3.2-1B: head_dim 64, tied, Llama 3 RoPE scaling (factor 32).
    "llama3.2-1b": ("LlamaConfig", dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True,
                                        rope_theta=500000.0, rope_scaling={
                                            "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    # Qwen3-0.6B: head_dim 128 with hidden 1024 and 16 heads (not hidden / heads), q/k norms, tied, rope_theta 1e6.
    "qwen3": ("Qwen3Config", dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=32, tie_word_embeddings=True, rope_theta=1e6,
                                  rms_norm_eps=1e-6)),
}
VOCAB = 160


def make_hf_folder(name: str, folder: Path, *, vocab: int = VOCAB) -> Path:
    """A transformers model of SHAPES[name] with random weights (norms too: 1 + noise), saved as safetensors."""
    config_class, fields = SHAPES[name]
    config = getattr(transformers, config_class)(vocab_size=vocab, max_position_embeddings=256, **fields)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if pname.endswith("norm.weight") else 0.05 * torch.randn_like(p))
    model.save_pretrained(folder)
    return folder


def hf_model(folder: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(str(folder)).float().eval()


def ours(folder: Path):
    read = open_hf_folder(folder)  # the one reader of import, load_model and generate
    return model_with_weights(read.args, read.read())


TOKENS = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_a_hugging_face_model_of_any_shape_imports_and_exports_with_its_logits(name: str, tmp_path: Path) -> None:
    folder = make_hf_folder(name, tmp_path / name)
    config = json.loads((folder / "config.json").read_text())
    model, reference = ours(folder), hf_model(folder)
    args = model.args
    assert (args.head_dim, args.tie_word_embeddings, args.qk_norm) == (
        config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
        config["tie_word_embeddings"], name == "qwen3")
    assert args.ffn_dim == config["intermediate_size"]
    if args.tie_word_embeddings:
        assert model.output_head.proj.weight is model.tok_embeddings.weight
    with torch.no_grad():
        expected = reference(TOKENS).logits
        torch.testing.assert_close(model.logits(TOKENS), expected, rtol=1e-4, atol=1e-5)
    prompt = TOKENS[0, :5].tolist()
    greedy = reference.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=0,
                                eos_token_id=None)[0, len(prompt):].tolist()
    assert generate(model, prompt, max_new_tokens=12, temperature=0) == greedy

    # Export back: the same architecture, one table where it was tied, transformers' logits equal ours.
    weights = {k: v.detach() for k, v in model.state_dict().items()}
    out = write_hf_export(tmp_path / "export", args=args, shapes={k: tuple(v.shape) for k, v in weights.items()},
                          fetch=lambda fqns: {k: weights[k] for k in fqns}, dtype=torch.float32)
    back = json.loads((out / "config.json").read_text())
    for key in ("architectures", "model_type", "hidden_size", "intermediate_size", "num_attention_heads",
                "num_key_value_heads", "tie_word_embeddings"):
        assert back[key] == config[key], key
    assert rope_fields(back)[1] == rope_fields(config)[1]  # rope_theta, in transformers 4's or 5's keys
    assert back["head_dim"] == args.head_dim
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert ("lm_head.weight" in f.keys()) != args.tie_word_embeddings
    with torch.no_grad():
        torch.testing.assert_close(hf_model(out)(TOKENS).logits, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("edit, message", [
    ({"attention_bias": True}, "attention_bias=True has no equivalent: this trainer's attention has no biases"),
    ({"mlp_bias": True}, "mlp_bias=True has no equivalent: this trainer's MLP has no biases"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu' has no equivalent: this trainer's MLP is SwiGLU with silu"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}},
     "rope_type='yarn' has no equivalent in this trainer"),
    ({"model_type": "qwen3", "use_sliding_window": True}, "use_sliding_window=True has no equivalent: this "
                                                         "trainer's attention is full causal"),
    ({"model_type": "qwen3", "layer_types": ["sliding_attention", "full_attention"]},
     "layer_types=['sliding_attention', 'full_attention'] has no equivalent"),
    ({"head_dim": 33}, "head_dim=33 must be even (RoPE rotates pairs of dimensions)"),
    ({"model_type": "mistral"}, "model_type='mistral' is not a layout this trainer reads"),
], ids=["attention_bias", "mlp_bias", "gelu", "yarn", "sliding_window", "layer_types", "odd_head_dim", "mistral"])
def test_what_has_no_mapping_is_one_line_naming_the_field(edit: dict, message: str, tmp_path: Path) -> None:
    folder = make_hf_folder("tinyllama", tmp_path / "hf")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **edit}))
    with pytest.raises(ExportError) as e:
        read_hf_config(folder)
    assert message in str(e.value) and str(e.value).startswith(str(folder / "config.json")), str(e.value)
    assert "\n" not in str(e.value)


# Issue 51 item 4a: config.json says tied, the safetensors say otherwise. transformers 5 ties the two only where the
# folder holds one table, or two equal ones; a head that differs stays its own weight (with a warning), and a folder
# holding the head alone ties the embeddings to it. Ours reads each as transformers does: the same logits.
@pytest.mark.parametrize("head", ["trained", "equal", "alone"])
def test_a_tied_config_reads_the_head_the_safetensors_hold_as_transformers_does(head: str, tmp_path: Path,
                                                                                caplog) -> None:
    from safetensors.torch import load_file, save_file

    folder = make_hf_folder("smollm2", tmp_path / "hf")  # tied: its safetensors hold the one table
    tensors = load_file(str(folder / "model.safetensors"))
    table = tensors["model.embed_tokens.weight"]
    tensors["lm_head.weight"] = {"trained": table + 0.5 * torch.randn_like(table), "equal": table.clone(),
                                 "alone": table}[head]
    if head == "alone":
        del tensors["model.embed_tokens.weight"]
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with caplog.at_level("WARNING", logger="trainer.hf"):
        model = ours(folder)
    with torch.no_grad():
        torch.testing.assert_close(model.logits(TOKENS), hf_model(folder)(TOKENS).logits, rtol=1e-4, atol=1e-5)
        assert torch.equal(model.output_head.proj.weight, tensors["lm_head.weight"])
    assert model.args.tie_word_embeddings == (head != "trained")
    assert (model.output_head.proj.weight is model.tok_embeddings.weight) == (head != "trained")
    warnings = [r.getMessage() for r in caplog.records if r.name == "trainer.hf" and r.levelname == "WARNING"]
    if head == "trained":
        difference = (tensors["lm_head.weight"] - table).abs().max().item()
        assert warnings == [f"{folder / 'config.json'} says tie_word_embeddings=true, but "
                            f"{folder / 'model.safetensors'} holds an lm_head.weight that differs from "
                            f"model.embed_tokens.weight (max |difference| {difference:.3g}); read as its own output "
                            "head, as transformers 5 loads it: set tie_word_embeddings to false in config.json to say "
                            "so"], warnings
        # A trainer model that ties them cannot hold the head: one line, never the embeddings in its place.
        with pytest.raises(ExportError, match=r"holds an lm_head\.weight that differs from model\.embed_tokens\."
                                              r"weight .*but the trainer model ties them \(one table, which cannot "
                                              r"hold both\)"):
            read_hf_weights(folder, args=read_hf_config(make_hf_folder("smollm2", tmp_path / "tied")))
    else:
        assert warnings == []
