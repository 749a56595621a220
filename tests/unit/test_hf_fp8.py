"""DeepSeek-V3 folders in block FP8 (`quantization_config.quant_method` "fp8"), as DeepSeek-V3/R1 ship.

The dequantizer (trainer/hf/fp8.py) against a table computed by hand (blocks of distinct scales, the last ones
partial), against transformers' `Fp8Dequantize` on every fp8 byte (where it can: whole blocks) and against the
product written out for partial blocks; then a folder whose linear weights this test quantizes itself (its own block
quantizer, which knows each value it encodes) read by `load_model`: the logits of the unquantized model holding the
quantizer's values (and of transformers loading the same folder, where accelerate is installed for its CPU
dequantization), within 1e-4 relative in fp32; its export is unquantized. Each bad input is refused in one line.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from tests.unit.test_hf_deepseek_v3 import TOKENS, _export, _hf_config, _random_hf
from tests.unit.test_hf_moe import _hf, _relative, _weights
from trainer.checkpoint import load_model
from trainer.hf import ExportError, open_hf_folder, read_hf_config
from trainer.hf import fp8
from trainer.models.deepseek_v3 import DeepseekV3

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

E4M3_MAX = 448.0


def _reference(q: torch.Tensor, s: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The product written out: each value times the scale of its block, in float32."""
    r, c = q.shape
    return q.float() * s.float().repeat_interleave(block[0], 0)[:r].repeat_interleave(block[1], 1)[:, :c]


@pytest.mark.parametrize("chunk", [fp8._CHUNK_VALUES, 1])  # 1: one row of blocks at a time
def test_dequantize_gives_a_hand_computed_table(chunk, monkeypatch):
    monkeypatch.setattr(fp8, "_CHUNK_VALUES", chunk)
    # [3, 5] in blocks of [2, 3]: a 2 x 2 grid, its last row of blocks one row high and last column two wide.
    q = torch.tensor([[1.0, 2.0, -1.5, 4.0, 0.5],
                      [-3.0, 0.25, 6.0, -448.0, 1.0],
                      [2.0, -1.0, 0.125, 3.0, -2.0]]).to(torch.float8_e4m3fn)
    assert torch.equal(q.float()[1, 3], torch.tensor(-448.0))  # every value above is exact in e4m3
    scale_inv = torch.tensor([[0.5, 3.0], [10.0, 0.75]])
    out = fp8.dequantize(q, scale_inv, (2, 3))
    assert out.dtype == torch.bfloat16 and out.shape == (3, 5)
    assert out.float().tolist() == [[0.5, 1.0, -0.75, 12.0, 1.5],
                                    [-1.5, 0.125, 3.0, -1344.0, 3.0],
                                    [20.0, -10.0, 1.25, 2.25, -1.5]]
    # The product in float32, rounded once to bfloat16: 1.125 x fp32(1/3) = 0.37500001 -> 0.375; 1.75 x 1.01 rounds
    # to bfloat16's 8 bits (1.7675 -> 1.765625).
    one = fp8.dequantize(torch.tensor([[1.125, 1.75]]).to(torch.float8_e4m3fn), torch.tensor([[1 / 3, 1.01]]), (1, 1))
    assert one.float().tolist() == [[0.375, 1.765625]]
    # In float32: fp32(1.01) = 1.00999999046..., times 1.75 = 1.76749998331..., rounded to fp32's 24 bits.
    assert fp8.dequantize(torch.tensor([[1.75]]).to(torch.float8_e4m3fn), torch.tensor([[1.01]]), (1, 1),
                          dtype=torch.float32).item() == 1.7674999237060547


def test_dequantize_equals_transformers_on_every_byte_and_the_product_on_partial_blocks(monkeypatch):
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    gen = torch.Generator().manual_seed(0)
    q = torch.arange(256, dtype=torch.uint8).repeat(3)[torch.randperm(768, generator=gen)]
    q = q.view(torch.float8_e4m3fn).reshape(32, 24)  # 0x7F and 0xFF are e4m3's NaN: NaN in both
    scale_inv = torch.rand(2, 3, generator=gen) * 0.01  # blocks of [16, 8], as amax / 448 gives them
    theirs = Fp8Dequantize(None)._dequantize_one
    for dtype in (torch.bfloat16, torch.float32):
        torch.testing.assert_close(fp8.dequantize(q, scale_inv, (16, 8), dtype=dtype), theirs(q, scale_inv, dtype),
                                   rtol=0, atol=0, equal_nan=True)
    monkeypatch.setattr(fp8, "_CHUNK_VALUES", 100)  # rows of blocks read a few at a time, the last one short
    for shape, block in (((37, 21), (16, 8)), ((5, 300), (128, 128)), ((130, 7), (4, 128))):
        q = (torch.randn(shape, generator=gen) * 100).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        s = torch.rand(fp8.scales_shape(shape, block), generator=gen) + 0.5
        assert torch.equal(fp8.dequantize(q, s, block, dtype=torch.float32), _reference(q, s, block))
        assert torch.equal(fp8.dequantize(q, s, block), _reference(q, s, block).bfloat16())


