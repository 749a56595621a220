"""AdamW kernel variants on dp_shard=2 local shards of 8B x 8 layers (rank 0's), bf16 weights/grads, stochastic rounding."""
import sys, torch, triton
sys.path.insert(0, ".")
import trainer.optim.kernel as K
from trainer.distributed import Layout

dev = torch.device("cuda")
layer = [(4096, 4096), (1024, 4096), (1024, 4096), (4096, 4096), (14336, 4096), (14336, 4096), (4096, 14336), (4096,), (4096,)]
shapes = [(128256, 4096)] + layer * 8 + [(4096,), (128256, 4096)]
def local(s):
    return (s[0] // 2,) + tuple(s[1:])
def run(mdtype, vdtype, reps=20):
    ps = [torch.randn(local(s), device=dev).to(torch.bfloat16) for s in shapes]
    gs = [torch.randn_like(p) * 1e-3 for p in ps]
    ms = [torch.zeros(p.shape, device=dev, dtype=mdtype) for p in ps]
    vs = [torch.zeros(p.shape, device=dev, dtype=vdtype) for p in ps]
    lay = [Layout((0,) * len(s), s) for s in shapes]
    inf = torch.zeros((), device=dev)
    numel = sum(p.numel() for p in ps)
    nbytes = numel * (2 * 2 + 2 + 2 * (ms[0].element_size() + vs[0].element_size()))
    out = {}
    for blk, nw in [(1024, 4), (1024, 2), (1024, 8), (2048, 4), (2048, 8), (512, 2), (512, 4), (4096, 8), (4096, 16)]:
        K.BLOCK, K.NUM_WARPS = blk, nw
        f = lambda: K.adamw_step(ps, gs, ms, vs, lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, found_inf=inf,
                                 step=5, rounding=K.ROUND_STOCHASTIC, layouts=lay, keys=list(range(len(ps))))
        try:
            t = triton.testing.do_bench(f, warmup=3, rep=200)
        except Exception as e:
            print(blk, nw, "failed", type(e).__name__, str(e)[:200]); continue
        print(f"m {mdtype} v {vdtype} BLOCK {blk} warps {nw}: {t:.2f} ms, {nbytes / t / 1e9:.0f} GB/s", flush=True)
    if mdtype == vdtype == torch.bfloat16:
        K.BLOCK, K.NUM_WARPS = 1024, 4
        f = lambda: K.adamw_step(ps, gs, ms, vs, lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, found_inf=inf, step=5)
        t = triton.testing.do_bench(f, warmup=3, rep=200)
        print(f"round to nearest BLOCK 1024 warps 4: {t:.2f} ms, {nbytes / t / 1e9:.0f} GB/s", flush=True)
        params = [torch.nn.Parameter(p) for p in ps]
        for q, g in zip(params, gs):
            q.grad = g
        opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
        opt.step()
        t = triton.testing.do_bench(opt.step, warmup=3, rep=200)
        print(f"torch AdamW fused, all bf16: {t:.2f} ms, {nbytes / t / 1e9:.0f} GB/s", flush=True)
        del opt, params
    t = triton.testing.do_bench(lambda: torch._foreach_norm(gs, 2.0), warmup=3, rep=100)
    print(f"grad norm (foreach_norm): {t:.2f} ms, {numel * 2 / t / 1e9:.0f} GB/s")
    flat = torch.empty(numel, dtype=torch.float32, device=dev)
    t = triton.testing.do_bench(lambda: flat.mul_(1.0001), warmup=3, rep=100)
    print(f"fp32 in-place scale (read+write 8 B/elem): {t:.2f} ms, {numel * 8 / t / 1e9:.0f} GB/s")
    del ps, gs, ms, vs, flat
    torch.cuda.empty_cache()
run(torch.bfloat16, torch.bfloat16)
run(torch.float32, torch.float32)
