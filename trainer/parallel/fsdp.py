"""FSDP2 (fully_shard) per block and at the root; HSDP on a 2-D mesh."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


def apply_fsdp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype | None,
    reduce_dtype: torch.dtype,
    reshard_after_forward: bool,
) -> str:
    """Shard the embeddings, every block, then the root (final norm, output head).

    The embeddings get a unit of their own, so they are freed after the first layer
    and their gradients reduce-scattered as soon as backward reaches them, instead of
    staying gathered with the root through the whole step. The norm and the head stay
    in the root: the compiled head+loss (trainer.parallel.compile) cannot call into an
    FSDP unit's hooks.

    param_dtype is the compute dtype weights are all-gathered in (bf16 for bf16
    and fp8 runs; float8 linears then cast to fp8 themselves, or receive fp8
    directly with fp8 all-gather); the sharded master weights keep their own
    dtype. A 2-D dp_mesh (dp_replicate, dp_shard) gives HSDP.
    """
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    units = []
    if getattr(model, "tok_embeddings", None) is not None:  # pipeline stages other than the first have none
        fully_shard(model.tok_embeddings, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
        units.append("embeddings")
    blocks = list(model.layers.values())
    for i, block in enumerate(blocks):
        # The last block's weights are needed again right away by backward.
        reshard = reshard_after_forward and i < len(blocks) - 1
        fully_shard(block, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    kind = "HSDP" if dp_mesh.ndim == 2 else "FSDP2"
    return (
        f"{kind}: {' + '.join([*units, f'{len(blocks)} blocks'])} + root over {dp_mesh.mesh_dim_names} (size {dp_mesh.size()}), "
        f"param_dtype={param_dtype}, reduce_dtype={reduce_dtype}, reshard_after_forward={reshard_after_forward}"
    )
