"""A projection, not a measurement: the per-GPU step of a multi-machine FSDP2 job from measured one-GPU compute and the
bytes each collective moves.

    python scripts/project_scaling.py --config configs/train/7b_16gpu_fp8.toml --world-size 16
    python scripts/project_scaling.py --config configs/train/7b_16gpu_fp8.toml --world-size 16 -- --train.mixed_precision=bf16

The job is resolved by the validation pass for `--world-size` ranks on machines of `--ranks-per-node` GPUs (as the dry
run does: FSDP2's automatic choices, the FP8 layers, AC), then:

- compute: the model FLOPs of a step (and the forward again under full AC) at `--tflops`, the one-GPU model TFLOP/s
  measured on the same kind of GPU without AC (its optimizer step taken out, `--optimizer-share`, and added back for
  this rank's 1/N of the parameters), slowed by `--efficiency`, the share of one GPU's step measured on 2 GPUs of one
  machine (the casts, copies and SMs the collectives take beside the compute);
- communication: ring collectives, each rank moving (N-1)/N of a unit's bytes at `--nvlink-gbs` (bus bandwidth, a
  shard group within a machine) or `--network-gbs` (per GPU, a shard group across machines). Each block's all-gather
  (per microbatch in forward, again in backward when resharded) hides behind the previous block's compute and its
  reduce-scatter behind the next block's backward; what exceeds the compute it overlaps is exposed, and so are the
  root unit's (embedding, final norm, head) gather at each microbatch's start and its reduce-scatter at each
  backward's end, which have nothing to overlap.

The defaults are the 1x H100 8B-shapes measurements of docs/benchmarks.md (fp8 832.2, bf16 598.5 model TFLOP/s; the
AdamW kernel 7% of the fp8 step; dp_shard=2 kept 97.1% / 97.6%) and a machine of 8 GPUs with 8 x 400 Gb/s InfiniBand.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.config import load_job_config  # noqa: E402
from trainer.models import family_of, flops_per_token, pipeline_costs  # noqa: E402
from trainer.validate import ResolvedJob, validate_job  # noqa: E402
from trainer.validate.memory import planned_gpus  # noqa: E402
from trainer.validate.resolve import shard_group_on_one_node  # noqa: E402

MEASURED_TFLOPS = {"fp8": 832.2, "bf16": 598.5}  # 1x H100, 8B shapes x 8 layers, no AC (docs/benchmarks.md)
MEASURED_TWO_GPU_SHARE = {"fp8": 0.971, "bf16": 0.976}  # dp_shard=2 of one GPU, 2x H200 (docs/benchmarks.md)
H100_DENSE_BF16 = 989e12


@dataclass
class Unit:
    name: str
    gather_bytes: float  # the unit's weights as all-gathered
    reduce_bytes: float  # its gradients as reduce-scattered
    compute_s: float  # forward + backward (+ recompute) per microbatch


def units(job: ResolvedJob, *, seconds_per_flop: float) -> tuple[list[Unit], Unit]:
    """(the blocks, the root unit): what each all-gathers and reduce-scatters and the compute beside it."""
    args, run, build = job.model_args, job.run, job.build
    fp8_gather = build.float8 is not None and build.float8.enable_fsdp_float8_all_gather
    layers = job.float8_layers or {}
    gather_bytes = build.fsdp.param_dtype.itemsize if build.fsdp.param_dtype else build.fsdp.master_dtype.itemsize
    reduce_bytes = build.fsdp.reduce_dtype.itemsize
    tokens = run.batch_size * run.seq_len
    _, block_flops, head_flops = pipeline_costs(args, run.seq_len)
    recompute = 1 / 3 if build.ac.mode == "full" else 0.0  # full AC runs each block's forward again in backward
    family = family_of(args)
    blocks = []
    for i, flops in enumerate(block_flops):
        linear = [fqn for fqn in layers if fqn.startswith(f"layers.{i}.")]
        converted = sum(_linear_params(args, fqn) for fqn in linear if layers[fqn] == "converted")
        params = family.block_params(args, i)[0]  # a dense block (MoE experts under ep are not modelled)
        other = params - converted
        per_param = 1 if fp8_gather else gather_bytes
        blocks.append(Unit(f"block {i}", converted * per_param + other * gather_bytes, params * reduce_bytes,
                           flops * tokens * (1 + recompute) * seconds_per_flop))
    head = args.dim * args.vocab_size
    head_gather = head * (1 if fp8_gather and layers.get("output_head.proj") == "converted" else gather_bytes)
    root = Unit("root", head_gather + (head + args.dim) * gather_bytes, (2 * head + args.dim) * reduce_bytes,
                head_flops * tokens * seconds_per_flop)
    return blocks, root


def _linear_params(args, fqn: str) -> int:
    name = fqn.rsplit(".", 1)[1]
    attn = {"q_proj": args.n_heads * args.head_dim, "k_proj": args.n_kv_heads * args.head_dim,
            "v_proj": args.n_kv_heads * args.head_dim, "o_proj": args.n_heads * args.head_dim}
    return args.dim * (attn[name] if name in attn else args.ffn_dim)


def project(job: ResolvedJob, *, tflops: float, share: float, optimizer_share: float, bus_gbs: float) -> dict:
    pd, run = job.parallel_dims, job.run
    n, m = pd.fsdp_shard, run.grad_accum_steps
    rate = tflops * 1e12 / (1 - optimizer_share) * share  # model FLOP/s of the forward and backward alone
    blocks, root = units(job, seconds_per_flop=1 / rate)
    ring = (n - 1) / n / (bus_gbs * 1e9)  # seconds per byte of a unit
    regather = 2 if job.build.fsdp.reshard_after_forward else 1
    exposed = {"all-gather": 0.0, "reduce-scatter": 0.0, "root unit": 0.0}
    moved = {"all-gather": 0.0, "reduce-scatter": 0.0, "root unit": 0.0}
    for b in blocks:  # forward: hidden behind a block's forward (a third of its compute); backward: behind its backward
        ag, rs = b.gather_bytes * ring, b.reduce_bytes * ring
        moved["all-gather"] += b.gather_bytes * m * regather
        moved["reduce-scatter"] += b.reduce_bytes * m
        exposed["all-gather"] += m * regather * max(0.0, ag - b.compute_s / 3)
        exposed["reduce-scatter"] += m * max(0.0, rs - b.compute_s * 2 / 3)
    exposed["reduce-scatter"] += m * blocks[0].reduce_bytes * ring  # the last block's has no backward left to hide in
    exposed["root unit"] = m * (root.gather_bytes + root.reduce_bytes) * ring
    moved["root unit"] = m * (root.gather_bytes + root.reduce_bytes)
    compute = m * (sum(b.compute_s for b in blocks) + root.compute_s)
    optimizer = optimizer_share * _one_gpu_step(job, tflops) / n
    step = compute + optimizer + sum(exposed.values())
    tokens = run.batch_size * run.seq_len * m
    flops = flops_per_token(job.model_args, run.seq_len)
    return {"step_s": step, "compute_s": compute, "optimizer_s": optimizer, "exposed": exposed, "moved": moved,
            "tokens_per_s": tokens / step, "tflops": flops * tokens / step / 1e12, "n": n}


def _one_gpu_step(job: ResolvedJob, tflops: float) -> float:
    """The seconds one GPU would take for this rank's tokens at the measured rate (the optimizer's share scales)."""
    run = job.run
    tokens = run.batch_size * run.seq_len * run.grad_accum_steps
    return flops_per_token(job.model_args, run.seq_len) * tokens / (tflops * 1e12)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--ranks-per-node", type=int, default=8)
    parser.add_argument("--tflops", type=float, help="one GPU's measured model TFLOP/s (default: by precision)")
    parser.add_argument("--efficiency", type=float, help="dp_shard=2's share of one GPU (default: by precision)")
    parser.add_argument("--optimizer-share", type=float, default=0.07)
    parser.add_argument("--nvlink-gbs", type=float, default=350.0)
    parser.add_argument("--network-gbs", type=float, default=50.0)
    parser.add_argument("overrides", nargs="*", help="--section.key=value after --")
    a = parser.parse_args(argv)
    cfg = load_job_config(["--config", a.config, *a.overrides])
    target = dataclasses.replace(planned_gpus(79.2), ranks_per_node=a.ranks_per_node)
    job = validate_job(cfg, world_size=a.world_size, target=target)
    precision = "fp8" if job.build.float8 is not None else "bf16"
    tflops = a.tflops or MEASURED_TFLOPS[precision]
    share = a.efficiency or MEASURED_TWO_GPU_SHARE[precision]
    within = shard_group_on_one_node(job.parallel_dims, a.ranks_per_node)
    bus = a.nvlink_gbs if within else a.network_gbs
    p = project(job, tflops=tflops, share=share, optimizer_share=a.optimizer_share, bus_gbs=bus)
    print(f"PROJECTION (arithmetic, not a measurement): {a.config}, {a.world_size} GPUs, {precision}, "
          f"{job.parallel_dims.summary}; {job.fsdp_choices or 'one rank per shard group'}")
    print(f"inputs: one GPU {tflops} model TFLOP/s without AC, {share:.1%} kept at 2 GPUs, optimizer "
          f"{a.optimizer_share:.0%} of one GPU's step, {'NVLink' if within else 'network'} {bus:g} GB/s per GPU")
    print("| | seconds a step | GB a rank receives a step |\n| --- | --- | --- |")
    print(f"| compute (AC {job.build.ac.mode}, {job.run.grad_accum_steps} microbatches) | {p['compute_s']:.3f} | |")
    print(f"| optimizer (1/{p['n']} of the parameters) | {p['optimizer_s']:.3f} | |")
    for k, v in p["exposed"].items():
        print(f"| exposed {k} | {v:.3f} | {p['moved'][k] * (p['n'] - 1) / p['n'] / 1e9:.1f} |")
    print(f"| **step** | **{p['step_s']:.3f}** | |")
    print(f"per GPU: {p['tokens_per_s']:,.0f} tokens/s, {p['tflops']:.0f} model TFLOP/s, "
          f"MFU {p['tflops'] * 1e12 / H100_DENSE_BF16:.1%} (H100 dense bf16 peak)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
