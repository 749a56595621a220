"""Low-precision AdamW state (trainer/optim/states.py, trainer/optim/adamw.py): the fp8 first moment's block
quantization, AdamW with moments of their own against an fp64 AdamW within the rounding of each state's dtype, the skip of a
non-finite step, checkpoint round trips and conversions, and the config's one-line errors.

Tolerances come from the dtypes: a stochastically rounded value lies within one ulp of the exact one (its two
neighbours), a value rounded to nearest within half an ulp; an ulp of bf16 is 2^-7 of the value's power of two, of
e4m3 2^-3 (normal range) or 2^-9 (subnormals) of the scaled value. `SLACK` covers fp32 arithmetic against fp64.
"""

from __future__ import annotations

import copy
import logging
import math

import pytest
import torch

from tests.helpers import DEBUG_CONFIG
from trainer.config import load_job_config
from trainer.errors import UserError
from trainer.optim.adamw import AdamW
from trainer.optim.states import (
    SCALE_KEY, StateDtypes, block_scales, dequantize_blocks, quantize_blocks, stochastic_round_to_e4m3,
)
from trainer.optim.update import random_bits16

BETAS = (0.9, 0.95)
SLACK = 2e-6  # relative: fp32 arithmetic (a few ulps of 2^-24) against fp64


def _e4m3_ulp(y: torch.Tensor) -> torch.Tensor:
    """e4m3's spacing at |y| (float64): 2^(e-3) in its normal range, 2^-9 among its subnormals."""
    e = torch.floor(torch.log2(y.abs().clamp(min=2.0**-6)))
    return torch.exp2(e - 3)


def _bf16_ulp(y: torch.Tensor) -> torch.Tensor:
    return torch.exp2(torch.floor(torch.log2(y.abs().clamp(min=1e-30))) - 7)


def _reference_scales(x: torch.Tensor) -> torch.Tensor:
    """2^ceil(log2(amax / 448)) per 1 x 128 block, in float64 (independent of block_scales' bit arithmetic)."""
    amax = x.double().reshape(*x.shape[:-1], -1, 128).abs().amax(-1)
    return torch.exp2(torch.ceil(torch.log2(amax / 448))).clamp(min=2.0**-126)


def test_block_scales_are_powers_of_two_that_fit_e4m3() -> None:
    torch.manual_seed(0)
    x = torch.randn(6, 512) * torch.logspace(-30, 30, 6).unsqueeze(1)
    x[0, :128] = 0
    amax = x.reshape(6, 4, 128).abs().amax(-1)
    s = block_scales(amax)
    assert torch.equal(torch.exp2(torch.log2(s).round()), s)  # powers of two
    assert torch.equal(s[1:].double(), _reference_scales(x)[1:])
    ratio = amax[1:] / s[1:]
    assert (ratio <= 448).all() and (ratio > 224).all()
    assert s[0, 0] == 2.0**-126  # an all-zero block


def test_quantization_round_trips_exactly() -> None:
    """Dequantizing is exact and quantizing a dequantized block again gives the same values, nearest or
    stochastic: a block that did not change stays bit-identical in value."""
    torch.manual_seed(1)
    x = torch.randn(5, 384) * torch.logspace(-20, 20, 5).unsqueeze(1)
    x[2, 5] = 0
    q, s = quantize_blocks(x)
    d = dequantize_blocks(q, s)
    assert torch.equal(d.double(), q.double() * s.double().repeat_interleave(128, dim=-1))
    bits = random_bits16(torch.arange(x.numel()).view(x.shape), torch.tensor(7), 1)
    for again in (quantize_blocks(d), quantize_blocks(d, bits)):
        assert torch.equal(dequantize_blocks(*again), d)
    # Round to nearest: within half an e4m3 ulp of the scaled value.
    ref = x.double() / _reference_scales(x).repeat_interleave(128, dim=-1)
    got = q.double()
    assert ((got - ref).abs() <= _e4m3_ulp(ref) / 2).all()
    # Columns offset into whole rows of scales (a checkpoint's scales loaded whole on a rank holding columns 128:).
    assert torch.equal(dequantize_blocks(q[:, 128:], s, col_offset=128), d[:, 128:])


