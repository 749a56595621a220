"""distributed.reduce_dtype: with bf16 master weights FSDP2 rounds each reduced gradient to bf16, so reducing two
ranks' gradients in bf16 equals reducing them in fp32 bit for bit (why `auto` picks bf16 there); over four ranks
the bf16 sum rounds each partial sum and tracks fp32 within that rounding. fp8 (trainer/parallel/fp8_reduce.py): the
reduce-scatter and one step's gradients equal a reduction by hand bit for bit, and a few steps track fp32's within
e4m3's rounding."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.spawn import gradients_of_one_step, run_distributed, train_and_read_metrics
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


# -- distributed.reduce_dtype = "fp8" (trainer/parallel/fp8_reduce.py) ----------------------------------------------

E4M3_MAX, E4M3_HALF_ULP, E4M3_SUBNORMAL_HALF_STEP = 448.0, 2**-4, 2**-10


def hand_reference(buffers: list[torch.Tensor], *, divide: float, out_dtype: torch.dtype) -> torch.Tensor:
    """What a float8 reduce-scatter must give rank 0, from every rank's buffer [world * n]: one scale from the amax of
    them all, each quantized to e4m3 with it, rank 0's rows summed in fp32, divided, cast to the output dtype."""
    world = len(buffers)
    amax = torch.stack([b.float().abs().max() for b in buffers]).max().reshape(1)
    scale = E4M3_MAX / amax.clamp(min=1e-30)
    rows = [(b.float() * scale).to(torch.float8_e4m3fn).view(world, -1)[0] for b in buffers]
    total = sum((r.float() for r in rows), torch.zeros_like(rows[0], dtype=torch.float32))
    return (total / (scale * divide)).to(out_dtype)


def _float8_reduce_scatter_cases() -> list[tuple[str, bool]]:
    """On each rank: FSDP2's call of the float8 reduce-scatter on buffers of gradients spread over 2^40, for each of
    FSDP2's ops and dtypes, and on all-zero and non-finite buffers; rank 0 checks its shard against hand_reference."""
    import torch.distributed as dist
    from torch.distributed import ReduceOp

    from trainer.parallel.fp8_reduce import Float8ReduceScatter

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    comm, n, results = Float8ReduceScatter(), 96, []
    cases = [("avg", ReduceOp.AVG, world), ("sum", ReduceOp.SUM, 1.0),
             ("premul_sum", dist._make_nccl_premul_sum(1 / 6), 6.0)]
    for dtype in (torch.bfloat16, torch.float32):
        for name, op, divide in cases:
            g = torch.Generator().manual_seed(rank)
            mine = (torch.randn(world * n, generator=g) * 2.0 ** torch.randint(-30, 10, (world * n,), generator=g))
            mine = mine.to(dtype)
            out = comm.allocate((n,), dtype=dtype, device=torch.device("cpu"))
            comm(out, mine, dist.group.WORLD, op)
            everyone = [torch.empty_like(mine) for _ in range(world)]
            dist.all_gather(everyone, mine)
            if rank == 0:
                ref = hand_reference(everyone, divide=divide, out_dtype=dtype)
                results.append((f"{dtype} {name}", torch.equal(out, ref)))
    zeros = torch.zeros(world * n)
    out = torch.empty(n)
    comm(out, zeros, dist.group.WORLD, ReduceOp.AVG)
    results.append(("all zero", bool((out == 0).all())))
    bad = torch.ones(world * n)
    bad[world * n - 1] = float("inf") if rank == world - 1 else 1.0  # one element of the last rank's last row
    comm(out, bad, dist.group.WORLD, ReduceOp.AVG)
    results.append(("inf anywhere: NaN everywhere", bool(out.isnan().all())))
    return results


@pytest.mark.slow
def test_float8_reduce_scatter_equals_the_hand_reference():
    """Three ranks: a division FSDP2 asks for that is no power of two, and a sum of three e4m3 values that fp32 holds
    exactly, so every shard is the hand reference bit for bit."""
    results = run_distributed(_float8_reduce_scatter_cases, world_size=3)[0]
    assert len(results) == 8 and [name for name, ok in results if not ok] == []


