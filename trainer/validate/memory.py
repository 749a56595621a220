"""Will the training state fit the device? Estimated from the model args, before anything is built.

Every parameter is sharded over its pipeline stage's FSDP x TP ranks (dp_shard x cp x tp: routed
experts are split over ep and FSDP-sharded over the rest of that group, so ep moves experts
between ranks without changing how much each holds), and each pp rank holds about 1/pp of the
model. What stays resident for the whole run, per parameter: the master weight, its gradient
(FSDP2 reduce-scatters into the master dtype) and AdamW's two moments, in
distributed.master_dtype or optimizer.exp_avg_dtype / exp_avg_sq_dtype (an fp8 exp_avg counted at 1 + 4/128 bytes
for every parameter, though 1-D tensors keep bf16: still a lower bound), plus a bf16 compensation buffer under
optimizer.bf16_update='kahan'.

That is a lower bound: no activations, no gathered compute-dtype weights, no padding or
allocator slack, replicated norms counted as sharded and the average pipeline stage rather than
the largest. So a refusal means the run cannot fit, never that it might not; on a GPU the bound
is held against the whole memory of the device (not what is free), on a CPU against each rank's share of the host's
RAM (the ranks of a host train in it side by side).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from trainer.config import JobConfig
from trainer.errors import ConfigError
from trainer.models.counts import param_count
from trainer.models import ModelArgs
from trainer.models.layers import rope_table_bytes
from trainer.optim.states import StateDtypes
from trainer.parallel import ParallelDims
from trainer.validate.resolve import uses_bf16_master

GIB = 2**30


@dataclass(frozen=True)
class TrainStateEstimate:
    """Parameters and the bytes of training state each rank holds for them (a lower bound)."""

    num_params: int
    bytes_per_param: float
    num_ranks: int
    """Ranks one parameter's state is spread over: dp_shard x cp x tp x pp."""
    what: str
    """What the bytes per parameter are, for the message."""

    @property
    def bytes_per_rank(self) -> int:
        return int(self.num_params * self.bytes_per_param) // self.num_ranks


def estimate_train_state(args: ModelArgs, pd: ParallelDims, *, bf16_master: bool, kahan: bool,
                         exp_avg: str = "auto", exp_avg_sq: str = "auto") -> TrainStateEstimate:
    """The training state per rank of the model `args` describes under the degrees `pd` (exp_avg, exp_avg_sq:
    optimizer.exp_avg_dtype / exp_avg_sq_dtype)."""
    dtypes = StateDtypes.resolve(bf16_master=bf16_master, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq)
    sizes = dtypes.bytes_per_param(kahan=kahan)
    if dtypes.in_master_dtype:
        what = f"{dtypes.master} master weights, gradients and 2 AdamW moments"
    else:
        what = (f"{dtypes.master} master weights and gradients, exp_avg in {dtypes.exp_avg}, exp_avg_sq in "
                f"{dtypes.exp_avg_sq}")
    if kahan:
        what += ", a bf16 Kahan buffer"
    return TrainStateEstimate(num_params=param_count(args), bytes_per_param=sum(sizes.values()) + sizes["master"],
                              num_ranks=pd.fsdp_shard * pd.tp * pd.pp, what=what)


@dataclass(frozen=True)
class Target:
    """Where a job is validated for: this machine (a real run), or GPUs a dry run plans for."""

    device_type: str
    """"cuda" or "cpu": what init_distributed will pick."""
    memory: tuple[int, str] | None
    """(bytes, what) each rank trains in; None when it cannot be told."""
    probe: bool = True
    """Probe this machine's FP8 kernels under float8.require; a dry run assumes GPUs with FP8 tensor cores."""
    planning: bool = False
    """A dry run: data files absent on this machine are reported, not refused (the run checks them)."""
    capability: tuple[int, int] | None = None
    """This rank's GPU's compute capability (train.mixed_precision='auto'); None: a dry run's planned GPUs."""
    name: str = ""
    """The GPU, for messages."""
    host_memory: bool = False
    """`memory` is the host's RAM (this machine without a GPU): a memory plan over it is refused, not warned as over a
    GPU, since past it the host swaps or the kernel kills a process (trainer.validate)."""
    ranks_per_node: int = 8
    """Ranks on one machine (torchrun's LOCAL_WORLD_SIZE): FSDP's automatic choices depend on whether a shard group
    crosses machines (trainer.validate.resolve.resolve_fsdp). A dry run plans for 8-GPU machines."""


def this_machine() -> Target:
    ranks_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if not torch.cuda.is_available():
        return Target(device_type="cpu", memory=device_memory(), ranks_per_node=ranks_per_node, host_memory=True)
    index = min(int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count() - 1)
    return Target(device_type="cuda", memory=device_memory(), capability=torch.cuda.get_device_capability(index),
                  name=f"GPU {index} ({torch.cuda.get_device_name(index)})", ranks_per_node=ranks_per_node)


def planned_gpus(gib: float) -> Target:
    """The GPUs of a dry run: CUDA devices of `gib` GiB each, FP8-capable, 8 to a machine."""
    return Target(device_type="cuda", memory=(int(gib * GIB), f"a {gib:g} GiB GPU"), probe=False, planning=True)


