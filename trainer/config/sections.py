"""The job config's sections: one dataclass per TOML section, a docstring under every field, and `Sections`, whose
fields are the sections ([model] and [moe] are generated from the model's dataclasses: trainer.config.model_sections).

`trainer.config.job.JobConfig` is `Sections` checked when built (its `__post_init__` runs
`trainer.config.checks.check_config`, which reads a `Sections`): every combination that the config alone
makes wrong is one `ConfigError` line naming the key. Loading (TOML, command line) is
`trainer.config.load`; `--help` and docs/config.md come from `trainer.config.reference`.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from trainer.config.docstrings import field_docs
from trainer.config.model_sections import DeepseekV3Section, GptOssSection, ModelSection, MoESection

MixedPrecision = Literal["fp32", "fp16", "bf16", "fp8"]


@dataclass
class JobSection:
    dump_folder: str = "./outputs/run"
    """Folder for everything a run writes (config, metrics, checkpoints, traces); "." for the current directory."""
    description: str = ""
    """Free text logged at start; say what this run is for."""


@dataclass
class TrainSection:
    steps: int = 100
    """Number of optimizer steps to run."""
    batch_size: int = 8
    """Sequences per data-parallel rank per microbatch; global batch = batch_size x dp x grad_accum_steps."""
    seq_len: int = 256
    """Tokens per sequence."""
    grad_accum_steps: int = 1
    """Microbatches accumulated before each optimizer step."""
    batch_size_warmup_tokens: int = 0
    """Batch-size warm-up: ramp the batch from batch_size_warmup_start sequences per rank to batch_size x grad_accum_steps over this many global tokens, linearly in whole microbatches (same shapes, no recompilation); 0 = off. The LR schedule stays per step."""
    batch_size_warmup_start: int = 0
    """With batch_size_warmup_tokens: the first step's sequences per data-parallel rank, a multiple of batch_size below batch_size x grad_accum_steps."""
    mixed_precision: Literal["auto", "fp32", "fp16", "bf16", "fp8"] = "bf16"
    """Compute dtype: fp32, fp16, bf16, fp8 (bf16 with torchao float8 linears) or auto (this machine's best)."""
    precision_schedule: list[str] = field(default_factory=list)
    """Precision changes inside the run, e.g. ["bf16:2000", "fp8:9500", "bf16"] or ["fp8-bwd:decay", "bf16"] (a step may be "decay", the LR's decay onset); needs checkpoint.enable."""
    max_norm: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping (the norm is still reported)."""
    seed: int = 0
    """Seed for weights and dropout-free RNG, 0 to 18446688729348; the data order has its own (data.seed)."""
    deterministic: bool = False
    """Use deterministic algorithms (slower); for bitwise-reproducible debugging."""
    activation_checkpointing: Literal["none", "selective", "full"] = "none"
    """Recompute activations in backward: none, selective (see selective_ac_every) or full (every block)."""
    selective_ac_every: int = 0
    """With selective AC: 0 = the per-op policy (matmul and attention outputs kept); N = full AC every Nth block."""
    compile_model: bool = False
    """torch.compile each transformer block and the output head with its loss. Neither compiles with inductor's pointwise autotuning (1x H200, fp8, cold caches: off in the blocks, 2.0-4.0 s less compiling; then off in the head-and-loss graph too, step 1 29.4-31.6 s after the launch against 34.3-40.1 s; the steps at the same speed each time: docs/benchmarks.md#cold-start)."""
    attention_backend: Literal["auto", "cudnn", "flash", "efficient", "math"] = "auto"
    """The kernel of causal attention: auto (on a GPU cuDNN's, else flash, efficient, math) or that kernel only."""
    loss_chunk_tokens: int = 0
    """Final norm, head and cross-entropy this many tokens at a time (one chunk's logits held); 0 = all at once."""
    on_nonfinite: Literal["stop", "skip"] = "stop"
    """What a NaN/inf loss or gradient norm does: stop the run naming the step, or skip that optimizer step."""
    ema_decay: float = 0.0
    """Keep an EMA of the weights (ema = decay x ema + (1 - decay) x w after each step, fp32, sharded like the weights, 4 B per parameter of a rank's shard; checkpointed; val_loss_ema); 0 = off, else 0 < decay < 1."""

    @property
    def is_fp8(self) -> bool:
        return self.mixed_precision == "fp8"


