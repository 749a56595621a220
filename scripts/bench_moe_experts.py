"""Micro-benchmark of the routed experts' grouped GEMMs, forward + backward, on one GPU (H100/H200).

    python scripts/bench_moe_experts.py                  # moe_16b shapes: 49,152 rows, 64 experts, dim 2048, ffn 1408
    python scripts/bench_moe_experts.py --rows 8192 --experts 8 --json out.jsonl

One SwiGLU expert MLP (w1 and w3 2048 -> 1408 each, i.e. 2048 -> 2816 together, then w2 1408 -> 2048) on rows
sorted by expert in equal groups, as the MoE layer runs it (rows gathered into the padded expert order, outputs
gathered back), in four variants:

    bf16          trainer.models.moe.grouped_swiglu: torch._grouped_mm (what float8.moe_experts='off' runs)
    torchao       the same layout with torchao's _to_fp8_rowwise_then_scaled_grouped_mm for each of the three GEMMs
    fp8           trainer.models.moe_fp8 (float8.moe_experts='rowwise'), weights quantized once per step (cached)
    fp8-requant   the same, weights quantized on every call (what FSDP-sharded experts do)

TFLOP/s count the 3 GEMMs x (forward + dgrad + wgrad) = 18 x rows x dim x ffn FLOPs; times are the median of
triton.testing.do_bench. Prints one line per variant and the speedup over bf16 (the target is >= 1.15x).
"""

from __future__ import annotations

import argparse
import json

import torch


def _inputs(rows: int, experts: int, dim: int, ffn: int):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(rows, dim, device="cuda", generator=g).bfloat16().requires_grad_()
    w1, w3 = (torch.randn(experts, ffn, dim, device="cuda", generator=g).mul(dim ** -0.5).bfloat16().requires_grad_()
              for _ in range(2))
    w2 = torch.randn(experts, dim, ffn, device="cuda", generator=g).mul(ffn ** -0.5).bfloat16().requires_grad_()
    counts = torch.full((experts,), rows // experts, device="cuda", dtype=torch.int64)
    return x, w1, w2, w3, counts


def _torchao_swiglu(x, counts, w1, w2, w3):
    import torch.nn.functional as F
    from torchao.prototype.moe_training.fp8_grouped_mm import _to_fp8_rowwise_then_scaled_grouped_mm

    from trainer.models.moe import GROUP_ALIGN
    from trainer.models.moe_permute import padded_layout, select_unique_rows

    dst, offs, n_pad = padded_layout(counts, x.shape[0], GROUP_ALIGN)
    x_pad = x.new_zeros(n_pad, x.shape[1]).index_copy(0, dst, x)

    def mm(a, w):  # w [E, N, K] Linear layout: its transpose is the column-major [E, K, N] torchao takes
        return _to_fp8_rowwise_then_scaled_grouped_mm(a, w.transpose(-2, -1), offs,
                                                      pad_token_groups_for_grouped_mm=False)

    h = F.silu(mm(x_pad, w1)) * mm(x_pad, w3)
    return select_unique_rows(mm(h, w2), dst)


def _variants(x, w1, w2, w3, counts):
    from trainer.models.moe import GROUP_ALIGN, grouped_swiglu
    from trainer.models.moe_fp8 import Fp8ExpertWeights, fp8_grouped_swiglu

    rows = torch.arange(x.shape[0], device="cuda")
    cached = Fp8ExpertWeights(per_step=True)

    def fp8(weights):
        return lambda: fp8_grouped_swiglu(x, rows, rows, counts, w1, w2, w3, k=1, weights=weights, emulate=False,
                                          align=GROUP_ALIGN)

    return {
        "bf16": lambda: grouped_swiglu(x, counts, w1, w2, w3),
        "torchao": lambda: _torchao_swiglu(x, counts, w1, w2, w3),
        "fp8": fp8(cached),
        "fp8-requant": fp8(Fp8ExpertWeights(per_step=False)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=49152, help="routed rows (tokens x top_k); default 8192 x 6")
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--ffn", type=int, default=1408, help="moe_ffn_dim (w1 and w3 together: 2 x ffn)")
    parser.add_argument("--json", default="", help="append one JSON line per variant to this file")
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
    verdict = "PASS" if results["bf16"] / results["fp8"] >= 1.15 else "BELOW TARGET"
    print(f"fp8 experts vs bf16: {results['bf16'] / results['fp8']:.2f}x (target >= 1.15x: {verdict}); "
          f"torchao: {results['bf16'] / results['torchao']:.2f}x")


if __name__ == "__main__":
    main()
