"""bf16 master weights: AdamW's stochastic and Kahan rounding keep the updates that plain bf16 AdamW rounds away.

Unit properties against torch AdamW on fp32 weights and the config checks. The (slow) whole
runs: tests/cli/test_bf16_master.py.
"""

from __future__ import annotations

import logging

import pytest
import torch

from tests.helpers import DEBUG_CONFIG
from trainer.config import load_job_config
from trainer.errors import UserError
from trainer.optim.adamw import AdamW
from trainer.optim.update import random_bits16, round_to_nearest_bf16, stochastic_round_to_bf16
from trainer.validate import validate_job

BETAS = (0.9, 0.95)
ULP_AT_1 = 2.0**-7  # bf16 spacing in [1, 2)


def _optimizer(kind: str, p: torch.nn.Parameter, *, lr: float, weight_decay: float = 0.0, seed: int = 0):
    if kind in ("fp32", "nearest"):
        return torch.optim.AdamW([p], lr=lr, betas=BETAS, eps=1e-8, weight_decay=weight_decay)
    return AdamW([p], lr=lr, betas=BETAS, eps=1e-8, weight_decay=weight_decay, rounding=kind, seed=seed,
                 implementation="eager")


def _train(kind: str, w0: torch.Tensor, grads, *, lr: float, weight_decay: float = 0.0) -> torch.Tensor:
    p = torch.nn.Parameter(w0.clone() if kind == "fp32" else w0.bfloat16())
    opt = _optimizer(kind, p, lr=lr, weight_decay=weight_decay)
    for g in grads:
        p.grad = g.to(p.dtype)
        opt.step()
    return p.detach().float()


def _grads(n: int, steps: int, seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    sign = torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0)
    return [sign * (1 + torch.rand(n, generator=gen)) for _ in range(steps)]


@pytest.mark.parametrize("kind", ["stochastic", "kahan"])
def test_updates_far_below_an_ulp_are_kept(kind: str) -> None:
    """lr=3e-4 on weights near 1 (half an ulp is 3.9e-3): plain bf16 AdamW never moves them; the
    safe roundings move them as far as fp32 AdamW does."""
    n, steps, lr = 2048, 300, 3e-4
    w0 = 1 + 0.5 * torch.rand(n, generator=torch.Generator().manual_seed(0))
    w0 = w0.bfloat16().float()  # start from the same (bf16-representable) weights in every run
    grads = _grads(n, steps)
    fp32 = _train("fp32", w0, grads, lr=lr, weight_decay=0.1) - w0
    assert fp32.abs().mean() > 20 * lr  # the fp32 run moves by ~steps * lr = 0.09
    assert torch.equal(_train("nearest", w0, grads, lr=lr, weight_decay=0.1), w0)  # every update lost
    moved = _train(kind, w0, grads, lr=lr, weight_decay=0.1) - w0
    # Per weight: mean displacement along the fp32 direction within 3% of fp32's.
    along = (moved * fp32.sign()).mean() / fp32.abs().mean()
    assert along == pytest.approx(1.0, abs=0.03)
    if kind == "kahan":
        # Compensated: every weight is within one bf16 ulp of the fp32 run, not just on average.
        assert (moved - fp32).abs().max() <= 2 * ULP_AT_1 / 2 + 1e-6
    else:
        # Stochastic: each weight is off by a random walk of sub-ulp roundings, unbiased on average.
        assert ((moved - fp32) * fp32.sign()).mean().abs() < 0.03 * fp32.abs().mean()


@pytest.mark.parametrize("kind", ["stochastic", "kahan"])
def test_large_updates_match_fp32_adamw(kind: str) -> None:
    """Where updates are many ulps, the rounded update is AdamW: within bf16 rounding of torch's fp32 AdamW
    (weight decay, bias correction and eps included)."""
    gen = torch.Generator().manual_seed(3)
    steps = 6
    w0 = torch.randn(64, 32, generator=gen).bfloat16().float()
    grads = [torch.randn(64, 32, generator=gen).bfloat16().float() for _ in range(steps)]
    ref = _train("fp32", w0, grads, lr=3e-2, weight_decay=0.1)
    got = _train(kind, w0, grads, lr=3e-2, weight_decay=0.1)
    ulp = 2.0 ** (torch.floor(torch.log2(ref.abs().clamp_min(1e-3))) - 7)  # bf16 spacing at each weight
    # Each stochastic rounding is off by less than an ulp (a random walk over the steps); Kahan stays
    # within about one ulp of the fp32 run. The bf16 moments add ~2^-9 relative noise to each update.
    bound = (steps if kind == "stochastic" else 1.5) * ulp + 1e-3
    assert bool(((got - ref).abs() <= bound).all()), ((got - ref).abs() / ulp).max()
    assert (got - ref).abs().mean() < 0.1 * (ref - w0).abs().mean()  # measured: 5% (stochastic)


