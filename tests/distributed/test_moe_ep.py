"""Expert parallelism reproduces the 1-process MoE run (gloo, 2 and 4 CPU processes, spawned functions): compiled,
in float64 over 50 steps, and gradient by gradient. The CLI under torchrun (the layouts' runs, checkpoints moving
between ep layouts, a one-line error): tests/cli/test_moe_ep.py.

Same seed, same global batch: the sequence-wise aux loss and the globally summed expert
loads make every term layout-independent, so fp32 losses agree to rounding.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.distributed.spawn import (gradients_of_one_step, run_distributed, train_and_read_metrics,
                                    train_then_one_process_in_float64)
from tests.helpers import REPO, column

MOE_CONFIG = str(REPO / "configs" / "train" / "debug_moe.toml")
ARGS = ["--config", MOE_CONFIG, "--train.seq_len=64", "--train.steps=4", "--metrics.log_freq=1",
        "--metrics.enable_tensorboard=false"]
FP32 = ["--train.mixed_precision=fp32"]
# Qwen3-MoE's shapes (q/k norms, no shared experts, blocks 1 and 3 MoE) in place of debug_moe's.
QWEN3_MOE_CONFIG = str(REPO / "configs" / "train" / "qwen3_moe_debug.toml")
CKPT = ["--checkpoint.enable=true", "--checkpoint.interval=2"]
# Held-out loss at steps 2 and 4 over 8 samples (validation.steps x batch_size x dp ranks = 8 where used).
VAL = ["--validation.enable=true", "--validation.freq=2", "--validation.steps=2"]


def assert_same_run(got: list[dict], ref: list[dict], *, rel: float = 1e-5) -> None:
    assert column(got, "step") == column(ref, "step")
    assert column(got, "loss") == pytest.approx(column(ref, "loss"), rel=rel)
    assert column(got, "aux_loss") == pytest.approx(column(ref, "aux_loss"), rel=rel)
    assert column(got, "grad_norm") == pytest.approx(column(ref, "grad_norm"), rel=10 * rel)
    # Expert loads are summed over all ranks before the bias moves: the same routing everywhere.
    assert column(got, "moe/imbalance_max") == pytest.approx(column(ref, "moe/imbalance_max"), rel=rel)
    if any("val_loss" in r for r in got):  # evaluation through EP's all-to-all, the same held-out samples
        val = [(r["step"], r["val_loss"]) for r in got if "val_loss" in r]
        assert val == [(r["step"], pytest.approx(r["val_loss"], rel=rel)) for r in ref if "val_loss" in r]


@pytest.mark.parametrize("args", [[], ["--distributed.ep=2"]], ids=["dp_shard2", "ep2"])
def test_gpt_oss_run_matches_single_process(args: list[str], tmp_path: Path) -> None:
    """4 steps of GPT-OSS under FSDP (and EP): the losses, aux loss, gradient norms, expert loads and held-out
    losses of the 1-process run."""
    ref = run_distributed(train_and_read_metrics, world_size=1, args=(
        [*ARGS, *FP32, *VAL, *GPT_OSS, "--train.batch_size=4"], str(tmp_path / "ref")))[0]
    got = run_distributed(train_and_read_metrics, world_size=2, args=(
        [*ARGS, *FP32, *VAL, *GPT_OSS, "--train.batch_size=2", *args], str(tmp_path / "got")))[0]
    assert_same_run(got, ref)
    assert any("val_loss" in r for r in got)


def test_compiled_moe_under_ep2_matches_eager_single_process(moe_ep_reference, tmp_path: Path) -> None:
    # MoE blocks compile with graph breaks (the EP split sizes are read on the host; the CPU grouped GEMM
    # stays eager), the loss compiles whole; Inductor reorders fp32 reductions.
    got = run_distributed(train_and_read_metrics, world_size=2, args=(
        [*ARGS, *FP32, "--train.batch_size=2", "--distributed.ep=2", "--train.compile_model=true"], str(tmp_path)))[0]
    ref = moe_ep_reference["metrics"]
    assert column(got, "step") == column(ref, "step")
    assert column(got, "loss") == pytest.approx(column(ref, "loss"), rel=1e-4)
    assert column(got, "aux_loss") == pytest.approx(column(ref, "aux_loss"), rel=1e-4)
    assert column(got, "grad_norm") == pytest.approx(column(ref, "grad_norm"), rel=1e-3)


def test_per_op_selective_ac_under_ep2_over_the_whole_shard_group_matches_single_process(moe_ep_reference,
                                                                                         tmp_path: Path) -> None:
    """The per-op selective policy at ep = dp_shard = 2, where the routed experts are no FSDP2 unit (whose hooks,
    run again in the recompute, it rejects; other ep layouts still refuse it): the single-process run. Measured
    compiled too, the same losses to 1e-7."""
    got = run_distributed(train_and_read_metrics, world_size=2, args=(
        [*ARGS, *FP32, "--train.batch_size=2", "--distributed.ep=2", "--train.activation_checkpointing=selective",
         "--train.selective_ac_every=0"], str(tmp_path)))[0]
    ref = moe_ep_reference["metrics"]
    assert column(got, "step") == column(ref, "step")
    assert column(got, "loss") == pytest.approx(column(ref, "loss"), rel=1e-5)
    assert column(got, "grad_norm") == pytest.approx(column(ref, "grad_norm"), rel=1e-4)


def compiled_moe_blocks_under_ep2(cases: list[tuple[str, float, str]], padded: bool = False,
                                  capture_host_reads: bool = True) -> list[dict]:
    """On each of 2 ranks, for each (dispatch, capacity_factor, dtype): debug_moe's first MoE block with its experts
    split over ep=2 (`dispatch`: the moe.dispatch_dtype; `padded`: moe.dispatch='padded'), run eagerly and then
    compiled by `apply_compile` as training compiles it: the graphs and graph breaks dynamo made, and the compiled
    forward's output and gradients against the eager ones (largest difference over each tensor's largest value).
    capture_host_reads=False: dynamo's capture of host reads turned off again after apply_compile turned it on, so
    that every read of a device value on the host breaks the graph."""
    import torch._dynamo
    import torch.distributed as dist
    from torch._dynamo.utils import counters
    from torch.distributed.device_mesh import init_device_mesh

    from trainer.models.layers import rope_cache
    from trainer.models.moe import MoETransformer, moe_args_for
    from trainer.parallel.compile import apply_compile
    from trainer.parallel.expert_parallel import apply_ep

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))
    results = []
    for dispatch, capacity_factor, dtype in cases:
        args = moe_args_for("debug_moe", capacity_factor=capacity_factor)
        model = MoETransformer(args)
        model.init_weights(seed=0)
        apply_ep(model, mesh, dispatch_dtype=dispatch, padded=padded)
        model.to(getattr(torch, dtype))
        name = next(n for n, block in model.layers.items() if getattr(block, "moe", None) is not None)
        g = torch.Generator().manual_seed(dist.get_rank())
        x, grad = (torch.randn(2, 64, args.dim, generator=g).to(getattr(torch, dtype)) for _ in range(2))
        rope = rope_cache(args, 64)

        def run(block) -> list[torch.Tensor]:
            model.zero_grad(set_to_none=True)
            xx = x.clone().requires_grad_()
            block(xx, rope).backward(grad)
            params = model.layers[name].parameters()
            return [xx.grad, *(p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in params)]

        eager = run(model.layers[name])
        torch._dynamo.reset()
        counters.clear()
        apply_compile(model, context_parallel=False)
        torch._dynamo.config.capture_scalar_outputs = capture_host_reads
        compiled = run(model.layers[name])
        results.append({"graphs": counters["stats"]["unique_graphs"], "breaks": sum(counters["graph_break"].values()),
                        "error": max(((c.float() - e.float()).abs().max() / e.float().abs().max()).item()
                                     for c, e in zip(compiled, eager))})
    return results


def test_moe_block_under_ep2_compiles_as_one_graph_and_computes_what_eager_does() -> None:
    # The host reads the split sizes (and, dropping tokens, the kept count) inside the block; traced as symbolic
    # sizes (capture_scalar_outputs) the block is one graph, where each read broke it once per Python frame
    # around it (9 graphs a block, 11 with fp8 dispatch), each piece a guard check and launches on the host.
    # bf16 takes the GPU's path, torch._grouped_mm inside the graph; fp32 (the CPU grouped GEMM eager, a break of
    # its own) compares values: in bf16 a router input rounded otherwise flips near-tied expert choices, which
    # token dropping then spreads to other tokens, so only fp32's rounding keeps both runs' routing the same.
    cases = [("bf16", 1.0, "bfloat16"), ("fp8", 0.0, "bfloat16"), ("bf16", 1.0, "float32"), ("fp8", 1.0, "float32")]
    for rank in run_distributed(compiled_moe_blocks_under_ep2, world_size=2, args=(cases,)):
        bf16_drop, fp8_dispatch, fp32_drop, fp32_fp8_dispatch = rank
        assert (bf16_drop["graphs"], bf16_drop["breaks"]) == (1, 0), rank
        assert (fp8_dispatch["graphs"], fp8_dispatch["breaks"]) == (1, 0), rank
        # Inductor reorders fp32 reductions (as in the compiled runs above): ~1e-6 of a value, 1e-4 bounds it.
        # Measured: 4e-7 and 5e-7 (fp32's CPU path is 10 graphs: its eager grouped GEMMs break it).
        assert fp32_drop["error"] < 1e-4, rank
        # fp8 dispatch rounds the same fp32 inputs to e4m3 in both runs, an input that moved by 1e-6 of itself
        # landing on the neighbouring e4m3 value at the most, one ulp of 3 mantissa bits: 2^-3 of that element.
        assert fp32_fp8_dispatch["error"] < 2**-3, rank


def test_the_padded_moe_block_reads_nothing_on_the_host() -> None:
    """moe.dispatch='padded' (tests/distributed/test_moe_ep_padded.py): compiled without capturing host reads, its
    block is one graph with no break; the sized dispatch's breaks at its split sizes' read (what the padded
    all-to-all removes: the host waits there)."""
    bf16 = [("bf16", 0.0, "bfloat16")]
    for rank in run_distributed(compiled_moe_blocks_under_ep2, world_size=2, args=(bf16, True, False)):
        assert (rank[0]["graphs"], rank[0]["breaks"]) == (1, 0), rank
    for rank in run_distributed(compiled_moe_blocks_under_ep2, world_size=2, args=(bf16, False, False)):
        assert rank[0]["breaks"] > 0, rank


def compute_inside_all_to_alls(args: list[str], dump: str) -> list[list[int]]:
    """The trainer's first forward and backward under `args` (ep=2, compiled, FSDP2 as training wraps it): per inductor
    graph that holds all-to-alls, how many GEMMs run between each token all-to-all's start and its wait, in the order
    of the waits."""
    import re

    from torch._inductor.utils import run_and_get_code

    from trainer.config import load_job_config
    from trainer.distributed import destroy_distributed
    from trainer.run.train import build_trainer

    trainer = build_trainer(load_job_config([*args, f"--job.dump_folder={dump}"]))
    try:
        _, codes = run_and_get_code(lambda: trainer.step_fn.forward_backward(trainer.data_loader.next_batch()))
    finally:
        trainer.close()
        destroy_distributed()
    graphs = []
    for code in codes:
        windows, started = [], {}
        for line in code[code.index("def call("):].split("\n"):  # the graph's body, after the kernels' sources
            if line.strip().startswith("#"):
                continue
            start = re.match(r"\s*(buf\d+) = torch\.ops\._c10d_functional\.all_to_all_single\.default\(", line)
            wait = re.search(r"_c10d_functional\.wait_tensor\.default\((buf\d+)\)", line)
            if start:
                started[start.group(1)] = 0
            elif wait and wait.group(1) in started:
                windows.append(started.pop(wait.group(1)))
            elif "extern_kernels.mm(" in line or "extern_kernels._grouped_mm(" in line:
                started = {buf: n + 1 for buf, n in started.items()}
        if windows:
            graphs.append(windows)
    return graphs


@pytest.mark.parametrize("dispatch, overlaps", [("padded", (True, False)), ("sized", (True,))])
def test_compiled_moe_block_runs_the_shared_experts_gemms_while_its_all_to_alls_cross(
        dispatch: str, overlaps: tuple[bool, ...], tmp_path: Path) -> None:
    """moe.overlap_all_to_all: dynamo puts each all-to-all's wait right after it, so as traced no compute overlaps the
    rows crossing; the pass (trainer.parallel.comm_overlap) moves what does not need them inside. At ep = dp_shard the
    routed experts are no FSDP2 unit (trainer.parallel.fsdp), so the whole block is one graph. Forward, beside the
    combine: the shared expert's gate and up projections (on a CPU inductor folds the residual add into its down
    projection, an addmm that then needs the combined rows; on a GPU it keeps them apart). Backward, beside the
    combine's gradient: the input and weight gradients of the shared expert's 3 projections (6 GEMMs); beside the
    dispatch's gradient: the routed experts' 3 weight gradients (grouped GEMMs) and the router's weight gradient
    (with the experts an FSDP2 unit of their own, whose hooks ended the graph there, it was outside). Off, none."""
    for overlap in overlaps:
        args = [*ARGS, "--train.batch_size=2", "--distributed.ep=2", "--train.compile_model=true",
                "--train.mixed_precision=bf16", f"--moe.dispatch={dispatch}", f"--moe.overlap_all_to_all={overlap}"]
        for rank in run_distributed(compute_inside_all_to_alls, world_size=2, args=(args, str(tmp_path / str(overlap)))):
            forward, backward = rank[0], rank[-1]  # one MoE block's graphs: every other block shares them
            assert len(rank) == 2 and len(forward) >= 2 and len(backward) == 2, rank
            if overlap:
                assert max(forward) >= 2 and backward == [6, 4], rank
            else:
                assert max(forward) == max(backward) == 0, rank


def test_ep2_equals_single_process_in_float64_for_50_steps(tmp_path: Path) -> None:
    # In fp32 an ep=2 run follows the 1-process run to ~1e-5 only until rounding flips a near-tied top-k
    # choice of some token (debug_moe at seq_len 128: first at step 11, an exact fp32 tie); each flip moves
    # that token's output and the loads that move the expert biases, and by step 30 the runs differ by
    # ~1e-4 in the loss and a few % in the gradient norm: rounding, not EP (docs/moe.md). In float64 the
    # runs differ by ~1e-12, far below the smallest top-k margins (>= 5e-8), so no choice flips and the
    # whole EP path (dispatch, expert gradients divided by dp, the balancer's global loads, the norm over
    # the ep mesh, AdamW on sharded experts) must give the same run at every step.
    # 2 MoE layers of 32-token sequences: every part of the path, at ~60% of debug_moe's cost.
    args = [*ARGS, *FP32, "--train.steps=50", "--model.n_layers=3", "--train.seq_len=32",
            "--optimizer.implementation=foreach"]
    got, ref = run_distributed(train_then_one_process_in_float64, world_size=2, args=(
        [*args, "--train.batch_size=2", "--distributed.ep=2"], [*args, "--train.batch_size=4"], str(tmp_path)))[0]
    assert column(got, "step") == column(ref, "step") == list(range(1, 51))
    # float64 sums in another order differ by ~1e-16 and grow over 50 steps of training (<= 5e-12 measured);
    # 1e-9 is far below what one fp32 rounding anywhere in the step (>= 6e-8) or one routing flip makes.
    # Measured: loads summed per rank instead of over the stage, expert gradients not divided by dp, or a
    # norm not summed over the ep shards each miss by >= 2e-3 within 2 steps.
    assert column(got, "grad_norm") == pytest.approx(column(ref, "grad_norm"), rel=1e-9, abs=0)
    assert column(got, "aux_loss") == pytest.approx(column(ref, "aux_loss"), rel=1e-9, abs=0)
    assert column(got, "loss") == pytest.approx(column(ref, "loss"), rel=2**-22, abs=0)  # logged as fp32: 2 ulps
    # Ratios of token counts: every token chose the same experts in both runs, every step.
    assert column(got, "moe/imbalance_max") == column(ref, "moe/imbalance_max")


# -- gradients ----------------------------------------------------------------
# Adam is blind to a constant factor on one parameter's gradient, so losses alone would
# not catch a wrongly scaled expert gradient: compare every gradient after one backward.


def _grads(tmp_path: Path, name: str, nproc: int, args: list[str], *, config: str = MOE_CONFIG
           ) -> dict[str, torch.Tensor]:
    argv = ["--config", config, *ARGS[2:], *FP32, *args]  # ARGS with another config
    return run_distributed(gradients_of_one_step, world_size=nproc, args=(argv, str(tmp_path / name)))[0]


# GPT-OSS (trainer/models/gpt_oss.py): the experts' biases and fused gate/up sharded over ep like the weights, the
# attention biases and sinks FSDP-sharded, document masking with its sliding windows (the flavor's window, 16, is
# shorter than the 64-token rows).
GPT_OSS = ["--model.flavor=debug_gpt_oss", "--data.document_masking=true"]


@pytest.mark.parametrize(
    "config, nproc, args",
    [
        (MOE_CONFIG, 2, ["--train.batch_size=2", "--distributed.ep=2"]),
        (MOE_CONFIG, 4, ["--train.batch_size=1", "--distributed.ep=2"]),
        (MOE_CONFIG, 4, ["--train.batch_size=1", "--distributed.ep=2", "--distributed.dp_replicate=2",
                         "--distributed.dp_shard=2"]),
        (QWEN3_MOE_CONFIG, 2, ["--train.batch_size=2", "--distributed.ep=2"]),
        (QWEN3_MOE_CONFIG, 4, ["--train.batch_size=1", "--distributed.ep=4"]),  # 2 experts per rank
        (MOE_CONFIG, 2, [*GPT_OSS, "--train.batch_size=2"]),
        (MOE_CONFIG, 2, [*GPT_OSS, "--train.batch_size=2", "--distributed.ep=2"]),
        (MOE_CONFIG, 4, [*GPT_OSS, "--train.batch_size=1", "--distributed.ep=2", "--distributed.dp_replicate=2",
                         "--distributed.dp_shard=2"]),
    ],
    ids=["ep2", "ep2-x-dp_shard2", "hsdp2-x-ep2", "qwen3-ep2", "qwen3-ep4", "gpt_oss-dp_shard2", "gpt_oss-ep2",
         "gpt_oss-hsdp2-x-ep2"],
)
def test_every_ep_gradient_matches_single_process(config: str, nproc: int, args: list[str], tmp_path: Path) -> None:
    model = [a for a in args if a in GPT_OSS]  # the flavor (and its document masking): the reference's too
    ref = _grads(tmp_path, "ref", 1, [*model, "--train.batch_size=4"], config=config)
    got = _grads(tmp_path, "ep", nproc, args, config=config)
    assert got.keys() == ref.keys()
    if model:  # GPT-OSS's own parameters are among those compared, with gradients
        assert all(ref[f"layers.1.{name}"].norm() > 0 for name in (
            "attention.sinks", "attention.q_proj.bias", "moe.router.gate.bias", "moe.experts.b13", "moe.experts.w13"))
    for fqn, g in ref.items():
        err = ((got[fqn] - g).norm() / g.norm()).item()
        assert err < 1e-5, (fqn, err)


def test_experts_out_of_fsdp_divide_their_gradients_as_their_fsdp_unit_did(tmp_path: Path) -> None:
    """bf16 at ep=2 over 2 ranks: with bf16 master weights the routed experts are no FSDP2 unit and divide their own
    gradients (GroupedExperts.grad_divisor); with fp32 master weights their one-rank unit casts them and divides. Both
    multiply the same bf16 weights (the fp32 master rounds to them) and the same bf16 activations, and halving a bf16
    or fp32 gradient is exact, so the experts' gradients are equal; a missing or doubled division is off by 2x."""
    bf16 = ["--train.mixed_precision=bf16", "--train.batch_size=2", "--distributed.ep=2"]
    left_out = _grads(tmp_path, "bf16_master", 2, bf16)
    unit = _grads(tmp_path, "fp32_master", 2, [*bf16, "--distributed.master_dtype=fp32"])
    experts = [fqn for fqn in unit if ".moe.experts." in fqn]
    assert experts and left_out.keys() == unit.keys()
    for fqn in experts:
        assert left_out[fqn].dtype == torch.bfloat16 and unit[fqn].dtype == torch.float32, fqn
        assert torch.equal(left_out[fqn].float(), unit[fqn]), (fqn, (left_out[fqn].float() - unit[fqn]).abs().max())