def test_stochastic_e4m3_picks_a_neighbour_and_is_unbiased() -> None:
    values = torch.tensor([0.3, -1.1, 200.7, 447.0, 2.0**-8 * 1.3, -(2.0**-7) * 0.37, 13.0])
    n = 1 << 14
    y = values.repeat(n, 1)
    bits = random_bits16(torch.arange(y.numel()).view(y.shape), torch.tensor(99), 1)
    r = stochastic_round_to_e4m3(y, bits)
    assert torch.equal(r.to(torch.float8_e4m3fn).float(), r)  # representable
    ulp = _e4m3_ulp(values.double())
    assert ((r.double() - values.double()).abs() < ulp).all()  # one of the two neighbours
    assert (r[:, -1] == 13.0).all()  # a representable value never moves
    # Unbiased: the mean of n draws within 4 standard deviations (at most ulp/2 each) of the value.
    assert ((r.double().mean(0) - values.double()).abs() <= 4 * ulp / 2 / math.sqrt(n)).all()


def test_nearest_would_stall_the_first_moment() -> None:
    """Why the fp8 first moment rounds stochastically: with a constant gradient, exp_avg rounded to nearest in
    e4m3 stops at ~0.7 of it (the 10% step is below half an ulp); stochastic rounding reaches it on average."""
    g = torch.linspace(0.5, 2.0, 128).view(1, 128)
    ratios = {}
    for mode in ("nearest", "stochastic"):
        q, s = quantize_blocks(torch.zeros(1, 128))
        for step in range(1, 101):
            bits = random_bits16(torch.arange(128).view(1, 128), torch.tensor(step * 7919), 1)
            q, s = quantize_blocks(dequantize_blocks(q, s).lerp(g, 0.1), bits if mode == "stochastic" else None)
        ratios[mode] = (dequantize_blocks(q, s) / g).mean().item()
    assert ratios["nearest"] < 0.8 and abs(ratios["stochastic"] - 1) < 0.02, ratios


COMBOS = [("fp32", "bf16", "bf16"), ("fp32", "fp8", "fp32"), ("bf16", "fp32", "fp32"), ("bf16", "fp8", "bf16")]
SHAPES = [(6, 256), (9,), (2, 3, 128), (4, 100)]  # fp8 blocks; 1-D, last dim not a multiple of 128: bf16


def _optimizer(params, dtypes: StateDtypes, implementation: str = "eager", **kw) -> AdamW:
    return AdamW(params, lr=1e-2, betas=BETAS, eps=1e-8, weight_decay=0.1, dtypes=dtypes, rounding="stochastic", seed=3,
                 implementation=implementation, **kw)


def _params(master: str, seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    dtype = torch.float32 if master == "fp32" else torch.bfloat16
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in SHAPES]


def _exp_avg(opt: AdamW, p: torch.Tensor) -> torch.Tensor:
    state = opt.state[p]
    if SCALE_KEY in state:
        return dequantize_blocks(state["exp_avg"], state[SCALE_KEY]).double()
    return state["exp_avg"].double()


@pytest.mark.parametrize("master, exp_avg, exp_avg_sq", COMBOS)
def test_update_matches_fp64_adamw_within_the_state_rounding(master: str, exp_avg: str, exp_avg_sq: str) -> None:
    dtypes = StateDtypes(master, exp_avg, exp_avg_sq)
    params = _params(master)
    opt = _optimizer(params, dtypes)
    gen = torch.Generator().manual_seed(1)
    for p in params:  # step 1 makes the state; step 2 is compared
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
    opt.step()
    before = [(p.detach().double(), _exp_avg(opt, p), opt.state[p]["exp_avg_sq"].double()) for p in params]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
    opt.grad_scale, opt.found_inf = torch.tensor(2.0), torch.tensor(0.0)
    opt.step()
    lr, wd, (b1, b2) = 1e-2, 0.1, BETAS
    for p, (p0, m0, v0) in zip(params, before):
        g = p.grad.double() / 2
        m = b1 * m0 + (1 - b1) * g
        v = b2 * v0 + (1 - b2) * g * g
        p_ref = p0 - lr * wd * p0 - lr * (m / (1 - b1**2)) / ((v / (1 - b2**2)).sqrt() + 1e-8)
        got_m, got_v, got_p = _exp_avg(opt, p), opt.state[p]["exp_avg_sq"].double(), p.detach().double()
        if SCALE_KEY in opt.state[p]:
            scale = _reference_scales(m).repeat_interleave(128, dim=-1)
            m_tol = _e4m3_ulp(m / scale) * scale
        else:
            m_tol = _bf16_ulp(m) if opt.state[p]["exp_avg"].dtype == torch.bfloat16 else 0 * m
        v_tol = _bf16_ulp(v) if exp_avg_sq == "bf16" else 0 * v
        p_tol = _bf16_ulp(p_ref) if master == "bf16" else 4 * 2.0**-24 * p_ref.abs()
        assert ((got_m - m).abs() <= m_tol + SLACK * m.abs().amax()).all(), (p.shape, (got_m - m).abs().max())
        assert ((got_v - v).abs() <= v_tol + SLACK * v.abs()).all(), p.shape
        step_size = (lr * (1 + wd)) * (p0.abs() + 1)
        assert ((got_p - p_ref).abs() <= p_tol + SLACK * step_size).all(), (p.shape, (got_p - p_ref).abs().max())


