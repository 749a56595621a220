import sys, torch
sys.path.insert(0, ".")
from trainer.optim.kernel import sum_of_squares
dim, ffn, vocab, kv = 4096, 14336, 128256, 1024
shapes = [(vocab, dim)] + [(dim, dim), (kv, dim), (kv, dim), (dim, dim), (ffn, dim), (ffn, dim), (dim, ffn), (dim,), (dim,)] * 8 + [(dim,), (vocab, dim)]
for world in (2, 1):
    gs = [torch.randn(((s[0] + world - 1) // world,) + s[1:], device="cuda").bfloat16() for s in shapes]
    n = sum(g.numel() for g in gs)
    fe = lambda: torch.stack(torch._foreach_norm(gs, 2.0, dtype=torch.float32)).square().sum()
    ss = lambda: sum_of_squares(gs)
    for name, f in (("foreach_norm", fe), ("sum_of_squares", ss), ("foreach_norm", fe), ("sum_of_squares", ss)):
        f(); torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(20): f()
        b.record(); torch.cuda.synchronize(); ms = a.elapsed_time(b) / 20
        print(f"world {world}: {n/1e9:.2f}B bf16 elements, {name}: {ms:.2f} ms, {2*n/ms/1e9:.2f} TB/s; value {f().item():.6e}", flush=True)
    del gs
