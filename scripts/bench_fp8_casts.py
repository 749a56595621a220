"""Micro-benchmark: the FP8 casts that also write a transposed copy, as inductor compiles them against Triton kernels of
ours, on one GPU.

    python scripts/bench_fp8_casts.py          # 1x H100/H200, about a minute

In the fp8 step (tensorwise) the weight-gradient GEMM wants each output gradient with the token dimension contiguous,
so every such gradient is cast to e5m2 twice: as is (for the input-gradient GEMM) and transposed. In the 2026-11-28
one-GPU trace of 8B shapes x 8 layers those kernels ran at 1.5-2.1 TB/s (docs/benchmarks/2026-11-28-no-host-sync-
scale-h200.md#inductors-autotuning-on-one-gpu). Two jobs of that trace's shapes, each timed as torch.compile makes
it from the eager reference and as two kernels of ours (an amax pass, then one pass writing both copies):

  head    the logits gradient [16384, 128256] bf16 -> e5m2 and its transpose (the output head's wgrad)
  swiglu  dh, gate, up [16384, 14336] bf16 -> d_gate, d_up (SwiGLU's backward) -> each e5m2 and its transpose

Prints ms and GB/s of the bytes each job must move at least, and how many bytes of ours differ from inductor's
(whether Triton's e5m2 rounding and torch's agree there; Triton's CPU interpreter rounds some values an ulp apart).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torchao.float8.float8_utils import amax_to_scale, tensor_to_amax, to_fp8_saturated

E5M2 = torch.float8_e5m2  # the kernels below write e5m2's largest value, 57344.0, and torchao's EPS, 1e-12, as literals


def cast_e5m2(t):
    """torchao's tensorwise cast of t to e5m2 (its amax, scale and saturated cast): (data, scale)."""
    s = amax_to_scale(tensor_to_amax(t), E5M2)
    return to_fp8_saturated(t.float() * s, E5M2), s


# ---- the head's job -------------------------------------------------------------------------------------------
def head_ref(g):
    """The head's job as the trainer's graph states it: tensorwise e5m2 of g, and its transposed copy."""
    q, s = cast_e5m2(g)
    return q, q.t().contiguous(), s


@triton.jit
def _amax_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.atomic_max(out_ptr, tl.max(tl.abs(x), axis=0))


@triton.jit
def _cast_both_kernel(x_ptr, y_ptr, yt_ptr, amax_ptr, M, N, BM: tl.constexpr, BN: tl.constexpr):
    pm, pn = tl.program_id(0), tl.program_id(1)
    rm = pm * BM + tl.arange(0, BM)
    rn = pn * BN + tl.arange(0, BN)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    s = 57344.0 / tl.maximum(tl.load(amax_ptr), 1e-12)
    x = tl.load(x_ptr + rm[:, None] * N + rn[None, :], mask=mask, other=0.0).to(tl.float32)
    q = tl.clamp(x * s, -57344.0, 57344.0).to(tl.float8e5)
    tl.store(y_ptr + rm[:, None] * N + rn[None, :], q, mask=mask)
    qt = tl.trans(q)
    tl.store(yt_ptr + rn[:, None] * M + rm[None, :], qt, mask=tl.trans(mask))


def head_ours(g, BM=128, BN=128, warps=8):
    """head_ref with our two kernels: the amax (atomic max of block maxima), then one pass writing both copies."""
    M, N = g.shape
    amax = torch.zeros((), device=g.device, dtype=torch.float32)
    n = g.numel()
    _amax_kernel[(triton.cdiv(n, 8192),)](g, amax, n, BLOCK=8192)
    y = torch.empty(M, N, device=g.device, dtype=E5M2)
    yt = torch.empty(N, M, device=g.device, dtype=E5M2)
    _cast_both_kernel[(triton.cdiv(M, BM), triton.cdiv(N, BN))](g, y, yt, amax, M, N, BM=BM, BN=BN, num_warps=warps)
    return y, yt, amax_to_scale(amax, E5M2)


# ---- the SwiGLU backward's job --------------------------------------------------------------------------------
def swiglu_ref(dh, g, u):
    """SwiGLU's backward (d_gate, d_up in bf16, as autograd makes them), then each cast as head_ref casts."""
    gf, uf, dhf = g.float(), u.float(), dh.float()
    sig = torch.sigmoid(gf)
    d_u = (dhf * gf * sig).to(torch.bfloat16)
    d_g = (dhf * uf * sig * (1 + gf * (1 - sig))).to(torch.bfloat16)
    out = []
    for d in (d_g, d_u):
        q, _ = cast_e5m2(d)
        out += [q, q.t().contiguous()]
    return out


@triton.jit
def _swiglu_grads(dh, g, u):
    gf, uf, dhf = g.to(tl.float32), u.to(tl.float32), dh.to(tl.float32)
    sig = tl.sigmoid(gf)
    d_u = (dhf * gf * sig).to(tl.bfloat16).to(tl.float32)
    d_g = (dhf * uf * sig * (1 + gf * (1 - sig))).to(tl.bfloat16).to(tl.float32)
    return d_g, d_u


