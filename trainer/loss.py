"""The LM loss every layout shares: final norm -> output head -> cross-entropy in fp32.

A model (`trainer.models.layers.Decoder.forward`), and each pipeline stage, returns hidden
states; `LossFn` applies the final norm and output head of the module that holds them and
computes the loss over all tokens at once, or `chunk_tokens` at a time. Labels equal to
IGNORE_INDEX (the token after an EOS under data.eod_mask_loss) count nowhere: `LossFn.sum` is the
summed loss of the valid labels, which the step divides by the valid labels of the whole global
batch (trainer/run/step.py); `LossFn(h, labels)` is their mean. The trainer calls the
same object at pp=1 (trainer/run/step.py) and the pipeline schedule calls it on the last stage
(trainer/parallel/pipeline.py), so the chunked loss and compile behave the same in every
layout. The MoE auxiliary loss is not computed here: each MoE layer injects its gradient
through autograd (`trainer.models.moe.attach_aux_loss`).

Under FSDP2 the norm and head weights belong to the root unit, which stays gathered from its
forward until its backward (FSDP2 never reshards the root after forward), so the loss may use
them after the model's forward has returned.

Compiled (and not chunked), where the output head is torchao's tensorwise FP8 Linear with its default dynamic
casts (`plain_float8_head`), the head and loss are `Float8HeadCrossEntropy`: the head's three GEMMs on the same FP8
operands as torchao's, with one pass over the logits in forward for each row's log-sum-exp (and the largest
|gradient| of the row, known before backward), and one in backward writing the logits gradient already cast to
FP8 with the scale torchao's cast would compute, as is and transposed (trainer/loss_kernels.py on a GPU), instead
of a bf16 gradient that is read again for its amax and its two casts. On 1x H200 at 8B shapes the head and loss
went from 49.4 to 45.2 ms a step (docs/benchmarks/2026-11-30-fused-fp8-head-loss-h200.md). Eager runs (the FP8
health monitor's steps too) keep the module and F.cross_entropy: the reference the fused path is tested against
(tests/unit/test_fused_head_loss.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

logger = logging.getLogger(__name__)

IGNORE_INDEX = -100
"""A label that is not trained on (F.cross_entropy's default ignore_index)."""

# FP8 formats of a gradient cast in the loss's backward: (largest value, mantissa bits, exponent bias).
FP8_FORMATS = {torch.float8_e5m2: (57344.0, 2, 15), torch.float8_e4m3fn: (448.0, 3, 7)}


# Inductor options of the head-and-loss graphs: no autotuning of pointwise kernels, as the blocks'
# (trainer/parallel/compile.py). On 1x H200 (8B shapes x 8 layers, fp8, cold caches, alternated with the default)
# it cut autotuning from 1.7-2.0 s to 0.4 s, step 1 came 29.4-31.6 s after the launch against 34.3-40.1 s, and
# the steps ran at the default's speed (docs/benchmarks.md#cold-start).
LOSS_INDUCTOR_OPTIONS = {"triton.autotune_pointwise": False}


def local_loss(loss: torch.Tensor) -> torch.Tensor:
    """The loss as a plain tensor: under TP's loss_parallel it is a DTensor replicated over the tp ranks."""
    return loss.to_local() if isinstance(loss, DTensor) else loss


class LossFn:
    """`loss_fn.sum(h, labels)`: the summed cross-entropy of `output_head(norm(h))` against the valid labels (not
    IGNORE_INDEX), in fp32; `loss_fn(h, labels)`: their mean."""

    def __init__(self, norm: nn.Module, output_head: nn.Module, *, chunk_tokens: int = 0, compile: bool = False):
        self.norm, self.output_head = norm, output_head
        self.chunk_tokens = chunk_tokens
        # Float8HeadCrossEntropy (module docstring) in the compiled whole-batch graph, where the head's Linear is
        # torchao's plain tensorwise one: its class, checked at each trace (an evaluation or a precision phase in
        # bf16 makes it a plain Linear, and the graph compiles again); None: the head and F.cross_entropy.
        self.fp8_head_class = (plain_float8_head(getattr(output_head, "proj", None))
                               if compile and not chunk_tokens else None)
        self.head_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = self._head_loss_sum
        self.chunk_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = self._chunk_loss
        if compile and chunk_tokens:
            # One graph per chunk, the loop stays eager: compiled as one graph, inductor would schedule
            # every chunk's recomputed logits together in backward
            # (docs/benchmarks.md#memory-levers-chunked-loss-trainloss_chunk_tokens). dynamic=False:
            # a shorter last chunk gets a static graph of its own rather than a dynamic one for all.
            self.chunk_loss = torch.compile(self._chunk_loss, fullgraph=True, dynamic=False,
                                            options=LOSS_INDUCTOR_OPTIONS)
        elif compile:
            # Norm, head and loss in one graph: the fp32 upcast of the logits fuses into the cross-entropy.
            self.head_loss = torch.compile(self._head_loss_sum, fullgraph=True, options=LOSS_INDUCTOR_OPTIONS)

    def sum(self, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The summed loss of the valid labels (a replicated DTensor under TP's loss_parallel)."""
        if self.chunk_tokens:
            return chunked_cross_entropy(self.chunk_loss, h, labels, chunk_tokens=self.chunk_tokens)
        return self.head_loss(h, labels)

    @torch.no_grad()
    def row_sums(self, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """[batch] the summed loss of each row's valid labels (h [batch, seq, dim], labels [batch, seq]), in fp32, for
        scoring (trainer/run/tasks.py): eager, forward only, `chunk_tokens` tokens' rows at a time where set (at
        least one row). Under TP's loss_parallel the per-token losses are replicated over the tp ranks."""
        assert h.shape[0] == labels.shape[0], "main states only: an MTP model evaluates without its MTP modules"
        rows = max(1, self.chunk_tokens // labels.shape[1]) if self.chunk_tokens else labels.shape[0]
        sums = []
        for h_rows, label_rows in zip(h.split(rows), labels.split(rows)):
            logits = self.output_head(self.norm(h_rows))
            nll = F.cross_entropy(logits.flatten(0, -2).float(), label_rows.flatten(), reduction="none",
                                  ignore_index=IGNORE_INDEX)
            nll = nll.full_tensor() if isinstance(nll, DTensor) else nll
            sums.append(nll.view(label_rows.shape).sum(-1))
        return torch.cat(sums)

    def __call__(self, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The mean loss over the valid labels (F.cross_entropy's mean)."""
        return local_loss(self.sum(h, labels)) / (labels != IGNORE_INDEX).sum().clamp(min=1)

    def _chunk_loss(self, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Summed cross-entropy of tokens h [n, dim], activation-checkpointed.

        Only h and labels are saved for backward: the logits are freed when forward returns and
        made again when backward reaches this chunk (one more head GEMM). torch.compile compiles
        this function, not the loop over chunks (see __init__).
        """
        return checkpoint(self._head_loss_sum, h, labels, use_reentrant=False)

    def _head_loss_sum(self, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """h [..., dim], labels [...]: the summed loss of the valid labels."""
        x = self.norm(h)
        if self.fp8_head_class is not None and torch.compiler.is_compiling():  # eager (FP8 health steps too): the reference
            proj = getattr(self.output_head, "proj", None)
            if type(proj) is self.fp8_head_class:
                grad = proj.config.cast_config_grad_output.target_dtype
                return Float8HeadCrossEntropy.apply(x.flatten(0, -2), proj.weight, labels.flatten(),
                                                    proj.linear_mm_config, grad)
        logits = self.output_head(x)
        return F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), reduction="sum",
                               ignore_index=IGNORE_INDEX)


def plain_float8_head(proj: nn.Module | None) -> type | None:
    """torchao's Float8Linear class where `proj` is one with every cast dynamic and tensorwise, inputs and weights in
    e4m3 and scales not rounded to powers of two (float8.recipe = "tensorwise", the default, without delayed scaling,
    weights cast once per step, FP8 saved inputs or bf16 roles, which make it another class or disable casts), and
    neither it nor the head is an FSDP unit or has hooks of its own (the fused path does not call its forward);
    else None."""
    if proj is None or "torchao" not in type(proj).__module__:
        return None
    from torchao.float8.config import ScalingGranularity, ScalingType, e4m3_dtype
    from torchao.float8.float8_linear import Float8Linear

    if type(proj) is not Float8Linear or proj.bias is not None or isinstance(proj, FSDPModule):
        return None
    if proj._forward_hooks or proj._forward_pre_hooks or proj._backward_hooks:
        return None
    c = proj.config
    casts = (c.cast_config_input, c.cast_config_weight, c.cast_config_grad_output, c.cast_config_input_for_grad_weight,
             c.cast_config_weight_for_grad_input, c.cast_config_grad_output_for_grad_weight)
    if any(k.scaling_type is not ScalingType.DYNAMIC or k.scaling_granularity is not ScalingGranularity.TENSORWISE
           for k in casts) or c.round_scales_to_power_of_2:
        return None
    inputs = {c.cast_config_input.target_dtype, c.cast_config_weight.target_dtype,
              c.cast_config_input_for_grad_weight.target_dtype, c.cast_config_weight_for_grad_input.target_dtype}
    grads = {c.cast_config_grad_output.target_dtype, c.cast_config_grad_output_for_grad_weight.target_dtype}
    if inputs != {e4m3_dtype} or len(grads) != 1 or not grads <= FP8_FORMATS.keys():
        return None
    return Float8Linear


@torch.library.custom_op("trainer::ce_row_stats", mutates_args=())
def ce_row_stats(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [n, vocab], labels [n] -> fp32 [n] each: each row's log-sum-exp, its loss (lse minus the label's
    logit; 0 where the label is IGNORE_INDEX) and its largest |softmax - one_hot| (0 where ignored): the largest
    |gradient| of the row over g, known before backward (a row's largest entry is either its largest non-label
    probability or 1 - p(label)). One pass over the logits (trainer/loss_kernels.py on a GPU)."""
    if logits.is_cuda:
        from trainer import loss_kernels  # imports triton

        return loss_kernels.row_stats(logits, labels)
    return row_stats_reference(logits, labels)


@ce_row_stats.register_fake
def _(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n = logits.shape[0]
    return tuple(logits.new_empty(n, dtype=torch.float32) for _ in range(3))


@torch.library.custom_op("trainer::ce_logits_grad_fp8", mutates_args=())
def ce_logits_grad_fp8(logits: torch.Tensor, lse: torch.Tensor, labels: torch.Tensor, g: torch.Tensor,
                       scale: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits gradient g x (softmax - one_hot) (0 in ignored rows), rounded to the logits' dtype, then cast to
    `dtype` as torchao's tensorwise cast does (x * scale clamped to the format's largest value, rounded to nearest
    even): (data [n, vocab], its transpose [vocab, n] contiguous), both written in one pass over the logits."""
    if logits.is_cuda:
        from trainer import loss_kernels

        return loss_kernels.logits_grad_fp8(logits, lse, labels, g, scale, *FP8_FORMATS[dtype], dtype)
    return logits_grad_reference(logits, lse, labels, g, scale, dtype)


@ce_logits_grad_fp8.register_fake
def _(logits: torch.Tensor, lse: torch.Tensor, labels: torch.Tensor, g: torch.Tensor, scale: torch.Tensor,
      dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    n, vocab = logits.shape
    return logits.new_empty((n, vocab), dtype=dtype), logits.new_empty((vocab, n), dtype=dtype)


def _targets(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(valid [n], target [n]: the label, 0 where ignored, one_hot [n, vocab] of target) for logits [n, vocab]."""
    valid = labels != IGNORE_INDEX
    target = torch.where(valid, labels, 0)
    return valid, target, torch.arange(logits.shape[1], device=logits.device)[None, :] == target[:, None]


def row_stats_reference(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ce_row_stats in torch (a CPU's implementation, and the kernel's reference)."""
    lf = logits.float()
    valid, target, hot = _targets(lf, labels)
    lse = torch.logsumexp(lf, dim=-1)
    picked = lf.gather(1, target[:, None]).squeeze(1)
    others = torch.where(hot, float("-inf"), lf).amax(dim=-1)
    amax = torch.maximum(torch.exp(others - lse), (torch.exp(picked - lse) - 1).abs())
    zero = torch.zeros((), device=lf.device)
    return lse, torch.where(valid, lse - picked, zero), torch.where(valid, amax, zero)


def logits_grad_reference(logits: torch.Tensor, lse: torch.Tensor, labels: torch.Tensor, g: torch.Tensor,
                          scale: torch.Tensor | None = None, dtype: torch.dtype | None = None
                          ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """ce_logits_grad_fp8 in torch; without a scale, the gradient in the logits' dtype it casts."""
    valid, _, hot = _targets(logits, labels)
    d = torch.exp(logits.float() - lse[:, None]) - hot.float()
    grad = torch.where(valid[:, None], d * g.float(), torch.zeros((), device=logits.device)).to(logits.dtype)
    if scale is None:
        return grad
    top = FP8_FORMATS[dtype][0]
    data = (grad.float() * scale).clamp(-top, top).to(dtype)
    return data, data.t().contiguous()


@torch._dynamo.allow_in_graph  # as torchao's own matmul: AOT autograd traces the Float8 tensors inside
class Float8HeadCrossEntropy(torch.autograd.Function):
    """The summed cross-entropy of x @ weight.T through torchao's tensorwise FP8 Linear (`plain_float8_head`):
    the same three GEMMs on the same FP8 operands as torchao's Float8Linear, but backward receives the logits
    gradient already cast (ce_logits_grad_fp8, with the scale torchao's cast computes from the same amax: the
    gradient is g x (softmax - one_hot) rounded to bf16, and rounding keeps the order of magnitudes, so its amax
    is g x ce_row_stats' largest row amax, rounded) and written in both layouts its two GEMMs read."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, mm_config, grad_dtype: torch.dtype
                ) -> torch.Tensor:
        from torchao.float8.config import e4m3_dtype
        from torchao.float8.float8_training_tensor import GemmInputRole

        x_fp8 = _cast(x, e4m3_dtype, mm_config, GemmInputRole.INPUT)
        weight_t = weight.t()
        logits = torch.mm(x_fp8, _cast(weight_t, e4m3_dtype, mm_config, GemmInputRole.WEIGHT))
        lse, loss, amax = ce_row_stats(logits, labels)
        # As torchao's matmul: the bf16 input and weight are saved and cast again in backward (the same bytes).
        ctx.save_for_backward(x, weight_t, logits, lse, labels, amax.amax())
        ctx.mm_config, ctx.grad_dtype = mm_config, grad_dtype
        return loss.sum()

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        from torchao.float8.config import e4m3_dtype
        from torchao.float8.float8_training_tensor import Float8TrainingTensor, GemmInputRole
        from torchao.float8.float8_utils import amax_to_scale

        x, weight_t, logits, lse, labels, amax = ctx.saved_tensors
        mm_config, dtype = ctx.mm_config, ctx.grad_dtype
        scale = amax_to_scale((amax * g.abs()).to(logits.dtype).float(), dtype)
        data, data_t = ce_logits_grad_fp8(logits, lse, labels, g, scale, dtype)
        grad = Float8TrainingTensor(data, scale, logits.dtype, mm_config, GemmInputRole.GRAD_OUTPUT)
        grad_t = Float8TrainingTensor(data_t, scale, logits.dtype, mm_config, GemmInputRole.GRAD_OUTPUT)
        grad_x = torch.mm(grad, _cast(weight_t, e4m3_dtype, mm_config, GemmInputRole.WEIGHT).t())
        grad_weight = torch.mm(grad_t, _cast(x, e4m3_dtype, mm_config, GemmInputRole.INPUT))
        return grad_x, grad_weight, None, None, None


def _cast(t: torch.Tensor, dtype: torch.dtype, mm_config, role):
    """torchao's dynamic tensorwise cast of t (a weight FSDP2 all-gathered in float8 is cast already)."""
    from torchao.float8.distributed_utils import tensor_already_casted_to_fp8
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic

    if tensor_already_casted_to_fp8(t):
        return t
    return hp_tensor_to_float8_dynamic(t, dtype, mm_config, gemm_input_role=role)


def build_loss_fn(model: nn.Module, *, chunk_tokens: int, compile: bool) -> LossFn:
    """The loss of the model (or last pipeline stage) that holds `norm` and `output_head`; logs what it does.

    compile=False under tensor parallel: the vocabulary-parallel loss runs eagerly there.
    """
    assert model.output_head is not None, "the loss needs the module with the output head (the last stage)"
    if chunk_tokens:
        logger.info("output head + loss: chunks of %d tokens, each activation-checkpointed (the head GEMM runs "
                    "again in backward)%s", chunk_tokens, ", compiled per chunk" if compile else "")
    loss_fn = LossFn(model.norm, model.output_head, chunk_tokens=chunk_tokens, compile=compile)
    if compile and not chunk_tokens:
        fused = "; the FP8 head's logits gradient cast to FP8 as the loss's backward writes it"
        logger.info("torch.compile: the final norm, output head and loss as one graph (pointwise kernels not "
                    "autotuned)%s", fused if loss_fn.fp8_head_class is not None else "")
    return loss_fn


def chunked_cross_entropy(
    chunk_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    h: torch.Tensor,
    labels: torch.Tensor,
    *,
    chunk_tokens: int,
) -> torch.Tensor:
    """The summed loss of the valid labels of h [batch, seq, dim], chunk_tokens tokens at a time.

    chunk_loss maps tokens [n, dim] and labels [n] to their summed loss, so this equals the plain
    summed loss up to fp32 summation order; the last chunk may be shorter.
    """
    h, labels = h.flatten(0, 1), labels.flatten()
    total = torch.zeros((), dtype=torch.float32, device=h.device)
    # split, not slicing: its backward concatenates the chunks' gradients once, where each
    # slice's backward would write a zero-padded gradient the size of all of h.
    for h_chunk, labels_chunk in zip(h.split(chunk_tokens), labels.split(chunk_tokens)):
        total = total + chunk_loss(h_chunk, labels_chunk)
    return total
