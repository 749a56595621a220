"""The HF export of a running job: every rank's shards and every pipeline stage's tensors, gathered to rank 0
(the final export of checkpoint.model_only, and checkpoint.export_interval's in trainer/checkpoint/exports.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from trainer.checkpoint.state import RunInfo, model_state_dict
from trainer.hf import check_exportable, require_safetensors, resolve_tokenizer, write_hf_export
from trainer.hf.tokenizer import ExportTokenizer
from trainer.model_values import ModelArgs


def prepare_export(run: RunInfo, *, key: str = "checkpoint.model_only=true") -> ExportTokenizer | None:
    """Before training, on every rank: what the final export needs is there (safetensors, a Hugging Face target
    for the model's options, the run's tokenizer unchanged), so a run that cannot export stops before it trains.
    Returns the tokenizer to copy (an ExportTokenizer) or None; `key`: the setting that asks for an export."""
    require_safetensors(f"{key} (a safetensors export)")
    check_exportable(run.model_args)
    return resolve_tokenizer(run.tokenizer, fingerprint=run.tokenizer_fingerprint) if run.tokenizer else None


def export_gathered(model: nn.Module, path: Path, *, args: ModelArgs, dtype: torch.dtype,
                    p2p_group: dist.ProcessGroup | None, before_p2p: Callable[[], None],
                    tokenizer: ExportTokenizer | None = None) -> Path:
    """Write `model`'s weights, gathered whole, as a Hugging Face export at `path` (collective; rank 0 writes),
    one shard's tensors at a time (`gathered_fetch`). `tokenizer` (an ExportTokenizer) is copied into the export."""
    shapes, fetch = gathered_fetch(model, p2p_group=p2p_group, before_p2p=before_p2p)
    out = write_hf_export(path, args=args, shapes=shapes, fetch=fetch, dtype=dtype, is_writer=dist.get_rank() == 0,
                          tokenizer=tokenizer)
    # Not p2p_group: a background save of this step may be using it from its thread right now.
    dist.barrier()
    return out


def gathered_fetch(model: nn.Module, *, p2p_group: dist.ProcessGroup | None, before_p2p: Callable[[], None],
                   dtype_of: Callable[[str], torch.dtype] | None = None
                   ) -> tuple[dict[str, tuple[int, ...]], Callable[[list[str]], dict[str, torch.Tensor]]]:
    """Every tensor's shape (by fqn, of every pipeline stage), and `fetch(fqns)`: those tensors, whole, on rank 0's
    host (an empty dict on the other ranks). Collective: every rank calls `fetch` with the same fqns in the same order.

    Sharded tensors are all-gathered one at a time (ranks other than 0 hold one full tensor at a
    time); a tensor rank 0 does not hold (another pipeline stage's) comes from its first holder
    by a send over `p2p_group`, after `before_p2p()` (the manager waits for a background save,
    which may be using that group). `dtype_of(fqn)`: the dtype rank 0 casts a tensor to before
    copying it to the host (on the device; None keeps each tensor's own dtype, and the writer casts).
    The host copies never alias the model's weights, so they may be written while training goes on.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    sd = model_state_dict(model)
    # Every rank's keys, in rank order: under pipeline parallelism ranks hold different stages.
    gathered: list[list[tuple[str, tuple[int, ...], torch.dtype]]] = [[] for _ in range(world_size)]
    # The default group, not p2p_group: a background save of this step may be using that right now.
    dist.all_gather_object(gathered, [(k, tuple(v.shape), v.dtype) for k, v in sd.items()])
    shapes: dict[str, tuple[int, ...]] = {}
    dtypes: dict[str, torch.dtype] = {}
    owner: dict[str, int] = {}
    for r, items in enumerate(gathered):
        for k, shape, dt in items:
            shapes.setdefault(k, shape)
            dtypes.setdefault(k, dt)
            owner.setdefault(k, r)
    on_rank0 = {k for k, _, _ in gathered[0]}
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
            # In the tensor's own dtype unless dtype_of says: the writer casts, and keeps what it must in fp32 (MoE
            # expert biases).
            if rank == 0:
                if full is None:  # another pipeline stage's tensor: its first rank sends it
                    full = torch.empty(shapes[fqn], dtype=dtypes[fqn])
                    dist.recv(full, src=owner[fqn], group=p2p_group)
                full = full.detach().to(dtype_of(fqn) if dtype_of else full.dtype)
                # copy: a 1-process CPU run's "gathered" tensor is the parameter itself, which the next step changes.
                out[fqn] = full.to("cpu", copy=True)
            elif owner[fqn] == rank and fqn not in on_rank0:
                dist.send(full.detach().to("cpu").contiguous(), dst=0, group=p2p_group)
        return out

    return shapes, fetch