@pytest.mark.parametrize("master, exp_avg, exp_avg_sq", COMBOS)
def test_a_non_finite_step_changes_nothing(master: str, exp_avg: str, exp_avg_sq: str) -> None:
    params = _params(master)
    opt = _optimizer(params, StateDtypes(master, exp_avg, exp_avg_sq))
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    before = [[p.detach().clone()] + [t.clone() for k, t in opt.state[p].items() if k != "step"] for p in params]
    opt.found_inf = torch.tensor(1.0)
    opt.step()
    for p, old in zip(params, before):
        now = [p.detach()] + [t for k, t in opt.state[p].items() if k != "step"]
        assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(old, now, strict=True))


def _train(opt: AdamW, params, steps: range) -> None:
    for step in steps:
        gen = torch.Generator().manual_seed(100 + step)
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
        opt.step()


@pytest.mark.parametrize("master, exp_avg, exp_avg_sq", COMBOS)
def test_state_dict_round_trip_resumes_bit_exact(master: str, exp_avg: str, exp_avg_sq: str) -> None:
    dtypes = StateDtypes(master, exp_avg, exp_avg_sq)
    a = _params(master)
    opt_a = _optimizer(a, dtypes)
    _train(opt_a, a, range(2))
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    opt_b = _optimizer(b, dtypes)
    opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))  # a checkpoint's own tensors
    for p, q in zip(a, b):
        assert {k: v.dtype for k, v in opt_a.state[p].items()} == {k: v.dtype for k, v in opt_b.state[q].items()}
    _train(opt_a, a, range(2, 4))
    _train(opt_b, b, range(2, 4))
    assert all(torch.equal(p, q) for p, q in zip(a, b))


def test_a_checkpoint_of_other_dtypes_is_converted_in_one_line(caplog) -> None:
    """fp8 -> bf16 is exact (an e4m3 value times a power of two is a bf16 value); fp32 -> fp8 rounds to nearest;
    fp32 -> bf16 exp_avg_sq rounds to nearest."""
    fp8 = _params("fp32")
    opt8 = _optimizer(fp8, StateDtypes("fp32", "fp8", "fp32"))
    _train(opt8, fp8, range(2))
    plain = [torch.nn.Parameter(p.detach().clone()) for p in fp8]
    opt = _optimizer(plain, StateDtypes("fp32", "bf16", "bf16"))
    with caplog.at_level(logging.INFO, logger="trainer.optim"):
        opt.load_state_dict(opt8.state_dict())
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "exp_avg fp8 -> bf16 (2 tensors)" in lines[0], lines
    assert "exp_avg_sq fp32 -> bf16 (4 tensors)" in lines[0]
    for p, q in zip(fp8, plain):
        assert SCALE_KEY not in opt.state[q] and opt.state[q]["exp_avg"].dtype == torch.bfloat16
        assert torch.equal(opt.state[q]["exp_avg"].double(), _exp_avg(opt8, p))
    back = [torch.nn.Parameter(p.detach().clone()) for p in fp8]
    opt_back = _optimizer(back, StateDtypes("fp32", "fp8", "fp32"))
    opt_back.load_state_dict(opt.state_dict())
    for p, q in zip(plain, back):
        assert (SCALE_KEY in opt_back.state[q]) == (q.dim() >= 2 and q.shape[-1] % 128 == 0)
        assert torch.equal(_exp_avg(opt_back, q), opt.state[p]["exp_avg"].double())  # exact: values were e4m3
    _train(opt_back, back, range(2, 3))  # and it trains on


