"""LossFn compiled, fused cross-entropy on/off, fp8 and bf16 heads at 8B shapes; kernel checks against the torch
references; tile sweeps."""
import os, sys, statistics, time
sys.path.insert(0, os.getcwd())
import torch
from torch import nn
from torchao.float8 import convert_to_float8_training, Float8LinearConfig
from torchao.float8.float8_utils import amax_to_scale
from trainer.loss import LossFn, row_stats_reference, logits_grad_reference, FP8_FORMATS
from trainer import loss_kernels as K
from trainer.models.layers import RMSNorm

N, D, V = 16384, 4096, 128256


class H(nn.Module):
    def __init__(s):
        super().__init__()
        s.proj = nn.Linear(D, V, bias=False)

    def forward(s, h):
        return s.proj(h)


def make(fp8):
    torch.manual_seed(0)
    head, norm = H(), RMSNorm(D, 1e-5)
    if fp8:
        convert_to_float8_training(head, config=Float8LinearConfig())
    return head.cuda().bfloat16(), norm.cuda().bfloat16()


def timed(fn, reps=10):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        torch.cuda.synchronize(); t = time.perf_counter(); fn(); torch.cuda.synchronize()
        ts.append(time.perf_counter() - t)
    return 1e3 * statistics.median(ts)


def kernels():
    torch.manual_seed(0)
    logits = (torch.randn(N, V, device="cuda") * 3).bfloat16()
    labels = torch.randint(0, V, (N,), device="cuda"); labels[:100] = -100
    st = K.row_stats(logits, labels)
    ref = row_stats_reference(logits, labels)
    print("row_stats max |diff| lse/loss/amax:", [f"{(a - b).abs().max().item():.3g}" for a, b in zip(st, ref)])
    g = torch.tensor(1 / 16000, device="cuda")
    lse = ref[0]
    grad = K.logits_grad(logits, lse, labels, g, None, None, FP8_FORMATS)
    gr = logits_grad_reference(logits, lse, labels, g)
    print("bf16 grad: elements differing", (grad != gr).sum().item(), "max |diff|", (grad.float() - gr.float()).abs().max().item(), "of", gr.abs().max().item())
    scale = amax_to_scale((ref[2].amax() * g).bfloat16().float(), torch.float8_e5m2)
    d, dt = K.logits_grad(logits, lse, labels, g, scale, torch.float8_e5m2, FP8_FORMATS)
    direct = (grad.float() * scale).clamp(-57344, 57344).to(torch.float8_e5m2)
    print("fp8: bytes differing from torch's cast of the kernel's bf16 grad", (d.view(torch.uint8) != direct.view(torch.uint8)).sum().item(),
          "transpose equal:", torch.equal(dt.view(torch.uint8), d.view(torch.uint8).t().contiguous()),
          "amax check", (ref[2].amax() * g).bfloat16().item(), grad.abs().max().item())
    gb = logits.numel() * 2 / 1e9
    print(f"row_stats {timed(lambda: K.row_stats(logits, labels)):.3f} ms ({gb:.2f} GB read)")
    for rb, rw in ((2048, 4), (1024, 4), (2048, 8), (4096, 8), (1024, 2)):
        K.ROW_BLOCK, K.ROW_WARPS = rb, rw
        print(f"  row_stats {rb}x{rw}: {timed(lambda: K.row_stats(logits, labels)):.3f} ms")
    K.ROW_BLOCK, K.ROW_WARPS = 2048, 4
    print(f"bf16 grad {timed(lambda: K.logits_grad(logits, lse, labels, g, None, None, FP8_FORMATS)):.3f} ms")
    for tile, w in (((64, 256), 8), ((64, 256), 4), ((128, 128), 8), ((128, 64), 4), ((128, 128), 4), ((64, 128), 4), ((32, 256), 4), ((128, 256), 16)):
        K.GRAD_TILE, K.GRAD_WARPS = tile, w
        print(f"  {tile}x{w}: bf16 {timed(lambda: K.logits_grad(logits, lse, labels, g, None, None, FP8_FORMATS)):.3f} ms, "
              f"fp8 pair {timed(lambda: K.logits_grad(logits, lse, labels, g, scale, torch.float8_e5m2, FP8_FORMATS)):.3f} ms")
    K.GRAD_TILE, K.GRAD_WARPS = (64, 256), 8


def loss_fns():
    h0 = torch.randn(1, N, D, device="cuda", dtype=torch.bfloat16)
    lab = torch.randint(0, V, (1, N), device="cuda")
    lab[0, :100] = -100
    res = {}
    for fp8 in (True, False):
        for fused in (False, True):
            torch._dynamo.reset()
            head, norm = make(fp8)
            lf = LossFn(norm, head, compile=True)
            lf.fused = fused
            h = h0.clone().requires_grad_(True)
            def step():
                head.proj.weight.grad = None
                h.grad = None
                loss = lf(h, lab)
                loss.backward()
                return loss
            ms = timed(step)
            head.proj.weight.grad = None; h.grad = None
            torch.cuda.synchronize(); base = torch.cuda.memory_allocated() / 2**30
            torch.cuda.reset_peak_memory_stats()
            loss = lf(h, lab); torch.cuda.synchronize()
            after_fwd, fwd_peak = torch.cuda.memory_allocated() / 2**30, torch.cuda.max_memory_allocated() / 2**30
            loss.backward(); del loss; torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() / 2**30
            print(f"   memory GiB: before {base:.2f}, after forward {after_fwd:.2f} (peak {fwd_peak:.2f}), peak in backward {peak:.2f}")
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    step()
                torch.cuda.synchronize()
            tag = f"{'fp8' if fp8 else 'bf16'} {'fused' if fused else 'inductor'}"
            print(f"== {tag}: {ms:.3f} ms fwd+bwd (median of 10), peak {peak:.2f} GiB; fp8 head class {lf.fp8_head_class}")
            rows = [(e.device_time_total / 3e3, e.count // 3, e.key) for e in prof.key_averages() if e.device_time_total > 0]
            for t, n, k in sorted(rows, reverse=True)[:12]:
                print(f"   {t:8.3f} ms {n:3d}x  {k[:140]}")
            loss = step()
            res[tag] = (loss.detach().float(), h.grad.float().clone(), head.proj.weight.grad.float().clone())
            del head, norm, lf
            torch.cuda.empty_cache()
    for p in ("fp8", "bf16"):
        a, b = res[f"{p} inductor"], res[f"{p} fused"]
        print(p, "loss", a[0].item(), b[0].item(), "dh max|diff|", (a[1] - b[1]).abs().max().item(), "of", a[1].abs().max().item(),
              "rel l2", ((a[1] - b[1]).norm() / a[1].norm()).item(),
              "dW max|diff|", (a[2] - b[2]).abs().max().item(), "of", a[2].abs().max().item(), "rel l2", ((a[2] - b[2]).norm() / a[2].norm()).item())


kernels()
loss_fns()