def _quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [R, C] -> (float8_e4m3fn [R, C], scale_inv float32 [ceil(R / bm), ceil(C / bn)], the values they encode in
    bfloat16): each block's largest |value| scaled to 448, as DeepSeek's quantizer does."""
    (r, c), (bm, bn) = w.shape, block
    grid = fp8.scales_shape((r, c), block)
    padded = torch.zeros(grid[0] * bm, grid[1] * bn)
    padded[:r, :c] = w
    blocks = padded.reshape(grid[0], bm, grid[1], bn)
    scale = (blocks.abs().amax(dim=(1, 3)) / E4M3_MAX).clamp(min=1e-12)
    q = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn).reshape(padded.shape)[:r, :c].contiguous()
    return q, scale, _reference(q, scale, block).bfloat16()


UNQUANTIZED = ("model.embed_tokens.weight", "lm_head.weight", "mlp.gate.weight")  # DeepSeek's: bf16


def _fp8_folder(out: Path, block: tuple[int, int]) -> tuple[Path, dict[str, torch.Tensor]]:
    """A random DeepseekV3ForCausalLM saved with its linear weights quantized by `_quantize` (and an MTP module's
    projection, as DeepSeek's folders hold it); returns a folder of the unquantized model holding the values the
    quantized one encodes, and those values by their Hugging Face names."""
    _random_hf(_hf_config()).save_pretrained(out)
    tensors = safetensors_torch.load_file(out / "model.safetensors")
    tensors["model.layers.3.eh_proj.weight"] = torch.randn(96, 192) * 0.05
    values = {}
    for name in [k for k, t in tensors.items() if t.ndim == 2 and not k.endswith(UNQUANTIZED)]:
        tensors[name], tensors[name + "_scale_inv"], values[name] = _quantize(tensors[name], block)
    for name in [k for k, t in tensors.items() if t.dtype == torch.float32 and not k.endswith(fp8.SCALE_INV)
                 and ".mlp.gate." not in k]:
        # The embeddings, norms and head in bf16, as DeepSeek's (transformers keeps the router in fp32: so here).
        tensors[name] = tensors[name].bfloat16()
    safetensors_torch.save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    plain = out.parent / "unquantized"
    plain.mkdir()
    (plain / "config.json").write_text(json.dumps(config))
    unquantized = {k: values.get(k, t) for k, t in tensors.items() if not k.endswith(fp8.SCALE_INV)}
    safetensors_torch.save_file(unquantized, plain / "model.safetensors", metadata={"format": "pt"})
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block)}
    (out / "config.json").write_text(json.dumps(config))
    values.pop("model.layers.3.eh_proj.weight")
    return plain, values


def _scales_apart(folder: Path) -> None:
    """The folder's scales moved to a second safetensors file (a sharded folder's index may put them anywhere)."""
    tensors = safetensors_torch.load_file(folder / "model.safetensors")
    files = {"model-00001-of-00002.safetensors": tensors, "model-00002-of-00002.safetensors": {
        k: tensors.pop(k) for k in list(tensors) if k.endswith(fp8.SCALE_INV)}}
    for name, part in files.items():
        safetensors_torch.save_file(part, folder / name, metadata={"format": "pt"})
    (folder / "model.safetensors").unlink()
    weight_map = {k: name for name, part in files.items() for k in part}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


# [8, 8]: whole blocks (transformers' CPU dequantization infers the block from the grid, so only whole blocks are
# its); [16, 24]: partial blocks at the ends of most weights, as DeepSeek-V3's kv_a_proj_with_mqa (576 rows) has,
# and the scales in a file apart from their weights.
@pytest.mark.parametrize("block", [(8, 8), (16, 24)])
def test_an_fp8_folder_imports_with_the_quantized_values_logits_and_exports_unquantized(block, tmp_path, caplog):
    plain, values = _fp8_folder(tmp_path / "hf", block)
    if block == (16, 24):
        _scales_apart(tmp_path / "hf")
    tokens = TOKENS % 300
    with torch.no_grad():
        expected = _hf(plain)(tokens).logits
        if block == (8, 8) and importlib.util.find_spec("accelerate"):  # transformers' FP8 loading needs it
            theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.bfloat16)
            assert _relative(theirs.float().eval()(tokens).logits, expected) < 1e-5
    # What reading it takes in memory (load_model's host-memory check): the files, and each fp8 value as bfloat16.
    on_disk = sum(f.stat().st_size for f in (tmp_path / "hf").glob("*.safetensors"))
    assert open_hf_folder(tmp_path / "hf").data_bytes == on_disk + sum(v.numel() for v in values.values())
    with caplog.at_level("INFO", logger="trainer.hf"):
        ours = load_model(tmp_path / "hf")
    assert f"{len(values)} FP8 tensors (the linear weights) are dequantized to bfloat16" in caplog.text
    assert "skipped 1 tensors of MTP modules" in caplog.text  # eh_proj, read with its scales
    assert isinstance(ours, DeepseekV3) and ours.args.q_lora_rank == 40
    with torch.no_grad():
        assert _relative(ours.logits(tokens), expected) < 1e-4
    # The export: no quantization_config; its weights are the quantizer's values exactly.
    out = _export(_weights(ours), ours.args, tmp_path / "out")
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    exported = safetensors_torch.load_file(out / "model.safetensors")
    assert not any(k.endswith(fp8.SCALE_INV) for k in exported)
    assert all(torch.equal(exported[name], v.float()) for name, v in values.items())


def test_bad_fp8_folders_and_other_quantizations_are_refused_in_one_line(tmp_path):
    _fp8_folder(tmp_path / "hf", (128, 128))  # DeepSeek's blocks: one partial block per weight here
    config_path, file = tmp_path / "hf" / "config.json", tmp_path / "hf" / "model.safetensors"
    config = json.loads(config_path.read_text())
    quant = config["quantization_config"]
    assert read_hf_config(tmp_path / "hf").n_experts == 8

    def refusal(**changes) -> str:
        config_path.write_text(json.dumps({**config, **changes}))
        with pytest.raises(ExportError) as e:
            read_hf_config(tmp_path / "hf")
        assert "\n" not in str(e.value)
        return str(e.value)

    assert "quantization_config.quant_method='awq': a quantized folder; this trainer reads DeepSeek-V3 weights in " \
           "bf16, fp16 or fp32 (or 'fp8')" in refusal(quantization_config={**quant, "quant_method": "awq"})
    assert "quantization_config.fmt='e5m2': this trainer reads block FP8 with fmt 'e4m3' only" in refusal(
        quantization_config={**quant, "fmt": "e5m2"})
    for block in ([128], [0, 128], None, [128, "128"], [True, 1]):
        assert f"quantization_config.weight_block_size={block!r}: not two positive integers" in refusal(
            quantization_config={**quant, "weight_block_size": block})
    assert "quantization_config.activation_scheme='static'" in refusal(
        quantization_config={**quant, "activation_scheme": "static"})
    assert "quantization_config.scale_fmt='ue8m0'" in refusal(quantization_config={**quant, "scale_fmt": "ue8m0"})
    assert "quantization_config.expert_dtype='fp4'" in refusal(quantization_config={**quant, "expert_dtype": "fp4"})
    assert "quantization_config.quant_method='fp8': a quantized folder; this trainer reads dense (Llama) weights" in \
        refusal(model_type="llama", architectures=["LlamaForCausalLM"])
    # Another block size than the folder's: its scales do not fit.
    assert "model.layers.0.mlp.down_proj.weight: scales of shape [1, 2] for a weight of shape [96, 160]: " \
           "weight_block_size [16, 128] gives [6, 2]" in refusal(
               quantization_config={**quant, "weight_block_size": [16, 128]})
    # Without its quantization_config: its files are too small for bf16 weights.
    assert "parameters, at least" in refusal(quantization_config=None)
    config_path.write_text(json.dumps(config))
    tensors = safetensors_torch.load_file(file)
    name = "model.layers.1.mlp.experts.3.down_proj.weight"

    def broken(**changes) -> str:
        safetensors_torch.save_file({k: v for k, v in {**tensors, **changes}.items() if v is not None}, file)
        return refusal()

    assert f"{name} is float8_e4m3fn with no {name}_scale_inv" in broken(**{name + "_scale_inv": None})
    assert f"{name}_scale_inv has no {name}" in broken(**{name: None})
    assert f"{name}: scales of shape [1, 2] for a weight of shape [96, 48]: weight_block_size [128, 128] gives " \
           "[1, 1]" in broken(**{name + "_scale_inv": torch.ones(1, 2)})
    assert f"{name}: stored as F8_E4M3 with scales of F16" in broken(**{name + "_scale_inv": torch.ones(1, 1).half()})
    assert f"{name}: stored as BF16 with scales of F32" in broken(**{name: torch.zeros(96, 48, dtype=torch.bfloat16)})
    # A config.json whose shapes its files cannot hold, even at one byte a parameter.
    safetensors_torch.save_file(tensors, file)
    assert "parameters, at least" in refusal(num_hidden_layers=3000)
