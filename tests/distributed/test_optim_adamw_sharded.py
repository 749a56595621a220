"""AdamW with bf16 master weights on sharded DTensors (2 gloo ranks, spawned) rounds every element exactly as one process does."""

from __future__ import annotations

import torch

from tests.distributed.spawn import run_distributed

KINDS = ("stochastic", "kahan")


def one_process_and_sharded(kinds: tuple[str, ...]) -> dict[str, tuple[list, list, list]]:
    """Per update kind, three steps of AdamW from the same weights and gradients, unsharded on this rank and
    sharded over both ranks: {kind: (start, one process, sharded)}, the full tensors (every rank returns them)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from trainer.optim.adamw import AdamW
    from trainer.distributed import destroy_distributed

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,))
    gen = torch.Generator().manual_seed(0)
    # Uneven shapes: FSDP-style Shard(0) of 7 rows gives ranks 4 and 3 rows.
    full = [torch.randn(7, 5, generator=gen).bfloat16(), torch.randn(9, generator=gen).bfloat16(),
            torch.randn(6, 11, generator=gen).bfloat16()]
    grads = [[torch.randn(t.shape, generator=gen).bfloat16() for t in full] for _ in range(3)]
    placements = [[Shard(0)], [Shard(0)], [Shard(1)]]

    def run(kind: str, sharded: bool) -> list[torch.Tensor]:
        params = [torch.nn.Parameter(distribute_tensor(t.clone(), mesh, pl) if sharded else t.clone())
                  for t, pl in zip(full, placements)]
        opt = AdamW(params, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, rounding=kind, seed=5,
                    implementation="eager")
        for step in grads:
            for p, g, pl in zip(params, step, placements):
                p.grad = distribute_tensor(g, mesh, pl) if sharded else g
            opt.step()
        return [p.detach().full_tensor() if sharded else p.detach() for p in params]

    try:
        return {kind: (full, run(kind, False), run(kind, True)) for kind in kinds}
    finally:
        destroy_distributed()  # barrier first: a rank must not close gloo while its peer still reads


def test_sharded_rounding_equals_one_process() -> None:
    ranks = run_distributed(one_process_and_sharded, world_size=2, args=(KINDS,))
    for rank in ranks:  # each rank's full_tensor() of the sharded run: both shards gathered
        assert list(rank) == list(KINDS)
        for kind, (start, one, sharded) in rank.items():
            for a, b, s in zip(one, sharded, start, strict=True):
                assert torch.equal(a, b), (kind, (a.float() - b.float()).abs().max())
                assert not torch.equal(a, s), kind  # the steps moved the weights