@pytest.mark.parametrize("kind", ["stochastic", "kahan"])
def test_grad_scale_and_skipped_step(kind: str) -> None:
    """The trainer's fused protocol: grads are divided by grad_scale; found_inf skips the step on the
    device, leaving weights and every state buffer bit-identical."""
    gen = torch.Generator().manual_seed(4)
    w0 = torch.randn(16, 8, generator=gen).bfloat16()
    g = torch.randn(16, 8, generator=gen).bfloat16()

    def run(scale: float, skip_second: bool):
        p = torch.nn.Parameter(w0.clone())
        opt = _optimizer(kind, p, lr=1e-3, weight_decay=0.1)
        p.grad = g * scale
        opt.grad_scale, opt.found_inf = torch.tensor(scale), torch.tensor(0.0)
        opt.step()
        before = {k: v.clone() for k, v in opt.state[p].items() if k != "step"}, p.detach().clone()
        p.grad = torch.full_like(g, float("nan")) if skip_second else g * scale
        opt.found_inf = torch.tensor(1.0 if skip_second else 0.0)
        opt.step()
        return p.detach().clone(), opt.state[p], before

    p1, state1, _ = run(1.0, skip_second=False)
    p4, state4, _ = run(4.0, skip_second=False)  # a power of two: dividing by it is exact
    assert torch.equal(p1, p4)
    assert all(torch.equal(state1[k], state4[k]) for k in state1)
    p_skip, state_skip, (buffers, p_before) = run(1.0, skip_second=True)
    assert torch.equal(p_skip, p_before)
    assert all(torch.equal(state_skip[k], v) for k, v in buffers.items())
    assert not torch.equal(p_before, p1)  # the second step, when applied, does move the weights


def test_stochastic_rounding_is_unbiased_and_a_function_of_its_key() -> None:
    n = 1 << 16
    index = torch.arange(n)
    for x in (1 + 0.3 * ULP_AT_1, -(1 + 0.8 * ULP_AT_1), 3e-5 * (1 + 0.1 * ULP_AT_1)):
        xs = torch.full((n,), x, dtype=torch.float32)
        r = stochastic_round_to_bf16(xs, random_bits16(index, torch.tensor(12345), 0)).float()
        toward_zero = (xs.view(torch.int32) & -65536).view(torch.float32)  # the two bf16 neighbours of x
        away = ((xs.view(torch.int32) & -65536) + 65536).view(torch.float32)
        assert bool(((r == toward_zero) | (r == away)).all())
        ulp = (away[0] - toward_zero[0]).abs().item()
        assert abs(r.double().mean().item() - xs[0].item()) < 0.01 * ulp  # unbiased (sampling error ~0.002 ulp)
    bits = random_bits16(index, torch.tensor(7), 0)
    assert torch.equal(bits, random_bits16(index, torch.tensor(7), 0))
    assert (bits != random_bits16(index, torch.tensor(8), 0)).float().mean() > 0.99
    assert (bits != random_bits16(index, torch.tensor(7), 1)).float().mean() > 0.99
    assert abs(bits.float().mean().item() / 65535 - 0.5) < 0.01  # uniform over 16 bits


def test_the_three_streams_of_an_element_are_uniform_and_uncorrelated() -> None:
    """The weights' and exp_avg's bits are the two halves of one hash, exp_avg_sq's a hash of it: over 2^20 elements
    each stream's mean is within 6 standard errors of a uniform 16-bit draw's (sd 65536 / sqrt(12) / sqrt(n), 18.5)
    and each pair's correlation within 6 / sqrt(n) (0.006) of zero, for two keys, one with a high half."""
    n = 1 << 20
    index = torch.arange(n) * 3 + (1 << 33)  # a global index past 2^32: only its low 32 bits enter the hash
    for key in (torch.tensor(7), torch.tensor((5 << 40) + 123)):
        streams = torch.stack([random_bits16(index, key, s).double() for s in range(3)])
        sd_mean = 65536 / 12**0.5 / n**0.5
        assert ((streams.mean(1) - 32767.5).abs() < 6 * sd_mean).all(), streams.mean(1)
        corr = torch.corrcoef(streams)
        assert (corr - torch.eye(3, dtype=corr.dtype)).abs().max() < 6 / n**0.5, corr
        # the low 8 bits against the high 8 bits of one stream and across streams: no shared bits by construction
        low, high = streams % 256, torch.div(streams, 256, rounding_mode="floor")
        cross = torch.corrcoef(torch.cat([low, high]))
        assert (cross - torch.eye(6, dtype=cross.dtype)).abs().max() < 6 / n**0.5, cross


