"""The update of moments of their own as the Triton kernel (trainer/optim/kernel.py, run by Triton's CPU interpreter)
against its eager update: the same random bits, the same fp8 blocks and scales, every state within one ulp of its
dtype. tests/gpu/test_optim_states_gpu.py runs the same comparisons on a GPU."""

from __future__ import annotations


import pytest
import torch

pytest.importorskip("triton", reason="Triton has no wheel for this platform (the `test` extra installs it on Linux)")

from tests.unit.test_optim_kernel import interpreted_kernel  # noqa: E402, F401  (autouse: Triton's interpreter)
from tests.unit.test_optim_kernel import step_through  # noqa: E402
from trainer.distributed import Layout  # noqa: E402
from trainer.optim.adamw import AdamW  # noqa: E402
from trainer.optim.states import SCALE_KEY, StateDtypes, dequantize_blocks  # noqa: E402

# fp8 blocks over several 1024-element programs with a masked tail, a 1-D tensor, a 3-D block of a larger tensor, a
# last dim that is no multiple of 128 (bf16 first moment), one plain block.
SHAPES = [(12, 256), (3,), (2, 3, 384), (9, 130), (5, 128)]
LAYOUTS = [Layout((12, 0), (48, 256)), Layout((0,), (3,)), Layout((1, 3, 0), (4, 6, 384)),
           Layout((0, 130), (9, 260)), Layout((0, 0), (5, 128))]
COMBOS = [("fp32", "fp8", "bf16"), ("bf16", "fp8", "bf16"), ("fp32", "bf16", "bf16"), ("bf16", "fp32", "fp32")]


def _values(opt: AdamW, p: torch.Tensor) -> list[tuple[torch.Tensor, torch.dtype]]:
    """(fp32 value, stored dtype) of the weights and each state tensor."""
    s = opt.state[p]
    m = dequantize_blocks(s["exp_avg"], s[SCALE_KEY]) if SCALE_KEY in s else s["exp_avg"].float()
    out = [(p.detach().float(), p.dtype), (m, s["exp_avg"].dtype), (s["exp_avg_sq"].float(), s["exp_avg_sq"].dtype)]
    return out + ([(s["kahan_comp"].float(), torch.bfloat16)] if "kahan_comp" in s else [])


def runs(combo, *, beta1: float = 0.9, update: str = "stochastic", device: str = "cpu", steps: int = 3):
    """The same training with the eager update and the kernel: per run, each tensor's [values], and its raw state."""
    gen = torch.Generator().manual_seed(7)
    dtype = torch.float32 if combo[0] == "fp32" else torch.bfloat16
    w0 = [(1 + torch.rand(s, generator=gen)).bfloat16().to(dtype).to(device) for s in SHAPES]
    # bf16 gradients (also for fp32 weights): with beta1 = 0.5 the new exp_avg is then exact in fp32 either way
    grads = [[torch.randn(s, generator=gen).bfloat16().to(dtype).to(device) for s in SHAPES] for _ in range(steps)]
    out = []
    for triton in (False, True):
        params = [torch.nn.Parameter(w.clone()) for w in w0]
        opt = AdamW(params, lr=1e-3, betas=(beta1, 0.95), eps=1e-8, weight_decay=0.1,
                    dtypes=StateDtypes(*combo), rounding=update, seed=3, implementation="triton" if triton else "eager",
                    names=[f"layers.{i}.w" for i in range(len(params))])
        opt._layouts.update(zip(params, LAYOUTS))
        step_through(opt, params, grads, device=device)
        out.append(([_values(opt, p) for p in params], [dict(opt.state[p]) for p in params]))
    return out


def check_same_bits(eager, kernel) -> None:
    """beta1 = 0.5: the new exp_avg is exact in fp32 in both, so its block scale and its rounding (stochastic, the
    element's random bits) must agree bit for bit."""
    for e, k in zip(eager[1], kernel[1]):
        assert e["exp_avg"].dtype == k["exp_avg"].dtype
        assert torch.equal(e["exp_avg"].view(torch.uint8) if e["exp_avg"].dtype == torch.float8_e4m3fn
                           else e["exp_avg"], k["exp_avg"].view(torch.uint8) if k["exp_avg"].dtype ==
                           torch.float8_e4m3fn else k["exp_avg"])
        if SCALE_KEY in e:
            assert torch.equal(e[SCALE_KEY], k[SCALE_KEY])


def check_within_an_ulp(eager, kernel) -> None:
    """beta1 = 0.9: fp32 values may differ in their last bits (operation order, FMA), which moves a rounding by one
    ulp of the stored dtype where the random threshold falls between them (e4m3: 2^-3 of the value's power of two;
    2^-2 where the block's amax sits on a scale boundary), rarely; near zero a few fp32 ulps."""
    differing = total = 0
    for e, k in zip(eager[0], kernel[0]):
        for (a, dtype), (b, _) in zip(e, k, strict=True):
            ulp = torch.exp2(torch.floor(torch.log2(torch.maximum(a.abs(), b.abs()).clamp_min(1e-30)))) * 2.0**-2
            assert bool(((a - b).abs() <= ulp + 1e-6).all())
            if dtype == torch.float32:  # stored as computed: the fp32 values' own last bits, a few ulps
                assert bool(((a - b).abs() <= 1e-5 * a.abs() + 1e-7).all())
                continue
            differing += int((a != b).sum())
            total += a.numel()
    assert differing <= total * 1e-2, (differing, total)


@pytest.mark.parametrize("combo", COMBOS)
def test_the_kernel_draws_the_eager_random_bits_and_blocks(combo) -> None:
    check_same_bits(*runs(combo, beta1=0.5))


@pytest.mark.parametrize("combo, update", [(c, "stochastic") for c in COMBOS] + [(("bf16", "fp8", "bf16"), "kahan")])
def test_the_kernel_equals_the_eager_update_to_an_ulp(combo, update) -> None:
    check_within_an_ulp(*runs(combo, update=update))


def test_the_kernel_keeps_every_state_dtype_and_skips_a_non_finite_step() -> None:
    eager, kernel = runs(("fp32", "fp8", "bf16"), steps=2)  # the second step is skipped
    one_step_eager, one_step_kernel = runs(("fp32", "fp8", "bf16"), steps=1)
    for after, before in ((kernel, one_step_kernel), (eager, one_step_eager)):
        for a, b in zip(after[1], before[1]):
            assert {k: v.dtype for k, v in a.items()} == {k: v.dtype for k, v in b.items()}
            assert all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a if k != "step")
