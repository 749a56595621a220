"""DeepSeek-V3 in a run's config: the [deepseek_v3] keys, what a DeepSeek-V3 flavor refuses (one line naming the key,
before any process group: trainer/validate/deepseek_v3.py), and its checkpoints."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from trainer.checkpoint import RunInfo, load_model, save_model_only
from trainer.config import load_job_config
from trainer.errors import ConfigError
from trainer.model_values import YarnScaling
from trainer.models import build_model
from trainer.models.layers import rope_cache
from trainer.models.deepseek_v3 import FLAVORS, DeepseekV3
from trainer.validate import validate_job
from trainer.validate.run_files import model_keys


def _args(*argv: str, world_size: int = 1):
    return validate_job(load_job_config(["--train.seq_len=32", *argv]), world_size=world_size).model_args


def test_the_deepseek_v3_keys_set_the_shape_and_resolved_keys_rebuild_it() -> None:
    args = _args("--model.flavor=deepseek_v3_16b", "--model.n_layers=2", "--deepseek_v3.q_lora_rank=96",
                 "--deepseek_v3.mtp_layers=2", "--deepseek_v3.n_group=8", "--deepseek_v3.topk_group=3",
                 "--deepseek_v3.v_head_dim=64", "--deepseek_v3.mtp_loss_weight=0.1")
    assert (args.q_lora_rank, args.mtp_layers, args.n_group, args.topk_group, args.v_head_dim,
            args.mtp_loss_weight) == (96, 2, 8, 3, 64, 0.1)
    # resolved.toml's keys given to the other flavor of the family build the same model.
    keys = [k for k in model_keys(args) if not k.startswith("--model.flavor=")]
    keys += [f"--moe.{k}={getattr(args, k)}" for k in ("aux_loss_coef", "bias_update_rate")]
    assert "--deepseek_v3.mtp_layers=2" in keys
    again = _args("--model.flavor=debug_deepseek_v3", *keys, "--deepseek_v3.mtp_loss_weight=0.1")
    # (head_dim: resolved.toml writes the value in effect, qk_rope_head_dim, which sets it explicitly)
    assert again == replace(args, max_seq_len=again.max_seq_len, explicit_head_dim=args.qk_rope_head_dim)


@pytest.mark.parametrize("argv, world_size, message", [
    (["--distributed.pp=2", "--distributed.pipeline_schedule=ZBVZeroBubble"], 2,
     "distributed.pipeline_schedule='ZBVZeroBubble' with deepseek_v3.mtp_layers=1: the V schedule puts the first and "
     "the last stage on one rank"),
    (["--model.rope_scaling=llama3"], 1, "model.rope_scaling='llama3' with the DeepSeek-V3 flavor"),
    (["--model.head_dim=64"], 1, "model.head_dim=64 with the DeepSeek-V3 flavor 'debug_deepseek_v3': MLA has no such "
                                 "setting"),
    (["--model.n_kv_heads=2"], 1, "model.n_kv_heads=2 with the DeepSeek-V3 flavor"),
    (["--model.qk_norm=true"], 1, "model.qk_norm=true with the DeepSeek-V3 flavor"),
    (["--moe.score_func=softmax"], 1, "moe.score_func='softmax' with the DeepSeek-V3 flavor"),
    (["--moe.sparse_step=2"], 1, "moe.sparse_step=2 with the DeepSeek-V3 flavor 'debug_deepseek_v3': its dense blocks "
                                 "are the leading ones"),
    (["--moe.dense_layers=2"], 1, "moe.dense_layers=[2] with the DeepSeek-V3 flavor"),
    (["--deepseek_v3.n_group=3"], 1, "moe.n_experts=8 must be a multiple of deepseek_v3.n_group=3"),
    (["--deepseek_v3.qk_rope_head_dim=7"], 1, "deepseek_v3.qk_rope_head_dim=7 must be even"),
    (["--deepseek_v3.mtp_layers=-1"], 1, "deepseek_v3.mtp_layers=-1 must be an integer in [0,"),
    (["--model.flavor=debug_moe", "--deepseek_v3.mtp_layers=1"], 1,
     "deepseek_v3.mtp_layers=1 has no effect: model.flavor='debug_moe' is not a DeepSeek-V3 flavor"),
])
def test_what_a_deepseek_v3_flavor_refuses_is_one_line_naming_the_key(argv, world_size, message) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        _args("--model.flavor=debug_deepseek_v3", *argv, world_size=world_size)


def test_fsdp_ep_cp_tp_pp_layouts_are_accepted() -> None:
    for layout in ("--distributed.ep=2", "--distributed.cp=2", "--distributed.tp=2", "--distributed.pp=2"):
        assert _args("--model.flavor=debug_deepseek_v3", layout, world_size=2).mtp_layers == 1
    for layout in ("--distributed.pp=2", "--distributed.cp=2", "--distributed.tp=2"):
        assert _args("--model.flavor=debug_deepseek_v3", "--deepseek_v3.mtp_layers=0", layout, world_size=2)


def test_a_checkpoint_of_a_deepseek_v3_model_loads_with_its_mtp_modules(tmp_path) -> None:
    args = replace(FLAVORS["debug_deepseek_v3"], n_layers=2, max_seq_len=48)
    with torch.device("meta"):
        model = build_model(args)
    model.to_empty(device="cpu")
    model.init_weights(seed=3)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    assert any(k.startswith("layers.2.eh_proj") for k in weights)  # the MTP module's
    save_model_only(tmp_path / "ckpt", weights, run=RunInfo(flavor="debug_deepseek_v3", model_args=args,
                                                            mixed_precision="fp32"), source="test")
    loaded = load_model(tmp_path / "ckpt")
    assert isinstance(loaded, DeepseekV3) and loaded.args == args
    assert all(torch.equal(v, weights[k]) for k, v in loaded.state_dict().items())


def test_the_memory_plan_holds_each_mtp_depths_logits() -> None:
    """Each MTP depth's eager logits (12 bytes per token and vocabulary entry, as the eager LM loss counts) and its
    states stay with the main loss's until backward."""
    def loss_bytes(*argv: str) -> int:
        cfg = load_job_config(["--model.flavor=debug_deepseek_v3", "--train.seq_len=64", "--train.batch_size=2",
                               "--train.mixed_precision=fp32", *argv])
        plan = validate_job(cfg, world_size=1).memory_plan
        return next(r.bytes for r in plan.rows if r.what == "logits and loss")

    tokens, vocab, dim = 2 * 64, 512, 128
    per_depth = 12 * tokens * vocab + 2 * tokens * dim * 4
    assert loss_bytes("--deepseek_v3.mtp_layers=2") - loss_bytes("--deepseek_v3.mtp_layers=0") == 2 * per_depth


