"""The HF export of a running job: every rank's shards and every pipeline stage's tensors, gathered to rank 0."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from trainer.checkpoint.state import model_state_dict


def export_gathered(model: nn.Module, path: Path, *, args: Any, dtype: torch.dtype, p2p_group: Any,
                    before_p2p: Callable[[], None]) -> Path:
    """Write `model`'s weights, gathered whole, as a Hugging Face export at `path` (collective; rank 0 writes).

    Sharded tensors are all-gathered one at a time (ranks other than 0 hold one full tensor at a
    time); a tensor rank 0 does not hold (another pipeline stage's) comes from its first holder
    by a send over `p2p_group`, after `before_p2p()` (the manager waits for a background save,
    which may be using that group).
    """
    from trainer.export import write_hf_export

    rank, world_size = dist.get_rank(), dist.get_world_size()
    sd = model_state_dict(model)
    # Every rank's keys, in rank order: under pipeline parallelism ranks hold different stages.
    gathered: list[list[tuple[str, tuple[int, ...]]]] = [[] for _ in range(world_size)]
    # The default group, not p2p_group: a background save of this step may be using that right now.
    dist.all_gather_object(gathered, [(k, tuple(v.shape)) for k, v in sd.items()])
    shapes: dict[str, tuple[int, ...]] = {}
    owner: dict[str, int] = {}
    for r, items in enumerate(gathered):
        for k, shape in items:
            shapes.setdefault(k, shape)
            owner.setdefault(k, r)
    on_rank0 = {k for k, _ in gathered[0]}
    if any(k not in sd for k in shapes):
        before_p2p()

    def fetch(fqns: list[str]) -> dict[str, torch.Tensor]:
        out = {}
        for fqn in fqns:
            full = None
            if fqn in sd:
                t = sd[fqn]
                # note: an all-gather per tensor; ranks other than 0 hold one full tensor at a time.
                full = t.full_tensor() if isinstance(t, DTensor) else t
            if rank == 0:
                if full is None:  # another pipeline stage's tensor: its first rank sends it
                    full = torch.empty(shapes[fqn], dtype=dtype)
                    dist.recv(full, src=owner[fqn], group=p2p_group)
                out[fqn] = full.detach().to("cpu", dtype)
            elif owner[fqn] == rank and fqn not in on_rank0:
                dist.send(full.detach().to("cpu", dtype).contiguous(), dst=0, group=p2p_group)
        return out

    out = write_hf_export(path, args=args, shapes=shapes, fetch=fetch, dtype=dtype, is_writer=rank == 0)
    # Not p2p_group: a background save of this step may be using it from its thread right now.
    dist.barrier()
    return out
