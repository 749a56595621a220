"""Tensor parallelism with sequence parallel norms and a vocabulary-parallel loss: applies the model family's plan."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import parallelize_module

from trainer.models import family_of


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, *, loss_parallel: bool) -> str:
    """Megatron-style TP on every block, as the model's family plans it; activations between blocks are sharded
    on the sequence dim.

    The plan (`family_of(model.args).tp_plan`: trainer.models.llama.tp_plan, trainer.models.moe.tp_plan) names
    the modules: column-parallel q/k/v and gate/up, row-parallel o/down, so each block needs one all-gather in
    and one reduce-scatter out per sublayer. With loss_parallel the logits stay sharded over the vocabulary and
    the loss runs under `torch.distributed.tensor.parallel.loss_parallel()`. Modules that sum statistics over
    whole sequences (the MoE aux loss) get the tp group, whose ranks hold the other slices of each sequence.
    """
    plan = family_of(model.args).tp_plan(model, loss_parallel=loss_parallel)
    parallelize_module(model, tp_mesh, plan.top)
    tp = tp_mesh.size()
    # trainer.validate checked this for the user; here it is an invariant.
    assert model.args.n_heads % tp == 0 and model.args.n_kv_heads % tp == 0, (tp, model.args)
    # The rope cache stays a plain tensor: sequence parallel shards the sequence only
    # between sublayers, and attention sees the whole (replicated) sequence.
    for name, block in model.layers.items():
        parallelize_module(block, tp_mesh, plan.blocks[name])
    for module in plan.sequence_modules:
        module.set_sequence_group(tp_mesh.get_group())
    return f"tensor parallel: tp={tp}, sequence parallel norms, loss_parallel={loss_parallel}{plan.summary}"
