"""AdamW kernel sweep: 8B shapes x 8 layers, the dp_shard=2 local shards (bf16 master/moments, SR)."""
import sys, time, torch, triton
sys.path.insert(0, ".")
import importlib.util, os
if os.environ.get("KVAR"):
    spec = importlib.util.spec_from_file_location("kvar", os.environ["KVAR"]); K = importlib.util.module_from_spec(spec); spec.loader.exec_module(K)
else:
    import trainer.optim.kernel as K
from trainer.distributed import Layout

dev = torch.device("cuda")
dim, ffn, vocab, kv = 4096, 14336, 128256, 1024
shapes = [(vocab, dim)]
for _ in range(8):
    shapes += [(dim, dim), (kv, dim), (kv, dim), (dim, dim), (ffn, dim), (ffn, dim), (dim, ffn), (dim,), (dim,)]
shapes += [(dim,), (vocab, dim)]
world = int(sys.argv[1]) if len(sys.argv) > 1 else 2
local = [((s[0] + world - 1) // world,) + s[1:] for s in shapes]
layouts = [Layout((0,) * len(s), s) for s in shapes]  # rank 0's block
def make(dtype):
    return [torch.empty(s, dtype=dtype, device=dev).uniform_(0.5, 1.5) for s in local]
P, G, M, V = make(torch.bfloat16), make(torch.bfloat16), make(torch.bfloat16), make(torch.bfloat16)
n = sum(p.numel() for p in P)
print(f"{len(P)} tensors, {n/1e9:.3f} B elements (world {world})", flush=True)
keys = [12345 + i for i in range(len(P))]

def run(rounding, block, warps, fp32=False, reps=20):
    K.BLOCK, K.NUM_WARPS = block, warps
    ps, ms, vs = (P, M, V) if not fp32 else (P32, M32, V32)
    kw = dict(lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=3, rounding=rounding)
    if rounding:
        kw.update(layouts=layouts, keys=keys)
    K.adamw_step(ps, G, ms, vs, **kw); torch.cuda.synchronize()
    st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    st.record()
    for _ in range(reps):
        K.adamw_step(ps, G, ms, vs, **kw)
    en.record(); torch.cuda.synchronize()
    ms_ = st.elapsed_time(en) / reps
    pb = ps[0].element_size()
    byts = n * (2 * pb + 2 + 2 * ms[0].element_size() + 2 * vs[0].element_size())
    return ms_, byts / ms_ / 1e9

# copy baseline: read 8 B, write 6 B per element
a = torch.empty(n * 4, dtype=torch.bfloat16, device=dev); b = torch.empty(n * 3, dtype=torch.bfloat16, device=dev)
torch.cuda.synchronize(); t = time.perf_counter()
for _ in range(20):
    b.copy_(a[: n * 3])
torch.cuda.synchronize(); dt = (time.perf_counter() - t) / 20
print(f"copy {n*3*2*2/1e9:.1f} GB: {dt*1e3:.2f} ms, {n*3*2*2/dt/1e12:.2f} TB/s", flush=True)
del a, b
for rounding, label in ((K.ROUND_STOCHASTIC, "bf16 SR " + os.environ.get("KVAR", "main")[-6:]),) + (((K.ROUND_NONE, "bf16 nearest"),) if os.environ.get("NEAREST") else ()):
    for block, warps in ((1024, 4), (256, 1)):
        try:
            t_ms, gbs = run(rounding, block, warps)
            print(f"{label:13s} BLOCK {block:5d} warps {warps:2d}: {t_ms:6.2f} ms {gbs:5.2f} TB/s", flush=True)
        except Exception as e:
            print(f"{label} {block} {warps}: {type(e).__name__}: {str(e)[:200]}", flush=True)
K.BLOCK, K.NUM_WARPS = 1024, 4

