"""GPT-OSS folders with MXFP4 experts (`quantization_config.quant_method` "mxfp4"), as gpt-oss-20b/120b ship.

The dequantizer (trainer/hf/mxfp4.py) against a table computed by hand and against transformers'
`convert_moe_packed_tensors` on every byte; then a folder whose experts this test quantizes itself (its own
quantizer, which knows each value it encodes) read by `load_model`: the logits of transformers loading the same folder
(it dequantizes on a CPU) and of the unquantized model holding the quantizer's values, within 1e-4 relative in fp32;
its export is unquantized. Other quantized folders are refused in one line naming quantization_config.quant_method.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tests.unit.test_hf_moe import _export, _hf, _relative, _weights
from trainer.checkpoint import load_model
from trainer.hf import ExportError, open_hf_folder, read_hf_config
from trainer.hf.mxfp4 import FP4_VALUES, dequantize
from trainer.models.gpt_oss import GptOssTransformer

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

_GRID = torch.tensor(FP4_VALUES[:8])  # the magnitudes of e2m1: nibbles 0-7; 8-15 are their negatives


def _quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [E, R, C] -> (blocks uint8 [E, R, C/32, 16], scales uint8 [E, R, C/32], the values they encode [E, R, C]):
    each block of 32 along C scaled by the power of two that puts its largest |value| in [4, 8), rounded to the
    nearest e2m1 magnitude (6 at most), nibble 2j the low half of byte j."""
    e, r, c = w.shape
    x = w.reshape(e, r, c // 32, 32)
    exp = (torch.floor(torch.log2(x.abs().amax(-1).clamp(min=2.0**-100))) - 2).clamp(-127, 127)
    scaled = x / torch.pow(2.0, exp)[..., None]
    idx = (scaled.abs()[..., None] - _GRID).abs().argmin(-1)
    negative = scaled < 0
    nibbles = idx + 8 * negative
    values = torch.where(negative, -_GRID[idx], _GRID[idx]) * torch.pow(2.0, exp)[..., None]
    blocks = (nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)).to(torch.uint8)
    return blocks, (exp + 127).to(torch.uint8), values.reshape(e, r, c)


def test_dequantize_gives_a_hand_computed_table():
    # Byte 0x1F with scale 128 (2^1): the low nibble 0xF (-6) first, the high nibble 0x1 (+0.5) second.
    # 0x70 with scale 127 (2^0): 0, then 6. 0x8A with scale 125 (2^-2): nibble A (-1) -> -0.25, then 8 (-0).
    blocks = torch.zeros(1, 3, 1, 16, dtype=torch.uint8)
    blocks[0, :, 0, 0] = torch.tensor([0x1F, 0x70, 0x8A], dtype=torch.uint8)
    blocks[0, :, 0, 15] = 0x43  # values 30 and 31 of each row: nibble 3 (1.5), then 4 (2)
    scales = torch.tensor([[[128], [127], [125]]], dtype=torch.uint8)
    out = dequantize(blocks, scales)
    assert out.shape == (1, 32, 3) and out.dtype == torch.bfloat16  # [E, C, R]: the rows are the last dim
    assert out[0, :2].float().tolist() == [[-12.0, 0.0, -0.25], [1.0, 6.0, -0.0]]
    assert out[0, 30:].float().tolist() == [[3.0, 1.5, 0.375], [4.0, 2.0, 0.5]]
    assert out[0, 2:30].abs().sum() == 0
    assert math.copysign(1, out[0, 1, 2].item()) == -1  # nibble 8 is -0


def test_dequantize_equals_transformers_on_every_byte_and_exponent():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(0)
    blocks = torch.arange(256, dtype=torch.uint8).repeat(3 * 5 * 2).reshape(3, 5, 32, 16)  # every byte, each row
    blocks = blocks[:, :, torch.randperm(32, generator=gen)]
    scales = torch.randint(0, 255, (3, 5, 32), generator=gen, dtype=torch.uint8)  # 2^-127 .. 2^127
    scales[0, 0, :3] = torch.tensor([0, 127, 254], dtype=torch.uint8)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    ours = dequantize(blocks, scales)
    assert ours.shape == theirs.shape == (3, 32 * 32, 5)
    assert torch.equal(ours.float(), theirs)  # exact: every MXFP4 value is a bfloat16
    assert torch.equal(dequantize(blocks, scales, dtype=torch.float32), theirs)