@dataclass
class OptimizerSection:
    """AdamW with decoupled weight decay."""

    lr: float = 3e-4
    """Peak learning rate."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    eps: float = 1e-8
    """AdamW epsilon."""
    weight_decay: float = 0.1
    """Decoupled weight decay (applied to every parameter)."""
    implementation: Literal["auto", "fused", "triton", "torch_fused", "foreach"] = "auto"
    """auto = triton on a GPU; on a CPU fused, or our eager update where the weights or moments are rounded (bf16 master weights with optimizer.bf16_update 'stochastic' or 'kahan', or an exp_avg_dtype / exp_avg_sq_dtype of their own); triton = our AdamW kernel over every local shard of a dtype in one launch (two where TP shards some weights by columns), compiled once for every shape (trainer/optim/kernel.py), for every state dtype and rounding; fused = torch's fused AdamW kernel over every local shard at once; both apply clipping and skip non-finite steps on the device; torch_fused = torch.optim.AdamW(fused=True) on the sharded parameters (the same kernel dispatched through DTensor); foreach syncs each step. torch's kernels (fused, torch_fused, foreach) run plain AdamW only: with a rounded state they are a config error naming both keys. docs/benchmarks.md, the optimizer step, compares them."""
    bf16_update: Literal["stochastic", "kahan", "nearest"] = "stochastic"
    """With bf16 master weights (distributed.master_dtype, bf16 by default for bf16 and fp8 compute; ignored with fp32): how each update is rounded into the bf16 weights. stochastic = unbiased random rounding (no extra memory); kahan = round to nearest plus a bf16 compensation buffer (+2 bytes/parameter); nearest = plain AdamW, loses updates below half a bf16 ulp (~0.2% of the weight). See docs/distributed.md, Master weights."""
    exp_avg_dtype: Literal["auto", "fp32", "bf16", "fp8"] = "auto"
    """Dtype of AdamW's first moment (MS-AMP O2, Megatron's precision-aware optimizer). auto = the master dtype (distributed.master_dtype); bf16 = stochastically rounded; fp8 = float8 e4m3 with one power-of-two fp32 scale per 1x128 block of the global tensor, stochastically rounded (1.03 bytes/parameter; tensors of one dim, with a last dim that is not a multiple of 128 or a shard cutting a block keep bf16, counted in the startup line). Any choice but auto rounds the moments in our AdamW (on a GPU the Triton kernel of the other states, said at startup). A checkpoint saved with another dtype is converted on resume, in one log line. docs/fp8.md#low-precision-optimizer-states."""
    exp_avg_sq_dtype: Literal["auto", "fp32", "bf16"] = "auto"
    """Dtype of AdamW's second moment: auto = the master dtype; bf16 = stochastically rounded (round to nearest could never shrink it at beta2 = 0.999). docs/fp8.md#low-precision-optimizer-states."""


@dataclass
class SchedulerSection:
    warmup_steps: int = 10
    """Steps of linear warmup from 0 to optimizer.lr."""
    decay_type: Literal["cosine", "linear", "wsd", "constant"] = "cosine"
    """Shape after warmup: cosine or linear to min_lr_ratio, wsd = constant then linear decay, constant = none."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of optimizer.lr."""
    wsd_decay_ratio: float = 0.2
    """For wsd: the fraction of train.steps spent in the final decay."""


