"""Routed experts: n_experts SwiGLU MLPs held as 3-D weights, run as dispatch -> kernel -> combine.

`GroupedExperts.forward` gives the tokens, sorted by expert, to its dispatcher, which says which rows this rank
runs (`ExpertRows`): all of them at ep=1 (`LocalDispatcher`), the rows an all-to-all brought under expert
parallelism (`trainer.parallel.expert_parallel.AllToAllDispatcher`). Its kernel runs them: bf16 grouped GEMMs
(`GroupedSwiGLU`, the default) or FP8 rowwise ones (`trainer.models.moe_fp8.Fp8GroupedSwiGLU`, installed by
`trainer.parallel.float8.apply_float8`). The dispatcher's combine sends the outputs back.

Rows reach the kernel not yet gathered (source rows and an index) so that the FP8 kernel can quantize each
source row once, before the gather: at ep=1 a token is quantized once, not once per chosen expert.

The grouped GEMM is `torch._grouped_mm` (bf16 on CUDA; on CPU the same kernel in fp32/bf16/fp16, and a
per-expert loop for float64, which the kernel rejects). Each expert's group of rows is padded to `GROUP_ALIGN`
rows, which the CUDA kernel needs, and the same padding runs on CPU so its tests cover the code the GPU runs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from trainer.models.moe_permute import gather_rows, padded_layout, select_unique_rows

logger = logging.getLogger(__name__)

# Rows per expert group are padded to a multiple of this: the CUDA grouped GEMM needs
# 16-byte aligned group starts (8 rows of bf16; 16 also serves float8 rowwise kernels).
GROUP_ALIGN = 16


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous.

    The CPU `torch._grouped_mm` backward rejects non-contiguous gradients (e.g. the
    stride-0 gradient of a `.sum()`: "Invalid strides/sizes"), and the CUDA kernel checks
    the same strides; for the contiguous gradients the MoE layer produces it is a no-op.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


class _DivideGrad(torch.autograd.Function):
    """Identity whose backward divides the gradient by a constant (`GroupedExperts.grad_divisor`)."""

    @staticmethod
    def forward(ctx, w: torch.Tensor, divisor: float) -> torch.Tensor:
        ctx.divisor = divisor
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad / ctx.divisor, None


_warned_loop = False


def _grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ w[g] for row groups ending at offs; w [G, N, K] (Linear layout, used transposed)."""
    if x.device.type == "cpu" and x.dtype != torch.bfloat16:
        return _cpu_grouped_mm(x, w, offs)
    if x.dtype != torch.bfloat16:
        # The CUDA grouped GEMM is bf16-only: fp32/fp16 runs on a GPU use a per-expert loop (said once).
        global _warned_loop
        if not _warned_loop:
            logger.warning("MoE experts in %s on CUDA: torch._grouped_mm needs bf16 there, so the experts run as a "
                           "per-expert loop of matmuls (slow); use train.mixed_precision='bf16' or 'fp8'", x.dtype)
            _warned_loop = True
        return _loop_mm(x, w, offs)
    return _ContiguousGrad.apply(torch._grouped_mm(x, w.transpose(-2, -1), offs=offs))


@torch.compiler.disable
def _cpu_grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    # Eager even inside a compiled block: torch.compile's shape check for _grouped_mm accepts
    # bf16 only, while the CPU kernel also takes fp32 and fp16 (fp32 CPU runs and tests). bf16 on a CPU takes the
    # GPU's path, compiled inside the block as there.
    if x.dtype == torch.float64:
        return _loop_mm(x, w, offs)  # the CPU kernel rejects float64 (float64 reference tests)
    return _ContiguousGrad.apply(torch._grouped_mm(x, w.transpose(-2, -1), offs=offs))


def _loop_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    ends = offs.tolist()  # note: a host sync; only the non-bf16 CUDA and the float64 CPU fallback
    outs, start = [], 0
    for g, end in enumerate(ends):
        outs.append(x[start:end] @ w[g].transpose(0, 1))
        start = end
    outs.append(x.new_zeros(x.shape[0] - start, w.shape[1]))
    return torch.cat(outs)


