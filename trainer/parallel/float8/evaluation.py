"""`validation.mixed_precision = "bf16"`: the held-out loss of an fp8 run with every matmul in bf16.

Axolotl's `bf16: full` evaluation, Accelerate's `use_autocast_during_eval`: the model as it trains, but the
converted Linears run as plain `nn.Linear` (bf16 weights and activations, no casts) and FP8 routed experts
run torch's bf16 grouped GEMM, for the length of the context. The parameters are the same objects: only the
module's class (a Linear) or the experts' kernel (a plain object) changes, and both come back on exit.

Under torch.compile the eval-mode blocks compile once more with the bf16 modules (the class and the kernel are
guarded), then every later evaluation reuses that graph. FP8 all-gather is off for such runs
(`trainer.validate.resolve.resolve_float8`): its gathered weights are float8 already, with no bf16 copy on
the rank to compute with.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn


@contextlib.contextmanager
def bf16_matmuls(model: nn.Module) -> Iterator[int]:
    """Inside: every FP8 Linear of `model` computes as nn.Linear, every FP8 expert kernel as the bf16 one; yields
    how many modules it switched."""
    from trainer.models.moe_experts import GroupedSwiGLU
    from trainer.parallel.float8.experts import fp8_experts_modules
    from trainer.parallel.float8.linear import is_float8_linear

    linears = [(m, type(m)) for m in model.modules() if is_float8_linear(m)]
    experts = [(m, m.kernel) for m in fp8_experts_modules(model).values()]
    try:
        for module, _ in linears:
            module.__class__ = nn.Linear
        for module, _ in experts:
            module.use(kernel=GroupedSwiGLU())
        yield len(linears) + len(experts)
    finally:
        for module, cls in linears:
            module.__class__ = cls
        for module, kernel in experts:
            module.use(kernel=kernel)
