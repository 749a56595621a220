"""The one reader of a Hugging Face folder (trainer.hf.open_hf_folder), as import, load_model and generate use it
(issue 51 item 4): every config.json value it reads is checked by type and range, the two spellings of RoPE must
agree, the size the config implies is bound by the safetensors files before anything is built, and every tensor's
dtype is a model weight's. Each refusal is one line naming the file and the key or tensor, on every path, and the
import leaves no output folder behind. Folders are written here with safetensors alone (no transformers): a small
Llama in our export's layout; the logits against transformers are in tests/unit/test_hf_models.py.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import load_script
from trainer.checkpoint import load_dcp_metadata, load_model
from trainer.hf import ExportError, expected_shapes, hf_config, open_hf_folder, to_hf_name, write_hf_export
from trainer.models.llama import ModelArgs
from trainer.models.moe import MOE_FLAVORS

safetensors = pytest.importorskip("safetensors")

ARGS = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, explicit_ffn_dim=160, rope_theta=1e4,
                 max_seq_len=64)


def make_folder(folder: Path, *, edit: dict | None = None, dtypes: dict[str, torch.dtype] | None = None,
                args: ModelArgs = ARGS) -> Path:
    """A Hugging Face folder of `args` with random weights (float32 unless `dtypes` says), config.json edited."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    gen = torch.Generator().manual_seed(0)
    tensors = {to_hf_name(fqn): 0.05 * torch.randn(shape, generator=gen) for fqn, shape in expected_shapes(args).items()
               if not (args.tie_word_embeddings and fqn == "output_head.proj.weight")}
    for name, dtype in (dtypes or {}).items():
        tensors[name] = tensors[name].to(dtype)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps({**hf_config(args, dtype=torch.float32), **(edit or {})}))
    return folder


def _convert():
    return load_script("convert_checkpoint")


CONVERT = _convert()