GLU = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""(gate, up) -> the hidden activation an expert's down projection takes; None: SwiGLU's silu(gate) * up."""


def grouped_swiglu(x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor,
                   *, align: int = GROUP_ALIGN, biases: tuple[torch.Tensor, ...] | None = None,
                   glu: GLU | None = None) -> torch.Tensor:
    """SwiGLU experts on rows sorted by expert: rows [sum(counts[:e]), sum(counts[:e+1])) go to expert e.

    x [N, dim]; counts [E] (int); w1, w3 [E, hidden, dim]; w2 [E, dim, hidden]. Each
    expert's rows are copied into a zero-padded buffer whose groups start at multiples
    of `align` rows; its size N + E * (align - 1) is known without a host sync.
    biases: (b1 [E, hidden], b2 [E, dim], b3 [E, hidden]) added to each row's expert's GEMM outputs (GPT-OSS);
    glu: another gate (GPT-OSS's clamped SwiGLU).
    """
    dst, offs, rows = padded_layout(counts, x.shape[0], align)
    x_pad = x.new_zeros(rows, x.shape[1]).index_copy(0, dst, x)
    gate, up = _grouped_mm(x_pad, w1, offs), _grouped_mm(x_pad, w3, offs)
    if biases is not None:
        # Each padded row's expert, without a host sync: n_experts for the rows past offs[-1], which get a zero bias
        # row of their own. The kernel leaves those rows unwritten (forward and backward): whatever they hold must
        # not reach an expert's bias gradient. Padding rows inside a group get a zero gradient (never read).
        expert = torch.searchsorted(offs, torch.arange(rows, device=x.device, dtype=offs.dtype), right=True)

        def per_row(bias: torch.Tensor) -> torch.Tensor:
            return F.pad(bias, (0, 0, 0, 1))[expert]

        gate, up = gate + per_row(biases[0]), up + per_row(biases[2])
    h = F.silu(gate) * up if glu is None else glu(gate, up)
    # Rows past offs[-1] belong to no group (the kernel leaves them unwritten); they are never read.
    out = _grouped_mm(h, w2, offs)
    if biases is not None:
        out = out + per_row(biases[1])
    return select_unique_rows(out, dst)


@dataclass(frozen=True)
class ExpertRows:
    """The rows a kernel runs, in expert order and not yet gathered: row i is source[index[i]].

    source [S, dim]: the tokens (each copied k times, once per chosen expert) or, under EP, the rows the
    all-to-all received (k = 1); counts [E] rows per local expert; inverse[s * k + j]: where source row s's j-th
    copy sits in expert order (>= len(index) where that copy was dropped).
    blocks: with fp8 dispatch, the received rows as e4m3 + 1x128 block scales (`trainer.models.moe_dispatch.
    Fp8Blocks`); `source` is then only their gradient handle, with no values (NaN): read `source_rows()`, or
    take the blocks (the FP8 kernel requantizes them rowwise without a bf16 copy).
    """

    source: torch.Tensor
    index: torch.Tensor
    inverse: torch.Tensor
    counts: torch.Tensor
    k: int
    blocks: Any = None  # a moe_dispatch.Fp8Blocks (not imported: moe_dispatch imports moe_fp8, which imports this)

    def source_rows(self) -> torch.Tensor:
        """The source rows in the compute dtype: `source`, or the blocks dequantized (exact), differentiable."""
        return self.source if self.blocks is None else self.blocks.dequantize(self.source)

    def gather(self) -> torch.Tensor:
        """source[index]; backward sums each source row's k copies by gathers (trainer.models.moe_permute)."""
        return gather_rows(self.source_rows(), self.index, self.inverse, self.k)


class ExpertKernel:
    """Runs the expert MLP: `kernel(rows, w1, w2, w3)` -> outputs [len(rows.index), dim] in rows' order; experts with
    biases or another gate (GPT-OSS) add `biases=` and `glu=` (grouped_swiglu's), which only the default takes."""

    def __call__(self, rows: ExpertRows, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class GroupedSwiGLU(ExpertKernel):
    """The default kernel: the rows gathered, then bf16 (the compute dtype's) grouped GEMMs."""

    def __call__(self, rows: ExpertRows, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor,
                 **options: Any) -> torch.Tensor:
        return grouped_swiglu(rows.gather(), rows.counts, w1, w2, w3, **options)


class ExpertDispatcher:
    """Which rows this rank's experts run (`dispatch`) and how their outputs go back (`combine`)."""

    def dispatch(self, x: torch.Tensor, counts: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor,
                 k: int) -> tuple[ExpertRows, Any]:
        """Tokens x [T, dim]; `order` sorts their k copies by expert (counts [n_experts] rows each; it may stop
        early: dropped copies are last), `inverse` is the full sort's inverse -> (rows, what combine needs)."""
        raise NotImplementedError

    def combine(self, y: torch.Tensor, ctx: Any) -> torch.Tensor:
        """The kernel's outputs -> outputs for `order`'s rows, in that order."""
        raise NotImplementedError


class LocalDispatcher(ExpertDispatcher):
    """Every expert on this rank (ep=1): the rows are the tokens themselves, nothing moves."""

    def dispatch(self, x, counts, order, inverse, k):
        return ExpertRows(x, order // k, inverse, counts, k), None

    def combine(self, y: torch.Tensor, ctx: None) -> torch.Tensor:
        return y


class GroupedExperts(nn.Module):
    """n_experts SwiGLU MLPs as 3-D weights, run as dispatch -> kernel -> combine (see the module docstring)."""

    def __init__(self, dim: int, hidden_dim: int, n_experts: int):
        super().__init__()
        self.n_experts = n_experts
        self.make_parameters(dim, hidden_dim, n_experts)
        # Plain objects, not modules: no parameters of their own, nothing in the module tree. Set through `use`.
        self.dispatcher: ExpertDispatcher = LocalDispatcher()
        self.kernel: ExpertKernel = GroupedSwiGLU()
        self.grad_divisor = 1.0
        """What the weights' gradients are divided by in the backward, as they leave the layer: the data-parallel degree
        where FSDP2, which would divide them as it reduces them, leaves these weights alone (trainer.parallel.fsdp:
        expert parallelism over the whole shard group; the all-to-all's backward already summed every rank's
        tokens into them)."""

    def use(self, *, dispatcher: ExpertDispatcher | None = None, kernel: ExpertKernel | None = None) -> None:
        """Install a dispatcher (expert parallelism: apply_ep) and/or a kernel (FP8 experts: apply_float8)."""
        if dispatcher is not None:
            assert isinstance(dispatcher, ExpertDispatcher), dispatcher
            self.dispatcher = dispatcher
        if kernel is not None:
            assert isinstance(kernel, ExpertKernel), kernel
            self.kernel = kernel

    def forward(self, x: torch.Tensor, counts: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor, k: int,
                beside: Callable[[], None] | None = None) -> torch.Tensor:
        """Tokens x [T, dim]; their copies x[order[i] // k] sorted by expert, counts [n_experts] rows each
        (`inverse` is the full sort's inverse) -> expert outputs [len(order), dim] in that order.

        `beside`: work that does not need the routed rows (the MoE layer's shared experts; it keeps its own result),
        run after the combine starts. Compiled, it then lies in the graph that holds the all-to-alls (where FSDP2 makes
        this module a unit of its own, its hooks end a graph before and after it), where moe.overlap_all_to_all runs
        it while the rows cross (trainer.parallel.comm_overlap)."""
        weights, options = self.local_weights()
        rows, ctx = self.dispatcher.dispatch(x, counts, order, inverse, k)
        routed = self.dispatcher.combine(self.kernel(rows, *weights, **options), ctx)
        if beside is not None:
            beside()
        return routed

    def make_parameters(self, dim: int, hidden_dim: int, n_experts: int) -> None:
        """The expert weights (a subclass may store them otherwise: GPT-OSS's fused gate/up with biases)."""
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden_dim, dim))  # gate
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden_dim))  # down
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden_dim, dim))  # up

    def local_weights(self) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], dict[str, Any]]:
        """This rank's (w1, w2, w3), and the kernel's options beyond them (none here)."""
        return tuple(self.local(w) for w in (self.w1, self.w2, self.w3)), {}

    def local(self, w: torch.Tensor) -> torch.Tensor:
        """This rank's experts of a weight (under EP the weights are DTensors sharded on dim 0 over the ep axis),
        its gradient divided by `grad_divisor` on the way back."""
        local = _local(w)
        return _DivideGrad.apply(local, self.grad_divisor) if self.grad_divisor != 1.0 else local


def _local(w: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (this rank's experts, or under TP its heads), a plain tensor as it is."""
    return w.to_local() if isinstance(w, DTensor) else w

