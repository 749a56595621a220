"""distributed.reduce_dtype: with bf16 master weights FSDP2 rounds each reduced gradient to bf16, so reducing two
ranks' gradients in bf16 equals reducing them in fp32 bit for bit (why `auto` picks bf16 there); over four ranks
the bf16 sum rounds each partial sum and tracks fp32 within that rounding."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.spawn import gradients_of_one_step, run_distributed
from tests.helpers import DEBUG_CONFIG

BF16 = ["--config", DEBUG_CONFIG, "--train.mixed_precision=bf16", "--checkpoint.enable=false", "--train.seq_len=32",
        "--train.batch_size=4"]


def _grads(world: int, reduce_dtype: str, dump: str, *more: str) -> dict:
    args = [*BF16, f"--distributed.dp_shard={world}", f"--distributed.reduce_dtype={reduce_dtype}", *more]
    return run_distributed(gradients_of_one_step, world_size=world, args=(args, dump))[0]


@pytest.mark.slow
@pytest.mark.parametrize("world, more", [(2, []), (1, ["--train.grad_accum_steps=2"])])
def test_up_to_two_ranks_reduce_in_bf16_exactly_as_in_fp32(tmp_path, world, more):
    """Two ranks' sum, or one rank's microbatches (accumulated in the bf16 master dtype either way)."""
    fp32, bf16 = _grads(world, "fp32", str(tmp_path / "a"), *more), _grads(world, "bf16", str(tmp_path / "b"), *more)
    assert fp32.keys() == bf16.keys() and all(g.dtype == torch.bfloat16 for g in fp32.values())
    for name in fp32:
        assert torch.equal(fp32[name], bf16[name]), name


@pytest.mark.slow
def test_four_ranks_reduce_in_bf16_within_its_rounding(tmp_path):
    fp32, bf16 = _grads(4, "fp32", str(tmp_path / "a")), _grads(4, "bf16", str(tmp_path / "b"))
    differ = 0
    for name in fp32:
        a, b = fp32[name].double(), bf16[name].double()
        # Each of the three partial sums of a 4-rank bf16 reduction rounds once more than fp32's single rounding:
        # at most 4 bf16 roundings (2^-8 each) of the gradient's size.
        assert (a - b).norm() <= 4 * 2**-8 * a.norm(), name
        differ += int(not torch.equal(a, b))
    assert differ  # four ranks in bf16 do round differently: the bound above is what is tested