# FP8 experts (emulated) with every Linear left bf16: rowwise scales depend on a row alone, so the layout
# cannot change what is quantized, only bf16 summation orders.
FP8_EXPERTS = ["--train.mixed_precision=fp8", "--float8.emulate=true", "--float8.exclude_fqns=layers,output_head"]


def test_fp8_experts_under_ep2_match_single_process(tmp_path: Path) -> None:
    def grads(name: str, nproc: int, args: list[str]) -> dict[str, torch.Tensor]:
        return run_distributed(gradients_of_one_step, world_size=nproc,
                               args=([*ARGS, *FP8_EXPERTS, *args], str(tmp_path / name)))[0]

    ref = grads("ref", 1, ["--train.batch_size=4", "--float8.moe_experts=rowwise"])
    got = grads("ep", 2, ["--train.batch_size=2", "--distributed.ep=2", "--float8.moe_experts=rowwise"])
    bf16_experts = grads("off", 1, ["--train.batch_size=4", "--float8.moe_experts=off"])
    assert got.keys() == ref.keys()
    for fqn, g in ref.items():
        err = ((got[fqn].float() - g.float()).norm() / g.float().norm()).item()
        assert err < 1e-2, (fqn, err)  # bf16 gradients, summed in other orders
    w1 = "layers.1.moe.experts.w1"
    err = ((bf16_experts[w1].float() - ref[w1].float()).norm() / ref[w1].float().norm()).item()
    assert err > 3e-2, err  # the FP8 experts ran: their gradient is an FP8 rounding away from the bf16 one
