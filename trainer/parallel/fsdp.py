"""FSDP2 (fully_shard) per block and at the root; HSDP on a 2-D mesh."""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from trainer.parallel.fp8_reduce import Float8ReduceScatter


def apply_fsdp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype | None,
    reduce_dtype: torch.dtype,
    reshard_after_forward: bool,
    expert_mesh: DeviceMesh | None = None,
    routers_with_experts: bool = False,
    experts_outside: bool = False,
) -> str:
    """Shard the embeddings, every block, then the root (final norm, output head); tied embeddings and head
    (model.tie_word_embeddings) share one unit with the final norm.

    The embeddings get a unit of their own, so they are freed after the first layer
    and their gradients reduce-scattered as soon as backward reaches them, instead of
    staying gathered with the root through the whole step. The norm and the head stay
    in the root, which is never resharded after forward: the loss (trainer/loss.py) applies
    them to the hidden states the forward returns, and backward needs them first.

    param_dtype is the compute dtype weights are all-gathered in (bf16 for bf16
    and fp8 runs; float8 linears then cast to fp8 themselves, or receive fp8
    directly with fp8 all-gather); the sharded master weights keep their own
    dtype. A 2-D dp_mesh (dp_replicate, dp_shard) gives HSDP.

    A float8 reduce_dtype (distributed.reduce_dtype='fp8'): see fsdp_policy.

    expert_mesh (EP or TP with an MoE model): each MoE layer's routed experts (with
    routers_with_experts, under TP, its router too) get an FSDP unit of their own over it;
    their gradients already sum other ranks' tokens (EP: the all-to-all's backward; TP: the
    reduce-scatter over dp_shard x tp sums the tp ranks' sequence slices), so they are divided
    by the data-parallel degree only, as the dense weights are. experts_outside (FSDPOptions.experts_outside: the
    expert mesh is one rank, nothing to shard or reduce): the experts stay out of FSDP2 and divide their own gradients
    (GroupedExperts.grad_divisor).
    """
    mp, comm = fsdp_policy(model, param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    shard = functools.partial(_shard, mp=mp, comm=comm)
    units = []
    if getattr(model, "tok_embeddings", None) is not None and model.args.tie_word_embeddings:
        # One Parameter in the embeddings and the head: one unit holds both (FSDP2 shards a shared parameter once
        # only within one unit), gathered like the root from the embeddings' forward to their backward.
        shard([model.tok_embeddings, model.norm, model.output_head], dp_mesh, False)
        units.append("tied embeddings, norm and head")
    elif getattr(model, "tok_embeddings", None) is not None:  # pipeline stages other than the first have none
        shard(model.tok_embeddings, dp_mesh, reshard_after_forward)
        units.append("embeddings")
    blocks = list(model.layers.values())
    ignored, experts_line = _shard_experts(blocks, expert_mesh, dp_mesh, shard, param_dtype=param_dtype,
                                           reshard_after_forward=reshard_after_forward,
                                           with_routers=routers_with_experts, outside=experts_outside)
    for i, block in enumerate(blocks):
        # The last block's weights are needed again right away by backward.
        shard(block, dp_mesh, reshard_after_forward and i < len(blocks) - 1, ignored=ignored)
    # The root (final norm, output head) stays gathered from its forward to its backward: the loss
    # (trainer/loss.py) runs the head after the model's forward returns, and backward starts with it.
    shard(model, dp_mesh, False, ignored=ignored)
    kind = "HSDP" if dp_mesh.ndim == 2 else "FSDP2"
    return (
        f"{kind}: {' + '.join([*units, f'{len(blocks)} blocks'])} + root over {dp_mesh.mesh_dim_names} "
        f"(size {dp_mesh.size()}){experts_line}, "
        f"param_dtype={param_dtype}, reduce_dtype={reduce_dtype}"
        + (f" (exchanged in float8, one scale per unit from the amax over ranks; shards written in {mp.reduce_dtype})"
           if comm is not None else "")
        + f", reshard_after_forward={reshard_after_forward}"
    )


def fsdp_policy(model: nn.Module, *, param_dtype: torch.dtype | None, reduce_dtype: torch.dtype
                ) -> tuple[MixedPrecisionPolicy, Float8ReduceScatter | None]:
    """FSDP2's mixed-precision policy, and the reduce-scatter that replaces FSDP2's own (None: FSDP2's).

    A float8 reduce_dtype (distributed.reduce_dtype='fp8'): every unit reduce-scatters its gradients as float8 with
    one scale from the amax over its shard group (trainer.parallel.fp8_reduce); FSDP2's reduce dtype, in which the
    reduced shards are written and microbatches accumulated, is the parameters' own (the master dtype), and so is
    HSDP's all-reduce across replicas.
    """
    if reduce_dtype.itemsize > 1:
        return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype), None
    master = {p.dtype for p in model.parameters()}
    assert len(master) == 1, f"one master dtype expected, found {master}"
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=master.pop()), Float8ReduceScatter(reduce_dtype)


