"""Model families (trainer/models/family.py): each family's tensor-parallel plan names modules its model has, and
covers every Linear layer except the ones meant to stay whole; every family has its Hugging Face mapping."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

import trainer.hf
from trainer.models import FAMILIES, FLAVORS, build_model, family_of, model_args_for


def _cases():
    yield "debug", model_args_for("debug")
    yield "debug_moe", model_args_for("debug_moe")
    yield "debug_moe, no shared expert", replace(model_args_for("debug_moe"), n_shared_experts=0)
    # MLA (trainer.models.mla.mla_tp_plan), with the q LoRA and an MTP module (trainer.models.mtp.mtp_tp_plan), and
    # with a plain q_proj.
    yield "debug_deepseek_v3", model_args_for("debug_deepseek_v3")
    yield "debug_deepseek_v3, plain q_proj", replace(model_args_for("debug_deepseek_v3"), mtp_layers=0, q_lora_rank=0)


@pytest.mark.parametrize("loss_parallel", [False, True])
@pytest.mark.parametrize("name,args", list(_cases()), ids=[n for n, _ in _cases()])
def test_tp_plan_names_existing_modules_and_covers_the_linears(name, args, loss_parallel) -> None:
    # parallelize_module only warns on a plan key that matches no module and leaves its weights whole: a plan
    # that lost touch with the fqns (a renamed feed-forward slot) would train unsharded, silently.
    with torch.device("meta"):
        model = build_model(args)
    plan = family_of(args).tp_plan(model, loss_parallel=loss_parallel)
    for fqn in plan.top:
        model.get_submodule(fqn)
    assert set(plan.blocks) == set(model.layers)
    planned = {f"{fqn}.weight" for fqn in plan.top}
    for block_name, block_plan in plan.blocks.items():
        for fqn in block_plan:
            model.layers[block_name].get_submodule(fqn)
        planned |= {f"layers.{block_name}.{fqn}.weight" for fqn in block_plan}
    linears = {f"{fqn}.weight" for fqn, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Embedding))}
    # Routers stay whole under TP: each tp rank routes its own sequence slice (trainer.models.moe.tp_plan).
    # (A DeepSeek-V3 MTP module, layers.{n_layers}, routes like the last block.)
    is_moe = getattr(args, "is_moe_layer", lambda i: False)
    blocks = range(args.n_layers + getattr(args, "mtp_layers", 0))
    assert sorted(linears - planned) == sorted(f"layers.{i}.moe.router.gate.weight" for i in blocks
                                               if is_moe(min(i, args.n_layers - 1)))
    # The MoE layers' aux loss sums over the tp group; so does a DeepSeek-V3 model with MTP modules, which cuts the
    # embeddings ahead from whole sequences; nothing else asks for it.
    moe_layers = [b.moe for b in model.layers.values() if hasattr(b, "moe")]
    mtp = [model] if getattr(args, "mtp_layers", 0) else []
    assert plan.sequence_modules == moe_layers + mtp and bool(plan.summary) == bool(moe_layers)


@pytest.mark.parametrize("flavor, n_layers, changes", [
    ("debug", 3, {}), ("debug_moe", 3, {}), ("moe_16b", 3, {}), ("debug_deepseek_v3", 3, {}),
    ("deepseek_v3_16b", 3, {}),
    # Qwen3-MoE's rule: every other block MoE (1, 3), then with block 3 listed dense too, then a lone dense block
    # among MoE ones (the dense kind's first block is not block 0).
    ("qwen3_moe_debug", 5, {}), ("qwen3_moe_debug", 5, {"dense_layers": (3,)}),
    ("qwen3_moe_debug", 5, {"sparse_step": 1, "dense_layers": (2,)}),
])
def test_block_params_count_each_block_and_alike_runs_cover_the_model(flavor: str, n_layers: int, changes: dict
                                                                      ) -> None:
    """The memory plan's facts of a family (trainer/validate/plan.py): each block's parameters and routed experts' as
    the built block has them, and runs of alike blocks that cover every block, each once."""
    from trainer.models.activations import ActivationPolicy

    args = replace(FLAVORS[flavor], n_layers=n_layers, **changes)
    family = family_of(args)
    with torch.device("meta"):
        model = build_model(args)
    for i, block in model.layers.items():
        params = dict(block.named_parameters())
        routed = sum(p.numel() for name, p in params.items() if name.startswith(("moe.experts.", "moe.router.")))
        assert family.block_params(args, int(i)) == (sum(p.numel() for p in params.values()), routed)
    runs = family.block_runs(args)
    assert sorted(i for run in runs for i in run) == list(range(len(model.layers)))  # DeepSeek-V3's MTP modules too
    policy = ActivationPolicy(compiled=True)
    for run in runs:
        # What the plan asks of a run (trainer/validate/plan.py): its size, its first block, which blocks are in it.
        assert (len(run), run[0]) == (len(list(run)), list(run)[0])
        assert all((i in run) == (i in list(run)) for i in range(-1, args.n_layers + 1))
        assert len({(family.block_params(args, i), family.activation_bytes(args, i, policy)) for i in run}) == 1


def test_every_family_has_its_hf_mapping_and_flavors() -> None:
    for flavor, args in FLAVORS.items():
        family = family_of(args)
        assert flavor in family.flavors
        assert trainer.hf.family(args).__name__ == f"trainer.hf.{family.name}"
    assert set(FAMILIES) == {"llama", "moe", "deepseek_v3", "gpt_oss"}
    # Each config.json layout is one family's (trainer.hf picks the family by it).
    model_types = [t for f in FAMILIES.values() for t in trainer.hf.mapping(f).MODEL_TYPES]
    assert len(model_types) == len(set(model_types)) == 7