def test_rounding_is_keyed_by_fqn_so_a_pipeline_stage_rounds_as_the_whole_model() -> None:
    """A pipeline stage's optimizer holds some of the parameters, at other positions: keyed by the fqn
    (not the position), each parameter draws the same bits as in the whole model's optimizer."""
    from trainer.models import FLAVORS, Llama
    from trainer.optim import build_optimizer

    def model() -> Llama:
        m = Llama(FLAVORS["debug"])
        m.init_weights(seed=0)
        m.to(torch.bfloat16)
        g = torch.Generator().manual_seed(1)
        for p in m.parameters():
            p.grad = torch.randn(p.shape, generator=g).mul(1e-3).to(torch.bfloat16)
        return m

    whole, stage = model(), model()
    # The last stage of a pp=2 split: blocks 2-3, final norm and head (the embedding and blocks 0-1 elsewhere).
    stage.tok_embeddings = None
    del stage.layers["0"], stage.layers["1"]
    kw = dict(lr=1e-4, betas=BETAS, eps=1e-8, weight_decay=0.1, implementation="eager", rounding="stochastic",
              seed=3)
    build_optimizer(whole, **kw).step()
    build_optimizer(stage, **kw).step()
    got = dict(stage.named_parameters())
    assert len(got) < len(dict(whole.named_parameters()))
    for name, p in whole.named_parameters():
        if name in got:
            assert torch.equal(got[name], p), name
    # The bits depend on the name: the same tensor under another fqn rounds differently.
    p = torch.nn.Parameter(torch.full((4096,), 1.0, dtype=torch.bfloat16))
    outs = []
    for name in ("layers.0.mlp.up_proj.weight", "layers.1.mlp.up_proj.weight"):
        q = torch.nn.Parameter(p.detach().clone())
        q.grad = torch.full_like(q, 1e-3)
        AdamW([q], lr=1e-3, betas=BETAS, eps=1e-8, weight_decay=0.0, rounding="stochastic", seed=0, implementation="eager",
                  names=[name]).step()
        outs.append(q.detach())
    assert not torch.equal(outs[0], outs[1])


def test_integer_round_to_nearest_is_torchs_cast() -> None:
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(1 << 16, generator=gen) * torch.logspace(-20, 20, 1 << 16)
    ties = (torch.randn(1024, generator=gen).bfloat16().view(torch.int16).int() << 16 | 0x8000).view(torch.float32)
    for v in (x, ties, -x):
        assert torch.equal(round_to_nearest_bf16(v), v.bfloat16().float())


# -- config -------------------------------------------------------------------


def _cfg(*args: str):
    return load_job_config(["--config", DEBUG_CONFIG, *args])


@pytest.mark.parametrize("args, message", [
    (["--distributed.master_dtype=bf16", "--train.mixed_precision=fp32"],
     "distributed.master_dtype='bf16' computes with the bf16 weights, so train.mixed_precision='fp32' would not hold"),
    (["--optimizer.bf16_update=round"], "optimizer.bf16_update"),
])
def test_bad_config_is_one_line_naming_the_key(args: list[str], message: str) -> None:
    with pytest.raises(UserError) as e:
        _cfg(*args)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_nearest_warns_that_small_updates_are_lost(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="trainer.validate"):
        validate_job(_cfg("--train.mixed_precision=bf16", "--distributed.master_dtype=bf16",
                          "--optimizer.bf16_update=nearest"), world_size=1)
    assert "LOSES every update below half a bf16 ulp" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="trainer.validate"):
        validate_job(_cfg("--train.mixed_precision=bf16", "--distributed.master_dtype=bf16"), world_size=1)
    assert "bf16_update" not in caplog.text


@pytest.mark.parametrize("args, world, reduce_dtype, line", [
    ([], 1, torch.bfloat16, "gradients in bfloat16 (one rank, one microbatch: nothing to sum)"),
    (["--distributed.master_dtype=fp32"], 1, torch.bfloat16, "gradients in bfloat16 (one rank, one microbatch"),
    (["--distributed.dp_shard=2"], 2, torch.bfloat16, "gradients reduced in bfloat16"),
    (["--distributed.dp_shard=4"], 4, torch.float32, "gradients reduced in float32"),
    (["--train.grad_accum_steps=2"], 1, torch.bfloat16, "gradients reduced in bfloat16"),
    (["--train.grad_accum_steps=2", "--distributed.master_dtype=fp32"], 1, torch.float32,
     "gradients reduced in float32"),
    (["--train.mixed_precision=fp32"], 1, torch.float32, "gradients in float32 (one rank, one microbatch"),
])
def test_gradients_reduce_in_fp32_wherever_bf16_would_round_otherwise(args, world, reduce_dtype, line) -> None:
    """FSDP2 rounds each reduced gradient to the master dtype and accumulates microbatches there: with bf16 master
    weights a sum over 1 or 2 ranks rounds once in bf16 as in fp32 (tests/distributed/test_reduce_dtype.py), so it
    runs in bf16; over more ranks, or into fp32 master weights, fp32. With nothing to sum FSDP2 would cast the bf16
    gradients to fp32 and back around a one-rank reduce-scatter (15 ms a step at 8B shapes on 1x H100) for the same
    values: they stay in the compute dtype there."""
    from trainer.validate.run_files import describe_precision

    job = validate_job(_cfg("--train.mixed_precision=bf16", *args), world_size=world)
    assert job.build.fsdp.reduce_dtype == reduce_dtype
    assert line in describe_precision(mixed_precision=job.run.mixed_precision, bf16_update=job.optimizer.bf16_update,
                                      build=job.build, float8_layers=job.float8_layers)