@dataclass
class MixSource:
    """One source of a weighted data mixture: a [[data.mix]] table (trainer/data/mix.py)."""

    path: str = ""
    """A folder of .bin shards or a glob, as data.path."""
    weight: float = 0.0
    """Its share of the samples, relative to the others' (0.8 and 0.2, or 4 and 1)."""
    name: str = ""
    """Its name in metrics (data/tokens/NAME, val/loss/NAME): letters, digits, '-', '_', '.'; "" = the folder's name."""
    validation_path: str = ""
    """Its held-out shards: with validation.enable and one on every source, the held-out loss is reported per source as well as overall."""

    @classmethod
    def from_cli(cls, text: str) -> "MixSource":
        """`[name=]path:weight`, one entry of --data.mix (entries separated by commas)."""
        named, _, weight = text.rpartition(":")
        name, eq, path = named.partition("=")
        if not eq:
            name, path = "", named
        try:
            value: Any = float(weight)
        except ValueError:
            value = weight  # reported as not a number, naming the key
        return cls(path=path, weight=value, name=name)


@dataclass
class DataSection:
    source: Literal["default", "stdlib", "synthetic", "shards"] = "default"
    """default = Python's documentation text (no download); stdlib = that and stdlib's source; synthetic; shards."""
    path: str = ""
    """For source='shards': a folder of .bin shards or a glob."""
    tokenizer: str = "byte"
    """'byte' or the path of the tokenizer.json the shards were written with (checked against each shard)."""
    seed: int = 0
    """Seed of the sample order, 0 to 2**64 - 1."""
    shuffle: bool = True
    """Shuffle samples each epoch (with data.seed)."""
    mix: list[MixSource] = field(default_factory=list)
    """A weighted mixture of shard sources in place of data.path: [[data.mix]] tables (docs/data.md)."""
    document_masking: bool = False
    """Attention stays inside each EOS-separated document of a packed row; RoPE positions restart at each."""
    eod_mask_loss: bool = False
    """Do not train on the token after each EOS (a document's first token; Megatron's --eod-mask-loss)."""


@dataclass
class TaskFile:
    """One multiple-choice task scored during training: a [[validation.tasks]] table (docs/evaluation.md)."""

    name: str = ""
    """Its name in metrics (val/acc_norm/NAME, val/acc/NAME): letters, digits, '-', '_', '.'."""
    path: str = ""
    """A JSON-lines file, one item a line: {"context": str, "choices": [str, ...], "answer": int}."""

    @classmethod
    def from_cli(cls, text: str) -> "TaskFile":
        """`name=path`, one entry of --validation.tasks (entries separated by commas)."""
        name, _, path = text.partition("=")
        return cls(name=name, path=path)


@dataclass
class ValidationSection:
    enable: bool = False
    """Evaluate the held-out loss and perplexity every freq steps (and at the last step)."""
    freq: int = 100
    """Steps between evaluations."""
    steps: int = 8
    """Batches per evaluation (of train.batch_size per data-parallel rank); the same batches every time."""
    path: str = ""
    """Held-out shards (folder or glob, data.tokenizer's); "" = data.source's held-out split (shards: required)."""
    mixed_precision: Literal["training", "bf16"] = "training"
    """Precision of the evaluation: training = as the model trains; bf16 = an fp8 run's matmuls in bf16."""
    tasks: list[TaskFile] = field(default_factory=list)
    """Multiple-choice tasks whose accuracy (acc_norm, acc) is logged with the held-out loss: [[validation.tasks]] tables."""


