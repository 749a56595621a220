"""Every shape from TOML (issue 33): a flavor is a preset that the [model] and [moe] keys override; the shapes a
config gives are checked as one, each error one line naming the key; resolved.toml holds every value used."""

from __future__ import annotations

import logging

import pytest
import torch

from trainer.checkpoint import RunInfo
from trainer.checkpoint.verify import check_model_matches
from trainer.config import load_job_config
from trainer.errors import ConfigError
from trainer.models import FLAVORS, build_model
from trainer.validate import validate_job
from trainer.validate.run_files import model_keys

DEBUG_AS_NUMBERS = ["--model.dim=128", "--model.n_layers=4", "--model.n_heads=4", "--model.n_kv_heads=2",
                    "--model.ffn_dim=384", "--model.vocab_size=512", "--model.rope_theta=10000",
                    "--model.rope_scaling=none", "--model.max_seq_len=8192"]
DEBUG_MOE_AS_NUMBERS = [*DEBUG_AS_NUMBERS[:4], "--model.vocab_size=512", "--model.multiple_of=64",
                        "--model.rope_theta=10000", "--model.rope_scaling=none", "--model.max_seq_len=8192",
                        "--moe.n_experts=8", "--moe.top_k=2", "--moe.moe_ffn_dim=64", "--moe.n_shared_experts=1",
                        "--moe.n_dense_layers=1", "--moe.dense_ffn_dim=0", "--moe.aux_loss_coef=0.01",
                        "--moe.bias_update_rate=1e-3"]


def _args(*argv: str, world_size: int = 1):
    return validate_job(load_job_config(["--train.seq_len=32", *argv]), world_size=world_size).model_args


def _effective(args) -> dict:
    """What builds the model: every field but those that only say where a width came from (explicit_*, and the
    rule's multiple_of and ffn_dim_multiplier), and the widths themselves."""
    derive = ("multiple_of", "ffn_dim_multiplier")
    values = {f: getattr(args, f) for f in args.__dataclass_fields__ if not f.startswith("explicit_") and f not in derive}
    return values | {"head_dim": args.head_dim, "ffn_dim": args.ffn_dim}


def _init_state(args) -> dict[str, torch.Tensor]:
    model = build_model(args)
    model.init_weights(seed=0)
    return model.state_dict()


@pytest.mark.parametrize("base, target, numbers", [("8b", "debug", DEBUG_AS_NUMBERS),
                                                   ("moe_small", "debug_moe", DEBUG_MOE_AS_NUMBERS)],
                         ids=["dense", "moe"])
def test_a_flavor_given_as_numbers_is_that_flavor(base: str, target: str, numbers: list[str]) -> None:
    """Another flavor of the family with every shape key set builds the target flavor: the same arguments in effect
    and the same initial weights, so the same run (tests/cli/test_train.py trains both)."""
    ours, theirs = _args(f"--model.flavor={base}", *numbers), _args(f"--model.flavor={target}")
    assert type(ours) is type(theirs) and _effective(ours) == _effective(theirs)
    a, b = _init_state(ours), _init_state(theirs)
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("flavor, other, more", [
    ("8b", "debug", []), ("moe_16b", "debug_moe", []),
    # Qwen3-MoE's rule, a list key among them (given back as --moe.dense_layers=1,3; none as an empty list).
    ("qwen3_30b_a3b", "debug_moe", ["--model.n_layers=5", "--moe.sparse_step=1", "--moe.dense_layers=1,3"]),
    ("qwen3_moe_debug", "debug_moe", []),
])
def test_resolved_values_rebuild_the_model_from_any_flavor_of_its_family(flavor: str, other: str, more: list[str]
                                                                         ) -> None:
    """resolved.toml's [model] (and [moe]) hold every value in effect: given to another flavor, they rebuild it."""
    args = _args(f"--model.flavor={flavor}", "--model.n_layers=2", "--model.head_dim=96", "--model.qk_norm=true",
                 *more)
    keys = [k for k in model_keys(args) if not k.startswith("--model.flavor=")]
    if other == "debug_moe":  # the balancing keys too (model_keys leaves them to the run)
        keys += [f"--moe.{k}={getattr(args, k)}" for k in ("aux_loss_coef", "bias_update_rate")]
    again = _args(f"--model.flavor={other}", *keys)
    assert _effective(again) == _effective(args)
    assert args.head_dim == 96 and args.qk_norm and again.n_layers == args.n_layers


