"""FP8 dispatch's quantization (trainer/models/moe_dispatch.py), the FP8 experts' byte-to-byte rowwise requantization
of the received blocks, and moe.dispatch_dtype's refusals. The all-to-all itself (bytes, straight-through backward,
ep=2 against bf16 dispatch and against the old dequantize-then-quantize path):
tests/distributed/test_moe_dispatch_fp8.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from trainer.models.moe_dispatch import (BLOCK, E4M3, Fp8Blocks, dequantize_blocks, fp8_bytes_per_token, pack_rows,
                                         quantize_blocks, requantize_rowwise, unpack_rows)
from trainer.models.moe_fp8 import Fp8ExpertWeights, fp8_grouped_swiglu, quantize_rows
from trainer.models.moe_permute import inverse_permutation

MOE_CONFIG = str(Path(__file__).resolve().parents[2] / "configs" / "train" / "debug_moe.toml")
FP8 = ["--train.mixed_precision=fp8", "--float8.emulate=true"]


def _rows() -> torch.Tensor:
    """Rows whose blocks span 12 decades, blocks of one row 1000x apart, zeros, and values deep in a block's range
    (e4m3's subnormals after scaling)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 3 * BLOCK, generator=g) * torch.logspace(-8, 4, 64).unsqueeze(1)
    x[:, BLOCK:2 * BLOCK] *= 1e-3
    x[0, :BLOCK] = 0.0
    x[1, 5] = x[1, :BLOCK].abs().max() * 1e-4  # below 2^-6 of the block's amax: a subnormal once scaled
    return x


def test_round_trip_is_within_e4m3_rounding_of_each_block() -> None:
    # A block with amax a is scaled by 2^s <= 448 / a (a power of two, so 2^s > 224 / a). e4m3 keeps 3 mantissa bits:
    # a scaled value in the normal range (>= 2^-6) is rounded to within half an ulp, 2^-4 of itself; below it the
    # step is 2^-9, so within 2^-10 / 2^s < 2^-10 * a / 224 < 2^-17 * a. Each element: max(2^-4 |v|, 2^-17 a).
    x = _rows()
    data, scale = quantize_blocks(x)
    assert data.dtype == E4M3 and scale.shape == (64, 3) and scale.dtype == torch.float32
    y = dequantize_blocks(data, scale, torch.float32)
    amax = x.abs().view(64, 3, BLOCK).amax(-1).repeat_interleave(BLOCK, 1)
    err = (y - x).abs()
    assert (err <= torch.maximum(x.abs() * 2**-4, amax * 2**-17)).all()
    assert torch.equal(y[0, :BLOCK], x[0, :BLOCK])  # an all-zero block stays zero
    # The bound is tight: some normal value is off by more than half of it (3 mantissa bits, not more).
    normal = (x.abs() >= amax * 2**-6) & (amax > 0)
    assert (err[normal] / x.abs()[normal]).max() > 2**-5
    # Scales are powers of two: the bf16 dequantization is the fp32 one, exactly.
    assert torch.equal(dequantize_blocks(data, scale, torch.bfloat16).float(), y)


def test_rows_pack_into_one_byte_per_element_and_four_per_block() -> None:
    x = _rows()
    data, scale = quantize_blocks(x)
    packed = pack_rows(data, scale)
    assert packed.dtype == torch.uint8 and packed.shape == (64, 3 * BLOCK + 4 * 3) == (64, fp8_bytes_per_token(384))
    d2, s2 = unpack_rows(packed, 3 * BLOCK)
    assert torch.equal(d2.view(torch.uint8), data.view(torch.uint8)) and torch.equal(s2, scale)
    assert fp8_bytes_per_token(2048) == 2048 + 64  # moe_16b: 2112 bytes per token instead of bf16's 4096


def _old_path(data: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What the FP8 experts did with fp8 dispatch's rows before: dequantize to bf16, quantize each row."""
    return quantize_rows(dequantize_blocks(data, scale, torch.bfloat16))


def _assert_same_bits(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> None:
    assert got[0].dtype == want[0].dtype == E4M3 and got[1].dtype == want[1].dtype == torch.float32
    assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))  # -0 and +0 apart too
    assert torch.equal(got[1].view(torch.int32), want[1].view(torch.int32))


def _crafted_blocks() -> tuple[torch.Tensor, torch.Tensor]:
    """Blockwise-quantized rows of 4 blocks: blocks 2^-40 .. 2^0 of their row's largest (values that land in e4m3's
    subnormals, or below them, once rescaled by the row's scale), negative values, zeros of both signs, all-zero
    blocks and rows, and a row whose only block's largest value rounded down to 224 (its row scale is twice its
    block scale)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(48, 4 * BLOCK, generator=g)
    blocks = x.view(48, 4, BLOCK)
    blocks *= (2.0 ** -torch.arange(48).remainder(41).float()).view(48, 1, 1) ** torch.tensor(
        [0.0, 0.25, 0.5, 1.0]).view(1, 4, 1)  # row r: blocks 1, 2^-r/4, 2^-r/2, 2^-r of the first's size
    blocks[1, 2] = 0.0  # an all-zero block
    blocks[2] = 0.0  # an all-zero row
    blocks[3, 1, :7] = -0.0
    blocks[4, 0, :] = torch.linspace(-1, 1, BLOCK) * 2.0 ** -30  # a block far below the others of its row
    blocks[5] = 0.0
    blocks[5, 0, 0] = 225 / 256  # 448 / amax -> 2^8, 225 rounds to 224: the row's amax 224 / 256 gives 2^9
    blocks[5, 0, 1:] = torch.linspace(-0.5, 0.5, BLOCK - 1)
    x = x.bfloat16()  # the dispatcher quantizes bf16 rows
    x[6, :BLOCK] = -x[6, :BLOCK].abs()  # a block of negative values only
    return quantize_blocks(x)


def test_requantizing_blocks_rowwise_is_dequantize_then_quantize_bit_for_bit() -> None:
    data, scale = _crafted_blocks()
    got, want = requantize_rowwise(data, scale), _old_path(data, scale)
    _assert_same_bits(got, want)
    # The crafted rows reach every case of the proof (moe_dispatch's docstring):
    row_q = got[0].view(torch.uint8) & 0x7F
    block_q = data.view(torch.uint8) & 0x7F
    assert ((row_q > 0) & (row_q < 8)).sum() > 100  # e4m3 subnormals after rescaling (exponent bits 0)
    assert ((row_q == 0) & (block_q > 0)).sum() > 100  # nonzero block values rounded to zero under the row scale
    assert (got[0].view(torch.uint8) == 0x80).any()  # -0 kept
    assert torch.equal(got[0][2].float(), torch.zeros(4 * BLOCK)) and got[1][2] > 0  # all-zero row: finite scale
    assert got[1][5] == scale[5, 0] / 2  # the row scale twice the block's (dequantization scales: half)
    # Values with 3 mantissa bits keep them under a smaller power-of-two scale, but not all of them: the row's
    # scale rounds again where the block's values fall into its subnormals (double rounding, the same in both).
    same_real = got[0].float() * got[1][:, None] == data.float() * scale.repeat_interleave(BLOCK, 1)
    assert 0 < (~same_real).sum() < same_real.sum()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_requantizing_random_blocks_rowwise_is_dequantize_then_quantize_bit_for_bit(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    n, n_blocks = 256, 8
    spread = torch.exp(torch.randn(n, n_blocks, 1, generator=g) * 4)  # blocks of one row e^+-4 sigma apart
    x = (torch.randn(n, n_blocks, BLOCK, generator=g) * spread).view(n, n_blocks * BLOCK).bfloat16()
    data, scale = quantize_blocks(x)
    _assert_same_bits(requantize_rowwise(data, scale), _old_path(data, scale))
    # The all-to-all's buffer, viewed (not copied): the same bits from strided views.
    packed = pack_rows(data, scale)
    d2, s2 = unpack_rows(packed, n_blocks * BLOCK)
    assert d2.data_ptr() == packed.data_ptr() and not d2.is_contiguous()
    _assert_same_bits(requantize_rowwise(d2, s2), _old_path(data, scale))


def test_fp8_experts_on_received_blocks_match_the_bf16_copy_path_bit_for_bit() -> None:
    # The EP kernel call (k = 1: received rows, a permutation by local expert), emulated: the kernel given the
    # blocks and a NaN gradient handle equals the kernel given their bf16 copy, output and every gradient, bit for
    # bit; the handle's values are never read (the output would be NaN) and it gets the rows' gradient.
    torch.manual_seed(0)
    n_rows, n_experts, dim, hidden = 40, 3, 2 * BLOCK, 32
    data, scale = _crafted_blocks()
    data, scale = data[:n_rows, :dim], scale[:n_rows, :2]
    experts = torch.randint(0, n_experts, (n_rows,))
    perm = torch.argsort(experts, stable=True)
    counts = torch.bincount(experts, minlength=n_experts)
    weights = [(0.1 * torch.randn(*shape)).bfloat16() for shape in
               ((n_experts, hidden, dim), (n_experts, dim, hidden), (n_experts, hidden, dim))]
    probe = torch.randn(n_rows, dim).bfloat16()

    def run(src: torch.Tensor, blocks: Fp8Blocks | None):
        ws = [w.clone().requires_grad_() for w in weights]
        out = fp8_grouped_swiglu(src, perm, inverse_permutation(perm), counts, *ws, k=1,
                                 weights=Fp8ExpertWeights(per_step=False), emulate=True, align=16, blocks=blocks)
        (out.float() * probe.float()).sum().backward()
        return out.detach(), src.grad, [w.grad for w in ws]

    handle = torch.full((n_rows, dim), float("nan"), dtype=torch.bfloat16, requires_grad=True)
    got = run(handle, Fp8Blocks(data, scale))
    want = run(dequantize_blocks(data, scale, torch.bfloat16).requires_grad_(), None)
    assert not got[0].isnan().any()
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    for g, w in zip(got[2], want[2]):
        assert torch.equal(g, w)
    assert got[1].abs().sum() > 0 and got[0].abs().sum() > 0


@pytest.mark.parametrize(
    "world_size, args, message",
    [
        (2, ["--distributed.ep=2", "--moe.dispatch_dtype=fp8", "--train.mixed_precision=bf16"],
         "moe.dispatch_dtype='fp8' needs train.mixed_precision='fp8', but it is 'bf16'"),
        (2, ["--distributed.ep=2", "--moe.dispatch_dtype=e5m2"], "moe.dispatch_dtype='e5m2' is not one of 'bf16', 'fp8'"),
        (1, ["--model.flavor=debug", "--moe.dispatch_dtype=fp8", *FP8],
         "moe.dispatch_dtype='fp8' needs an MoE model, but model.flavor='debug' is dense"),
        (2, ["--moe.dispatch_dtype=fp8", *FP8], "moe.dispatch_dtype='fp8' needs distributed.ep > 1"),
        (2, ["--distributed.ep=2", "--moe.dispatch_dtype=fp8", "--model.dim=192", "--model.n_heads=4", *FP8],
         "moe.dispatch_dtype='fp8' needs model.dim a multiple of 128 (one scale per 1x128 block of each token row), "
         "but it is 192"),
    ],
)
def test_bad_dispatch_configs_are_one_line_naming_the_key(world_size: int, args: list[str], message: str) -> None:
    from trainer.config import load_job_config
    from trainer.errors import ConfigError
    from trainer.validate import validate_job

    with pytest.raises(ConfigError) as e:
        validate_job(load_job_config(["--config", MOE_CONFIG, *args]), world_size=world_size)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_fp8_dispatch_is_handed_to_the_build() -> None:
    from trainer.config import load_job_config
    from trainer.validate import validate_job

    job = validate_job(load_job_config(["--config", MOE_CONFIG, "--distributed.ep=2", "--moe.dispatch_dtype=fp8", *FP8]),
                       world_size=2)
    assert job.build.moe_dispatch_dtype == "fp8"


MOE_16B = ["--config", "configs/train/moe_16b_4gpu_fp8.toml", "--model.n_layers=8", "--float8.moe_experts=off",
           "--train.batch_size=2", "--data.source=synthetic"]


@pytest.mark.parametrize("ep, gib, extra, padded, why", [
    (2, 139.8, [], True, "padded at ep=2, its memory plan 29.3 GiB (sized: 25.3 GiB) against 132.8 GiB, 95% of a "
                         "139.8 GiB GPU"),
    (2, 30, [], False, "sized, padded does not fit: its memory plan 29.3 GiB (sized: 25.3 GiB) against 28.5 GiB"),
    (4, 139.8, [], False, "sized, ep=4: padded moves ep x the rows and was measured faster only at ep=2"),
    (2, 139.8, ["--moe.dispatch_dtype=fp8"], False, "sized, moe.dispatch_dtype='fp8' sizes its blocks on the host"),
    (2, 139.8, ["--moe.capacity_factor=1.25"], False, "sized, moe.capacity_factor=1.25: token dropping reads"),
])
def test_auto_dispatch_takes_padded_at_ep2_where_its_plan_fits(ep: int, gib: float, extra: list[str], padded: bool,
                                                               why: str) -> None:
    """moe.dispatch='auto' (the default): padded only at ep=2 on GPUs, with bf16 dispatch and no token dropping, and
    only when the memory plan with it stays within 95% of the device; the plan is then the padded one."""
    from trainer.config import load_job_config
    from trainer.validate import validate_job
    from trainer.validate.memory import planned_gpus

    job = validate_job(load_job_config([*MOE_16B, f"--distributed.ep={ep}", *extra]), world_size=ep,
                       target=planned_gpus(gib))
    assert job.build.moe_padded_dispatch == padded
    assert job.build.moe_dispatch_note.startswith(f"moe.dispatch='auto': {why}"), job.build.moe_dispatch_note
    chosen = validate_job(load_job_config([*MOE_16B, f"--distributed.ep={ep}", *extra,
                                           f"--moe.dispatch={'padded' if padded else 'sized'}"]),
                          world_size=ep, target=planned_gpus(gib))
    assert job.memory_plan.peak_bytes == chosen.memory_plan.peak_bytes  # the plan of what runs


def test_auto_dispatch_is_sized_on_a_cpu_and_silent_without_expert_parallelism() -> None:
    from trainer.config import load_job_config
    from trainer.validate import validate_job

    cpu = validate_job(load_job_config(["--config", MOE_CONFIG, "--distributed.ep=2"]), world_size=2)
    assert not cpu.build.moe_padded_dispatch
    assert cpu.build.moe_dispatch_note == ("moe.dispatch='auto': sized, not on GPUs, where padded saves one host sync "
                                           "per MoE layer")
    one = validate_job(load_job_config(["--config", MOE_CONFIG]), world_size=2)
    assert not one.build.moe_padded_dispatch and one.build.moe_dispatch_note == ""