def _cfg(*args: str):
    return load_job_config(["--config", DEBUG_CONFIG, *args])


@pytest.mark.parametrize("args, message", [
    (["--optimizer.exp_avg_dtype=fp16"], "optimizer.exp_avg_dtype"),
    (["--optimizer.exp_avg_sq_dtype=fp8"], "optimizer.exp_avg_sq_dtype"),
])
def test_bad_dtype_is_one_line_naming_the_key(args: list[str], message: str) -> None:
    with pytest.raises(UserError) as e:
        _cfg(*args)
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("args, message", [
    (["--optimizer.exp_avg_dtype=fp8", "--optimizer.implementation=foreach"],
     "optimizer.exp_avg_dtype='fp8' with bf16 master weights needs our AdamW"),
    (["--distributed.master_dtype=fp32", "--optimizer.exp_avg_sq_dtype=bf16", "--optimizer.implementation=torch_fused"],
     "optimizer.exp_avg_sq_dtype='bf16' with fp32 master weights needs our AdamW"),
    (["--optimizer.exp_avg_dtype=fp32", "--optimizer.bf16_update=nearest"],
     "optimizer.exp_avg_dtype='fp32' rounds bf16 master weights stochastically"),
])
def test_what_cannot_run_is_refused_in_the_validation_pass(args: list[str], message: str) -> None:
    from trainer.validate import validate_job

    with pytest.raises(UserError) as e:
        validate_job(_cfg("--train.mixed_precision=bf16", *args), world_size=1)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_auto_keeps_the_master_dtype() -> None:
    from trainer.validate import validate_job

    assert validate_job(_cfg("--train.mixed_precision=bf16"), world_size=1).optimizer.state_dtypes.in_master_dtype
    job = validate_job(_cfg("--train.mixed_precision=bf16", "--optimizer.exp_avg_dtype=fp8"), world_size=1)
    assert job.optimizer.state_dtypes == StateDtypes("bf16", "fp8", "bf16")


@pytest.mark.parametrize("args, moments", [
    ([], 2 + 2), (["--optimizer.exp_avg_dtype=fp8"], 1 + 4 / 128 + 2),
    (["--distributed.master_dtype=fp32", "--optimizer.exp_avg_dtype=fp8", "--optimizer.exp_avg_sq_dtype=bf16"],
     1 + 4 / 128 + 2),
    (["--optimizer.exp_avg_dtype=fp32", "--optimizer.exp_avg_sq_dtype=fp32"], 4 + 4),
])
def test_the_memory_plan_and_the_fit_check_count_the_state_dtypes(args: list[str], moments: float) -> None:
    """The dry run's optimizer-state row and the validation pass's fit estimate use the moments' dtypes."""
    from tests.unit.test_memory_plan import plan_of, row
    from trainer.validate.memory import estimate_train_state

    cfg = ["--config", "configs/train/llama3_8b.toml", "--model.n_layers=2", *args]
    job, plan = plan_of(cfg)
    master = job.build.fsdp.master_dtype.itemsize
    local = row(plan, "weights (sharded)") / master
    assert abs(row(plan, "optimizer state") / (local * moments) - 1) < 1e-6
    opt = load_job_config(cfg).optimizer
    est = estimate_train_state(job.model_args, job.parallel_dims, bf16_master=master == 2, kahan=False,
                               exp_avg=opt.exp_avg_dtype, exp_avg_sq=opt.exp_avg_sq_dtype)
    assert est.bytes_per_param == 2 * master + moments  # weights and gradients in the master dtype, the moments


