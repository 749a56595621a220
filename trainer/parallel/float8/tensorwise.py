"""Our tensorwise FP8 Linear: delayed scaling (float8.scaling) and FP8 inputs saved for backward
(float8.save_fp8_activations), on torchao's cast and matmul primitives.

Why not torchao's Float8Linear for these: torchao removed delayed scaling in 0.10, and its autograd function
saves the bf16 input and casts it to float8 again in backward. `Float8TensorwiseLinear` *is* a torchao
`Float8Linear` (same parameter, same fp8 all-gather weight wrapper, so `precompute_float8_dynamic_scale_for_fsdp`,
the health stats and `is_float8_linear` see it unchanged) whose forward is `TensorwiseFp8Matmul` below, which
builds torchao's `Float8TrainingTensor`s with torchao's scale formula (`amax_to_scale`) and multiplies them
through torchao's `torch._scaled_mm` dispatch (and its emulation under float8.emulate). With dynamic scales it
computes exactly what torchao's tensorwise Float8Linear computes, bit for bit (tests/unit/test_float8_scaling.py).

Delayed scaling (Transformer Engine's recipe): each converted Linear holds two fp32 buffers of 3 values, one per
operand (input, weight, output gradient): `amax`, the largest |value| this optimizer step has seen (a max over
microbatches and over activation-checkpoint recomputes, which repeat the same values), and `scale`, the scale
its casts use, computed from the amaxes of *earlier* steps by `trainer.parallel.float8.delayed.DelayedScaling`
(a step hook that all-reduces the amaxes, rolls the histories and refreshes the scales once per optimizer
step). Until that hook has run once (a run's first step: no history yet) the casts use the tensor's own amax,
as dynamic scaling does. A weight that FSDP2 all-gathered in float8 arrives already cast with the scale torchao
precomputed after the optimizer step (its current amax): that cast is kept, see docs/fp8.md#delayed-scaling.

The input's and weight's amaxes leave the autograd function as a (non-differentiable) output and are written into
the buffer by the module, a plain buffer update as BatchNorm's running stats. The gradient's is only known in
backward, so it is written there by `record_amax`, a custom op that mutates the buffer, which torch.compile keeps
as an in-place write in the compiled backward graph. (The same custom op in the forward made inductor return NaN
input gradients for the attention block on a CPU, torch 2.13, where aot_eager was exact: hence the two ways.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torchao.float8.distributed_utils import tensor_already_casted_to_fp8
from torchao.float8.float8_linear import Float8Linear
from torchao.float8.float8_training_tensor import (Float8TrainingTensor, GemmInputRole, LinearMMConfig,
                                                   hp_tensor_and_scale_to_float8)
from torchao.float8.float8_utils import amax_to_scale, tensor_to_amax

# Rows of a module's `amax` and `scale` buffers (and of the histories).
OPERANDS = ("input", "weight", "grad_output")
INPUT, WEIGHT, GRAD = 0, 1, 2
E4M3 = torch.float8_e4m3fn


@torch.library.custom_op("trainer::fp8_record_amax", mutates_args=("amax",))
def record_amax(amax: torch.Tensor, value: torch.Tensor, row: int) -> None:
    """amax[row] = max(amax[row], value): one operand's largest |value| of this optimizer step so far."""
    amax[row] = torch.maximum(amax[row], value)


@record_amax.register_fake
def _(amax: torch.Tensor, value: torch.Tensor, row: int) -> None:
    return None


@dataclass(frozen=True)
class TensorwiseCast:
    """How one call casts its operands (a constant of the compiled graph: changing it recompiles)."""

    grad_dtype: torch.dtype
    """float8.format: e5m2 (hybrid) or e4m3."""
    delayed: bool = False
    """float8.scaling='delayed': record every operand's amax into the module's `amax` buffer."""
    use_history: bool = False
    """Cast with the module's `scale` buffer (from earlier steps' amaxes) instead of the tensor's own amax."""
    save_fp8_input: bool = False
    """Save the float8 input (1 byte per element and its scale) for the weight gradient, not the bf16 one."""


def _to_float8(t: torch.Tensor, role: GemmInputRole, row: int, dtype: torch.dtype, cast: TensorwiseCast,
               buffers: tuple[torch.Tensor, torch.Tensor] | None, mm_config: LinearMMConfig,
               amaxes: list[torch.Tensor] | None = None) -> Float8TrainingTensor:
    """`t` cast to `dtype` with one scale: the delayed one (buffers' `scale[row]`), or torchao's dynamic one
    (`amax_to_scale(max |t|)`, exactly what torchao's tensorwise cast computes). With `amaxes` (delayed scaling),
    max |t| is appended to it for the caller to record."""
    if amaxes is not None or not cast.use_history:
        amax = tensor_to_amax(t)
        if amaxes is not None:
            amaxes.append(amax.float())
    scale = buffers[1][row] if cast.use_history else amax_to_scale(amax, dtype)
    return hp_tensor_and_scale_to_float8(t, scale, dtype, mm_config, role)


