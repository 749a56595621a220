"""Micro-benchmark of the AdamW kernel (trainer/optim/kernel.py) against torch's fused AdamW, on one GPU.

    python scripts/bench_adamw.py                       # Llama 3 8B shapes x 8 layers: 75 tensors, 2.79B parameters
    python scripts/bench_adamw.py --layers 2 --configs 1024x4,512x2

Times one step over plain tensors of the model's shapes (median of 8, between device syncs) for bf16 weights with
stochastic rounding (AdamW's rounded update), bf16 weights rounded to nearest, and fp32 weights, for each kernel
configuration (elements per program x warps), then torch.optim.AdamW(fused=True) over the same tensors. GB/s count
the 7 tensor passes an AdamW step makes (read weight, gradient and two moments; write three). Also prints how many
16-byte vector loads the compiled kernel has (none where Triton cannot prove the tensors' alignment) and its
registers per thread.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from trainer.distributed import Layout
import trainer.optim.kernel as kernel


def shapes_8b(layers: int) -> list[tuple[int, ...]]:
    dim, ffn, vocab, kv = 4096, 14336, 128256, 1024
    block = [(dim, dim), (kv, dim), (kv, dim), (dim, dim), (ffn, dim), (ffn, dim), (dim, ffn), (dim,), (dim,)]
    return [(vocab, dim), *block * layers, (dim,), (vocab, dim)]


def median_ms(fn, repeats: int = 8) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--configs", default=f"{kernel.BLOCK}x{kernel.NUM_WARPS}",
                        help="kernel configurations to time, elements per program x warps, comma-separated")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    launches = []
    run = kernel._adamw_kernel.run
    kernel._adamw_kernel.run = lambda *a, **k: launches.append(run(*a, **k)) or launches[-1]
    shapes = shapes_8b(args.layers)
    configs = [tuple(int(v) for v in c.split("x")) for c in args.configs.split(",")]
    for dtype, rounding in [(torch.bfloat16, kernel.ROUND_STOCHASTIC), (torch.bfloat16, kernel.ROUND_NONE),
                            (torch.float32, kernel.ROUND_NONE)]:
        ps = [torch.randn(s, device="cuda", dtype=dtype) for s in shapes]
        gs = [torch.randn_like(p) for p in ps]
        ms, vs = [torch.zeros_like(p) for p in ps], [torch.zeros_like(p) for p in ps]
        gbytes = sum(p.numel() for p in ps) * dtype.itemsize * 7 / 1e9
        kw = dict(lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1,
                  grad_scale=torch.tensor(1.0, device="cuda"), found_inf=torch.tensor(0.0, device="cuda"))
        if rounding == kernel.ROUND_STOCHASTIC:
            kw.update(step=3, rounding=rounding, layouts=[Layout((0,) * len(s), s) for s in shapes],
                      keys=[12345 + i for i in range(len(ps))])
        else:
            kw.update(steps=[torch.ones((), device="cuda") for _ in ps])
        name = f"{str(dtype).removeprefix('torch.')} {'stochastic' if rounding else 'nearest'}"
        for block, warps in configs:
            kernel.BLOCK, kernel.NUM_WARPS = block, warps
            ms_ = median_ms(lambda: kernel.adamw_step(ps, gs, ms, vs, **kw))
            ptx = launches[-1].asm.get("ptx", "")
            print(f"{name:<20} ours {block}x{warps}: {ms_:7.2f} ms {gbytes / ms_ * 1e3:6.0f} GB/s "
                  f"({len(re.findall(r'ld.global.v', ptx))} vector loads, {launches[-1].n_regs} registers)")
        params = [torch.nn.Parameter(p.clone()) for p in ps]
        for p, g in zip(params, gs):
            p.grad = g
        opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
        ms_ = median_ms(opt.step)
        print(f"{name:<20} torch AdamW(fused): {ms_:7.2f} ms {gbytes / ms_ * 1e3:6.0f} GB/s")
        del ps, gs, ms, vs, params, opt
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