@dataclass
class DistributedSection:
    dp_replicate: int = 1
    """Data-parallel replicas (HSDP when > 1: shard inside a replica, replicate across)."""
    dp_shard: int = -1
    """FSDP2 shard degree; -1 = whatever the other degrees leave of the world size."""
    tp: int = 1
    """Tensor-parallel degree (with sequence parallel on the norms and loss parallel on the output)."""
    ep: int = 1
    """Expert-parallel degree (MoE flavors): routed experts split over ep ranks carved out of dp_shard (docs/moe.md)."""
    pp: int = 1
    """Pipeline-parallel degree: the model is split into stages over this many ranks (outermost mesh axis)."""
    cp: int = 1
    """Context-parallel degree: each sequence in 2 x cp chunks, K/V all-gathered in attention. Not with tp > 1."""
    pipeline_schedule: Literal["auto", "GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble",
                               "ZBVZeroBubble"] = "auto"
    """With pp > 1: the torch.distributed.pipelining schedule; Interleaved*/ZBV run several stages per rank. auto = Interleaved1F1B with 2 stages per rank where every stage gets a block and torch's interleaved schedule takes the microbatch count (at least pp, and a multiple of its rounds, microbatches // pp) (8B shapes x 16 layers, pp=2, 8 microbatches, 2x H200: 1.016-1.021x 1F1B's step for +3-4 GiB on the first rank, docs/distributed.md), else 1F1B; a pp_stages_per_rank, pp_split_points or pp_layers_per_stage that gives one stage per rank means 1F1B, more means Interleaved1F1B."""
    pp_microbatch_size: int = 1
    """With pp > 1: sequences per pipeline microbatch; must divide train.batch_size."""
    pp_stages_per_rank: int = 0
    """With pp > 1: stages per pipeline rank; 0 = 1 for GPipe/1F1B, 2 for Interleaved*/ZBVZeroBubble."""
    pp_layers_per_stage: int = 0
    """With pp > 1: a stage's cost in blocks, setting the number of stages; 0 = from pp x pp_stages_per_rank."""
    pp_split_points: list[str] = field(default_factory=list)
    """With pp > 1: explicit stage boundaries, the first block of each later stage (["layers.2"]); [] = even split."""
    pp_embedding_weight: float = -1.0
    """With pp > 1, automatic split: the token embedding's cost in blocks; -1 = its FLOPs (0: a lookup)."""
    pp_head_weight: float = -1.0
    """With pp > 1, automatic split: the final norm and output head's cost in blocks; -1 = its FLOPs."""
    reshard_after_forward: Literal["default", "always", "never"] = "default"
    """FSDP2: free gathered weights after forward (always, ZeRO-3) or keep them for backward (never, ZeRO-2)."""
    reduce_dtype: Literal["auto", "fp32", "bf16", "fp8"] = "auto"
    """Dtype FSDP2 reduce-scatters gradients in; auto = bf16 or fp32 by the master weights and ranks summed (never fp8). fp8 (MS-AMP O1): each FSDP unit's gradients cast to float8 e4m3 with one scale from their amax over the shard group, exchanged by an all-to-all and summed in fp32, the shards written in the master dtype; costs: an all-reduce of one amax per unit, and each rank's gradient rounded to e4m3 (relative error <= 2^-4 per element) before the sum; gains: half bf16's bytes. Needs distributed.dp_shard x cp > 1."""
    master_dtype: Literal["auto", "fp32", "bf16"] = "auto"
    """Dtype of the sharded master weights and AdamW moments; auto = bf16 for bf16 and fp8 compute, else fp32."""
    loss_parallel: bool = True
    """With tp > 1: keep logits sharded over the vocabulary when computing the loss."""
    init_timeout_seconds: int = 600
    """Timeout of collectives (process group init included)."""


