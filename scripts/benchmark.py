"""Throughput of the real training path (Trainer.train_step) for one config in several precisions.

    python scripts/benchmark.py --config configs/train/llama3_8b.toml --precisions bf16,fp8 \
        --warmup 5 --steps 15 -- --model.n_layers=8 --train.batch_size=4 --train.seq_len=4096 \
        --data.source=synthetic --train.activation_checkpointing=none --train.compile_model=true

With `--dry-run [--world-size N] [--gpu-memory-gib G]` (train.py's flags) nothing runs: each precision's job is
validated for N ranks and its memory plan printed, as `scripts/train.py --dry-run` does (with --emulate-gpus E: for
the E GPUs emulated), exit 3 when a plan does not fit its GPU. scripts/gpu_checks.sh's GPU_CHECKS_DRY_RUN checks its
multi-GPU steps this way.

`--inductor KEY=VALUE` (repeatable) sets one of torch._inductor.config's options for every run, e.g.
`--inductor triton.prefer_nd_tiling=true`: an inductor option measured before the trainer adopts it.

A precision may name an FP8 recipe, `fp8:RECIPE` (e.g. `--precisions bf16,fp8,fp8:blockwise`): that run adds
`--float8.recipe=RECIPE` after the overrides.

The runs' job.dump_folder is `--dump-folder` (default `outputs/benchmark/<config file stem>`), never the
config's own: a Trainer starting fresh moves an earlier run's metrics.jsonl and tb/ aside, and a benchmark must not
do that to a training run's. An override `--job.dump_folder` is refused for the same reason.

Everything after `--` is a normal config override. Prints, per precision: tokens/s per
GPU, model TFLOP/s per GPU (6 N_non-embedding + 12 L H Dh S per token), MFU against
the GPU's dense bf16 peak from trainer.metrics.logger.PEAK_BF16_FLOPS (the same table the
training log uses; n/a on CPU or an unknown GPU), peak memory beside the dry run's estimate of it, and the speedup over
the first precision. After --warmup steps (compilation happens there), --steps steps run back
to back as in training and are timed together between two device syncs.

It also times the optimizer part of a step alone (grad norm, clipping, the non-finite skip and the
AdamW update: `TrainStep.optimizer_step`, between device syncs, after a forward/backward) and, once
the model is freed, the reference: torch's `AdamW(fused=True)` over plain tensors of the same local
shapes and dtype, plus one read of their gradients for a norm. Both are printed in ms and in GB/s
of the bytes an AdamW step must move (read weight, gradient and two moments, write three).
"""

from __future__ import annotations

import argparse
import difflib
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

# The checkout this script is in comes first, even when another copy of trainer is installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch._inductor.config as inductor_config

from trainer.cli import dry_run_flags
from trainer.config import ConfigError, load_job_config
from trainer.distributed import destroy_distributed
from trainer.errors import UserError
from trainer.log import setup_logging
from trainer.metrics.logger import device_peak_flops
from trainer.metrics.trace_summary import format_summary, load_trace_events, summarize_events
from trainer.models import flops_per_token
from trainer.optim.states import StateDtypes
from trainer.parallel.compile import CompileTimes
import trainer.parallel.float8.linear as fp8_linear
from trainer.run.dry_run import EXIT_DOES_NOT_FIT, dry_run
from trainer.run.train import Trainer, build_trainer
from trainer.validate.plan import plan_ranks



def mfu_pct(model_flops_per_s: float, device: torch.device) -> float | None:
    """Model FLOP/s as a percentage of the device's dense bf16 peak; None where the peak is unknown."""
    peak = device_peak_flops(device)
    return 100 * model_flops_per_s / peak if peak else None


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def state_bytes_per_param(master_dtype: str, bf16_update: str, exp_avg: str = "auto", exp_avg_sq: str = "auto") -> float:
    """Bytes per parameter that FSDP2 shards: master weight, its gradient and AdamW's two moments (in
    optimizer.exp_avg_dtype / exp_avg_sq_dtype; + Kahan buffer)."""
    sizes = StateDtypes.resolve(bf16_master=master_dtype == "bf16", exp_avg=exp_avg, exp_avg_sq=exp_avg_sq
                                ).bytes_per_param(kahan=master_dtype == "bf16" and bf16_update == "kahan")
    return sum(sizes.values()) + sizes["master"]


