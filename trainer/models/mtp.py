"""Multi-token prediction (DeepSeek-V3 section 2.2): module k (1..D) predicts the token k + 1 ahead.

    h'_i^k = eh_proj([enorm(Emb(t_{i+k})); hnorm(h_i^{k-1})])     (the embedding first, as DeepSeek's published
    h_i^k  = Block_k(h'_i^k)                                       weights and vLLM's deepseek_mtp concatenate them)
    logits = output_head(shared_head_norm(h_i^k))                  -> t_{i+k+1}

h^0 is the main model's last hidden states (before its final norm); the embeddings and the output head are the main
model's. Module k's states at positions i >= seq - k have no input token t_{i+k} (their rows get zeros) and no
target: `mtp_labels` ignores them, and every target whose span crosses an ignored main label (a document boundary
under data.eod_mask_loss), so no depth trains across a boundary the main loss does not. Under context and tensor
parallelism, where t_{i+k} may sit in another rank's chunk or sequence shard, it is looked up from the whole
sequences' ids (`tokens_ahead`; under cp gathered over the cp group, which gives the labels k ahead too: `MTPLossFn`).

The loss (`MTPLossFn`): the main summed loss plus mtp_loss_weight / D x the sum over depths of each depth's summed
loss. The step divides the sum by the main loss's valid labels of the global batch (trainer/run/step.py), so a
depth's term is its mean loss times (its valid targets / the main's): (seq - k) / seq of it without masking, DeepSeek's
mean to within that factor. Each depth's mean is kept for the log (`mtp_loss_1`, ...: `MTPLossFn.pop_metrics`).
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle, SequenceParallel
from torch.nn.attention.flex_attention import BlockMask
from torch.utils.checkpoint import checkpoint

from trainer.hooks import StepHook
from trainer.loss import IGNORE_INDEX, LossFn, build_loss_fn, chunked_cross_entropy, local_loss
from trainer.model_values import DeepseekV3Args, ModelArgs
from trainer.models.layers import RMSNorm, SequenceChunks

logger = logging.getLogger(__name__)


class MTPLayer(nn.Module):
    """Mixed in before a block class (trainer.models.deepseek_v3): the block's attention and feed-forward, plus
    `enorm`, `hnorm`, `eh_proj` and `shared_head_norm` (fqns `layers.{n_layers + k - 1}.*`)."""

    def add_mtp_modules(self, args: DeepseekV3Args) -> None:
        self.enorm = RMSNorm(args.dim, args.norm_eps)
        self.hnorm = RMSNorm(args.dim, args.norm_eps)
        self.eh_proj = nn.Linear(2 * args.dim, args.dim, bias=False)
        self.shared_head_norm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, h: torch.Tensor, emb: torch.Tensor, rope: torch.Tensor,
                mask: BlockMask | torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(h^{k-1}, Emb(t_{i+k})) -> (h^k for the next depth, shared_head_norm(h^k) for the head). The head norm
        runs here, inside this module's FSDP unit, whose weights are resharded once its forward returns."""
        x = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(h)], dim=-1))
        out = super().forward(x, rope, mask)
        return out, self.shared_head_norm(out)


def mtp_forward(layers: list[nn.Module], h: torch.Tensor, ahead: list[torch.Tensor], rope: torch.Tensor, mask: tuple
                ) -> torch.Tensor:
    """Every depth's states after the main ones: [(1 + D) x batch, seq, dim] (main h, then each depth's normed h);
    `ahead` each depth's embeddings Emb(t_{i+k}) [batch, seq, dim] (`embeddings_ahead`, `tokens_ahead`)."""
    outs, prev = [h], h
    for layer, emb in zip(layers, ahead):
        prev, normed = layer(prev, emb, rope, *mask)
        outs.append(normed)
    return torch.cat(outs, dim=0)


def embeddings_ahead(emb: torch.Tensor, depths: int) -> list[torch.Tensor]:
    """Each depth k's Emb(t_{i+k}) from whole sequences' embeddings [batch, seq, dim]: shifted by k, zero rows
    past the end."""
    return [torch.cat([emb[:, k:], emb.new_zeros(emb.shape[0], k, emb.shape[2])], dim=1)
            for k in range(1, depths + 1)]