class TensorwiseFp8Matmul(torch.autograd.Function):
    """x @ weight_t with tensorwise float8 operands in forward and both backward GEMMs (torchao's numerics).

    Forward: x (e4m3) @ weight_t (e4m3). Backward: dgrad = grad (grad_dtype) @ weight (e4m3), wgrad =
    grad.T (grad_dtype) @ x (e4m3), the x of the forward cast: kept in float8 with `save_fp8_input`, else cast
    again from the saved bf16 x with the same scale (the same bytes).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight_t: torch.Tensor, amax: torch.Tensor | None, scale: torch.Tensor | None,
                mm_config: LinearMMConfig, cast: TensorwiseCast, kept: tuple[torch.Tensor, ...] | None = None
                ) -> torch.Tensor:
        buffers = (amax, scale) if cast.delayed else None
        amaxes = [] if cast.delayed else None
        x2d = x.reshape(-1, x.shape[-1])
        x_fp8 = _to_float8(x2d, GemmInputRole.INPUT, INPUT, E4M3, cast, buffers, mm_config, amaxes)
        ctx.kept = kept is not None
        if kept is not None:  # the weight cast once this step (weights_per_step.py): the same bytes as casting here
            data, w_scale, w_amax = kept
            weight_fp8 = Float8TrainingTensor(data.t(), w_scale, weight_t.dtype, mm_config, GemmInputRole.WEIGHT)
            if amaxes is not None:
                amaxes.append(w_amax)
        elif tensor_already_casted_to_fp8(weight_t):
            weight_fp8 = weight_t
            if amaxes is not None:
                amaxes.append(torch.zeros_like(amaxes[0]))  # cast before the all-gather: no amax of ours
        else:
            weight_fp8 = _to_float8(weight_t, GemmInputRole.WEIGHT, WEIGHT, E4M3, cast, buffers, mm_config, amaxes)
        out = torch.mm(x_fp8, weight_fp8)
        # The buffers ride on ctx, not in save_for_backward: the next microbatch's forward writes `amax` before
        # this backward runs, which autograd's version check would refuse.
        ctx.buffers, ctx.mm_config, ctx.cast, ctx.x_shape = buffers, mm_config, cast, x.shape
        # A kept cast is saved instead of the weight: backward's dgrad multiplies it, never casts again.
        weight_saved = (weight_fp8._data, weight_fp8._scale) if kept is not None else (weight_t,)
        ctx.weight_dtype = weight_t.dtype
        if cast.save_fp8_input:
            ctx.x_dtype = x.dtype
            ctx.num_x = 2
            ctx.save_for_backward(x_fp8._data, x_fp8._scale, *weight_saved)
        else:
            ctx.num_x = 1
            ctx.save_for_backward(x2d, *weight_saved)
        out = out.reshape(*x.shape[:-1], out.shape[-1])
        if amaxes is None:
            return out, None
        amaxes = torch.stack(amaxes)
        ctx.mark_non_differentiable(amaxes)
        return out, amaxes

    @staticmethod
    def backward(ctx, grad: torch.Tensor, _: torch.Tensor | None):
        cast, buffers, mm_config = ctx.cast, ctx.buffers, ctx.mm_config
        saved = ctx.saved_tensors  # unpacked once (activation checkpointing refuses a second unpack)
        x_saved, weight_saved = saved[:ctx.num_x], saved[ctx.num_x:]
        grad2d = grad.reshape(-1, grad.shape[-1])
        amaxes = [] if cast.delayed else None
        grad_fp8 = _to_float8(grad2d, GemmInputRole.GRAD_OUTPUT, GRAD, cast.grad_dtype, cast, buffers, mm_config,
                              amaxes)
        if amaxes:
            record_amax(buffers[0], amaxes[0], GRAD)
        if ctx.kept:
            weight_fp8 = Float8TrainingTensor(*weight_saved, ctx.weight_dtype, mm_config, GemmInputRole.WEIGHT)
        else:
            weight_t, = weight_saved
            weight_fp8 = weight_t if tensor_already_casted_to_fp8(weight_t) else _to_float8(
                weight_t, GemmInputRole.WEIGHT, WEIGHT, E4M3, cast, buffers, mm_config)
        grad_x = torch.mm(grad_fp8, weight_fp8.t()).reshape(*ctx.x_shape[:-1], weight_fp8.shape[0])
        if cast.save_fp8_input:
            data, x_scale = x_saved
            x_fp8 = Float8TrainingTensor(data, x_scale, ctx.x_dtype, mm_config, GemmInputRole.INPUT)
        else:
            x_fp8 = _to_float8(x_saved[0], GemmInputRole.INPUT, INPUT, E4M3, cast, buffers, mm_config)
        grad_weight = torch.mm(grad_fp8.t(), x_fp8)
        return grad_x, grad_weight.t(), None, None, None, None, None


class Float8TensorwiseLinear(Float8Linear):
    """torchao's Float8Linear with our matmul (`TensorwiseFp8Matmul`): delayed scaling and/or FP8 saved inputs.

    Made in place from a converted torchao Float8Linear (`from_float8_linear`): the parameter (and FSDP2's fp8
    all-gather wrapper around it) is the same object, so the state_dict is a Linear's and checkpoints move
    between this, torchao's Float8Linear and bf16. The delayed-scaling buffers are not persistent: the
    histories are checkpointed by `DelayedScaling`, outside the model's state_dict (and so outside HF exports).
    """

    cast: TensorwiseCast
    fp8_weight: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None
    """This step's FP8 weight (e4m3 data like the weight, its scale, its amax under delayed scaling), set and dropped
    by `trainer.parallel.float8.weights_per_step.Fp8WeightsPerStep`; None: each call casts the weight itself."""

    @classmethod
    def from_float8_linear(cls, mod: Float8Linear, *, delayed: bool, save_fp8_input: bool) -> Float8TensorwiseLinear:
        mod.__class__ = cls
        mod.cast = TensorwiseCast(grad_dtype=mod.config.cast_config_grad_output.target_dtype, delayed=delayed,
                                  save_fp8_input=save_fp8_input)
        if delayed:
            device = mod.weight.device
            mod.register_buffer("amax", torch.zeros(len(OPERANDS), dtype=torch.float32, device=device),
                                persistent=False)
            mod.register_buffer("scale", torch.ones(len(OPERANDS), dtype=torch.float32, device=device),
                                persistent=False)
        return mod

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_autocast_enabled():  # as torchao's Float8Linear.forward: the output in autocast's dtype
            x = x.to(torch.get_autocast_gpu_dtype())
        buffers = (self.amax, self.scale) if self.cast.delayed else (None, None)
        out, amaxes = TensorwiseFp8Matmul.apply(x, self.weight.t(), *buffers, self.linear_mm_config, self.cast,
                                                self.fp8_weight)
        # This step's input and weight amaxes so far (a buffer update, as BatchNorm's running stats). Not under
        # no_grad: an evaluation between steps must not move the next step's scales (nor a resume's, which
        # finds the buffer zeroed), and training forwards, activation-checkpoint recomputes included, run
        # with grad enabled.
        if amaxes is not None and torch.is_grad_enabled():
            self.amax[:GRAD] = torch.maximum(self.amax[:GRAD], amaxes)
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out

    @torch.no_grad()
    def cast_weight(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """`weight` (the full weight in the dtype the forward sees) cast as the forward casts `self.weight.t()`:
        the same amax, scale and bytes (an elementwise cast of the same values; its transpose is that cast)."""
        c = self.cast
        amaxes = [] if c.delayed else None
        fp8 = _to_float8(weight, GemmInputRole.WEIGHT, WEIGHT, E4M3, c, (self.amax, self.scale) if c.delayed else None,
                         self.linear_mm_config, amaxes)
        return fp8._data, fp8._scale.clone(), amaxes[0] if amaxes else None

    def use_history(self, on: bool = True) -> None:
        """Cast with the `scale` buffer from now on (DelayedScaling, once the first step's amaxes are reduced)."""
        assert self.cast.delayed, "dynamic scaling keeps no history"
        if self.cast.use_history != on:
            self.cast = TensorwiseCast(self.cast.grad_dtype, True, on, self.cast.save_fp8_input)

    def extra_repr(self) -> str:
        c = self.cast
        return (f"{super().extra_repr()}, scaling={'delayed' if c.delayed else 'dynamic'}"
                f"{', fp8 input saved' if c.save_fp8_input else ''}")


def convert_to_tensorwise(model: torch.nn.Module, *, delayed: bool, save_fp8_input: bool) -> int:
    """Swap every torchao Float8Linear of `model` for a Float8TensorwiseLinear, in place; returns how many."""
    mods = [m for m in model.modules() if type(m) is Float8Linear]
    for m in mods:
        Float8TensorwiseLinear.from_float8_linear(m, delayed=delayed, save_fp8_input=save_fp8_input)
    return len(mods)