def memory_cap_bytes(*, local_params: int, bytes_per_param: float, world: int, emulate_gpus: int, gpu_bytes: int) -> int:
    """What one rank of this job may use to behave like one rank of the same job on `emulate_gpus` GPUs of
    `gpu_bytes` each: the sharded state shrinks by world / emulate_gpus there, everything else is the same.
    """
    state_here = local_params * bytes_per_param
    return int(gpu_bytes - state_here * world / emulate_gpus + state_here)


def cap_memory(runner: Trainer, *, emulate_gpus: int, gpu_gib: float) -> float:
    """Cap this process's CUDA allocator (torch.cuda.set_per_process_memory_fraction); returns the cap in GiB."""
    device = runner.device
    local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in runner.model.parameters())
    master = "bf16" if next(runner.model.parameters()).dtype == torch.bfloat16 else "fp32"
    o = runner.job.optimizer
    dtypes = o.state_dtypes
    per_param = state_bytes_per_param(master, o.bf16_update or "stochastic", dtypes.exp_avg, dtypes.exp_avg_sq)
    cap = memory_cap_bytes(local_params=local, bytes_per_param=per_param, world=runner.env.world_size,
                           emulate_gpus=emulate_gpus, gpu_bytes=int(gpu_gib * 2**30))
    total = torch.cuda.get_device_properties(device).total_memory
    if cap > total:
        raise SystemExit(f"error: emulating {emulate_gpus} GPUs of {gpu_gib} GiB needs {cap / 2**30:.1f} GiB per "
                         f"process here, more than this GPU's {total / 2**30:.1f} GiB; use more GPUs")
    torch.cuda.set_per_process_memory_fraction(cap / total, device)
    return cap / 2**30


def adamw_bytes(numel: int, dtype: torch.dtype, moment_bytes: float | None = None) -> int:
    """Bytes one AdamW step over `numel` elements of `dtype` must move, and one more read of the gradients (the
    norm): read weight, gradient and two moments, write weight and moments. moment_bytes: the two moments' bytes per
    element together where they are not in `dtype` (optimizer.exp_avg_dtype / exp_avg_sq_dtype)."""
    moments = 2 * dtype.itemsize if moment_bytes is None else moment_bytes
    return int(numel * (dtype.itemsize * 4 + 2 * moments))


def time_optimizer(runner: Trainer, *, repeats: int = 10) -> tuple[float, list[tuple[int, ...]], torch.dtype]:
    """Median seconds of `TrainStep.optimizer_step` (each after a forward/backward), and the local shapes and dtype
    of the parameters it updated."""
    device, times = runner.device, []
    for _ in range(repeats):
        runner.step_fn.forward_backward(runner.data_loader.next_batch())
        sync(device)
        start = time.perf_counter()
        runner.step_fn.optimizer_step(runner.state.step + 1)
        sync(device)
        times.append(time.perf_counter() - start)
    local = [p.to_local() if hasattr(p, "to_local") else p for p in runner.model.parameters()]
    return statistics.median(times), [tuple(t.shape) for t in local], local[0].dtype


def profile_optimizer(runner: Trainer, trace_dir: Path) -> None:
    """Trace one optimizer step (after a forward/backward) and print its kernel summary: where its time goes."""
    runner.step_fn.forward_backward(runner.data_loader.next_batch())
    sync(runner.device)
    trace_dir.mkdir(parents=True, exist_ok=True)
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        with torch.profiler.record_function("ProfilerStep#1"):
            runner.step_fn.optimizer_step(runner.state.step + 1)
            sync(runner.device)
    path = trace_dir / _trace_name("optimizer_trace", runner)
    prof.export_chrome_trace(str(path))
    print(_rank_header(runner) + format_summary(summarize_events(load_trace_events(str(path)), num_steps=1), top=12),
          flush=True)