@triton.jit
def _swiglu_amax_kernel(dh_ptr, g_ptr, u_ptr, amax_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    d_g, d_u = _swiglu_grads(tl.load(dh_ptr + offs, mask=m, other=0.0), tl.load(g_ptr + offs, mask=m, other=0.0),
                             tl.load(u_ptr + offs, mask=m, other=0.0))
    tl.atomic_max(amax_ptr, tl.max(tl.abs(d_g), axis=0))
    tl.atomic_max(amax_ptr + 1, tl.max(tl.abs(d_u), axis=0))


@triton.jit
def _swiglu_cast_kernel(dh_ptr, g_ptr, u_ptr, amax_ptr, yg_ptr, ygt_ptr, yu_ptr, yut_ptr, M, N,
                        BM: tl.constexpr, BN: tl.constexpr):
    pm, pn = tl.program_id(0), tl.program_id(1)
    rm = pm * BM + tl.arange(0, BM)
    rn = pn * BN + tl.arange(0, BN)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    idx = rm[:, None] * N + rn[None, :]
    d_g, d_u = _swiglu_grads(tl.load(dh_ptr + idx, mask=mask, other=0.0), tl.load(g_ptr + idx, mask=mask, other=0.0),
                             tl.load(u_ptr + idx, mask=mask, other=0.0))
    sg = 57344.0 / tl.maximum(tl.load(amax_ptr), 1e-12)
    su = 57344.0 / tl.maximum(tl.load(amax_ptr + 1), 1e-12)
    qg = tl.clamp(d_g * sg, -57344.0, 57344.0).to(tl.float8e5)
    qu = tl.clamp(d_u * su, -57344.0, 57344.0).to(tl.float8e5)
    tl.store(yg_ptr + idx, qg, mask=mask)
    tl.store(yu_ptr + idx, qu, mask=mask)
    tidx = rn[:, None] * M + rm[None, :]
    tl.store(ygt_ptr + tidx, tl.trans(qg), mask=tl.trans(mask))
    tl.store(yut_ptr + tidx, tl.trans(qu), mask=tl.trans(mask))


def swiglu_ours(dh, g, u, BM=64, BN=128, warps=8):
    """swiglu_ref with our two kernels: both amaxes in one pass, then d_gate and d_up recomputed and written, each
    as is and transposed."""
    M, N = g.shape
    amax = torch.zeros(2, device=g.device, dtype=torch.float32)
    n = g.numel()
    _swiglu_amax_kernel[(triton.cdiv(n, 4096),)](dh, g, u, amax, n, BLOCK=4096)
    outs = [torch.empty(M, N, device=g.device, dtype=E5M2), torch.empty(N, M, device=g.device, dtype=E5M2),
            torch.empty(M, N, device=g.device, dtype=E5M2), torch.empty(N, M, device=g.device, dtype=E5M2)]
    _swiglu_cast_kernel[(triton.cdiv(M, BM), triton.cdiv(N, BN))](dh, g, u, amax, *outs, M, N, BM=BM, BN=BN,
                                                                   num_warps=warps)
    return outs


def same_bytes(a, b):
    """How many bytes of the e5m2 tensors in `a` differ from `b`'s."""
    return sum(int((x.view(torch.uint8) != y.view(torch.uint8)).sum()) for x, y in zip(a, b))


def report(name, fn, nbytes):
    """fn's median time (triton.testing.do_bench) and the GB/s of `nbytes` in it, printed; returns the ms."""
    ms = triton.testing.do_bench(fn, warmup=25, rep=200)
    print(f"{name:<44} {ms:7.3f} ms  {nbytes / (ms / 1e3) / 1e9:6.0f} GB/s", flush=True)
    return ms


def main():
    torch.manual_seed(0)
    dev = "cuda"
    T, V, F = 16384, 128256, 14336
    g = (torch.randn(T, V, device=dev) * 1e-5).to(torch.bfloat16)
    head_bytes = g.numel() * (2 + 2)  # read bf16 once, write two e5m2 copies (the amax pass reads it again: +2)
    print(f"head: [{T}, {V}] bf16 -> e5m2 and its transpose; minimum {head_bytes / 1e9:.2f} GB "
          f"(+{g.numel() * 2 / 1e9:.2f} GB for the amax pass)")
    ref = torch.compile(head_ref)
    report("inductor (torch.compile of the reference)", lambda: ref(g), head_bytes)
    for BM, BN, w in [(128, 128, 8), (64, 128, 4), (128, 64, 4), (64, 256, 8), (256, 64, 8)]:
        report(f"ours BM={BM} BN={BN} warps={w}", lambda: head_ours(g, BM, BN, w), head_bytes)
    print("bytes differing from inductor's:", same_bytes(ref(g)[:2], head_ours(g)[:2]))
    del g
    torch.cuda.empty_cache()
    dh, gg, u = [(torch.randn(T, F, device=dev) * s).to(torch.bfloat16) for s in (1e-4, 1.0, 1.0)]
    sw_bytes = dh.numel() * (3 * 2 + 4)
    print(f"swiglu: [{T}, {F}] x3 bf16 -> d_g, d_u e5m2 and transposes; minimum {sw_bytes / 1e9:.2f} GB "
          f"(+{dh.numel() * 6 / 1e9:.2f} GB for the amax pass)")
    sref = torch.compile(swiglu_ref)
    report("inductor (torch.compile of the reference)", lambda: sref(dh, gg, u), sw_bytes)
    for BM, BN, w in [(64, 128, 8), (128, 128, 8), (64, 64, 4), (128, 64, 4), (32, 256, 8)]:
        report(f"ours BM={BM} BN={BN} warps={w}", lambda: swiglu_ours(dh, gg, u, BM, BN, w), sw_bytes)
    print("bytes differing from inductor's:", same_bytes(sref(dh, gg, u), swiglu_ours(dh, gg, u)))
    report("plain copy of the three inputs (bandwidth reference)", lambda: [t.clone() for t in (dh, gg, u)],
           dh.numel() * 2 * 2 * 3)


if __name__ == "__main__":
    main()
