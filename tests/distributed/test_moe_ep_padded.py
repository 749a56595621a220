"""The padded all-to-all (moe.dispatch='padded', trainer.parallel.expert_parallel.PaddedAllToAllDispatcher) under
ep=2 on gloo: the same rows reach the same experts in the same order as with the sized all-to-all, so every gradient
is the sized dispatch's; the config refusals and the memory plan. That the compiled MoE block reads nothing on the
host: tests/distributed/test_moe_ep.py, beside the block's other compile tests.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.distributed.spawn import gradients_of_one_step, run_distributed
from tests.helpers import REPO

MOE_CONFIG = str(REPO / "configs" / "train" / "debug_moe.toml")
ARGS = ["--config", MOE_CONFIG, "--train.seq_len=64", "--train.steps=1", "--metrics.enable_tensorboard=false",
        "--train.batch_size=2", "--distributed.ep=2", "--train.mixed_precision=fp32"]
GPT_OSS = ["--model.flavor=debug_gpt_oss"]
FP8_EXPERTS = ["--train.mixed_precision=fp8", "--float8.emulate=true", "--float8.exclude_fqns=layers,output_head",
               "--float8.moe_experts=rowwise"]


@pytest.mark.parametrize("extra", [[], FP8_EXPERTS, GPT_OSS], ids=["bf16_experts", "fp8_rowwise_experts", "gpt_oss"])
def test_padded_dispatch_gives_the_sized_dispatchs_gradients(extra: list[str], tmp_path: Path) -> None:
    """One step's gradients, every parameter: the padded slots' empty rows sort after every expert's rows and the
    grouped GEMMs never run them, so each expert sees the sized dispatch's rows in its order. Empty rows' outputs
    (which the kernels leave unwritten: any value) and their gradients must never reach a real row or a weight."""
    def grads(dispatch: str) -> dict[str, torch.Tensor]:
        return run_distributed(gradients_of_one_step, world_size=2, args=(
            [*ARGS, *extra, f"--moe.dispatch={dispatch}"], str(tmp_path / dispatch)))[0]

    got, ref = grads("padded"), grads("sized")
    assert got.keys() == ref.keys()
    experts = [fqn for fqn in ref if ".moe.experts." in fqn]
    assert experts and all(ref[fqn].abs().sum() > 0 for fqn in experts)
    for fqn, g in ref.items():
        assert torch.isfinite(got[fqn]).all(), fqn
        # The same GEMMs on the same rows; only the buffers around them are larger: expected bit for bit, 1e-6 of a
        # gradient's norm allows a kernel that blocks its sums by the buffer's size.
        assert (got[fqn] - g).norm() <= 1e-6 * g.norm(), fqn


@pytest.mark.parametrize(
    "args, message",
    [
        (["--moe.dispatch=padded"], "moe.dispatch='padded' needs distributed.ep > 1"),
        (["--distributed.ep=2", "--moe.dispatch=padded", "--moe.dispatch_dtype=fp8", "--train.mixed_precision=fp8"],
         "moe.dispatch='padded' with moe.dispatch_dtype='fp8' is not supported yet"),
        (["--distributed.ep=2", "--moe.dispatch=padded", "--moe.capacity_factor=1.25"],
         "moe.dispatch='padded' with moe.capacity_factor=1.25: token dropping reads the rows it keeps on the host"),
        (["--model.flavor=debug", "--moe.dispatch=padded"],
         "moe.dispatch='padded' needs an MoE model, but model.flavor='debug' is dense"),
        (["--distributed.ep=2", "--moe.dispatch=fixed"], "moe.dispatch='fixed' is not one of 'sized', 'padded', 'auto'"),
    ],
)
def test_bad_padded_dispatch_configs_are_one_line_naming_the_keys(args: list[str], message: str) -> None:
    from trainer.config import load_job_config
    from trainer.errors import ConfigError
    from trainer.validate import validate_job

    with pytest.raises(ConfigError) as e:
        validate_job(load_job_config(["--config", MOE_CONFIG, *args]), world_size=2)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_the_memory_plan_counts_every_slot_of_the_padded_dispatch() -> None:
    """The routed experts' activations hold ep slots of rows under the padded all-to-all: the plan's activations
    grow by (ep - 1) x the routed rows' bytes, and nothing else in it moves."""
    from trainer.config import load_job_config
    from trainer.models.activations import ActivationPolicy, block_activation_bytes
    from trainer.models.moe import moe_args_for
    from trainer.validate import validate_job
    from trainer.validate.memory import planned_gpus

    def plan(dispatch: str) -> dict[str, int]:
        cfg = load_job_config(["--config", MOE_CONFIG, "--distributed.ep=2", f"--moe.dispatch={dispatch}"])
        job = validate_job(cfg, world_size=2, target=planned_gpus(1000))
        assert job.build.moe_padded_dispatch == (dispatch == "padded")
        return {row.what: row.bytes for row in job.memory_plan.rows}

    padded, sized = plan("padded"), plan("sized")
    assert padded.keys() == sized.keys()
    moved = {what for what in sized if padded[what] != sized[what]}
    assert moved == {"activations"} and padded["activations"] > sized["activations"], (padded, sized)
    args = moe_args_for("debug_moe")
    one, two = (block_activation_bytes(args, ActivationPolicy(compiled=False, routed_slots=s), ffn_dim=0, fp8_mlp=False,
                                       routed_rows=args.top_k, routed_dim=args.moe_ffn_dim) for s in (1, 2))
    assert two[0] - one[0] == args.top_k * (6 * args.dim + 8 * args.moe_ffn_dim)  # eager: one more slot's rows