@pytest.mark.parametrize("argv, world_size, message", [
    (["--model.dim=130"], 1, "model.dim=130 must be an even multiple of model.n_heads=4 (an even head_dim, for RoPE), "
                             "or set model.head_dim (model.flavor='debug' and the [model] and [moe] keys set)"),
    (["--model.dim=136", "--model.n_heads=8"], 1, "model.dim=136 must be an even multiple of model.n_heads=8"),
    (["--model.n_kv_heads=3"], 1, "model.n_heads=4 must be a multiple of model.n_kv_heads=3"),
    (["--model.head_dim=33"], 1, "model.head_dim=33 must be even (RoPE rotates pairs of dimensions)"),
    (["--model.dim=-8"], 1, "model.dim=-8 must be an integer in [1, 1099511627776] (leave model.dim out for the "
                            "flavor's own)"),
    # 0 and -1 no longer keep the flavor's value: a key left out does, and the error says so.
    (["--model.dim=0"], 1, "model.dim=0 must be an integer in [1, 1099511627776] (leave model.dim out for the "
                           "flavor's own)"),
    (["--model.norm_eps=-1e-5"], 1, "model.norm_eps=-1e-05 must be in (0, 1] (leave model.norm_eps out for the "
                                    "flavor's own)"),
    (["--model.rope_scaling=llama3", "--model.rope_scaling_factor=-2"], 1,
     "model.rope_scaling_factor=-2.0 must be in (0, 1e+06] (leave model.rope_scaling_factor out for the flavor's own)"),
    (["--moe.n_shared_experts=-1"], 1, "moe.n_shared_experts=-1 must be an integer in [0, 1099511627776] (leave "
                                       "moe.n_shared_experts out for the flavor's own)"),
    (["--model.flavor=debug_moe", "--model.ffn_dim=256"], 1,
     "model.ffn_dim=256 with the MoE flavor 'debug_moe': its dense blocks' width is moe.dense_ffn_dim"),
    (["--model.flavor=debug_moe", "--moe.n_experts=4", "--moe.top_k=6"], 1, "moe.top_k=6 must be at most "
                                                                              "moe.n_experts=4"),
    (["--model.n_heads=8", "--model.n_kv_heads=1", "--distributed.tp=2"], 2,
     "distributed.tp=2 must divide the model's n_heads=8 and n_kv_heads=1"),
    (["--model.tie_word_embeddings=true", "--distributed.pp=2"], 2,
     "model.tie_word_embeddings=true with distributed.pp=2: a tied table is one weight, which pipeline parallel would "
     "split in two; set distributed.pp=1"),
    (["--model.tie_word_embeddings=true", "--distributed.tp=2"], 2,
     "model.tie_word_embeddings=true with distributed.tp=2: a tied table is one weight, which tensor parallel would "
     "split in two"),
    (["--model.tie_word_embeddings=true", "--train.loss_chunk_tokens=128"], 1,
     "model.tie_word_embeddings=true with train.loss_chunk_tokens=128 is not supported yet"),
], ids=["dim_heads", "odd_head_dim_from_dim", "kv_heads", "odd_head_dim", "negative_dim", "zero_dim", "norm_eps",
        "rope_factor", "shared_experts", "ffn_dim_moe", "top_k", "tp_heads", "tied_pp", "tied_tp", "tied_chunks"])