def tokens_ahead(tokens: torch.Tensor, depths: int, cp: SequenceChunks | None, *, whole: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Where t_{i+k} may sit on another rank (a cp rank's chunk, a tp rank's sequence shard): (the tokens, then each
    depth's ids t_{i+k} at their positions i, stacked on the batch dim for one embedding lookup; each depth's mask
    [seq, 1] of the positions with an i + k in the sequence, whose embeddings `embeddings_ahead` keeps). Under cp the
    ids come from the whole sequences (`whole` where the caller has them, else gathered over the cp group: ids are
    cheap, no gradient) and are this rank's chunks; without (tensor parallel) `tokens` are the whole sequences, which
    the embeddings shard after the lookup."""
    if cp is not None:
        whole = cp.whole(tokens) if whole is None else whole.to(tokens.device)
    else:
        whole = tokens
    positions = (torch.arange(whole.shape[1], device=tokens.device) if cp is None
                 else cp.positions(tokens.shape[1], tokens.device))
    ids, keep = [tokens], []
    for k in range(1, depths + 1):
        ahead = F.pad(whole[:, k:], (0, k))
        ids.append(ahead if cp is None else cp.shard(ahead))
        keep.append((positions + k < whole.shape[1]).unsqueeze(-1))
    return torch.cat(ids, dim=0), keep


def mtp_tp_plan() -> dict[str, ParallelStyle]:
    """An MTP module's own modules under tensor parallel (fqns relative to the module; its block is planned like the
    others): each on this rank's sequence shard with replicated weights (their gradients summed over tp)."""
    return {name: SequenceParallel(use_local_output=True) for name in ("enorm", "hnorm", "eh_proj", "shared_head_norm")}


def mtp_labels(labels: torch.Tensor, k: int) -> torch.Tensor:
    """Depth k's targets [batch, seq]: position i's is labels[i + k] (= t_{i+k+1}); IGNORE_INDEX for the last k
    positions and wherever labels[i..i+k] holds an IGNORE_INDEX (a boundary the main loss does not cross)."""
    ignored = F.pad((labels == IGNORE_INDEX).to(torch.int32), (0, k), value=1)
    crossed = ignored.unfold(1, k + 1, 1).amax(dim=-1).bool()  # any ignored label in the window [i, i + k]
    shifted = F.pad(labels[:, k:], (0, k), value=IGNORE_INDEX)
    return shifted.masked_fill(crossed, IGNORE_INDEX)


