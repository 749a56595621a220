"""Micro-benchmark of the routed experts' grouped GEMMs, forward + backward, on one GPU (H100/H200).

    python scripts/bench_moe_experts.py                  # moe_16b shapes: 49,152 rows, 64 experts, dim 2048, ffn 1408
    python scripts/bench_moe_experts.py --rows 8192 --experts 8 --json out.jsonl

One SwiGLU expert MLP (w1 and w3 2048 -> 1408 each, i.e. 2048 -> 2816 together, then w2 1408 -> 2048) on rows
sorted by expert in equal groups, as the MoE layer runs it (rows gathered into the padded expert order, outputs
gathered back), in four variants:

    bf16          trainer.models.moe.grouped_swiglu: torch._grouped_mm (what float8.moe_experts='off' runs)
    torchao       the same layout with torchao's _to_fp8_rowwise_then_scaled_grouped_mm for each of the three GEMMs
    fp8           trainer.models.moe_fp8 (float8.moe_experts='rowwise'), the weights quantized in the call (forward
                  its orientation, backward the other): what a step with one forward per layer pays
    fp8-kept      the same with the weights' FP8 copies kept from an earlier call: what gradient accumulation's
                  later microbatches (and pipeline microbatches) pay

and the weights' quantization alone (both orientations of one layer), with the bytes it moves.

TFLOP/s count the 3 GEMMs x (forward + dgrad + wgrad) = 18 x rows x dim x ffn FLOPs; times are the median of
triton.testing.do_bench. Prints one line per variant and the speedup over bf16 (the target is >= 1.15x).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# The checkout this script is in comes first, even when another copy of trainer is installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from trainer.models.moe import GROUP_ALIGN, grouped_swiglu  # noqa: E402
from trainer.models.moe_fp8 import (  # noqa: E402
    Fp8ExpertWeights, fp8_grouped_swiglu, quantize_dgrad_weights, quantize_forward_weights,
)
from trainer.models.moe_permute import padded_layout, select_unique_rows  # noqa: E402


def _inputs(rows: int, experts: int, dim: int, ffn: int):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(rows, dim, device="cuda", generator=g).bfloat16().requires_grad_()
    w1, w3 = (torch.randn(experts, ffn, dim, device="cuda", generator=g).mul(dim ** -0.5).bfloat16().requires_grad_()
              for _ in range(2))
    w2 = torch.randn(experts, dim, ffn, device="cuda", generator=g).mul(ffn ** -0.5).bfloat16().requires_grad_()
    counts = torch.full((experts,), rows // experts, device="cuda", dtype=torch.int64)
    return x, w1, w2, w3, counts


def _torchao_swiglu(x, counts, w1, w2, w3):
    from torchao.prototype.moe_training.fp8_grouped_mm import _to_fp8_rowwise_then_scaled_grouped_mm

    dst, offs, n_pad = padded_layout(counts, x.shape[0], GROUP_ALIGN)
    x_pad = x.new_zeros(n_pad, x.shape[1]).index_copy(0, dst, x)

    def mm(a, w):  # w [E, N, K] Linear layout: its transpose is the column-major [E, K, N] torchao takes
        return _to_fp8_rowwise_then_scaled_grouped_mm(a, w.transpose(-2, -1), offs,
                                                      pad_token_groups_for_grouped_mm=False)

    h = F.silu(mm(x_pad, w1)) * mm(x_pad, w3)
    return select_unique_rows(mm(h, w2), dst)


def _variants(x, w1, w2, w3, counts):
    rows = torch.arange(x.shape[0], device="cuda")

    def fp8(weights):
        return lambda: fp8_grouped_swiglu(x, rows, rows, counts, w1, w2, w3, k=1, weights=weights, emulate=False,
                                          align=GROUP_ALIGN)

    return {
        "bf16": lambda: grouped_swiglu(x, counts, w1, w2, w3),
        "torchao": lambda: _torchao_swiglu(x, counts, w1, w2, w3),
        "fp8": fp8(Fp8ExpertWeights(per_step=False)),
        "fp8-kept": fp8(Fp8ExpertWeights(per_step=True)),
    }


def _weight_quantization(w1, w2, w3, do_bench) -> str:
    def both():
        quantize_forward_weights(w1, w2, w3)
        quantize_dgrad_weights(w1, w2, w3)

    both()
    ms = do_bench(both, warmup=10, rep=100)
    moved = 3 * (w1.numel() + w2.numel() + w3.numel())  # each orientation reads bf16 (2 bytes), writes e4m3 (1)
    return f"weight quantization (both orientations, one layer): {ms:.3f} ms, {moved / ms / 1e6:.0f} GB/s"


def _profile(name: str, forward, probe: torch.Tensor, calls: int = 5) -> None:
    """Where one call's time goes: the CUDA kernels of `calls` forward + backward calls, per call."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            forward().backward(probe)
        torch.cuda.synchronize()
    print(f"--- {name}: CUDA kernels, totals over {calls} calls")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=20, max_name_column_width=90))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=49152, help="routed rows (tokens x top_k); default 8192 x 6")
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--ffn", type=int, default=1408, help="moe_ffn_dim (w1 and w3 together: 2 x ffn)")
    parser.add_argument("--json", default="", help="append one JSON line per variant to this file")
    parser.add_argument("--profile", default="", help="also print the CUDA kernel table of these variants "
                                                      "(comma-separated, e.g. bf16,fp8)")
    args = parser.parse_args()
    from triton.testing import do_bench

    x, w1, w2, w3, counts = _inputs(args.rows, args.experts, args.dim, args.ffn)
    flops = 18 * args.rows * args.dim * args.ffn
    probe = torch.randn(args.rows, args.dim, device="cuda", dtype=torch.bfloat16)
    results, reference = {}, None
    for name, forward in _variants(x, w1, w2, w3, counts).items():
        def step():
            out = forward()
            out.backward(probe)
            return out

        out = step().float()  # warm-up (compiles the fused quantization kernels)
        if reference is None:
            reference = out
        err = ((out - reference).norm() / reference.norm()).item()
        for t in (x, w1, w2, w3):
            t.grad = None
        ms = do_bench(step, warmup=25, rep=200, grad_to_none=[x, w1, w2, w3])
        results[name] = ms
        line = {"variant": name, "rows": args.rows, "experts": args.experts, "dim": args.dim, "ffn": args.ffn,
                "ms": ms, "tflops": flops / ms / 1e9, "speedup_vs_bf16": results["bf16"] / ms, "rel_err_vs_bf16": err}
        print(f"{name:12s} {ms:8.3f} ms  {line['tflops']:7.1f} TFLOP/s  {line['speedup_vs_bf16']:.2f}x bf16  "
              f"output rel. error vs bf16 {err:.4f}", flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(line) + "\n")
    print(_weight_quantization(w1, w2, w3, do_bench))
    variants = _variants(x, w1, w2, w3, counts)
    for name in filter(None, args.profile.split(",")):
        _profile(name, variants[name], probe)
    for name in ("fp8", "fp8-kept"):
        speedup = results["bf16"] / results[name]
        print(f"{name} experts vs bf16: {speedup:.2f}x (target >= 1.15x: {'PASS' if speedup >= 1.15 else 'BELOW'})")
    print(f"torchao: {results['bf16'] / results['torchao']:.2f}x")


if __name__ == "__main__":
    main()
