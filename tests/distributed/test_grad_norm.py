"""trainer.run.step.grad_norm (local shards, one reduction per mesh and placement) equals the norm of the full
gradients.

FSDP over dp_shard x TP on a 2-D mesh gives every placement the trainer meets: FSDP's _StridedShard on dim 0
where TP also shards dim 0 (column-parallel weights; not a Shard subclass), Shard x Shard (row-parallel),
Shard x Replicate (norms) and plain replicated tensors on a 1-D sub-mesh.
"""

from __future__ import annotations

import pytest

from tests.distributed.spawn import run_distributed


def _norms_of_fsdp_tp_gradients() -> tuple[float, float, list[str]]:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from trainer.run.step import grad_norm

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 12), nn.ReLU(), nn.Linear(12, 8))
    parallelize_module(model, mesh["tp"], {"1": ColwiseParallel(), "3": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp_shard"])
    torch.manual_seed(1 + dist.get_rank() // 2)  # tp ranks see the same batch, dp ranks different ones
    model(torch.randn(5, 8)).square().sum().backward()
    params = list(model.parameters())
    expected = torch.nn.utils.get_total_norm([p.grad.full_tensor() for p in params])
    return float(grad_norm(params)), float(expected), sorted({str(tuple(p.grad.placements)) for p in params})


def test_grad_norm_matches_the_full_gradients_under_fsdp_x_tp() -> None:
    for got, expected, placements in run_distributed(_norms_of_fsdp_tp_gradients, world_size=4):
        assert any("_StridedShard" in p for p in placements), placements  # the case that once went unreduced
        assert got == pytest.approx(expected, rel=1e-6)