class MTPLossFn(LossFn):
    """The LM loss plus the MTP losses (module docstring); on main states alone (evaluation), the LM loss."""

    def __init__(self, norm: nn.Module, output_head: nn.Module, *, depths: int, weight: float, chunk_tokens: int = 0,
                 compile: bool = False, cp: SequenceChunks | None = None):
        super().__init__(norm, output_head, chunk_tokens=chunk_tokens, compile=compile)
        self.depths, self.weight = depths, weight
        # Under context parallelism the labels are this rank's chunks: a depth's targets, labels[i + k] over the
        # window [i, i + k], are cut from the whole sequences' (gathered over the cp group) instead.
        self.cp = cp
        self.sums = torch.zeros(depths)  # since the last pop_metrics: each depth's summed loss and its targets
        self.counts = torch.zeros(depths)

    def sum(self, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if h.shape[0] == labels.shape[0]:
            return super().sum(h, labels)
        parts = h.chunk(1 + self.depths, dim=0)
        total = super().sum(parts[0], labels)
        whole = labels if self.cp is None else self.cp.whole(labels)
        for k, part in enumerate(parts[1:], 1):
            target = mtp_labels(whole, k) if self.cp is None else self.cp.shard(mtp_labels(whole, k))
            if self.chunk_tokens:
                depth = chunked_cross_entropy(self._chunk_head_only, part, target, chunk_tokens=self.chunk_tokens)
            else:
                depth = self._head_only_sum(part, target)
            if self.sums.device != depth.device:
                self.sums, self.counts = self.sums.to(depth.device), self.counts.to(depth.device)
            self.sums[k - 1] += local_loss(depth).detach().float()
            self.counts[k - 1] += (target != IGNORE_INDEX).sum()
            total = total + (self.weight / self.depths) * depth
        return total

    def _chunk_head_only(self, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return checkpoint(self._head_only_sum, h, labels, use_reentrant=False)

    def _head_only_sum(self, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The summed loss of states already normed by their MTP module's shared_head_norm."""
        logits = self.output_head(h)
        return F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), reduction="sum",
                               ignore_index=IGNORE_INDEX)

    def pop_totals(self) -> torch.Tensor:
        """[2, depths]: each depth's summed loss and its targets since the last call; resets them."""
        totals = torch.stack([self.sums, self.counts])
        self.sums.zero_()
        self.counts.zero_()
        return totals

    def pop_metrics(self, group: dist.ProcessGroup | None = None) -> dict[str, float]:
        """Each depth's mean loss since the last call (`mtp_loss_1`, ...), over the tokens of `group`'s ranks (None:
        this rank's); resets them. note: a host sync, and a collective over `group`."""
        return depth_means(self.pop_totals(), group)


def depth_means(totals: torch.Tensor, *groups: dist.ProcessGroup | None) -> dict[str, float]:
    """`mtp_loss_1`, ...: each depth's summed loss over its targets ([2, depths]), both summed over `groups`' ranks.
    note: a host sync, and a collective over each group."""
    for group in groups:
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(totals, group=group)
    sums, counts = totals.tolist()
    return {f"mtp_loss_{k}": s / c for k, (s, c) in enumerate(zip(sums, counts), 1) if c}


def mtp_or_plain_loss_fn(model: nn.Module, args: ModelArgs, *, chunk_tokens: int, compile: bool) -> LossFn:
    """The loss of `model` (or the last pipeline stage): with args.mtp_layers MTP modules (DeepSeek-V3), the
    MTPLossFn; else trainer.loss.build_loss_fn's."""
    if not (depths := getattr(args, "mtp_layers", 0)):
        return build_loss_fn(model, chunk_tokens=chunk_tokens, compile=compile)
    logger.info("multi-token prediction: %d MTP modules, each predicting one token further; loss + %g x their mean "
                "(mtp_loss_1, ... in the metrics)", depths, args.mtp_loss_weight)
    return MTPLossFn(model.norm, model.output_head, depths=depths, weight=args.mtp_loss_weight,
                     chunk_tokens=chunk_tokens, compile=compile, cp=model.cp)


class MTPLossMetrics(StepHook):
    """The step hook (trainer/hooks.py) that logs each MTP depth's mean loss since the last log line, over the
    data-parallel ranks (`group`): `mtp_loss_1`, ... in the metrics. Under pipeline parallelism the last stage's
    ranks hold the losses (`loss_fn`; None on the others, which add zeros) and `pp_group` sums them to every rank."""

    def __init__(self, loss_fn: MTPLossFn | None, *, depths: int, group: dist.ProcessGroup | None,
                 pp_group: dist.ProcessGroup | None, device: torch.device):
        self.loss_fn, self.depths, self.group, self.pp_group, self.device = loss_fn, depths, group, pp_group, device

    @classmethod
    def of(cls, loss_fn: LossFn | None, args: ModelArgs, parallel_dims, *, device: torch.device
           ) -> list[MTPLossMetrics]:
        """The hook on every rank of a job with MTP modules (args.mtp_layers), else none; its sums over the dp x cp
        ranks of the stage and the pp ranks (parallel_dims: trainer.parallel.ParallelDims)."""
        if not (depths := getattr(args, "mtp_layers", 0)):
            return []
        assert loss_fn is None or isinstance(loss_fn, MTPLossFn), type(loss_fn)
        return [cls(loss_fn, depths=depths, group=parallel_dims.mesh("dp_cp").get_group(),
                    pp_group=parallel_dims.mesh("pp").get_group(), device=device)]

    def on_log(self, step: int) -> dict[str, float]:
        totals = (self.loss_fn.pop_totals().to(self.device) if self.loss_fn is not None
                  else torch.zeros(2, self.depths, device=self.device))
        return depth_means(totals, self.group, self.pp_group)