CASES = {
    # (b) a string where a bool goes: "false" is a non-empty string, which bool() calls true
    "tie string": ({"tie_word_embeddings": "false"}, {}, "config.json: tie_word_embeddings='false' must be true or "
                                                         "false"),
    "tie null": ({"tie_word_embeddings": None}, {}, "config.json: tie_word_embeddings=None must be true or false"),
    "bias string": ({"attention_bias": "false"}, {}, "config.json: attention_bias='false' must be true or false"),
    "act list": ({"hidden_act": ["silu"]}, {}, "config.json: hidden_act=['silu'] must be a string"),
    # (c) transformers 4 reads the top-level rope_theta, 5 the one in rope_parameters
    "two thetas": ({"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}, {},
                   "config.json: rope_theta=10000.0 but rope_parameters.rope_theta=500000.0 (transformers 4 reads the "
                   "first, 5 the second): make them agree, or remove one"),
    "two ropes": ({"rope_scaling": {"rope_type": "default"}, "rope_parameters": {"rope_type": "llama3"}}, {},
                  "config.json: rope_scaling.rope_type='default' but rope_parameters.rope_type='llama3'"),
    # (d) a RoPE dict that is none
    "rope list": ({"rope_scaling": [1, 2]}, {}, "config.json: rope_scaling=[1, 2] must be an object (or null)"),
    "rope string": ({"rope_parameters": "llama3"}, {}, "config.json: rope_parameters='llama3' must be an object"),
    "rope nested": ({"rope_parameters": {"full_attention": {"rope_theta": 1e4}}}, {},
                    "config.json: rope_parameters.full_attention is an object: RoPE parameters per layer type have no "
                    "equivalent"),
    # (e) weights of a dtype no model's weights have
    "int64 embeddings": ({}, {"model.embed_tokens.weight": torch.int64},
                         "model.safetensors: model.embed_tokens.weight is stored as int64, not a floating-point dtype "
                         "of a model's weights (F32, BF16, F16, F64)"),
    "bool norm": ({}, {"model.norm.weight": torch.bool}, "model.safetensors: model.norm.weight is stored as bool"),
    # (f) a size the files cannot hold: refused before anything of n_layers' size is built
    "1e8 layers": ({"num_hidden_layers": 10**8}, {}, "config.json: the model arguments (dim=64, n_layers=100000000, "
                                                     "vocab_size=128) imply "),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_what_the_reader_refuses_is_one_line_on_every_path(case: str, tmp_path: Path, capsys) -> None:
    edit, dtypes, message = CASES[case]
    folder = make_folder(tmp_path / "hf", edit=edit, dtypes=dtypes)
    for path, read in {"reader": open_hf_folder, "load_model (generate)": load_model}.items():
        start = time.perf_counter()
        with pytest.raises(ExportError) as e:
            read(folder)
        assert str(e.value).startswith(str(folder)) and message in str(e.value), (path, str(e.value))
        assert "\n" not in str(e.value) and time.perf_counter() - start < 10, path
    capsys.readouterr()
    assert CONVERT.main(["import", str(folder), str(tmp_path / "imported")]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], errors
    assert not (tmp_path / "imported").exists() and not (tmp_path / "imported.tmp").exists()


def test_the_one_reader_is_the_one_every_path_reads_through(tmp_path: Path, monkeypatch) -> None:
    """import and load_model call open_hf_folder and nothing else reads a config.json: a check added there holds on
    every path (the cases above pin it per path)."""
    import trainer.checkpoint.offline as offline
    import trainer.hf as hf

    folder = make_folder(tmp_path / "hf")
    calls = []
    real = hf.open_hf_folder

    def counted(*a, **k):
        calls.append(a[0])
        return real(*a, **k)

    monkeypatch.setattr(hf, "open_hf_folder", counted)
    monkeypatch.setattr(offline, "open_hf_folder", counted)
    load_model(folder)
    assert CONVERT.main(["import", str(folder), str(tmp_path / "imported")]) == 0
    assert [Path(c) for c in calls] == [folder, folder]


def test_float16_and_float64_weights_import_as_what_a_run_reads(tmp_path: Path, capsys) -> None:
    """A run loads float32 and bfloat16 checkpoint entries only (trainer/checkpoint/values.py INDEX_DTYPES): the
    reader reads float16 (exactly) and float64 as float32, as transformers loads them, and says so."""
    folder = make_folder(tmp_path / "hf", dtypes={"model.embed_tokens.weight": torch.float16,
                                                  "model.norm.weight": torch.float64})
    assert CONVERT.main(["import", str(folder), str(tmp_path / "imported")]) == 0
    assert f"{folder}: the tensors stored as float16 and float64 are read as float32" in capsys.readouterr().out
    entries = load_dcp_metadata(tmp_path / "imported" / ".metadata").state_dict_metadata
    assert {md.properties.dtype for k, md in entries.items() if k.startswith("model.")} == {torch.float32}
    from safetensors.torch import load_file

    stored = load_file(str(folder / "model.safetensors"))["model.embed_tokens.weight"]
    assert torch.equal(load_model(tmp_path / "imported").tok_embeddings.weight, stored.float())


def test_a_trained_head_under_a_tied_config_is_imported_as_its_own(tmp_path: Path) -> None:
    """The import keeps what transformers keeps (tests/unit/test_hf_models.py compares the logits): the checkpoint's
    model is untied and its head is the folder's lm_head.weight, not the embeddings."""
    from safetensors.torch import load_file

    untied = make_folder(tmp_path / "hf", edit={"tie_word_embeddings": True})  # both tables, config says tied
    assert CONVERT.main(["import", str(untied), str(tmp_path / "imported")]) == 0
    model = load_model(tmp_path / "imported")
    assert not model.args.tie_word_embeddings
    assert torch.equal(model.output_head.proj.weight, load_file(str(untied / "model.safetensors"))["lm_head.weight"])


def test_moe_routing_keys_are_checked_by_type(tmp_path: Path) -> None:
    args = MOE_FLAVORS["debug_moe"]
    weights = {k: 0.02 * torch.randn(s) for k, s in expected_shapes(args).items()}
    out = write_hf_export(tmp_path / "hf", args=args, shapes={k: tuple(v.shape) for k, v in weights.items()},
                          fetch=lambda fqns: {k: weights[k] for k in fqns}, dtype=torch.float32)
    config = json.loads((out / "config.json").read_text())
    for key, value, message in [("use_bias", "false", "use_bias='false' must be true or false"),
                                ("moe_norm_min", "0", "moe_norm_min='0' must be a number"),
                                ("moe_layer_end_index", 1.5, "moe_layer_end_index=1.5 must be an integer")]:
        (out / "config.json").write_text(json.dumps({**config, key: value}))
        with pytest.raises(ExportError) as e:
            open_hf_folder(out)
        assert str(e.value).startswith(str(out / "config.json")) and message in str(e.value), str(e.value)
