"""Old vs new AdamW kernel on dp_shard=2 local shards of 8B x 8 layers (rank 0's), bf16 p/g/m/v, stochastic."""
import importlib, sys, torch, triton
from trainer.distributed import Layout
which = sys.argv[1]
if which == "old":
    sys.path.insert(0, "tmp_gpu/old")
    for m in [k for k in sys.modules if k.startswith("trainer")]:
        del sys.modules[m]
import trainer.optim.kernel as K
from trainer.distributed import Layout
print(which, K.__file__)
dev = torch.device("cuda")
layer = [(4096, 4096), (1024, 4096), (1024, 4096), (4096, 4096), (14336, 4096), (14336, 4096), (4096, 14336), (4096,), (4096,)]
shapes = [(128256, 4096)] + layer * 8 + [(4096,), (128256, 4096)]
local = lambda s: (s[0] // 2,) + tuple(s[1:])
for mdt in (torch.bfloat16, torch.float32):
    ps = [torch.randn(local(s), device=dev).to(torch.bfloat16) for s in shapes]
    gs = [torch.randn_like(p) * 1e-3 for p in ps]
    ms = [torch.zeros(p.shape, device=dev, dtype=mdt) for p in ps]
    vs = [torch.zeros(p.shape, device=dev, dtype=mdt) for p in ps]
    lay = [Layout((0,) * len(s), s) for s in shapes]
    inf = torch.zeros((), device=dev)
    numel = sum(p.numel() for p in ps)
    nbytes = numel * (2 * 2 + 2 + 2 * (ms[0].element_size() + vs[0].element_size()))
    for blk, nw in [(1024, 4), (512, 2), (2048, 8), (1024, 2)]:
        K.BLOCK, K.NUM_WARPS = blk, nw
        f = lambda: K.adamw_step(ps, gs, ms, vs, lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1,
                                 found_inf=inf, step=5, rounding=K.ROUND_STOCHASTIC, layouts=lay,
                                 keys=list(range(len(ps))))
        t = triton.testing.do_bench(f, warmup=3, rep=300)
        print(f"{which} moments {mdt} BLOCK {blk} warps {nw}: {t:.2f} ms, {nbytes / t / 1e6:.0f} GB/s", flush=True)
    del ps, gs, ms, vs
    torch.cuda.empty_cache()
