"""Exploratory: the final norm + output head + loss graph alone, 8B shapes (16384 tokens, 4096 -> 128256), compiled,
fp8 (tensorwise) and bf16: the current F.cross_entropy against a closed-form backward."""
import os, sys, statistics, time
sys.path.insert(0, os.getcwd())
import torch
import torch.nn.functional as F
from torch import nn
from torchao.float8 import convert_to_float8_training, Float8LinearConfig
from trainer.models.layers import RMSNorm

IGN = -100
N, D, V = int(os.environ.get("N", 16384)), int(os.environ.get("D", 4096)), int(os.environ.get("V", 128256))
DEV = "cuda" if torch.cuda.is_available() else "cpu"
SYNC = torch.cuda.synchronize if DEV == "cuda" else (lambda: None)


class CE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels):
        lf = logits.float()
        lse = torch.logsumexp(lf, dim=-1)
        valid = labels != IGN
        tgt = lf.gather(1, torch.where(valid, labels, 0)[:, None]).squeeze(1)
        ctx.save_for_backward(logits, lse, labels)
        return torch.where(valid, lse - tgt, 0.0).sum()

    @staticmethod
    def backward(ctx, g):
        logits, lse, labels = ctx.saved_tensors
        valid = labels != IGN
        p = torch.exp(logits.float() - lse[:, None])
        hot = torch.arange(logits.shape[1], device=logits.device)[None, :] == labels[:, None]
        grad = torch.where(valid[:, None], p - hot.float(), 0.0) * g
        return grad.to(logits.dtype), None


from torchao.float8.float8_utils import amax_to_scale
from torchao.float8.float8_training_tensor import GemmInputRole, hp_tensor_and_scale_to_float8


class CE8(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, cast):
        lf = logits.float()
        valid = labels != IGN
        target = torch.where(valid, labels, 0)
        lse = torch.logsumexp(lf, dim=-1)
        picked = lf.gather(1, target[:, None]).squeeze(1)
        hot = torch.arange(lf.shape[1], device=lf.device)[None, :] == target[:, None]
        others = torch.where(hot, float("-inf"), lf).amax(-1)
        row = torch.maximum(torch.exp(others - lse), (torch.exp(picked - lse) - 1).abs())
        amax = torch.where(valid, row, 0.0).amax()
        ctx.save_for_backward(logits, lse, labels, amax)
        ctx.cast = cast
        return torch.where(valid, lse - picked, 0.0).sum()

    @staticmethod
    def backward(ctx, g):
        logits, lse, labels, amax = ctx.saved_tensors
        valid = labels != IGN
        target = torch.where(valid, labels, 0)
        p = torch.exp(logits.float() - lse[:, None])
        hot = torch.arange(logits.shape[1], device=logits.device)[None, :] == target[:, None]
        grad = torch.where(valid[:, None], (p - hot.float()) * g, 0.0).to(logits.dtype)
        dtype, mm_config = ctx.cast
        scale = amax_to_scale((amax * g.abs()).to(logits.dtype).float(), dtype)
        return hp_tensor_and_scale_to_float8(grad, scale, dtype, mm_config, GemmInputRole.GRAD_OUTPUT), None, None


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
    return head.to(DEV).bfloat16(), norm.to(DEV).bfloat16()


def ref(head, norm, h, lab):
    lg = head(norm(h))
    return F.cross_entropy(lg.flatten(0, -2).float(), lab.flatten(), reduction="sum", ignore_index=IGN)


def closed(head, norm, h, lab):
    lg = head(norm(h))
    return CE.apply(lg.flatten(0, -2), lab.flatten())


def fp8grad(head, norm, h, lab):
    lg = head(norm(h))
    return CE8.apply(lg.flatten(0, -2), lab.flatten(), (torch.float8_e5m2, head.proj.linear_mm_config))


def main():
    opts = {"triton.autotune_pointwise": False}
    h0 = torch.randn(1, N, D, device=DEV, dtype=torch.bfloat16)
    lab = torch.randint(0, V, (1, N), device=DEV)
    lab[0, :100] = IGN
    results = {}
    for fp8 in (True, False):
        for name, fn in (("inductor", ref), ("closed", closed), ("fp8grad", fp8grad))[: 3 if fp8 else 2]:
            head, norm = make(fp8)
            f = torch.compile(fn, fullgraph=True, options=opts)
            h = h0.clone().requires_grad_(True)
            def step():
                head.proj.weight.grad = None
                h.grad = None
                loss = f(head, norm, h, lab)
                (loss / N).backward()
                return loss
            for _ in range(3):
                step()
            SYNC()
            (DEV == 'cuda' and torch.cuda.reset_peak_memory_stats())
            ts = []
            for _ in range(10):
                SYNC(); t = time.perf_counter(); step(); SYNC()
                ts.append(time.perf_counter() - t)
            peak = torch.cuda.max_memory_allocated() / 2**30 if DEV == 'cuda' else 0.0
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA if DEV == 'cuda' else torch.profiler.ProfilerActivity.CPU]) as prof:
                for _ in range(3):
                    step()
                SYNC()
            tag = f"{'fp8' if fp8 else 'bf16'} {name}"
            print(f"== {tag}: {1e3 * statistics.median(ts):.3f} ms fwd+bwd (median of 10), peak {peak:.2f} GiB")
            rows = [((e.device_time_total if DEV == 'cuda' else e.cpu_time_total) / 3e3, e.count // 3, e.key) for e in prof.key_averages() if (e.device_time_total if DEV == 'cuda' else e.cpu_time_total) > 0]
            for ms, n, k in sorted(rows, reverse=True)[:14]:
                print(f"   {ms:8.3f} ms {n:3d}x  {k[:150]}")
            loss = step()
            results[tag] = (loss.detach().float(), h.grad.float().clone(), head.proj.weight.grad.float().clone())
            del head, norm, f
            torch.cuda.empty_cache()
    for p in ("fp8", "bf16"):
      for v in ("closed", "fp8grad")[: 2 if p == "fp8" else 1]:
        a, b = results[f"{p} inductor"], results[f"{p} {v}"]
        print(p, v, "loss", a[0].item(), b[0].item(), "max|dh|", (a[1] - b[1]).abs().max().item(), a[1].abs().max().item(),
              "max|dW|", (a[2] - b[2]).abs().max().item(), a[2].abs().max().item())


main()
