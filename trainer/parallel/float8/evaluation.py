"""`validation.mixed_precision = "bf16"`: the held-out loss of an fp8 run with every matmul in bf16.

Axolotl's `bf16: full` evaluation, Accelerate's `use_autocast_during_eval`: the model as it trains, but every
module an FP8 converter of the run's report made computes in bf16 for the length of the context (each converter's
`in_bf16`): the converted Linears run as plain `nn.Linear` (bf16 weights and activations, no casts) and FP8
routed experts run torch's bf16 grouped GEMM. The parameters are the same objects: only the module's class (a
Linear) or the experts' kernel (a plain object) changes, and both come back on exit.

Under torch.compile the eval-mode blocks compile once more with the bf16 modules (the class and the kernel are
guarded), then every later evaluation reuses that graph. FP8 all-gather is off for such runs
(`trainer.validate.resolve.resolve_float8`): its gathered weights are float8 already, with no bf16 copy on
the rank to compute with.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

from trainer.parallel.float8.report import Float8Report


@contextlib.contextmanager
def bf16_matmuls(model: nn.Module, report: Float8Report) -> Iterator[int]:
    """Inside: every module of `model` that a converter of `report` made computes in bf16; yields how many modules
    it switched."""
    modules = [(converter, module) for converter in report.converters for module in converter.modules(model).values()]
    undo = []
    try:
        for converter, module in modules:
            undo.append(converter.in_bf16(module))
        yield len(undo)
    finally:
        for restore in undo:
            restore()