def _shard_experts(blocks: list[nn.Module], expert_mesh: DeviceMesh | None, dp_mesh: DeviceMesh, shard, *,
                   param_dtype: torch.dtype | None, reshard_after_forward: bool, with_routers: bool, outside: bool
                   ) -> tuple[set[nn.Parameter], str]:
    """Each MoE layer's routed experts (with_routers: and its router) an FSDP2 unit over expert_mesh, or with
    `outside` none: (the parameters the blocks' units must leave alone, the startup line's words)."""
    layers = [(i, block.moe) for i, block in enumerate(blocks) if getattr(block, "moe", None) is not None]
    if expert_mesh is None or not layers:
        return set(), ""
    if outside:
        experts = [moe.experts for _, moe in layers]
        # trainer.validate decided it (experts_outside_fsdp): a one-rank expert mesh, weights needing no cast.
        assert expert_mesh.size() == 1 and not with_routers, (expert_mesh, with_routers)
        assert param_dtype is None or all(p.dtype == param_dtype for e in experts for p in e.parameters()), param_dtype
        for e in experts:
            # FSDP2 would divide their gradients by every data-parallel rank as it reduced them; they divide their own.
            e.grad_divisor = float(dp_mesh.size())
        return ({p for e in experts for p in e.parameters()},
                f"; routed experts of {len(experts)} MoE layers left out (ep covers the shard group: nothing to "
                f"shard or reduce; their gradients divided by {dp_mesh.size()} in their backward)")
    for i, moe in layers:
        for unit in ([moe.router, moe.experts] if with_routers else [moe.experts]):
            shard(unit, expert_mesh, reshard_after_forward and i < len(blocks) - 1)
            # Gradients that already sum other ranks' tokens: divide by every data-parallel
            # rank, as the dense weights are, not by the expert mesh's size.
            unit.set_gradient_divide_factor(float(dp_mesh.size()))
            if expert_mesh.device_type == "cpu" and expert_mesh.size(expert_mesh.ndim - 1) > 1:
                # That factor makes FSDP2 reduce with PREMUL_SUM, which gloo lacks: SUM, then divide.
                # Not with one rank per shard group: there FSDP2 (torch 2.13) already divides while
                # copying and would divide a second time after (tests/distributed/test_moe_ep.py).
                unit.set_force_sum_reduction_for_comms(True)
    return set(), (f"; routed experts{' and routers' if with_routers else ''} of {len(layers)} MoE layers over "
                   f"{expert_mesh.mesh_dim_names} (size {expert_mesh.size()})")


def _shard(unit: nn.Module | list[nn.Module], mesh: DeviceMesh, reshard: bool, *, mp: MixedPrecisionPolicy,
           comm: Float8ReduceScatter | None, ignored: set[nn.Parameter] | None = None) -> FSDPModule:
    """fully_shard one unit (a module, or a list of modules sharing one unit), with comm as its reduce-scatter;
    `ignored` parameters stay out of it (and of the units above it)."""
    sharded = fully_shard(unit, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard, ignored_params=ignored or None)
    module = sharded[0] if isinstance(sharded, list) else sharded
    if comm is not None:
        module.set_custom_reduce_scatter(comm)
    return module