def _one_step_against_hand_reference() -> list[tuple[str, str, float]]:
    """The debug model under apply_fsdp with a float8 reduce_dtype over 2 ranks (bf16 and fp32 master weights), one
    forward and backward of a different batch per rank, against the same step of an unsharded copy on each rank whose
    gradients are reduced by hand (hand_reference per FSDP2 unit: embeddings, each block, the root). Rank 0 returns
    (dtype, fqn, largest difference) for every gradient, and one row per dtype with the fp32-reduced gradient's
    distance from the fp8 one against its bound."""
    import copy

    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh

    from trainer.models import FLAVORS, build_model
    from trainer.models.layers import clean_fqn
    from trainer.parallel.apply import cast_parameters
    from trainer.parallel.fsdp import apply_fsdp

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        model = build_model(FLAVORS["debug"])
        model.init_weights(seed=0)
        cast_parameters(model, dtype)
        plain = copy.deepcopy(model)
        apply_fsdp(model, mesh, param_dtype=dtype, reduce_dtype=torch.float8_e4m3fn, reshard_after_forward=False)
        tokens = torch.randint(0, 512, (2, 33), generator=torch.Generator().manual_seed(rank))
        for m in (model, plain):
            logits = m.logits(tokens[:, :-1]).float()
            F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        local = {clean_fqn(n): p.grad for n, p in plain.named_parameters()}
        reduced = {clean_fqn(n): p.grad.full_tensor() for n, p in model.named_parameters()}
        everyone: list = [None] * world
        dist.all_gather_object(everyone, local)
        if rank:
            continue
        rows += _compare_units(everyone, reduced, dtype)
    return rows


def _unit(fqn: str) -> str:
    """apply_fsdp's unit of a parameter: the embeddings, a block, or the root (final norm and output head)."""
    return "tok_embeddings" if fqn.startswith("tok_embeddings.") else ".".join(fqn.split(".")[:2]) \
        if fqn.startswith("layers.") else "root"


def _compare_units(everyone: list[dict], reduced: dict, dtype: torch.dtype) -> list[tuple[str, str, float]]:
    world, rows = len(everyone), []
    error, bound = 0.0, 0.0
    for unit in sorted({_unit(f) for f in reduced}):
        fqns = [f for f in reduced if _unit(f) == unit]
        # One flat buffer per rank, as FSDP2 lays the unit out (the order does not change any element's value).
        flat = [torch.cat([grads[f].flatten() for f in fqns]) for grads in everyone]
        ref = hand_reference([torch.cat([b, b]) for b in flat], divide=world, out_dtype=dtype)  # rank 0's row: all
        offset = 0
        for f in fqns:
            n = reduced[f].numel()
            rows.append((str(dtype), f, (reduced[f].flatten().float() - ref[offset:offset + n].float()).abs().max()
                         .item()))
            offset += n
        # Against fp32's reduce: each rank's e4m3 rounding is at most 2^-4 of each element (normal numbers) or half a
        # subnormal step (2^-10 / scale), then both sums are rounded once more to the master dtype.
        amax = max(b.float().abs().max().item() for b in flat)
        exact = sum(b.double() for b in flat) / world
        fp8 = torch.cat([reduced[f].flatten() for f in fqns]).double()
        error += (fp8 - exact).norm().item() ** 2
        unit_bound = sum(E4M3_HALF_ULP * b.double().norm() + E4M3_SUBNORMAL_HALF_STEP * amax / E4M3_MAX
                         * b.numel() ** 0.5 for b in flat) / world
        bound += (unit_bound + torch.finfo(dtype).eps / 2 * exact.norm()).item() ** 2
    rows.append((str(dtype), "fp8 against exact: error, bound", error ** 0.5 / bound ** 0.5))
    return rows


@pytest.mark.slow
def test_gradients_of_one_step_equal_the_hand_reduced_ones():
    rows = run_distributed(_one_step_against_hand_reference, world_size=2)[0]
    grads = [r for r in rows if not r[1].startswith("fp8 against")]
    assert len(grads) == 2 * 39 and [r for r in grads if r[2] != 0.0] == []
    ratios = [r[2] for r in rows if r[1].startswith("fp8 against")]
    assert len(ratios) == 2 and all(0 < r <= 1 for r in ratios), ratios


@pytest.mark.slow
def test_fp8_reduce_tracks_fp32_within_its_rounding(tmp_path):
    """Two ranks, six steps of the debug model in bf16 (bf16 master weights): the same first loss (the same weights;
    the reduce comes after it), then each loss within 2^-3 of how far the fp32-reduced run's loss has moved so far.
    Why 2^-3: each element of each rank's gradient is off by at most 2^-4 of itself (e4m3's rounding; the one-step
    test above pins it); AdamW divides its first moment by the root of its second, each off by at most that, so each
    update is off by at most about 2 x 2^-4 of itself, and to first order so is the change of the loss it makes."""
    args = [*BF16, "--distributed.dp_shard=2", "--train.steps=6", "--metrics.log_freq=1",
            "--metrics.enable_tensorboard=false"]
    fp32, fp8 = ([row["loss"] for row in run_distributed(train_and_read_metrics, world_size=2, args=(
        [*args, f"--distributed.reduce_dtype={dtype}"], str(tmp_path / dtype)))[0]] for dtype in ("fp32", "fp8"))
    assert len(fp32) == len(fp8) == 6 and fp8[0] == fp32[0] and fp8 != fp32
    moved = 0.0
    for step in range(1, 6):
        moved += abs(fp32[step] - fp32[step - 1])
        assert abs(fp8[step] - fp32[step]) <= 2**-3 * moved, (step + 1, fp8[step], fp32[step], moved)