def _mxfp4_folder(out: Path) -> tuple["transformers.PreTrainedModel", dict[str, torch.Tensor]]:
    """A random GptOssForCausalLM saved with its experts quantized by `_quantize`; returns the model holding the
    values the folder encodes (unquantized), and those values by their Hugging Face names."""
    config = transformers.GptOssConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=258, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
        max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0, 0.3 if "bias" in name or "sinks" in name else 0.08) if "norm" not in name else p.uniform_(
                0.8, 1.2)
    model.save_pretrained(out)
    tensors = safetensors_torch.load_file(out / "model.safetensors")
    values = {}
    for name in [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        # Stored transposed: gate_up_proj [E, d, 2h] as blocks over d of its [E, 2h, d], down_proj [E, h, d] over h.
        blocks, scales, value = _quantize(tensors.pop(name).transpose(1, 2))
        tensors |= {f"{name}_blocks": blocks, f"{name}_scales": scales}
        values[name] = value.transpose(1, 2).contiguous()
    safetensors_torch.save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    hf_config = json.loads((out / "config.json").read_text())
    hf_config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (out / "config.json").write_text(json.dumps(hf_config))
    model.load_state_dict(values, strict=False)
    return model, values


def test_an_mxfp4_folder_imports_with_transformers_logits_and_exports_unquantized(tmp_path, caplog):
    reference, values = _mxfp4_folder(tmp_path / "hf")
    tokens = torch.randint(0, 258, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = reference(tokens).logits
        # (No GPU kernels here: transformers dequantizes, which Mxfp4Config says, as it needs no accelerate then.)
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path / "hf", quantization_config=transformers.Mxfp4Config(dequantize=True))
        theirs = hf.float().eval()(tokens).logits
    assert _relative(theirs, expected) < 1e-5  # transformers reads the folder as holding the quantizer's values
    # What reading it takes in memory (load_model's host-memory check): the files, and the experts as bfloat16.
    packed = sum(v.numel() for v in values.values())
    on_disk = (tmp_path / "hf" / "model.safetensors").stat().st_size
    assert open_hf_folder(tmp_path / "hf").data_bytes == on_disk - packed * 17 // 32 + packed * 2
    with caplog.at_level("INFO", logger="trainer.hf"):
        ours = load_model(tmp_path / "hf")
    assert "4 MXFP4 tensors (the experts) are dequantized to bfloat16" in caplog.text
    assert isinstance(ours, GptOssTransformer) and ours.args.moe_ffn_dim == 96
    with torch.no_grad():
        logits = ours.logits(tokens)
    assert _relative(logits, theirs) < 1e-4 and _relative(logits, expected) < 1e-4
    # The export: bf16 or fp32 tensors, no quantization_config; its experts are the quantizer's values exactly.
    out = _export(_weights(ours), ours.args, tmp_path / "out")
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    exported = safetensors_torch.load_file(out / "model.safetensors")
    assert all(torch.equal(exported[name], v) for name, v in values.items())
    with torch.no_grad():
        assert _relative(_hf(out)(tokens).logits, expected) < 1e-4


def test_other_quantized_folders_and_broken_mxfp4_tensors_are_refused_in_one_line(tmp_path):
    _mxfp4_folder(tmp_path / "hf")
    config_path, file = tmp_path / "hf" / "config.json", tmp_path / "hf" / "model.safetensors"
    config = json.loads(config_path.read_text())

    def refusal() -> str:
        with pytest.raises(ExportError) as e:
            read_hf_config(tmp_path / "hf")
        assert "\n" not in str(e.value)
        return str(e.value)

    config_path.write_text(json.dumps({**config, "quantization_config": {"quant_method": "fp8"}}))
    assert "quantization_config.quant_method='fp8': a quantized folder; this trainer reads GPT-OSS weights in " \
           "bf16, fp16 or fp32 (or 'mxfp4')" in refusal()
    # Without its quantization_config: its files are too small for unquantized experts.
    config_path.write_text(json.dumps({**config, "quantization_config": None}))
    assert "parameters, at least" in refusal()
    config_path.write_text(json.dumps({**config, "model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    assert "quantization_config.quant_method='mxfp4': a quantized folder; this trainer reads dense (Llama) weights in bf16, fp16 or fp32: load it" in refusal()
    config_path.write_text(json.dumps(config))
    tensors = safetensors_torch.load_file(file)
    scales = tensors.pop("model.layers.0.mlp.experts.down_proj_scales")
    safetensors_torch.save_file(tensors, file, metadata={"format": "pt"})
    assert "model.layers.0.mlp.experts.down_proj_blocks has no model.layers.0.mlp.experts.down_proj_scales" in \
        refusal()
    tensors["model.layers.0.mlp.experts.down_proj_scales"] = scales[:, :, :1].contiguous()
    safetensors_torch.save_file(tensors, file, metadata={"format": "pt"})
    assert "down_proj_blocks: blocks of shape [4, 64, 3, 16] and scales of shape [4, 64, 1]" in refusal()
