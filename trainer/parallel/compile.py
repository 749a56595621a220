"""torch.compile per transformer block (the loss compiles in trainer/loss.py), and what compiling cost."""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
import torch._dynamo.utils as dynamo_utils
from torch._inductor.async_compile import maybe_warm_pool
from torch import nn

from trainer.parallel.comm_overlap import OverlapAllToAlls


# Inductor options of the blocks' graphs. No autotuning of pointwise kernels: on 1x H200 (8B shapes x 8 layers, fp8,
# cold caches) it cost 1.5 s of autotuning and 2.0-4.0 s of compiling in all at the first step, and the steps ran within
# 0.44% of it either way (mean -0.13% over four runs; docs/benchmarks.md#cold-start). The head-and-loss graph compiles
# with the same option (trainer/loss.py's LOSS_INDUCTOR_OPTIONS, measured on its own).
BLOCK_INDUCTOR_OPTIONS = {"triton.autotune_pointwise": False}

# MoE blocks under expert parallelism (moe.overlap_all_to_all): the blocks' options plus the pass that puts the compute
# that does not need an all-to-all's rows between its start and its wait (trainer.parallel.comm_overlap), and without
# inductor's reordering for peak memory, which moved that compute back after the waits (on gloo).
OVERLAP_INDUCTOR_OPTIONS = {"post_grad_custom_post_pass": OverlapAllToAlls(), "reorder_for_peak_memory": False}


def start_compile_workers(*, compile: bool, device_type: str) -> None:
    """Start inductor's Triton-compiling worker processes now, while the process group and the model are built.

    Inductor starts them at its first graph, and they took 8-12 s to be ready on 1x H200 (16 cores): until then it
    compiles each kernel in this process, one after another. Started at the Trainer's start, 2-18 of fp8's ~195
    kernels found them not ready instead of 34-41, and compiling and waiting for kernels cost 1.8-3.3 s of step 1
    instead of 5.8-6.2 (docs/benchmarks.md#cold-start). Not earlier, before validation: a config error then waited
    9-11 s for the workers' shutdown. A no-op without compile, off a GPU, and where inductor would not start them
    (TORCHINDUCTOR_COMPILE_THREADS=1, no Triton)."""
    if compile and device_type == "cuda":
        maybe_warm_pool()


def apply_compile(model: nn.Module, *, context_parallel: bool, overlap_all_to_all: bool = False) -> str:
    """Compile each block; identical blocks share one compiled graph.

    Blocks are compiled one by one, not the whole model, so FSDP2's per-block hooks stay
    outside the graphs and compile time does not grow with depth. The final norm, output
    head and loss are compiled together by `trainer.loss.LossFn`, so the logits never
    round-trip to memory in fp32 (at vocab 128256 that is most of the step's elementwise traffic).
    context_parallel: the model's attention runs the K/V all-gather (trainer.parallel.context_parallel).
    overlap_all_to_all: moe.overlap_all_to_all under expert parallelism: MoE blocks compile with
    OVERLAP_INDUCTOR_OPTIONS.
    """
    moe = any(getattr(block, "moe", None) is not None for block in model.layers.values())
    if moe:
        # The host reads token counts in MoE blocks (EP's split sizes, token dropping's kept rows): traced as
        # symbolic sizes rather than breaking the graph, so an MoE block under ep compiles as one graph (with
        # bf16 experts; torchtitan sets the same flag), not as one piece per Python frame around each read.
        torch._dynamo.config.capture_scalar_outputs = True
    for name, block in list(model.layers.named_children()):
        # Not fullgraph: FP8 experts' kernel stays eager inside an MoE block, context parallel breaks the graph
        # around its attention; dense blocks compile whole.
        routes = getattr(block, "moe", None) is not None
        fullgraph = not routes and not context_parallel
        options = BLOCK_INDUCTOR_OPTIONS | (OVERLAP_INDUCTOR_OPTIONS if routes and overlap_all_to_all else {})
        model.layers.register_module(name, torch.compile(block, fullgraph=fullgraph, options=options))
    traced = "; token counts traced (capture_scalar_outputs)" if moe else ""
    if overlap_all_to_all and moe:
        traced += "; all-to-alls overlapped with the compute that does not need them (moe.overlap_all_to_all)"
    return f"torch.compile: {len(model.layers)} blocks (pointwise kernels not autotuned){traced}"


@dataclass(frozen=True)
class CompileTimes:
    """What compiling has cost this process so far: torch.compile (dynamo's own totals, forward and backward
    graphs, inductor's code generation and the Triton kernels it compiles while compiling), inductor's autotuning
    at the kernels' first runs, and the first launch of each variant of our AdamW kernel (Triton compiling it, or
    loading it from its cache)."""

    torch_compile_s: float
    graphs: int
    autotune_s: float
    """Inductor benchmarking its kernels' configurations at their first run (outside dynamo's compile total)."""
    optimizer_kernel_s: float

    @classmethod
    def now(cls) -> CompileTimes:
        spent = dynamo_utils.calculate_time_spent()
        kernel = sys.modules.get("trainer.optim.kernel")  # imported only where it runs: never on a CPU
        return cls(torch_compile_s=spent.get("total_wall_time", 0.0),
                   graphs=int(dynamo_utils.counters["stats"]["unique_graphs"]),
                   autotune_s=spent.get("CachingAutotuner.benchmark_all_configs", 0.0),
                   optimizer_kernel_s=kernel.compile_seconds if kernel is not None else 0.0)

    def since(self, earlier: CompileTimes) -> CompileTimes:
        return CompileTimes(self.torch_compile_s - earlier.torch_compile_s, self.graphs - earlier.graphs,
                            self.autotune_s - earlier.autotune_s, self.optimizer_kernel_s - earlier.optimizer_kernel_s)

    @property
    def seconds(self) -> float:
        return self.torch_compile_s + self.autotune_s + self.optimizer_kernel_s

    def describe(self) -> str:
        parts = [f"torch.compile {self.torch_compile_s:.1f} s, {self.graphs} graph{'s' * (self.graphs != 1)}"]
        if self.autotune_s:
            parts.append(f"autotuning {self.autotune_s:.1f} s")
        if self.optimizer_kernel_s:
            parts.append(f"AdamW kernel {self.optimizer_kernel_s:.1f} s")
        return f"{self.seconds:.1f} s compiling ({'; '.join(parts)})"
