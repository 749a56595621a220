"""Moving MoE rows between token order and expert order by gathers only, forward and backward.

`x.index_select(0, idx)` has a scatter-add (`index_add`, atomics on CUDA) as its backward, and
`out.index_add_(0, idx, rows)` is one in forward. Every move here is a permutation whose inverse
is known (or k copies of each token, summed back over a view), so both directions are gathers:
no atomics, deterministic sums, and nothing that needs a host sync.
"""

from __future__ import annotations

import torch
from torch.fx.experimental.symbolic_shapes import guard_or_true


def inverse_permutation(perm: torch.Tensor) -> torch.Tensor:
    """inv with inv[perm[i]] = i (a scatter of arange: no sort, no host sync)."""
    return torch.empty_like(perm).scatter_(0, perm, torch.arange(perm.numel(), device=perm.device))


class _PermuteRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, perm: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        return x.index_select(0, perm)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


def permute_rows(x: torch.Tensor, perm: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """x[perm] for a permutation `perm` of x's rows whose inverse is `inverse`; backward grad[inverse]."""
    return _PermuteRows.apply(x, perm, inverse)


class _SelectUniqueRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(index)
        ctx.rows = x.shape[0]
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (index,) = ctx.saved_tensors
        # One row more than x, sliced off: a zeros tensor of x's shape would be the forward's zeros buffer (the one
        # x was index_copy'd into: the padded dispatch's send buffer, the experts' padded input) to a compiled
        # graph's common-subexpression pass, and its partitioner then keeps that buffer from forward to backward
        # (materialized in backward: never recomputed), one more activation-sized tensor per MoE layer.
        return grad.new_zeros(ctx.rows + 1, grad.shape[1])[: ctx.rows].index_copy_(0, index, grad), None


def select_unique_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x[index] for distinct indices (rows never read get zero gradient); backward copies rows back
    (index_copy: a plain scatter, no accumulation)."""
    return _SelectUniqueRows.apply(x, index)


class _TokensToExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor, k: int) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        ctx.k = k
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        n_copies, dim, k = inverse.numel(), grad.shape[1], ctx.k
        if guard_or_true(grad.shape[0] < n_copies):  # dropped copies (past capacity) give no gradient
            grad = torch.cat([grad, grad.new_zeros(n_copies - grad.shape[0], dim)])
        grad = grad.index_select(0, inverse)
        # k = 1: a permutation's backward, one gather (a sum over one copy would only copy the rows).
        return grad if k == 1 else grad.view(n_copies // k, k, dim).sum(1), None, None, None


def gather_rows(x: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor, k: int) -> torch.Tensor:
    """Rows x[index] where each row of x has k copies: copy j of row s is position inverse[s * k + j] of `index`
    (positions past its end were dropped). Backward sums each row's k gradients by a gather and a sum over k;
    for k = 1 (`index` a permutation, `inverse` its inverse) it is `permute_rows`."""
    return _TokensToExperts.apply(x, index, inverse, k)


def tokens_to_experts(x: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor, k: int) -> torch.Tensor:
    """Rows x[order[i] // k]: token t's copy for its j-th expert is assignment t * k + j, `order` sorts the
    assignments by expert (it may stop early: dropped ones are last), `inverse` is the full sort's inverse.
    Backward sums each token's k gradients by a gather and a sum over k."""
    return gather_rows(x, order // k, inverse, k)


def experts_to_tokens(rows: torch.Tensor, inverse: torch.Tensor, order: torch.Tensor, weights: torch.Tensor,
                      ) -> torch.Tensor:
    """Each token's weighted sum over its k experts' output rows, in fp32: rows [kept, dim] in expert order
    (dropped assignments past the end count as zeros), `order` the full sort, `inverse` its inverse,
    weights [tokens, k] fp32 -> [tokens, dim] fp32."""
    n_tokens, k = weights.shape
    n_assign, dim = inverse.numel(), rows.shape[1]
    if guard_or_true(rows.shape[0] < n_assign):  # compiled with dropping the count is unknown: pad (maybe by 0)
        rows = torch.cat([rows, rows.new_zeros(n_assign - rows.shape[0], dim)])
    by_token = permute_rows(rows, inverse, order).view(n_tokens, k, dim)
    return (by_token.float() * weights.unsqueeze(-1)).sum(1)


def padded_layout(counts: torch.Tensor, n_rows: int, align: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Where rows sorted by expert go in a buffer whose expert groups start at multiples of `align` rows.

    counts [E] rows per expert, summing to n_rows or fewer: rows past sum(counts) belong to no expert (the padded
    all-to-all's empty rows, trainer.parallel.expert_parallel) and go after the last group, where grouped GEMMs
    neither read nor write -> (dst [n_rows]: each row's buffer row, offs [E] int32: the groups' ends, as grouped
    GEMMs take them, buffer rows). The buffer has n_rows + E * (align - 1) rows rounded up to `align`, a size known
    without a host sync.
    """
    n_experts = counts.shape[0]
    counts = counts.to(torch.int64)
    padded = (counts + align - 1) // align * align
    ends, padded_ends = torch.cumsum(counts, 0), torch.cumsum(padded, 0)
    # Each row's expert; n_experts for a row past the last group, which moves by the last group's padding.
    expert_of_row = torch.searchsorted(ends, torch.arange(n_rows, device=counts.device), right=True)
    starts = torch.cat([ends - counts, ends[-1:]])
    padded_starts = torch.cat([padded_ends - padded, padded_ends[-1:]])
    dst = torch.arange(n_rows, device=counts.device) - starts[expert_of_row] + padded_starts[expert_of_row]
    rows = n_rows + n_experts * (align - 1)
    return dst, padded_ends.to(torch.int32), (rows + align - 1) // align * align