def reference_optimizer(shapes: list[tuple[int, ...]], dtype: torch.dtype, device: torch.device, *,
                        repeats: int = 10) -> float:
    """Median seconds of torch.optim.AdamW(fused=True) over plain tensors of these shapes, with one norm of the
    gradients (a read of them all) before each step."""
    params = [torch.nn.Parameter(torch.randn(s, dtype=dtype, device=device)) for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    grads = [p.grad for p in params]
    for _ in range(2):  # creates the moments; warms the kernels and the allocator
        opt.step()
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        torch.stack(torch._foreach_norm(grads, 2.0)).norm()
        opt.step()
        sync(device)
        times.append(time.perf_counter() - start)
    del params, grads, opt
    return statistics.median(times)


def inductor_options(items: list[str]) -> dict:
    """`--inductor KEY=VALUE` items -> {key: value} for torch._inductor.config.patch, each key one of inductor's
    options (`triton.prefer_nd_tiling=true`, `coordinate_descent_tuning=1`) and its value of that option's type;
    a ValueError that names the bad item otherwise."""
    known, options = inductor_config.get_config_copy(), {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep:
            raise ValueError(f"--inductor {item}: expected KEY=VALUE")
        if key not in known:
            near = difflib.get_close_matches(key, list(known), n=1)
            raise ValueError(f"--inductor {item}: inductor has no option {key!r}"
                             + (f" (did you mean {near[0]}?)" if near else ""))
        current = known[key]
        if isinstance(current, bool):
            if raw.lower() not in ("true", "false", "1", "0"):
                raise ValueError(f"--inductor {item}: {key} is true or false")
            options[key] = raw.lower() in ("true", "1")
        elif isinstance(current, (int, float)) or current is None:
            try:
                options[key] = type(current)(raw) if current is not None else int(raw)
            except ValueError:
                raise ValueError(f"--inductor {item}: {key} is a number") from None
        elif isinstance(current, str):
            options[key] = raw
        else:
            raise ValueError(f"--inductor {item}: {key} holds a {type(current).__name__}; only booleans, numbers "
                             "and strings can be set here")
    return options


def precision_overrides(precision: str) -> list[str]:
    """`bf16` -> [--train.mixed_precision=bf16]; `fp8:blockwise` -> [... =fp8, --float8.recipe=blockwise]."""
    name, _, recipe = precision.partition(":")
    return [f"--train.mixed_precision={name}", *([f"--float8.recipe={recipe}"] if recipe else [])]


def bench_one(argv: list[str], precision: str, *, warmup: int, steps: int, profile_dir: str | None,
              emulate: tuple[int, float] | None = None) -> dict:
    result, shapes, dtype, device = _bench_runner(argv, precision, warmup=warmup, steps=steps,
                                                  profile_dir=profile_dir, emulate=emulate)
    numel = sum(int(torch.Size(s).numel()) for s in shapes)
    result["reference_optimizer_ms"] = 1e3 * reference_optimizer(shapes, dtype, device)
    for key, moments in (("optimizer", result["moment_bytes"]), ("reference_optimizer", None)):
        result[f"{key}_gbps"] = adamw_bytes(numel, dtype, moments) / (result[f"{key}_ms"] / 1e3) / 1e9
    result["master_dtype"] = str(dtype).removeprefix("torch.")
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def ranks_values(value: float, world: int) -> list[float]:
    """Every rank's `value`, in rank order (all ranks call it; [value] in one process)."""
    if world == 1:
        return [value]
    values: list = [None] * world
    torch.distributed.all_gather_object(values, value)
    return values


def _bench_runner(argv: list[str], precision: str, *, warmup: int, steps: int, profile_dir: str | None,
                  emulate: tuple[int, float] | None):
    cfg = load_job_config([*argv, *precision_overrides(precision), "--train.precision_schedule=",
                           f"--train.steps={warmup + steps}", "--metrics.enable_tensorboard=false",
                           "--metrics.enable_jsonl=false"])
    runner = build_trainer(cfg)
    try:
        device, t = runner.device, cfg.train
        cap_gib = cap_memory(runner, emulate_gpus=emulate[0], gpu_gib=emulate[1]) if emulate else None
        warmup_times, compiled_before = [], CompileTimes.now()
        for _ in range(warmup):  # compilation, autotuning, allocator warm-up
            start = time.perf_counter()
            runner.train_step(runner.events.next_batch(runner.data_loader))  # metrics.event_log's marks, as in training
            sync(device)
            warmup_times.append(time.perf_counter() - start)
        compiled = CompileTimes.now().since(compiled_before)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        # Timed like training runs: steps back to back, no host sync between them.
        start = time.perf_counter()
        for _ in range(steps):
            runner.train_step(runner.events.next_batch(runner.data_loader))
        sync(device)
        step_s = (time.perf_counter() - start) / steps
        runner.check_finite()
        if profile_dir:
            profile_steps(runner, Path(profile_dir) / precision.replace(":", "_"))
        optimizer_s, shapes, dtype = time_optimizer(runner)
        if profile_dir:
            profile_optimizer(runner, Path(profile_dir) / precision.replace(":", "_"))
        world = runner.env.world_size
        tokens_per_gpu = t.batch_size * t.seq_len * t.grad_accum_steps * runner.parallel_dims.dp / world
        tps = tokens_per_gpu / step_s
        model_flops = tps * flops_per_token(runner.model_args, t.seq_len)
        peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
        job = runner.job
        return {
            "precision": precision,
            "world_size": world,
            "optimizer_ms": 1e3 * optimizer_s,
            "step_s": step_s,
            "tokens_per_s_per_gpu": tps,
            "model_tflops_per_gpu": model_flops / 1e12,
            "mfu_pct": mfu_pct(model_flops, device),
            "peak_memory_gib": peak,
            "plan_memory_gib": job.memory_plan.peak_bytes / 2**30,
            # Each rank's own peak, and the plan of each pipeline rank (one without pp): the pipeline's ranks differ.
            "peak_memory_gib_ranks": ranks_values(peak, world),
            "plan_memory_gib_pp_ranks": [p.peak_bytes / 2**30 for p in plan_ranks(
                cfg, job.model_args, job.parallel_dims, job.build, job.pipeline, job.float8_layers,
                cpu=device.type == "cpu")],
            "float8_converted": len(runner.float8.linears.converted) if runner.float8 else 0,
            "first_step_s": warmup_times[0],
            "compile_s": compiled.seconds,
            "torch_compile_s": compiled.torch_compile_s,
            "compiled_graphs": compiled.graphs,
            "autotune_s": compiled.autotune_s,
            "optimizer_kernel_compile_s": compiled.optimizer_kernel_s,
            "memory_cap_gib": cap_gib,
            "moment_bytes": (None if runner.job.optimizer.state_dtypes.in_master_dtype else sum(
                v for k, v in runner.job.optimizer.state_dtypes.bytes_per_param().items() if k != "master")),
        }, shapes, dtype, device
    finally:
        # The process group stays for the next precision, as between precision-schedule phases:
        # destroying and re-creating it under torchrun failed on NCCL (the new group's connect
        # raced the old one's store keys). main() destroys it once at the end.
        runner.close()
        del runner
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def profile_steps(runner: Trainer, trace_dir: Path, num_steps: int = 2) -> None:
    """Trace a few more steps and print the kernel summary (where the time goes)."""
    trace_dir.mkdir(parents=True, exist_ok=True)
    path = trace_dir / _trace_name("trace", runner)
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for i in range(num_steps):
            # Step markers: scripts/summarize_trace.py (and --ranks) count the trace's steps by them.
            with torch.profiler.record_function(f"ProfilerStep#{i + 1}"):
                runner.train_step(runner.data_loader.next_batch())
        sync(runner.device)
    prof.export_chrome_trace(str(path))
    print(_rank_header(runner) + format_summary(summarize_events(load_trace_events(str(path)), num_steps=num_steps),
                                                top=25), flush=True)


def _trace_name(stem: str, runner: Trainer) -> str:
    """trace.json.gz with one process; trace_rank1.json.gz (each rank its own) under torchrun."""
    return f"{stem}.json.gz" if runner.env.world_size == 1 else f"{stem}_rank{runner.env.rank}.json.gz"


def _rank_header(runner: Trainer) -> str:
    """Under torchrun every rank prints its summary (their steps differ in what they wait for): say whose."""
    return "" if runner.env.world_size == 1 else f"[summary of rank {runner.env.rank}]\n"


def dry_run_precisions(argv: list[str], args: argparse.Namespace, plan: dict) -> int:
    """--dry-run: each precision's job validated for its ranks (the emulated GPUs with --emulate-gpus) and planned."""
    if args.emulate_gpus:
        plan = plan | {"world_size": args.emulate_gpus, "gpu_gib": args.gpu_memory_gib}
    all_fit = True
    for p in args.precisions.split(","):
        print(f"== {args.label or args.config}, {p}:")
        try:
            text, fits = dry_run(load_job_config([*argv, *precision_overrides(p)]), **plan)
        except UserError as e:
            print(f"config error: {e}", file=sys.stderr)
            return 2
        print(text)
        all_fit &= fits
    return 0 if all_fit else EXIT_DOES_NOT_FIT


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--precisions", default="bf16,fp8")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--label", default="")
    parser.add_argument("--json", help="append one JSON line per precision to this file")
    parser.add_argument("--profile-dir", help="also trace 2 steps per precision here and print the kernel summary")
    parser.add_argument("--dump-folder", metavar="DIR",
                        help="the runs' job.dump_folder (default outputs/benchmark/<config file stem>; never the "
                             "config's own, whose metrics.jsonl and tb/ a fresh run would move aside)")
    parser.add_argument("--emulate-gpus", type=int, default=0,
                        help="cap each process's memory to what one of this many GPUs would have free for the same "
                             "job (its sharded weights, gradients and AdamW state shrink with more GPUs)")
    parser.add_argument("--own-fp8-linear", action="store_true",
                        help="fp8 tensorwise through our Float8TensorwiseLinear (trainer/parallel/float8/tensorwise.py) "
                             "even with dynamic scaling and bf16 saved inputs: times it against torchao's Float8Linear, "
                             "whose numbers it computes")
    parser.add_argument("--inductor", action="append", default=[], metavar="KEY=VALUE",
                        help="set one of torch._inductor.config's options for every run (repeatable), e.g. "
                             "triton.prefer_nd_tiling=true: to measure an inductor option before the trainer adopts it")
    parser.add_argument("--gpu-memory-gib", type=float, default=79.6,
                        help="memory of each emulated GPU (default 79.6 GiB: an H100 80GB)")
    args, overrides = parser.parse_known_args()
    try:
        overrides, plan = dry_run_flags(overrides)
    except ConfigError as e:
        parser.error(str(e))
    if args.emulate_gpus and not torch.cuda.is_available() and plan is None:
        parser.error("--emulate-gpus caps CUDA memory: it needs a GPU")
    if args.emulate_gpus < 0 or args.gpu_memory_gib <= 0:
        parser.error("--emulate-gpus must be >= 0 and --gpu-memory-gib > 0")
    try:
        inductor = inductor_options(args.inductor)
    except ValueError as e:
        parser.error(str(e))
    overrides = [o for o in overrides if o != "--"]
    if any(o.startswith("--job.dump_folder") for o in overrides):
        parser.error("the benchmark's folder is --dump-folder DIR, not the override --job.dump_folder")
    setup_logging(0)
    if args.own_fp8_linear:
        fp8_linear.OWN_TENSORWISE_LINEAR = True
    dump_folder = args.dump_folder or str(Path("outputs") / "benchmark" / Path(args.config).stem)
    argv = ["--config", args.config, *overrides, f"--job.dump_folder={dump_folder}"]
    try:
        for p in args.precisions.split(","):  # every precision's config, before any of them builds a model
            load_job_config([*argv, *precision_overrides(p)])
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if plan is not None:
        return dry_run_precisions(argv, args, plan)
    ok = False
    try:
        emulate = (args.emulate_gpus, args.gpu_memory_gib) if args.emulate_gpus else None
        with inductor_config.patch(inductor):
            results = [bench_one(argv, p, warmup=args.warmup, steps=args.steps, profile_dir=args.profile_dir,
                                 emulate=emulate) for p in args.precisions.split(",")]
        ok = True
    finally:
        destroy_distributed(barrier=ok)
    if int(os.environ.get("RANK", "0")) != 0:  # under torchrun, rank 0 prints and writes for all
        return 0
    base = results[0]["tokens_per_s_per_gpu"]
    print(f"\n{args.label or args.config}: {' '.join(overrides)}"
          + "".join(f" --inductor {k}={v}" for k, v in inductor.items()))
    if args.emulate_gpus:
        print(f"memory capped per process to {results[0]['memory_cap_gib']:.1f} GiB: one of {args.emulate_gpus} "
              f"GPUs of {args.gpu_memory_gib} GiB running this job")
    print(f"{'precision':<13} {'step s':>7} {'tok/s/GPU':>10} {'TFLOP/s':>8} {'MFU%':>6} {'peak GiB':>8} "
          f"{'plan GiB':>8} {'vs ' + results[0]['precision']:>8} {'step 1 s':>8} {'compile s':>9}")
    for r in results:
        r["speedup"] = r["tokens_per_s_per_gpu"] / base
        r["label"], r["overrides"], r["inductor"] = args.label, overrides, inductor
        print(f"{r['precision']:<13} {r['step_s']:7.3f} {r['tokens_per_s_per_gpu']:10,.0f} "
              f"{r['model_tflops_per_gpu']:8.1f} {_pct(r['mfu_pct']):>6} {r['peak_memory_gib']:8.2f} "
              f"{r['plan_memory_gib']:8.2f} {r['speedup']:7.2f}x {r['first_step_s']:8.1f} {r['compile_s']:9.1f}")
    print("plan GiB: the dry run's estimate of the peak (trainer/validate/plan.py); peak GiB: measured, steps after "
          "the warm-up")
    for r in results:
        if r["world_size"] > 1:
            print(f"{r['precision']:<13} peak GiB by rank: {', '.join(f'{g:.2f}' for g in r['peak_memory_gib_ranks'])}"
                  + (f"; plan by pipeline rank: {', '.join(f'{g:.2f}' for g in r['plan_memory_gib_pp_ranks'])}"
                     if len(r["plan_memory_gib_pp_ranks"]) > 1 else ""))
    print("step 1 s: the first step, compilation included; compile s: torch.compile's graphs, inductor's autotuning "
          "and the AdamW kernel during the warm-up (a warm TORCHINDUCTOR_CACHE_DIR and Triton cache make them shorter)")
    for r in results:
        print(f"{r['precision']:<13} optimizer step ({r['master_dtype']} master weights): {r['optimizer_ms']:.1f} ms, "
              f"{r['optimizer_gbps']:.0f} GB/s; torch AdamW(fused) on plain tensors + a norm read: "
              f"{r['reference_optimizer_ms']:.1f} ms, {r['reference_optimizer_gbps']:.0f} GB/s "
              f"(ours {r['optimizer_ms'] / r['reference_optimizer_ms']:.2f}x its time)")
    if args.json:
        with open(args.json, "a") as f:
            for r in results:
                f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