@dataclass
class Float8Section:
    recipe: Literal["tensorwise", "rowwise", "rowwise_with_gw_hp", "blockwise"] = "tensorwise"
    """torchao float8 scaling recipe: tensorwise (one scale per tensor), rowwise / rowwise_with_gw_hp (one per row), or blockwise (DeepSeek-V3 style: one scale per 1x128 tile of activations and gradients and per 128x128 block of weights, all e4m3; torchao's blockwise Linear on cuBLAS, compute capability >= 9.0; Linears with a dim not a multiple of 128 stay bf16; weights all-gathered in bf16). docs/fp8.md#recipes."""
    enable_fsdp_float8_all_gather: Literal["auto", True, False] = "auto"
    """All-gather weights in float8 under FSDP2 (tensorwise only; true with another recipe is a config error): halves all-gather bytes. auto = on for tensorwise when FSDP shards over more than one rank (distributed.dp_shard > 1), off otherwise (one rank gathers nothing, and the eager cast before the gather is slower than the cast fused into the compiled blocks: +2.4% on 1x H100, docs/benchmarks.md)."""
    format: Literal["auto", "hybrid", "e4m3"] = "auto"
    """FP8 formats (Transformer Engine's fp8_format): hybrid = e4m3 for weights and activations, e5m2 for gradients (more range, less precision); e4m3 = e4m3 everywhere. The tensorwise recipe takes either; rowwise and blockwise are e4m3 everywhere. auto = hybrid for tensorwise, e4m3 otherwise."""
    emulate: bool = False
    """Emulate float8 matmuls in high precision (for machines without FP8 kernels; tests). Blockwise: a plain-torch quantize-dequantize with torchao's tiles and scales, then fp32 matmuls."""
    exclude_fqns: list[str] = field(default_factory=list)
    """Extra Linears to keep in bf16, each a fqn or a run of its whole dotted segments ("output_head.proj", "layers.0", "mlp"; not "layers.0." nor the substring "up_pro"); an entry matching no Linear is an error."""
    bf16_first_blocks: int = 0
    """Keep the first N transformer blocks (layers.0 .. layers.N-1) in bf16, every Linear of them, whatever the layout (pipeline stages agree on the global block index); 0 = none. Each is named with its reason in the startup line and fp8_layers.json. docs/fp8.md#precision-per-block-and-per-gemm."""
    bf16_last_blocks: int = 0
    """Keep the last N transformer blocks in bf16 (layers.L-N .. layers.L-1 of the model's L = n_layers; DeepSeek-V3's MTP modules after them are not counted); 0 = none. docs/fp8.md#precision-per-block-and-per-gemm."""
    forward: Literal["fp8", "bf16"] = "fp8"
    """Which GEMM of a converted Linear (and of the FP8 experts) runs in FP8 in forward: fp8, or bf16 (the forward GEMM in bf16; the backward as float8.backward says). docs/fp8.md#precision-per-block-and-per-gemm."""
    backward: Literal["fp8", "bf16"] = "fp8"
    """The two backward GEMMs (input and weight gradients) of a converted Linear: fp8, or bf16 from the bf16 input and weight (the forward's FP8 casts are not reused): a bf16 Linear's gradients for the same forward. docs/fp8.md#precision-per-block-and-per-gemm."""
    require: bool = False
    """Fail instead of running bf16 when this CUDA GPU has no FP8 tensor cores (compute capability < 8.9), or no FP8 grouped GEMM for float8.moe_experts (sm90 only)."""
    scaling: Literal["dynamic", "delayed"] = "dynamic"
    """How the tensorwise recipe scales each cast: dynamic = by the tensor's own amax (torchao's); delayed = Transformer Engine's delayed scaling, by the amax history of earlier steps (float8.amax_history_len, float8.amax_compute_algo, float8.margin), the step's amaxes all-reduced over the data- and context-parallel ranks once per optimizer step; the first step (no history yet) scales dynamically; weights all-gathered in fp8 keep their current amax. Tensorwise only. docs/fp8.md#delayed-scaling."""
    amax_history_len: int = 1024
    """float8.scaling='delayed': how many steps of amaxes each Linear keeps per operand (input, weight, gradient), at most 16,384 (the histories live on the GPU and in every checkpoint); Transformer Engine / NeMo's default 1024."""
    amax_compute_algo: Literal["max", "most_recent"] = "max"
    """float8.scaling='delayed': the amax a scale is computed from: the history's max, or its newest value."""
    margin: int = 0
    """float8.scaling='delayed': scale = fp8_max / amax / 2^margin (0 to 16; headroom for amaxes that grow between steps: beyond 16 even the largest value rounds to zero in e4m3, whose range spans 2^17.8)."""
    save_fp8_activations: bool = False
    """Tensorwise only: keep each converted Linear's float8 input (1 byte per element and a scale) for the weight gradient instead of its bf16 input (2 bytes): the same values the forward multiplied, so identical math (Transformer Engine's behaviour). Off until measured; under torch.compile the partitioner already chooses what the blocks save (docs/fp8.md#fp8-activations-saved-for-backward)."""
    weights_per_step: Literal["auto", "on", "off"] = "auto"
    """Cast each FP8 weight once per optimizer step and reuse it in every microbatch's forward, backward and activation-checkpoint recompute (Megatron's --fp8-param-gather and torchtitan's quantize-once-per-unshard spirit): the same bits as casting per use, for 1 byte per converted weight parameter, and 1 more per microbatch in flight for the column-major copy its backward multiplies, held through the step's forward/backward (the memory plan's row). auto = for the FP8 routed experts' weights, on where a weight is used more than once per step (train.grad_accum_steps > 1, pipeline parallelism or activation checkpointing) and FSDP2 does not shard it (dp_shard x cp = 1; sharded weights are gathered per microbatch, and enable_fsdp_float8_all_gather casts their shards); for the Linears auto is on under pipeline parallelism only (measured faster there: pp=2 1F1B 1.02x; with accumulation on one GPU it measured slower). on = the Linears too, and also with one use per step (the backward reuses the forward's cast); off = never (the memory back). Tensorwise and blockwise Linears with both roles fp8 (blockwise: 1 byte per element and an fp32 scale per 128x128 block; rowwise is refused: its forward and dgrad cast the weight along different dims); docs/fp8.md#fp8-weights-cast-once-per-step."""
    moe_experts: str = "off"
    """MoE routed experts: "off" keeps their grouped GEMMs bf16; "rowwise" runs them as FP8 grouped GEMMs (torch._scaled_grouped_mm, rowwise e4m3 scales; forward and dgrad FP8, wgrad bf16; docs/fp8.md). Needs an MoE flavor, H100/H200 (or float8.emulate=true), dim and moe_ffn_dim multiples of 16."""


