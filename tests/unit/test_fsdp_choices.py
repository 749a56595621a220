"""FSDP2's automatic choices (trainer.validate.resolve.resolve_fsdp, docs/distributed.md#fsdp2s-automatic-choices):
the weights stay gathered from forward to backward where they fit, float8 weights are gathered in bf16 within one
machine and in fp8 across machines, and bf16 master weights summed over two ranks reduce in bf16 (fp32 otherwise);
each said in one line."""

from __future__ import annotations

import pytest
import torch

from trainer.config import load_job_config
from trainer.errors import ConfigError
from trainer.validate import validate_job
from trainer.validate.memory import planned_gpus
from tests.helpers import REPO

LLAMA_8B = str(REPO / "configs" / "train" / "llama3_8b.toml")
EIGHT_LAYERS = ["--model.n_layers=8", "--train.batch_size=4", "--train.seq_len=4096", "--data.source=synthetic",
                "--train.activation_checkpointing=none", "--train.compile_model=true"]


def _job(world: int, *args: str, gib: float = 139.8, precision: str = "fp8"):
    cfg = load_job_config(["--config", LLAMA_8B, f"--train.mixed_precision={precision}", *args])
    return validate_job(cfg, world_size=world, target=planned_gpus(gib))


def test_two_ranks_on_one_machine_keep_weights_gather_in_bf16_and_reduce_in_bf16():
    job = _job(2, *EIGHT_LAYERS)
    assert not job.build.fsdp.reshard_after_forward and job.build.fsdp.reduce_dtype == torch.bfloat16
    assert not job.build.float8.enable_fsdp_float8_all_gather
    assert job.fsdp_choices == (
        "FSDP2 automatic choices (the shard group of 2 ranks is on one machine): weights kept gathered from forward "
        "to backward (ZeRO-2; they fit); float8 weights all-gathered in bf16, cast after the gather; gradients reduced "
        "in bfloat16 (bf16 master weights summed over 2 ranks: equal to fp32, half the bytes)")


def test_across_machines_it_gathers_fp8_and_reduces_in_fp32():
    job = _job(16, *EIGHT_LAYERS)
    assert not job.build.fsdp.reshard_after_forward and job.build.fsdp.reduce_dtype == torch.float32
    assert job.build.float8.enable_fsdp_float8_all_gather
    assert job.fsdp_choices.startswith("FSDP2 automatic choices (the shard group of 16 ranks spans machines of 8 "
                                       "ranks): weights kept gathered from forward to backward (ZeRO-2; they fit); "
                                       "float8 weights all-gathered in fp8; gradients reduced in float32")


def test_weights_that_would_not_fit_gathered_are_resharded_and_the_plan_follows():
    fits, tight = _job(2, gib=139.8), _job(2, gib=79.2)  # the whole 8B: kept gathered, its plan is ~15 GiB larger
    assert not fits.build.fsdp.reshard_after_forward and tight.build.fsdp.reshard_after_forward
    assert tight.memory_plan.peak_bytes < fits.memory_plan.peak_bytes and fits.memory_plan.peak_bytes > 0.95 * 79.2 * 2**30
    assert "weights resharded after forward (ZeRO-3; kept gathered they would not fit the GPU)" in tight.fsdp_choices


@pytest.mark.parametrize("world, args", [
    (2, ["--distributed.master_dtype=fp32"]),  # fp32 master weights keep fp32 gradients
    (4, ["--distributed.dp_replicate=2", "--distributed.dp_shard=2"]),  # 4 ranks summed (HSDP)
    (4, []),
])
def test_gradients_reduce_in_fp32_where_bf16_would_round_differently(world, args):
    assert _job(world, *EIGHT_LAYERS, *args).build.fsdp.reduce_dtype == torch.float32


def test_keys_set_by_hand_are_kept_and_not_reported_as_choices():
    job = _job(2, *EIGHT_LAYERS, "--distributed.reshard_after_forward=always", "--distributed.reduce_dtype=fp32",
               "--float8.enable_fsdp_float8_all_gather=true")
    assert job.build.fsdp.reshard_after_forward and job.build.fsdp.reduce_dtype == torch.float32
    assert job.build.float8.enable_fsdp_float8_all_gather and job.fsdp_choices == ""
    assert _job(1, *EIGHT_LAYERS).fsdp_choices == ""  # one rank: nothing is sharded


def test_fp8_reduce_is_taken_when_asked_said_in_the_precision_line_and_never_chosen_by_auto():
    from trainer.validate.run_files import describe_precision

    job = _job(2, *EIGHT_LAYERS, "--distributed.reduce_dtype=fp8")
    assert job.build.fsdp.reduce_dtype == torch.float8_e4m3fn and job.build.fsdp.master_dtype == torch.bfloat16
    assert "gradients reduced in float8 (e4m3, one scale per unit from the amax over ranks)" in describe_precision(
        mixed_precision=job.run.mixed_precision, bf16_update=job.optimizer.bf16_update, build=job.build,
        float8_layers=job.float8_layers)
    assert "gradients reduced" not in job.fsdp_choices  # set by hand: not an automatic choice
    assert all(_job(world, *EIGHT_LAYERS, precision=precision).build.fsdp.reduce_dtype.itemsize > 1
               for world in (2, 16) for precision in ("fp8", "bf16"))


@pytest.mark.parametrize("world, args, where", [
    (1, [], "distributed.dp_shard x distributed.cp = 1 x 1, world size 1): no"),
    (2, ["--distributed.dp_replicate=2", "--distributed.dp_shard=1"],
     "world size 2), and the 2 HSDP replicas all-reduce in the master dtype: no"),
])
def test_fp8_reduce_without_a_shard_group_to_sum_over_is_one_config_error(world, args, where):
    with pytest.raises(ConfigError, match=r"^distributed.reduce_dtype='fp8' reduce-scatters gradients in float8 over "
                       r"FSDP's shard group, but it has one rank \(") as e:
        _job(world, *EIGHT_LAYERS, "--distributed.reduce_dtype=fp8", *args)
    assert where in str(e.value) and "\n" not in str(e.value)



@pytest.mark.parametrize("world, args, outside", [
    (2, ["--distributed.ep=2"], True),  # bf16 master weights, bf16 compute
    (2, ["--distributed.ep=2", "--train.mixed_precision=fp32"], True),  # fp32 both
    (2, ["--distributed.ep=2", "--distributed.master_dtype=fp32"], False),  # the unit casts them to bf16
    (4, ["--distributed.ep=2"], False),  # sharded over dp_shard / ep = 2
    (4, ["--distributed.ep=2", "--distributed.dp_replicate=2", "--distributed.dp_shard=2"], False),  # HSDP replicas
    (2, [], False),  # no expert parallelism
])
def test_routed_experts_leave_fsdp_only_where_their_unit_would_shard_and_cast_nothing(world, args, outside):
    """A one-rank expert mesh (ep = dp_shard) with master weights already in the compute dtype: FSDP2 leaves every MoE
    layer's experts alone (FSDPOptions.experts_outside, trainer.parallel.fsdp); a larger mesh shards them, replicas
    reduce them, and fp32 master weights under bf16 compute need the unit's cast."""
    cfg = load_job_config(["--config", str(REPO / "configs" / "train" / "debug_moe.toml"),
                           "--train.mixed_precision=bf16", *args])
    job = validate_job(cfg, world_size=world, target=planned_gpus(139.8))
    assert job.build.fsdp.experts_outside is outside
    assert (job.parallel_dims.expert_fsdp == 1) is (outside or "--distributed.master_dtype=fp32" in args)