def test_yarn_keys_turn_on_yarn_and_a_checkpoint_keeps_it(tmp_path) -> None:
    args = _args("--model.flavor=debug_deepseek_v3", "--model.n_layers=2", "--deepseek_v3.rope_yarn_factor=40",
                 "--deepseek_v3.rope_yarn_original_max_seq_len=8", "--deepseek_v3.rope_yarn_mscale=1",
                 "--deepseek_v3.rope_yarn_mscale_all_dim=1")
    assert args.rope_yarn == YarnScaling(factor=40.0, original_max_seq_len=8, mscale=1.0, mscale_all_dim=1.0)
    # resolved.toml's keys rebuild it; "none" turns it off.
    keys = [k for k in model_keys(args) if "rope_yarn" in k]
    assert "--deepseek_v3.rope_yarn=yarn" in keys and _args("--model.flavor=debug_deepseek_v3", "--model.n_layers=2",
                                                            *keys).rope_yarn == args.rope_yarn
    assert _args("--model.flavor=debug_deepseek_v3", *keys, "--deepseek_v3.rope_yarn=none").rope_yarn is None
    with torch.device("meta"):
        model = build_model(args)
    model.to_empty(device="cpu")
    model.init_weights(seed=3)
    # The softmax scale's factor: (0.1 ln 40 + 1)^2 on q, the attention factor 1 (mscale = mscale_all_dim).
    assert model.layers["0"].attention.softmax_factor == pytest.approx((0.1 * math.log(40) + 1) ** 2)
    assert torch.equal(model.rope, rope_cache(args, args.max_seq_len)) and args.rope_yarn.attention_factor == 1.0
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    save_model_only(tmp_path / "ckpt", weights, run=RunInfo(flavor="debug_deepseek_v3", model_args=args,
                                                            mixed_precision="fp32"), source="test")
    assert load_model(tmp_path / "ckpt").args == args
    with pytest.raises(ConfigError, match=r"deepseek_v3.rope_yarn_mscale=-1.0 must be in \[0, "):
        _args("--model.flavor=debug_deepseek_v3", "--deepseek_v3.rope_yarn_mscale=-1")
