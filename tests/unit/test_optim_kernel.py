"""trainer/optim/kernel.py, the Triton AdamW kernel (AdamW's implementation="triton"), run by Triton's CPU interpreter.

The interpreter runs the kernel's own code (its table of addresses, block map, index arithmetic, hashing and
rounding) in numpy; the GPU run of the same comparisons is tests/gpu/test_optim_kernel_gpu.py. References: torch's
fused AdamW (fp32) and the eager update (bf16 master weights).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="Triton has no wheel for this platform (the `test` extra installs it on Linux)")

from tests.helpers import under_triton_interpreter  # noqa: E402
from trainer.optim.adamw import AdamW  # noqa: E402

BETAS = (0.9, 0.95)
ULP_BF16 = 2.0**-7  # bf16 spacing relative to the value's power of two


@pytest.fixture(autouse=True, scope="module")
def interpreted_kernel():
    """trainer.optim.kernel with its kernels built for Triton's interpreter (decided when @triton.jit runs), then
    as it was."""
    import trainer.optim.kernel as kernel

    with under_triton_interpreter(kernel) as interpreted:
        yield interpreted


# Shapes over several of the kernel's 4096-element blocks (a tail included), 1-d and 3-d tensors.
SHAPES = [(70, 130), (3,), (2, 9, 300), (70, 130)]


def fp32_pair(device: str = "cpu", steps: int = 5):
    """The same fp32 training with the Triton kernel and torch's fused kernel (AdamW's "triton" and "fused"): both
    optimizers and
    parameter lists. (tests/gpu/test_optim_kernel_gpu.py runs it on a GPU.)"""
    torch.manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(s, device=device)) for s in SHAPES]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    kw = dict(lr=1e-2, betas=BETAS, eps=1e-8, weight_decay=0.1)
    a, b = AdamW(ours, implementation="triton", **kw), AdamW(ref, implementation="fused", **kw)
    for i in range(steps):
        for p, q in zip(ours, ref):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        for opt in (a, b):
            opt.grad_scale = torch.tensor(2.0, device=device)  # gradients divided by loss scale x clip
            opt.found_inf = torch.tensor(1.0 if i == 2 else 0.0, device=device)  # step 3 skipped
            opt.param_groups[0]["lr"] = 1e-2 * (i + 1)
        a.step()
        b.step()
    return a, b, ours, ref


def check_fp32_pair(a, b, ours, ref) -> None:
    """Tolerance: each step's update is computed to a few fp32 ulps of itself (lr <= 5e-2 times a ratio near 1)
    and rounds into weights of magnitude up to ~4 (ulp 4.8e-7); 4 counted steps."""
    for p, q in zip(ours, ref):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(a.state[p][key], b.state[q][key], rtol=1e-5, atol=1e-7)
    assert a.state[ours[0]]["step"].item() == b.state[ref[0]]["step"].item() == 4  # the skip is not counted
    assert a.state_dict()["state"][0].keys() == b.state_dict()["state"][0].keys()


def test_fp32_kernel_equals_torchs_fused_adamw_to_fp32_rounding() -> None:
    """The Triton kernel against torch's fused kernel: the same AdamW, skip and loss-scale protocol, and state (so
    checkpoints of either load into the other)."""
    check_fp32_pair(*fp32_pair())


def test_a_skipped_step_changes_nothing() -> None:
    torch.manual_seed(1)
    p = torch.nn.Parameter(torch.randn(5000))
    opt = AdamW([p], lr=1e-2, betas=BETAS, eps=1e-8, weight_decay=0.1, implementation="triton")
    p.grad = torch.randn_like(p)
    opt.step()
    before = [p.detach().clone(), *(t.clone() for t in opt.state[p].values())]
    p.grad = torch.randn_like(p)
    opt.found_inf = torch.tensor(1.0)
    opt.step()
    for old, new in zip(before, [p.detach(), *opt.state[p].values()]):
        assert torch.equal(old, new)


def step_through(opt: torch.optim.Optimizer, params: list[torch.Tensor], grads: list[list[torch.Tensor]], *,
                 device: str) -> None:
    """One optimizer step per list of gradients, with the trainer's loss scale of 2 and the second step skipped
    (found_inf): the steps the kernel tests compare the eager update and the kernel over."""
    for i, step_grads in enumerate(grads):
        for p, g in zip(params, step_grads):
            p.grad = g
        opt.grad_scale = torch.tensor(2.0, device=device)
        opt.found_inf = torch.tensor(1.0 if i == 1 else 0.0, device=device)
        opt.step()


def bf16_runs(kind: str, layouts_from_shards: bool, *, beta1: float = 0.9, steps: int = 3, device: str = "cpu"):
    """The same bf16 training with the eager update and with the kernel: each run's weights and state tensors.
    layouts_from_shards: the tensors are blocks of larger global tensors (offsets along one or two dims), as FSDP
    and TP shard them."""
    gen = torch.Generator().manual_seed(7)
    w0 = [(1 + torch.rand(s, generator=gen)).bfloat16().to(device) for s in SHAPES]
    grads = [[torch.randn(s, generator=gen).bfloat16().to(device) for s in SHAPES] for _ in range(steps)]
    out = []
    for triton in (False, True):
        params = [torch.nn.Parameter(w.clone()) for w in w0]
        opt = AdamW(params, lr=1e-3, betas=(beta1, BETAS[1]), eps=1e-8, weight_decay=0.1, rounding=kind, seed=3,
                    implementation="triton" if triton else "eager", names=[f"layers.{i}.w" for i in range(len(params))])
        if layouts_from_shards:
            from trainer.distributed import Layout

            # The first: rows 70-139 of 280 (one contiguous run of the global tensor); the third: a block of
            # a (4, 18, 300) tensor at (2, 9, 0) (not contiguous in it); the last: columns 130-259 of 260.
            global_layouts = [Layout((70, 0), (280, 130)), Layout((0,), (3,)), Layout((2, 9, 0), (4, 18, 300)),
                              Layout((0, 130), (70, 260))]
            opt._layouts.update(zip(params, global_layouts))
        step_through(opt, params, grads, device=device)
        out.append([[p.detach(), *(v for k, v in opt.state[p].items() if k != "step")] for p in params])
    return out


@pytest.mark.parametrize("kind", ["stochastic", "kahan"])
@pytest.mark.parametrize("sharded", [False, True])
def test_bf16_kernel_draws_the_eager_random_bits(kind: str, sharded: bool) -> None:
    """beta1 = 0.5: the new exp_avg (m + g) / 2 of bf16 m and g is exact in fp32 whatever the order of operations,
    and rarely a bf16 value, so its stochastic rounding shows each element's random bits: they must be the eager
    update's bit for bit (the key, the element's index in the global tensor, the hash), sharded or not."""
    check_random_bits(*bf16_runs(kind, sharded, beta1=0.5))


def check_random_bits(eager, kernel) -> None:
    for e, k in zip(eager, kernel):
        assert torch.equal(e[1], k[1])


@pytest.mark.parametrize("kind", ["stochastic", "kahan"])
def test_bf16_kernel_equals_the_eager_update_to_a_bf16_ulp(kind: str) -> None:
    """beta1 = 0.9: the fp32 values may differ in their last bits between the two (operation order, FMA), which
    moves a rounding by one bf16 ulp where the random threshold falls between them: rare, and never more. Near
    zero (a moment that cancels) the fp32 difference itself shows: a few fp32 ulps of the operands (|g| < 4
    here, 2^-24 * 4 each), 1e-6 at most."""
    check_within_an_ulp(*bf16_runs(kind, True), kahan=kind == "kahan")


def check_within_an_ulp(eager, kernel, *, kahan: bool) -> None:
    differing, total = 0, 0
    for e, k in zip(eager, kernel):
        for a, b in zip(e, k):
            a, b = a.float(), b.float()
            ulp = torch.exp2(torch.floor(torch.log2(torch.maximum(a.abs(), b.abs()).clamp_min(1e-30)))) * ULP_BF16
            assert bool(((a - b).abs() <= ulp + 1e-6).all())
            differing += int((a != b).sum())
            total += a.numel()
    assert differing <= total * 1e-3, (differing, total)
    if kahan:
        assert kernel[0][-1].float().abs().max() > 0  # the compensation is alive


def test_the_kernel_updates_an_fp8_all_gather_weight_with_a_precomputed_scale() -> None:
    """fp8 + FSDP2: the weights are torchao's fp8 all-gather wrappers, and after the first step they hold a
    precomputed scale. The update must reach the wrapped storage and equal the update of a plain tensor."""
    from torchao.float8.config import Float8LinearConfig
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    gen = torch.Generator().manual_seed(3)
    w0 = (1 + torch.rand(16, 32, generator=gen)).bfloat16()
    grads = [torch.randn(16, 32, generator=gen).bfloat16() for _ in range(3)]
    mm_config = Float8Linear.from_float(torch.nn.Linear(32, 16), config=Float8LinearConfig()).linear_mm_config
    out = []
    for wrapped in (False, True):
        data = w0.clone()
        p = torch.nn.Parameter(WeightWithDynamicFloat8CastTensor(data, mm_config, torch.float8_e4m3fn)
                               if wrapped else data)
        opt = AdamW([p], lr=1e-3, betas=BETAS, eps=1e-8, weight_decay=0.1, rounding="stochastic", seed=0,
                    implementation="triton")
        for g in grads:
            p.grad = g
            opt.step()
            if wrapped:
                p._precomputed_scale = torch.tensor(7.0)  # as precompute_float8_dynamic_scale_for_fsdp leaves it
        out.append(data)
    assert not torch.equal(out[1], w0)
    assert torch.equal(out[0], out[1])


def test_one_launch_per_dtype_whatever_the_shapes(interpreted_kernel, monkeypatch) -> None:
    """The compile cost must not grow with the model: every tensor of a dtype goes through one launch of one
    kernel variant, whatever the number of tensors and shapes."""
    launches = []
    real = interpreted_kernel.adamw_step
    monkeypatch.setattr(interpreted_kernel, "adamw_step", lambda params, *a, **k: (launches.append(len(params)),
                                                                                   real(params, *a, **k)))
    torch.manual_seed(2)
    params = [torch.nn.Parameter(torch.randn(n, 8)) for n in range(1, 40)]
    opt = AdamW(params, lr=1e-2, betas=BETAS, eps=1e-8, weight_decay=0.1, implementation="triton")
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    assert launches == [len(params)]
