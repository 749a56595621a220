"""The scaling projection's arithmetic (scripts/project_scaling.py): bytes per unit from the resolved job, and what
is exposed only where a collective outlasts the compute it overlaps."""

from __future__ import annotations

import dataclasses

import pytest

from scripts.project_scaling import project, units
from trainer.config import load_job_config
from trainer.models import pipeline_costs
from trainer.validate import validate_job
from trainer.validate.memory import planned_gpus

RECIPE = "configs/train/7b_16gpu_fp8.toml"


def _job(*overrides: str):
    cfg = load_job_config(["--config", RECIPE, *overrides])
    return validate_job(cfg, world_size=16, target=dataclasses.replace(planned_gpus(79.2), ranks_per_node=8))


def test_fp8_gathers_half_the_bytes_of_bf16_and_reduces_in_fp32():
    fp8, bf16 = _job(), _job("--float8.enable_fsdp_float8_all_gather=false")
    (b8, *_), root8 = units(fp8, seconds_per_flop=1e-15)
    (b16, *_), _ = units(bf16, seconds_per_flop=1e-15)
    args = fp8.model_args
    norms = 2 * args.dim
    assert b16.gather_bytes == 2 * b8.gather_bytes - 2 * norms  # the Linears in fp8, the two norms in bf16
    assert b8.reduce_bytes == 4 * (b16.gather_bytes / 2)  # fp32 gradients of every parameter (auto at 16 ranks)
    assert root8.gather_bytes == args.dim * args.vocab_size * 3 + 2 * args.dim  # fp8 head, bf16 embedding and norm


def test_nothing_is_exposed_but_the_root_and_the_last_reduce_when_the_network_is_fast():
    job = _job()
    fast = project(job, tflops=800.0, share=1.0, optimizer_share=0.0, bus_gbs=1e12)
    assert fast["exposed"]["all-gather"] == 0.0
    assert fast["exposed"]["root unit"] == pytest.approx(0.0, abs=1e-6)
    # compute: every model FLOP at the rate, the blocks' forward (a third) again under full AC
    run = job.run
    _, blocks, head = pipeline_costs(job.model_args, run.seq_len)
    tokens = run.batch_size * run.seq_len * run.grad_accum_steps
    assert fast["compute_s"] == pytest.approx((sum(blocks) * 4 / 3 + head) * tokens / 800e12, rel=1e-9)
    slow = project(job, tflops=800.0, share=1.0, optimizer_share=0.0, bus_gbs=1.0)
    assert slow["exposed"]["all-gather"] > 0 and slow["step_s"] > 10 * fast["step_s"]