@dataclass
class CheckpointSection:
    enable: bool = False
    """Save checkpoints and resume automatically from the latest complete one in folder."""
    folder: str = "checkpoint"
    """Checkpoint folder, relative to job.dump_folder."""
    interval: int = 500
    """Save every this many steps (and at the last step)."""
    keep_latest_k: int = 0
    """Keep only the newest k complete checkpoints; 0 keeps all. Never deletes the only complete one."""
    load_step: int = -1
    """Step to resume from; -1 = the latest complete checkpoint."""
    async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = "disabled"
    """Write checkpoints in the background (async) while training continues."""
    initial_load_path: str = ""
    """Start a new run from this checkpoint's model weights, shape and vocabulary (no optimizer, no step)."""
    model_only: bool = False
    """At the end of training, also export the model weights only (see export_dtype)."""
    export_dtype: Literal["float32", "bfloat16"] = "bfloat16"
    """Dtype of the weights-only exports (model_only's final one, export_interval's)."""
    export_interval: int = 0
    """Every this many steps, also export the weights to folder/step-N-hf (Hugging Face), written in the background; 0 = off."""
    export_keep_latest_k: int = 0
    """Keep only the newest k step-N-hf exports (removed after each new one); 0 keeps all."""
    on_save_error: Literal["stop", "continue"] = "stop"
    """A failed save (disk full, folder gone): stop the run, or log it and keep training ("continue")."""
    allow_unverified: bool = False
    """Load a checkpoint whose checkpoint.json has no "files" list (sizes, crc32), so its shards go unverified."""
    restart_data: bool = False
    """On resume, start the data from its beginning (other data, data.seed or a longer train.seq_len)."""
    resume_check: bool = True
    """Record a fixed probe batch's loss in each checkpoint and recompute it on resume (bit-equal, or within a stated tolerance at another layout); docs/checkpointing.md."""