def job_train_state(cfg: JobConfig, args: ModelArgs, pd: ParallelDims) -> TrainStateEstimate:
    """`estimate_train_state` for this job's master dtype, bf16 update and moment dtypes."""
    bf16_master, o = uses_bf16_master(cfg), cfg.optimizer
    return estimate_train_state(args, pd, bf16_master=bf16_master, kahan=bf16_master and o.bf16_update == "kahan",
                                exp_avg=o.exp_avg_dtype, exp_avg_sq=o.exp_avg_sq_dtype)


def check_fits_device(cfg: JobConfig, args: ModelArgs, pd: ParallelDims, memory: tuple[int, str] | None) -> None:
    """Refuse a model whose sharded weights, gradients and optimizer state alone exceed a rank's `memory`."""
    if memory is None:
        return
    capacity, device = memory
    bf16_master = uses_bf16_master(cfg)
    est = job_train_state(cfg, args, pd)
    if est.bytes_per_rank <= capacity:
        return
    m = cfg.model
    key = f"model.n_layers={m.n_layers} (model.flavor={m.flavor!r})" if m.n_layers else f"model.flavor={m.flavor!r}"
    cp = f", cp={pd.cp}" if pd.cp > 1 else ""
    layout = f"dp_shard={pd.dp_shard}{cp}, tp={pd.tp}, pp={pd.pp}, ep={pd.ep}"
    fixes = ["lower model.n_layers" if m.n_layers else "pick a smaller model.flavor",
             "spread the model over more ranks (distributed.dp_shard, pp or tp)"]
    if not bf16_master and cfg.train.mixed_precision != "fp32":
        fixes.append("set distributed.master_dtype='bf16' (half the bytes)")
    raise ConfigError(
        f"{key}: about {est.num_params / 1e9:,.1f}B parameters, {est.bytes_per_rank / GIB:,.1f} GiB of weights, "
        f"gradients and optimizer state per rank after sharding ({layout}; {est.bytes_per_param:.4g} bytes per "
        f"parameter: {est.what}), more than the {capacity / GIB:,.1f} GiB of {device}, before any activation; "
        + ", or ".join(fixes)
    )


def device_memory() -> tuple[int, str] | None:
    """(bytes, what) of the memory this rank will train in, by init_distributed's rule: GPU LOCAL_RANK's whole
    memory when CUDA is available, else its share of the host's RAM (every rank on this host trains in it: torchrun's
    LOCAL_WORLD_SIZE); None when it cannot be told."""
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if local_rank >= torch.cuda.device_count():
            return None  # init_distributed's set_device reports it
        props = torch.cuda.get_device_properties(local_rank)
        return props.total_memory, f"GPU {local_rank} ({props.name})"
    try:
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not a POSIX host
        return None
    ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    if ranks == 1:
        return host, "host memory (a CPU run)"
    return host // ranks, f"this rank's 1/{ranks} of the {host / GIB:.1f} GiB of host memory (a CPU run, {ranks} ranks)"


def check_step_fits_device(cfg: JobConfig, args: ModelArgs, pd: ParallelDims, memory: tuple[int, str] | None) -> None:
    """Refuse a microbatch that cannot fit beside the training state, by a lower bound: the RoPE table, the
    microbatch's token ids, its logits (or one loss chunk of them) and each block's input, which backward needs in
    every activation-checkpointing mode. (The dry run's plan, trainer/validate/plan.py, estimates the rest.)"""
    if memory is None:
        return
    capacity, device = memory
    t = cfg.train
    rows = cfg.distributed.pp_microbatch_size if pd.pp > 1 else t.batch_size
    tokens = rows * t.seq_len // pd.cp
    compute = 4 if t.mixed_precision == "fp32" and not t.precision_schedule else 2  # a schedule's phases may be bf16
    logit_tokens = min(tokens, t.loss_chunk_tokens) if t.loss_chunk_tokens else tokens
    parts = {
        "the RoPE table": rope_table_bytes(args, max(args.max_seq_len, t.seq_len)),
        "token ids": 16 * tokens,  # inputs and labels, int64
        "logits": logit_tokens * args.vocab_size * compute // pd.tp,
        "block inputs": -(-args.n_layers // pd.pp) * tokens * args.dim * compute // pd.tp,
    }
    bf16_master, est = uses_bf16_master(cfg), job_train_state(cfg, args, pd)
    # At the start of backward the gradients are not there yet: the weights and AdamW's moments are.
    state = est.bytes_per_rank - est.num_params * (2 if bf16_master else 4) // est.num_ranks
    step = sum(parts.values())
    if state + step <= capacity:
        return
    biggest = max(parts, key=parts.get)
    raise ConfigError(
        f"train.batch_size={rows if pd.pp == 1 else t.batch_size} x train.seq_len={t.seq_len}: a microbatch of "
        f"{tokens:,} tokens per rank needs at least {step / GIB:,.1f} GiB ({biggest}: {parts[biggest] / GIB:,.1f} GiB) "
        f"besides {state / GIB:,.1f} GiB of training state, more than the {capacity / GIB:,.1f} GiB of {device}; "
        "lower train.batch_size (train.grad_accum_steps keeps the batch) or train.seq_len"
    )