def test_impossible_shapes_are_one_line_naming_the_key(argv: list[str], world_size: int, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        _args(*argv, world_size=world_size)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_fp8_names_the_layers_its_shapes_leave_in_bf16(caplog) -> None:
    caplog.set_level(logging.WARNING, logger="trainer")
    _args("--train.mixed_precision=fp8", "--float8.emulate=true", "--model.ffn_dim=200")
    line = next(r.getMessage() for r in caplog.records if "because of their shapes" in r.getMessage())
    assert line == ("FP8: 12 Linear layers stay bf16 because of their shapes (FP8 GEMMs need dimensions divisible by "
                    "16): layers.0.mlp.gate_proj (128x200 not divisible by 16), layers.0.mlp.up_proj (128x200 not "
                    "divisible by 16), layers.0.mlp.down_proj (200x128 not divisible by 16) and 9 more; "
                    "fp8_layers.json lists every layer")


def test_checkpoint_shapes_compare_head_dim_qk_norm_and_tying(tmp_path) -> None:
    """A qk_norm, tied or other-head_dim checkpoint is refused by a run without them (the state dict would load
    wrongly or not at all); one written before these arguments existed matches as what they meant then."""
    debug = FLAVORS["debug"]
    old = {k: v for k, v in RunInfo(flavor="debug", model_args=debug, mixed_precision="fp32").model_json().items()
           if k not in ("explicit_head_dim", "explicit_ffn_dim", "tie_word_embeddings", "qk_norm", "head_dim")}
    check_model_matches({"model": old}, RunInfo(flavor="debug", model_args=debug, mixed_precision="fp32"),
                        path=tmp_path)
    qk = RunInfo(flavor="debug", model_args=_args("--model.qk_norm=true", "--model.head_dim=48"),
                 mixed_precision="fp32")
    with pytest.raises(ConfigError.__mro__[1]) as e:  # CheckpointError and ConfigError share UserError
        check_model_matches({"model": qk.model_json()}, RunInfo(flavor="debug", model_args=debug,
                                                                 mixed_precision="fp32"), path=tmp_path)
    assert "model shape mismatch: the checkpoint is llama3 debug with head_dim=48 (this run: 32), qk_norm=True (this " \
           "run: False); use the [model] shapes it was trained with (its resolved.toml has them all)" in str(e.value)


@pytest.mark.slow
def test_a_flavor_given_as_numbers_trains_as_that_flavor(tmp_path) -> None:
    """The same losses, step for step, as the flavor the numbers describe (dense and MoE)."""
    from tests.helpers import FAST, losses_by_step, run_cli_cases

    runs = {"dense": ["--model.flavor=8b", *DEBUG_AS_NUMBERS], "debug": ["--model.flavor=debug"],
            "moe": ["--model.flavor=moe_small", *DEBUG_MOE_AS_NUMBERS], "debug_moe": ["--model.flavor=debug_moe"]}
    results = run_cli_cases({name: [*FAST, "--train.steps=4", *argv, f"--job.dump_folder={tmp_path / name}"]
                             for name, argv in runs.items()})
    assert all(r["rc"] == 0 for r in results.values()), {n: r["stderr"][-1000:] for n, r in results.items()}
    for ours, theirs in (("dense", "debug"), ("moe", "debug_moe")):
        assert losses_by_step(tmp_path / ours) == losses_by_step(tmp_path / theirs)
        assert len(losses_by_step(tmp_path / ours)) == 4


@pytest.mark.slow
def test_a_tied_model_compiles(tmp_path) -> None:
    """train.compile_model with a tied head: its FSDP2 unit's hooks cannot be traced inside the compiled loss (seen on
    an H100: dynamo refused the loss graph), so the loss runs eagerly and the run gives the eager run's losses."""
    from tests.helpers import FAST, losses_by_step, run_cli_cases

    tied = [*FAST, "--train.steps=3", "--model.tie_word_embeddings=true", "--model.qk_norm=true"]
    results = run_cli_cases({"compiled": [*tied, "--train.compile_model=true", f"--job.dump_folder={tmp_path / 'c'}"],
                             "eager": [*tied, f"--job.dump_folder={tmp_path / 'e'}"]})
    assert all(r["rc"] == 0 for r in results.values()), {n: r["stderr"][-1500:] for n, r in results.items()}
    assert "the final norm, tied head and loss run eagerly" in results["compiled"]["stdout"]
    compiled, eager = losses_by_step(tmp_path / "c"), losses_by_step(tmp_path / "e")
    assert list(compiled) == [1, 2, 3]
    assert [compiled[s] for s in compiled] == pytest.approx([eager[s] for s in compiled], rel=1e-5)


def test_bf16_master_weights_keep_a_tied_head_one_parameter() -> None:
    """The cast to bf16 master weights gave each module a Parameter of its own: the optimizer then held the table
    twice (751.6M parameters for a 596.0M-parameter Qwen3-0.6B shape, seen on an H100) and the tie was gone."""
    from trainer.parallel.apply import cast_parameters

    with torch.device("meta"):
        model = build_model(_args("--model.tie_word_embeddings=true"))
    cast_parameters(model, torch.bfloat16)
    assert model.output_head.proj.weight is model.tok_embeddings.weight
    assert model.tok_embeddings.weight.dtype == torch.bfloat16
    assert len(list(model.parameters())) == len(dict(model.named_parameters(remove_duplicate=False))) - 1