@dataclass
class ProfilingSection:
    enable: bool = False
    """Record a torch.profiler trace of steps start_step..end_step."""
    start_step: int = 3
    """First profiled step (1-based, inclusive)."""
    end_step: int = 5
    """Last profiled step (inclusive)."""
    trace_dir: str = ""
    """Where traces, the kernel summary and memory snapshots go; "" = job.dump_folder/profiler_traces."""
    record_shapes: bool = False
    """Record operator input shapes."""
    with_stack: bool = False
    """Record Python stacks (large traces)."""
    profile_memory: bool = False
    """Record tensor allocations in the trace."""
    memory_snapshot: bool = False
    """CUDA only: record allocator history and dump a snapshot after the window and on OOM."""


@dataclass
class MetricsSection:
    log_freq: int = 10
    """Log (console, metrics.jsonl, TensorBoard) every this many steps, and at the first and last step."""
    enable_tensorboard: bool = True
    """Write TensorBoard scalars under {job.dump_folder}/tb/."""
    enable_jsonl: bool = True
    """Append one JSON object per logged step to {job.dump_folder}/metrics.jsonl."""
    loss_spike_factor: float = 3.0
    """Flag a loss spike when loss > this x its running mean."""
    wandb: bool = False
    """Also log what TensorBoard gets to Weights & Biases (rank 0; pip install 'trainer[wandb]')."""
    wandb_project: str = "trainer"
    """W&B project."""
    wandb_entity: str = ""
    """W&B entity (team or user); "" = your default."""
    wandb_run_name: str = ""
    """W&B run name; "" = the name of job.dump_folder."""
    wandb_group: str = ""
    """W&B group (e.g. the runs of one sweep); "" = none."""
    wandb_tags: list[str] = field(default_factory=list)
    """W&B tags."""
    fp8_stats_freq: int = 0
    """Every this many steps (fp8 runs): FP8 health per layer group to the metrics; 0 = off (it costs: see docs)."""
    event_log: bool = False
    """Each rank logs step times, checkpoints, stops to {job.dump_folder}/events/ (scripts/summarize_events.py)."""
    kurtosis_warn: float = 0.0
    """At the FP8 stats steps: warn when a block input's channel kurtosis (FOG's outlier metric) passes this; 0 = off."""


