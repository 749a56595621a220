"""Checkpoints and Hugging Face export, function by function: scanning and pruning checkpoints, file checks,
the name map, shards and config of an export, exports against transformers, loading a model.

The trainer relaunched (exact resume after SIGKILL, kill mid-save, SIGTERM, precision switch, bad input,
export/import of a run) is in tests/cli/test_checkpoint.py; the multi-process cases in
tests/cli/test_checkpoint_distributed.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from trainer.checkpoint import (
    CheckpointError, RunInfo, check_file, file_digest, load_full_model_weights, load_model, prune_checkpoints,
    save_model_only, scan_checkpoints,
)
from trainer.files.publish import start_partial
from trainer.hf import (
    ExportError, args_from_hf_config, expected_shapes, from_hf_name, hf_config, plan_shards, read_hf_weights,
    to_hf_name, write_hf_export,
)
from trainer.models.llama import FLAVORS, Llama, ModelArgs, RopeScaling

DEBUG = FLAVORS["debug"]


def _random_llama(args: ModelArgs) -> Llama:
    """A plain (unsharded) fp32 model on CPU with the pretraining init."""
    with torch.device("meta"):
        model = Llama(args)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)  # also builds the rope cache
    return model.eval()


def _hf_logits(folder: Path, tokens: torch.Tensor) -> torch.Tensor:
    transformers = pytest.importorskip("transformers")
    # .float(): transformers 4 loads fp32 by default, 5 the config's dtype; bf16 -> fp32 is exact.
    model = transformers.LlamaForCausalLM.from_pretrained(str(folder)).float().eval()
    with torch.no_grad():
        return model(tokens).logits


# -- pure functions -----------------------------------------------------------


def test_hf_names_round_trip():
    fqns = list(expected_shapes(DEBUG))
    assert len(fqns) == 2 + 9 * DEBUG.n_layers + 1
    assert to_hf_name("layers.3.attention.q_proj.weight") == "model.layers.3.self_attn.q_proj.weight"
    assert to_hf_name("layers.0.mlp_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    assert to_hf_name("output_head.proj.weight") == "lm_head.weight"
    assert [from_hf_name(to_hf_name(f)) for f in fqns] == fqns
    with pytest.raises(ExportError, match="layers.0.attention.wq.weight"):
        to_hf_name("layers.0.attention.wq.weight")


def test_plan_shards():
    sizes = {"a": 4, "b": 4, "c": 10, "d": 1}
    assert plan_shards(sizes, max_shard_bytes=8) == [["a", "b"], ["c"], ["d"]]
    assert plan_shards(sizes, max_shard_bytes=100) == [["a", "b", "c", "d"]]


def _fake_checkpoint(folder: Path, name: str, *, metadata=True, info=True, partial=False) -> Path:
    path = folder / name
    start_partial(path) if partial else path.mkdir(parents=True)  # partial: as a save starts its step-N.tmp
    if metadata:
        (path / ".metadata").write_bytes(b"x")
    if info:
        (path / "checkpoint.json").write_text("{}")
    return path


def test_scan_and_prune_keep_latest_k(tmp_path):
    for name in ("step-5", "step-10", "step-20"):
        _fake_checkpoint(tmp_path, name)
    _fake_checkpoint(tmp_path, "step-8.tmp", metadata=False, info=False, partial=True)  # interrupted, superseded
    _fake_checkpoint(tmp_path, "step-25.tmp", metadata=False, info=False, partial=True)  # a save still in progress
    _fake_checkpoint(tmp_path, "step-7.tmp", info=False)  # no marker: not provably a save of this trainer's
    _fake_checkpoint(tmp_path, "step-15", info=False)  # copied partially
    (tmp_path / "step-20-hf").mkdir()  # an export: never a checkpoint, never pruned
    complete, incomplete = scan_checkpoints(tmp_path)
    assert sorted(complete) == [5, 10, 20]
    assert sorted(p.name for p, _ in incomplete) == ["step-15", "step-25.tmp", "step-7.tmp", "step-8.tmp"]
    assert dict((p.name, why) for p, why in incomplete)["step-7.tmp"] == (
        "named like an unfinished save but without the .partial marker every save writes first (kept)")
    removed = prune_checkpoints(tmp_path, newest=20, keep_latest_k=2)
    assert sorted(p.name for p in removed) == ["step-5", "step-8.tmp"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-10", "step-15", "step-20", "step-20-hf",
                                                          "step-25.tmp", "step-7.tmp"]
    # The only complete checkpoint is never removed.
    only = tmp_path / "only"
    _fake_checkpoint(only, "step-3")
    assert prune_checkpoints(only, newest=3, keep_latest_k=1) == []
    assert (only / "step-3").is_dir()


def test_pruning_keeps_the_checkpoint_just_written_and_the_one_resumed_from(tmp_path):
    """Resumed step-5 of a run that had reached step-15, then saved step-8: keep_latest_k=1 removes neither step-8
    (the newest by number is step-15) nor step-5, and never a later step (the manager moves those aside)."""
    for name in ("step-5", "step-8", "step-15", "step-10.abandoned"):
        _fake_checkpoint(tmp_path, name)
    assert prune_checkpoints(tmp_path, newest=8, keep_latest_k=1, resumed=5) == []
    _fake_checkpoint(tmp_path, "step-12")
    assert [p.name for p in prune_checkpoints(tmp_path, newest=12, keep_latest_k=1, resumed=5)] == ["step-8"]
    _fake_checkpoint(tmp_path, "step-13")
    assert [p.name for p in prune_checkpoints(tmp_path, newest=13, keep_latest_k=2, resumed=-1)] == ["step-5"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-10.abandoned", "step-12", "step-13", "step-15"]


def test_check_file_detects_truncation_and_corruption(tmp_path):
    f = tmp_path / "__0_0.distcp"
    f.write_bytes(bytes(range(256)) * 64)
    digest = file_digest(f)
    assert check_file(f, digest) is None
    data = bytearray(f.read_bytes())
    data[1000] ^= 0xFF
    f.write_bytes(bytes(data))
    assert "is corrupted: crc32" in check_file(f, digest)
    f.write_bytes(bytes(data[:5000]))
    assert "is truncated or corrupted: 5,000 bytes, expected 16,384" in check_file(f, digest)
    assert "is truncated" in check_file(f, None, min_bytes=6000)
    assert check_file(tmp_path / "nope", digest).endswith("nope is missing")


def test_export_with_llama3_rope_scaling_matches_transformers(tmp_path):
    """Exact export of a randomly initialized model whose config has Llama 3.1 rope scaling."""
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=96, multiple_of=32,
                     rope_theta=500000.0, rope_scaling=RopeScaling(factor=8.0, original_max_seq_len=32),
                     max_seq_len=128)
    model = _random_llama(args)
    weights = {k: v.detach() for k, v in model.state_dict().items()}
    write_hf_export(tmp_path / "hf", args=args, shapes={k: tuple(v.shape) for k, v in weights.items()},
                    fetch=lambda fqns: {k: weights[k] for k in fqns}, dtype=torch.float32)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    # As the reference Llama 3.1/3.2 configs: the long context, not the original one.
    assert config["max_position_embeddings"] == 131072
    assert config["rope_scaling"]["original_max_position_embeddings"] == 32
    tokens = torch.randint(0, args.vocab_size, (2, 100), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model.logits(tokens)
        loaded = load_model(tmp_path / "hf", max_seq_len=128).logits(tokens)  # config.json -> ModelArgs -> our model
    torch.testing.assert_close(_hf_logits(tmp_path / "hf", tokens), ours, atol=1e-4, rtol=0)
    assert torch.equal(loaded, ours)
    back = read_hf_weights(tmp_path / "hf", args=args)
    assert all(torch.equal(back[k], weights[k]) for k in weights)
    with pytest.raises(ExportError, match="num_hidden_layers=2 but the trainer model has 3"):
        read_hf_weights(tmp_path / "hf", args=ModelArgs(**{**args.__dict__, "n_layers": 3}))


@pytest.mark.parametrize("flavor", ["debug", "1b", "8b", "70b"])
def test_hf_config_round_trip(flavor):
    args = FLAVORS[flavor]
    config = hf_config(args, dtype=torch.bfloat16)
    if args.rope_scaling is not None:  # Llama 3.1/3.2 reference configs: 131072
        assert config["max_position_embeddings"] == 131072
    back = args_from_hf_config(config, where="config.json")
    assert back.ffn_dim == args.ffn_dim and expected_shapes(back) == expected_shapes(args)
    assert (back.rope_scaling, back.rope_theta, back.norm_eps) == (args.rope_scaling, args.rope_theta, args.norm_eps)
    # A width no flavor has still maps exactly.
    odd = args_from_hf_config({**config, "intermediate_size": 300, "hidden_size": 128, "num_attention_heads": 4,
                               "num_key_value_heads": 2,
                               "head_dim": 32}, where="config.json")
    assert odd.ffn_dim == 300


def test_load_model_from_a_dcp_checkpoint(tmp_path):
    args = ModelArgs(**{**DEBUG.__dict__, "max_seq_len": 64})
    weights = {k: v.detach().clone() for k, v in _random_llama(args).state_dict().items()}
    save_model_only(tmp_path / "ckpt", weights, run=RunInfo(flavor="debug", model_args=args, mixed_precision="fp32"),
                    source="test")
    model = load_model(tmp_path / "ckpt")
    assert model.args == args and not model.training and model.rope.shape[0] == 64
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())
    half = load_model(tmp_path / "ckpt", dtype=torch.bfloat16, max_seq_len=16)
    assert half.tok_embeddings.weight.dtype == torch.bfloat16 and half.rope.shape[0] == 16
    tokens = torch.randint(0, args.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model.logits(tokens), _random_llama(args).logits(tokens))
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(tmp_path / "nope")


def test_load_full_model_weights_errors(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_full_model_weights(tmp_path / "nope")
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "checkpoint.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"checkpoint.json is corrupted \(not valid JSON"):
        load_full_model_weights(tmp_path / "c")