def test_the_startup_line_says_dtypes_bytes_and_update_for_every_optimizer() -> None:
    from trainer.optim.build import describe_optimizer_state

    kw = dict(lr=1e-3, betas=BETAS, eps=1e-8, weight_decay=0.1)
    lines = {
        "bf16": describe_optimizer_state(AdamW(_params("bf16"), rounding="kahan", implementation="eager", **kw)),
        "fp32": describe_optimizer_state(AdamW(_params("fp32"), implementation="fused", **kw)),
        "nearest": describe_optimizer_state(AdamW(_params("bf16"), implementation="fused", **kw)),
        "fp8": describe_optimizer_state(_optimizer(_params("fp32"), StateDtypes("fp32", "fp8", "bf16"))),
    }
    assert lines["bf16"] == ("master bf16 (Kahan); exp_avg bf16 (stochastic rounding); exp_avg_sq bf16 (stochastic "
                             "rounding); master 2 + exp_avg 2 + exp_avg_sq 2 + kahan 2 = 8 B/param; update: eager torch "
                             "per tensor")
    assert lines["fp32"].endswith("master 4 + exp_avg 4 + exp_avg_sq 4 = 12 B/param; update: torch's fused kernel "
                                  "over the local shards")
    assert "exp_avg bf16 (round to nearest)" in lines["nearest"]
    # SHAPES: 1536 + 768 fp8 elements (1 + 4/128 bytes each), 9 + 400 bf16 ones (2 bytes)
    fp8 = (2304 * (1 + 4 / 128) + 409 * 2) / 2713
    assert "in 2/4 tensors, bf16 in 2 (1-D" in lines["fp8"]
    assert f"master 4 + exp_avg {fp8:.3g} + exp_avg_sq 2" in lines["fp8"]
    assert lines["fp8"].endswith("update: eager torch per tensor")


def _index(entries: dict[str, tuple[tuple[int, ...], torch.dtype]]):
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata, Metadata, TensorProperties, TensorStorageMetadata,
    )

    return Metadata(state_dict_metadata={
        key: TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(shape),
                                   [ChunkStorageMetadata(torch.Size([0] * len(shape)), torch.Size(shape))])
        for key, (shape, dtype) in entries.items()})


@pytest.mark.parametrize("entry, message", [
    (("optimizer.state.w.exp_avg_scale", (4, 3), torch.float32), "has shape [4, 3] in the checkpoint but [4, 2]"),
    (("optimizer.state.w.exp_avg_sq", (4, 256), torch.float8_e4m3fn), "is stored as torch.float8_e4m3fn"),
    (("optimizer.state.n.exp_avg_scale", (4, 1), torch.float32), "which has no whole 1x128 blocks"),
])
def test_the_index_check_knows_the_fp8_first_moment(tmp_path, entry, message) -> None:
    """A checkpoint's fp8 exp_avg (e4m3) and its block scales (the tensor's shape over 128) pass the index check;
    scales of another shape, an fp8 entry of another name, scales of a 1-D tensor are one-line errors."""
    from trainer.checkpoint.format import CheckpointError
    from trainer.checkpoint.values import check_index_entries

    shapes = {"w": (4, 256), "n": (4,)}
    good = {"model.w": ((4, 256), torch.float32), "model.n": ((4,), torch.float32),
            "optimizer.state.w.exp_avg": ((4, 256), torch.float8_e4m3fn),
            "optimizer.state.w.exp_avg_scale": ((4, 2), torch.float32),
            "optimizer.state.n.exp_avg": ((4,), torch.bfloat16), "optimizer.state.w.step": ((), torch.float32)}
    check_index_entries(_index(good), shapes, path=tmp_path)
    key, shape, dtype = entry
    with pytest.raises(CheckpointError) as e:
        check_index_entries(_index({**good, key: (shape, dtype)}), shapes, path=tmp_path)
    assert message in str(e.value) and key in str(e.value) and "\n" not in str(e.value)


def test_the_fp8_first_moment_is_saved_in_the_checkpoint_formats_terms() -> None:
    """checkpoint/ imports no optimizer module: its index check knows per-parameter state by the format's names
    (trainer/checkpoint/format.py), which the fp8 first moment's entries must follow."""
    from trainer.checkpoint.format import E4M3 as FORMAT_E4M3
    from trainer.checkpoint.format import SCALE_SUFFIX, STATE_BLOCK, STEP_KEY
    from trainer.optim.states import E4M3, QBLOCK

    assert SCALE_KEY == "exp_avg" + SCALE_SUFFIX and QBLOCK == STATE_BLOCK and E4M3 == FORMAT_E4M3
    assert STEP_KEY == "step"  # the step of torch's optimizer state dicts, which ours keeps