@dataclass
class Sections:
    """The TOML file's sections, in order; the docstring under each is its line in `--help` and docs/config.md."""

    job: JobSection = field(default_factory=JobSection)
    """where the run writes and what it is for"""
    model: ModelSection = field(default_factory=ModelSection)
    """model flavor (size preset) and shape overrides"""
    moe: MoESection = field(default_factory=MoESection)
    """routing and load balancing of MoE flavors"""
    deepseek_v3: DeepseekV3Section = field(default_factory=DeepseekV3Section)
    """multi-head latent attention, group-limited routing and multi-token prediction of DeepSeek-V3 flavors"""
    gpt_oss: GptOssSection = field(default_factory=GptOssSection)
    """attention windows, clamped SwiGLU and YaRN RoPE of GPT-OSS flavors"""
    train: TrainSection = field(default_factory=TrainSection)
    """steps, batch, sequence length, precision, AC, compile"""
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    """AdamW hyperparameters"""
    scheduler: SchedulerSection = field(default_factory=SchedulerSection)
    """learning-rate warmup and decay"""
    data: DataSection = field(default_factory=DataSection)
    """training data source, shards and tokenizer"""
    validation: ValidationSection = field(default_factory=ValidationSection)
    """held-out loss and perplexity during training"""
    distributed: DistributedSection = field(default_factory=DistributedSection)
    """parallel degrees (dp_replicate, dp_shard, tp, ep, pp, cp) and FSDP2 policy"""
    float8: Float8Section = field(default_factory=Float8Section)
    """FP8 recipe, exclusions, all-gather (with train.mixed_precision='fp8')"""
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    """DCP checkpoints, resume, export"""
    profiling: ProfilingSection = field(default_factory=ProfilingSection)
    """torch.profiler window and memory snapshots"""
    metrics: MetricsSection = field(default_factory=MetricsSection)
    """log line, metrics.jsonl, TensorBoard, W&B"""

    @property
    def is_fp8(self) -> bool:
        return self.train.is_fp8

    @property
    def trace_dir(self) -> str:
        """profiling.trace_dir, or the run's own folder for traces when it is empty."""
        return self.profiling.trace_dir or str(Path(self.job.dump_folder) / "profiler_traces")

    def shape_sections(self) -> list[tuple[str, Any]]:
        """(name, section) of the sections generated from a model dataclass: [model], [moe], then [deepseek_v3] and
        [gpt_oss]; each applies to the flavors whose args are its `args_class`."""
        return [("model", self.model), ("moe", self.moe), ("deepseek_v3", self.deepseek_v3), ("gpt_oss", self.gpt_oss)]

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)

    def to_toml(self) -> str:
        return to_toml(self.to_dict())


def field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


# The sections the TOML loader and `--help` know, and each one's line: the fields of Sections.
_SECTIONS: dict[str, type] = field_types(Sections)
SECTION_HELP: dict[str, str] = field_docs(Sections)


def to_toml(sections: dict[str, dict[str, Any]], *, header: str = "") -> str:
    """Tables of scalars and lists; a dict value becomes a sub-table ([model_args.rope_scaling]). Every string (of
    Unicode scalar values) reads back as itself: `toml_string` escapes what a TOML string may not hold."""
    lines = [f"# {line}" for line in header.splitlines()] + ([""] if header else [])

    def tables(v: Any) -> bool:  # a list of tables: [[section.key]] entries
        return isinstance(v, list) and bool(v) and all(isinstance(x, dict) for x in v)

    def table(name: str, values: dict[str, Any]) -> None:
        lines.append(f"[{name}]")
        # None: a key left out (TOML has no null), such as a [model] key that keeps the flavor's value
        lines.extend(f"{toml_key(k)} = {toml_value(v)}" for k, v in values.items()
                     if v is not None and not isinstance(v, dict) and not tables(v))
        lines.append("")
        for k, v in values.items():
            if isinstance(v, dict):
                table(f"{name}.{toml_key(k)}", v)
            elif tables(v):
                for entry in v:
                    lines.append(f"[[{name}.{toml_key(k)}]]")
                    lines.extend(f"{toml_key(key)} = {toml_value(x)}" for key, x in entry.items())
                    lines.append("")

    for name, values in sections.items():
        table(toml_key(name), values)
    return "\n".join(lines)


# What a TOML basic string may not hold as itself: the backslash, the quote and every control character but tab.
_TOML_ESCAPES = {"\\": "\\\\", '"': '\\"', "\b": "\\b", "\n": "\\n", "\f": "\\f", "\r": "\\r",
                 **{chr(c): f"\\u{c:04x}" for c in [*range(0x20), 0x7F] if chr(c) not in "\b\t\n\f\r"}}
_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def toml_string(text: str) -> str:
    """`text` as a TOML basic string that reads back as `text` (tomllib), whatever characters it holds."""
    return '"' + "".join(_TOML_ESCAPES.get(c, c) for c in text) + '"'


def toml_key(key: Any) -> str:
    """A bare key where TOML allows one, else a quoted one."""
    return key if _BARE_KEY.fullmatch(str(key)) else toml_string(str(key))


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return toml_string(str(value))
