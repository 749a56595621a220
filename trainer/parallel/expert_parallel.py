"""Expert parallelism: routed experts split over the `ep` mesh axis, tokens moved by all-to-all.

`apply_ep` turns each MoE layer's 3-D expert weights into DTensors sharded on dim 0
(the expert dim) over the ep axis, so each rank holds n_experts / ep experts and
checkpoints keep the global view (DCP reshards them to any ep). It then installs an
`AllToAllDispatcher` in `GroupedExperts` (`use(dispatcher=...)`), which the layer calls around its kernel:

    tokens sorted by global expert --all-to-all--> this rank's experts' tokens
      (sorted by local expert) --grouped GEMM--> outputs --all-to-all back--> original order

Token counts per expert are exchanged first (a small all-to-all, then one host sync for
the split sizes; compiled, dynamo traces them as symbolic sizes and the block stays one graph,
trainer.parallel.compile; with `moe.dispatch = "padded"` no host sync: `PaddedAllToAllDispatcher` moves fixed
slots of rows); the token all-to-alls are differentiable
(`all_to_all_single_autograd`), so backward sends the gradients the reverse way. With
`moe.dispatch_dtype = "fp8"` the dispatch moves the rows as e4m3 with one fp32 scale per 1x128 block and the
receiver keeps them so (`ExpertRows.blocks`): FP8 rowwise experts requantize them rowwise byte to byte, other
kernels dequantize them (`trainer.models.moe_dispatch`: bytes, rounding, the proof that the requantization is the
old dequantize-then-quantize bit for bit, the straight-through backward); the combine stays in the compute dtype.
FSDP2 later shards the expert weights over `expert_fsdp` (dp_shard / ep ranks; at one rank it leaves them
alone), see `trainer.parallel.fsdp.apply_fsdp`.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single, all_to_all_single_autograd, wait_tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from trainer.models.moe_dispatch import BLOCK, fp8_all_to_all_blocks, fp8_bytes_per_token
from trainer.models.moe_experts import ExpertDispatcher, ExpertRows
from trainer.models.moe_permute import inverse_permutation, permute_rows, select_unique_rows, tokens_to_experts


class AllToAllDispatcher(ExpertDispatcher):
    """Moves expert-sorted rows to the rank that holds their expert (dispatch) and back (combine)."""

    def __init__(self, ep_mesh: DeviceMesh, n_experts: int, *, dispatch_dtype: str = "bf16"):
        self.group = ep_mesh.get_group()
        self.ep = ep_mesh.size()
        assert n_experts % self.ep == 0, (n_experts, self.ep)  # trainer.validate checked it
        assert dispatch_dtype in ("bf16", "fp8"), dispatch_dtype
        self.n_local = n_experts // self.ep
        self.fp8 = dispatch_dtype == "fp8"

    def dispatch(self, x: torch.Tensor, counts: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor,
                 k: int) -> tuple[ExpertRows, tuple]:
        """Tokens x [T, dim], their copies sorted by global expert (`order`, counts [n_experts]) -> (the rows for
        this rank's experts as received, with the gather that sorts them by local expert; what combine needs).

        The copies cross the all-to-all in the compute dtype, or as e4m3 + 1x128 block scales with fp8 dispatch,
        kept so on arrival (`ExpertRows.blocks`, `source` then their gradient handle): the FP8 kernel
        (trainer/models/moe_fp8.py) requantizes the received bytes rowwise (1 byte in, 1 byte out) and gathers
        the byte rows and row scales by `perm`; other kernels dequantize them (`ExpertRows.source_rows`)."""
        rows = tokens_to_experts(x, order, inverse, k)
        received, blocks, perm, perm_inverse, local_counts, ctx = self._exchange(rows, counts)
        return ExpertRows(received, perm, perm_inverse, local_counts, k=1, blocks=blocks), ctx

    def _exchange(self, x: torch.Tensor, counts: torch.Tensor):
        """x [N, dim] sorted by global expert, counts [n_experts] -> (rows as received, grouped by source rank, or
        with fp8 dispatch their gradient handle; the received blocks or None; perm, with received[perm] sorted by
        local expert; its inverse; counts [n_local]; what combine needs)."""
        ep, n_local = self.ep, self.n_local
        recv = self._received_counts(counts)
        # note: a host sync: the split sizes of the token all-to-all must be known on the host.
        sizes = torch.stack([counts.view(ep, n_local).sum(1), recv.sum(1)]).tolist()
        send_splits, recv_splits = sizes
        # The same number written in x's rows: compiled, the combine's output then has x's shape, not an unknown one.
        send_splits[-1] = x.shape[0] - sum(send_splits[:-1])
        if self.fp8:
            x_recv, blocks = fp8_all_to_all_blocks(x, recv_splits, send_splits, self.group)
        else:
            x_recv, blocks = all_to_all_single_autograd(x, recv_splits, send_splits, group=self.group), None
        # Received rows are grouped by (source rank, local expert); the grouped GEMM wants them by expert.
        segment = torch.repeat_interleave(
            torch.arange(ep * n_local, device=x.device), recv.flatten(), output_size=x_recv.shape[0]
        )
        src, expert = segment // n_local, segment % n_local
        perm = torch.argsort(expert * ep + src, stable=True)
        inverse = inverse_permutation(perm)
        return x_recv, blocks, perm, inverse, recv.sum(0), (perm, inverse, send_splits, recv_splits)

    def _received_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """counts [n_experts] this rank sends -> recv [ep, n_local]: rows rank `src` sends to this rank's local
        expert e (a small all-to-all; on the device)."""
        # wait_tensor, not .wait(): torch 2.11 on CUDA may hand back a plain tensor rather than an
        # AsyncCollectiveTensor.
        recv = wait_tensor(all_to_all_single(counts.to(torch.int64), None, None, group=self.group))
        return recv.view(self.ep, self.n_local)

    def combine(self, y: torch.Tensor, ctx: tuple) -> torch.Tensor:
        """Outputs for this rank's experts -> back to the ranks (and the order) the rows came from."""
        perm, inverse, send_splits, recv_splits = ctx
        y_recv_order = permute_rows(y, inverse, perm)  # row perm[i] of the received order is y's row i
        return all_to_all_single_autograd(y_recv_order, send_splits, recv_splits, group=self.group)


class PaddedAllToAllDispatcher(AllToAllDispatcher):
    """`moe.dispatch = "padded"`: the token all-to-alls move a fixed number of rows, so the host never waits for the
    split sizes. Each rank sends every destination a slot of N rows (N: its expert-sorted rows, all of which may go
    to one rank), its rows first and zeros after; the receiver sorts the rows it got by local expert, the empty
    rows last, where the grouped GEMMs do not run them (`moe_permute.padded_layout`), and the combine sends the
    slots back. The same rows, experts and sums as the sized all-to-all; ep times the rows on the wire and in the
    experts' activation buffers (docs/moe.md)."""

    def dispatch(self, x, counts, order, inverse, k):
        rows = tokens_to_experts(x, order, inverse, k)
        ep, n_local, n = self.ep, self.n_local, rows.shape[0]
        per_rank = counts.view(ep, n_local).sum(1)
        ends, row = torch.cumsum(per_rank, 0), torch.arange(n, device=x.device)
        rank_of_row = torch.searchsorted(ends, row, right=True)
        # Row i's place in the send buffer: its destination's slot, after that destination's earlier rows.
        slot = rank_of_row * n + row - (ends - per_rank)[rank_of_row]
        send = rows.new_zeros(ep * n, rows.shape[1]).index_copy(0, slot, rows)
        recv = self._received_counts(counts)
        splits = [n] * ep
        x_recv = all_to_all_single_autograd(send, splits, splits, group=self.group)
        # Received row j of source s's slot: its local expert, n_local past the source's rows (an empty row).
        local = torch.searchsorted(torch.cumsum(recv, 1), row.expand(ep, n).contiguous(), right=True)
        source = torch.arange(ep, device=x.device).view(ep, 1)
        perm = torch.argsort((local * ep + source).flatten(), stable=True)
        perm_inverse = inverse_permutation(perm)
        return ExpertRows(x_recv, perm, perm_inverse, recv.sum(0), k=1), (perm, perm_inverse, slot)

    def combine(self, y: torch.Tensor, ctx: tuple) -> torch.Tensor:
        """Outputs in expert order (empty rows' unwritten) -> the slots back to their ranks -> this rank's rows."""
        perm, perm_inverse, slot = ctx
        splits = [slot.shape[0]] * self.ep
        back = all_to_all_single_autograd(permute_rows(y, perm_inverse, perm), splits, splits, group=self.group)
        return select_unique_rows(back, slot)  # an empty row's output (garbage) is never read


def apply_ep(model: nn.Module, ep_mesh: DeviceMesh, *, dispatch_dtype: str = "bf16", padded: bool = False,
             note: str = "") -> str:
    """Shard every MoE layer's routed experts over ep_mesh and install the all-to-all dispatcher, in place.
    dispatch_dtype: moe.dispatch_dtype, what the token rows cross the dispatch all-to-all as ("bf16": the compute
    dtype; "fp8": e4m3 with 1x128 block scales). padded: moe.dispatch='padded' (`PaddedAllToAllDispatcher`, bf16).
    note: moe.dispatch='auto''s choice and its reason, added to the returned startup line.

    Runs on the meta-device model right after TP and before FP8/AC/compile/FSDP2, which
    see the expert weights as the DTensors they will shard further.
    """
    rank, ep = ep_mesh.get_local_rank(), ep_mesh.size()
    n_layers = n_experts = 0
    for block in model.layers.values():
        moe = getattr(block, "moe", None)
        if moe is None:
            continue
        experts = moe.experts
        n_experts, n_local = experts.n_experts, experts.n_experts // ep
        for name, param in list(experts.named_parameters(recurse=False)):
            assert not isinstance(param, DTensor), f"{name} is already distributed"
            local = param.detach()[rank * n_local:(rank + 1) * n_local]
            dt = DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False, shape=param.shape,
                                    stride=param.stride())
            experts.register_parameter(name, nn.Parameter(dt, requires_grad=param.requires_grad))
        dispatcher = PaddedAllToAllDispatcher if padded else AllToAllDispatcher
        experts.use(dispatcher=dispatcher(ep_mesh, n_experts, dispatch_dtype=dispatch_dtype))
        n_layers += 1
    if not n_layers:  # a pipeline stage of dense blocks (trainer.validate refuses ep > 1 on a dense model)
        return f"expert parallel: ep={ep}, no MoE layer in this pipeline stage"
    line = (f"expert parallel: ep={ep}, {n_experts // ep} of {n_experts} routed experts per rank in "
            f"{n_layers} MoE layers, all-to-all dispatch over {ep_mesh.mesh_dim_names}")
    if padded:
        line += f"; padded all-to-all: {ep} slots of every rank's rows, no host sync for the split sizes"
    if note:
        line += f" ({note})"
    if dispatch_dtype == "fp8":
        dim = model.args.dim
        assert dim % BLOCK == 0, dim  # trainer.validate checked it
        line += (f"; tokens dispatched in fp8 (e4m3, 1x{BLOCK} block scales): {fp8_bytes_per_token(dim)} bytes per "
                 f"token instead of {2 * dim} (bf16), the combine in bf16")
    return line

