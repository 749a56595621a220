"""The long texts of docs/config.md: a key's whole story, where the docstring in code (what `--help` shows) is one
line. Keyed "section.key"; `python -m trainer.config --markdown` writes each in place of that key's docstring, and a
note that names no key is an error (tests/unit/test_config.py)."""

from __future__ import annotations

NOTES: dict[str, str] = {
    "model.flavor": (
        "Size preset, which also picks the family: dense debug, 1b, 3b, 8b, 70b, 405b (trainer/models/llama.py); MoE "
        "debug_moe, moe_small, moe_16b, qwen3_moe_debug, qwen3_30b_a3b (trainer/models/moe.py). Every other [model] (and, for an MoE flavor, [moe]) "
        "key set replaces the flavor's value; a key left out keeps it."),
    "model.vocab_size": "Vocabulary size (128256 for the Llama 3 sizes, 512 for debug).",
    "model.norm_eps": "RMSNorm epsilon (1e-5 for every flavor but the Qwen3-MoE ones: 1e-6).",
    "model.rope_theta": "RoPE base frequency (500000 for Llama 3, 1e6 for Qwen3).",
    "model.rope_scaling": (
        '"llama3": Llama 3.1\'s long-context frequency scaling (the rope_scaling_* keys; one of them set on a flavor '
        'without scaling turns it on too); "none": plain RoPE.'),
    "model.rope_scaling_factor": "Llama 3 RoPE scaling factor (8 for 3.1, 32 for 3.2); left out: the flavor's, or 8 "
                                 "where it has none.",
    "model.rope_scaling_low_freq_factor": "Llama 3 RoPE scaling low_freq_factor; left out: the flavor's, or 1.",
    "model.rope_scaling_high_freq_factor": "Llama 3 RoPE scaling high_freq_factor; left out: the flavor's, or 4.",
    "model.rope_scaling_original_max_seq_len": "The context the scaled RoPE was trained at; left out: the flavor's, "
                                               "or 8192.",
    "model.max_seq_len": "Positions of the RoPE table (a longer train.seq_len extends it, with a warning).",
    "model.head_dim": (
        "Each head's width, even (RoPE rotates pairs); 0 = dim / n_heads. Qwen3 sets it apart: 128 with dim=1024 and "
        "16 heads."),
    "model.ffn_dim": (
        "The MLP's hidden width; 0 = Llama's rule: 8/3 x dim, times ffn_dim_multiplier, rounded up to multiple_of. An "
        "MoE flavor's dense blocks take moe.dense_ffn_dim."),
    "model.tie_word_embeddings": (
        "One table for the embeddings and the output head (SmolLM2, Qwen3-0.6B, Llama 3.2 1B); no flavor ties. Not "
        "with pipeline or tensor parallel."),
    "model.qk_norm": (
        "RMSNorm over each head's q and k before RoPE (Qwen3, OLMo 2): steadier attention logits; no flavor has it."),
    "deepseek_v3.rope_yarn": (
        '"yarn": YaRN RoPE over the qk_rope_head_dim part (the rope_yarn_* keys; one of them set turns it on too, '
        "from the defaults of the others), as transformers' DeepseekV3 computes it: the frequencies, cos and sin times "
        "the attention factor, and the softmax scale times mscale(mscale_all_dim)^2. DeepSeek-V3/R1's: factor 40, "
        "original_max_seq_len 4096, beta_fast 32, beta_slow 1, mscale 1, mscale_all_dim 1, truncate true (an imported "
        'folder brings its own); "none": plain RoPE.'),
    "gpt_oss.rope_yarn_mscale_all_dim": (
        "With rope_yarn_mscale: cos and sin times mscale(mscale) / mscale(mscale_all_dim), mscale(m) = 0.1 m "
        "ln(factor) + 1, as transformers' GptOss reads it; GPT-OSS's softmax scale has no mscale (0 = unset)."),
    "moe.route_norm": "Renormalize the chosen top_k scores to sum to 1 (the Qwen3-MoE flavors do, Qwen3-MoE's norm_topk_prob).",
    "job.dump_folder": (
        "Folder for everything a run writes: config.toml, resolved.toml, metrics.jsonl, tb/, checkpoints, profiler "
        "traces. Not empty (\".\" for the current directory)."),
    "train.mixed_precision": (
        "Compute dtype. fp8 = bf16 compute with torchao float8 linears. auto (Axolotl's bf16: auto) = what this "
        "machine runs best: fp8 on GPUs with FP8 tensor cores (compute capability >= 8.9; bf16 under tensor "
        "parallelism), bf16 on >= 8.0, fp16 below, fp32 on a CPU, said in one startup line. The master weights "
        "follow distributed.master_dtype (bf16 for bf16 and fp8 by default)."),
    "train.precision_schedule": (
        "Change precision inside the run: \"precision:last_step\" entries, the last one without a step, e.g. "
        "[\"bf16:2000\", \"fp8:9500\", \"bf16\"] = bf16 for steps 1-2000, fp8 for 2001-9500, bf16 to train.steps. "
        "Overrides mixed_precision; needs checkpoint.enable (each switch saves a checkpoint, rebuilds the model and "
        "resumes it in the same process). A step may be \"decay\", the learning rate's decay onset (after the "
        "warm-up for cosine and linear, at the end of wsd's constant stretch; constant has none): "
        "[\"fp8:decay\", \"bf16\"]. Besides the precisions, \"fp8-fwd\" (FP8 forward, bf16 backward) and "
        "\"fp8-bwd\" (bf16 forward, FP8 backward) are fp8 phases that set float8.forward / float8.backward. "
        "The resolved steps are in the startup line and resolved.toml. Empty = off (see docs/fp8.md)."),
    "train.seed": (
        "Seed for weights and dropout-free RNG, 0 to 18446688729348 (each parameter's init generator is seeded with "
        "seed x 1000003 + crc32(fqn), which must fit torch's 64 bits); the data order has its own seed in [data]."),
    "train.selective_ac_every": (
        "With selective AC: 0 = per-op policy that keeps matmul and attention outputs; N > 0 = full AC on every Nth "
        "block."),
    "train.attention_backend": (
        "The kernel of causal attention (torch's scaled_dot_product_attention). auto = on a GPU cuDNN's first, then "
        "flash, efficient and math, the first that takes the inputs (cuDNN's is 1.86x flash's at Llama 3 8B shapes "
        "on an H100, docs/benchmarks.md); on a CPU torch's choice. Another value: that kernel only (torch raises if "
        "it cannot take the inputs; cudnn and efficient need a GPU). Context parallelism keeps its own attention."),
    "train.loss_chunk_tokens": (
        "Compute the final norm, output head and cross-entropy this many tokens at a time, each chunk "
        "activation-checkpointed, so only one chunk's logits exist in forward and backward (at vocab 128256 the "
        "whole batch's fp32 logits are 8.4 GB per 16K tokens); costs one more output-head GEMM in backward. Same "
        "loss and gradients up to fp32 summation order. 0 = off (all tokens at once). Not with distributed.tp > 1 "
        "(under pp > 1 on the last stage). See docs/benchmarks.md#memory-levers-chunked-loss-trainloss_chunk_tokens."),
    "data.source": (
        "default = Python's documentation text that ships with Python (byte-level, no download, 0.47M tokens); "
        "stdlib = that plus the standard library's source (~13M tokens); synthetic = random tokens; shards = files "
        "made by scripts/prepare_data.py."),
    "data.mix": (
        "A weighted mixture of shard sources in place of data.path: [[data.mix]] tables of path, weight, and "
        "optional name and validation_path (on the command line: --data.mix=web=data/web:0.8,code=data/code:0.2). "
        "Samples are drawn in proportion to the weights, deterministically from (data.seed, position), rank-disjoint "
        "and exactly resumable; a source its share exhausts repeats (its epochs logged); tokens per source go to the "
        "metrics (docs/data.md)."),
    "data.document_masking": (
        "Attention never crosses an EOS inside a packed sequence and RoPE positions restart at each document (Llama "
        "3): FlexAttention with a document block mask on a GPU (with train.compile_model), a dense mask on a CPU; "
        "in every layout (pp, cp included) and family."),
    "data.eod_mask_loss": (
        "Do not train on the token after each EOS (a document's first token, which nothing before it predicts; "
        "Megatron's --eod-mask-loss): the loss is the mean over the step's other tokens, in training and validation."),
    "validation.path": (
        "Held-out shards (folder or glob, same tokenizer as data.tokenizer). Empty = the held-out split of "
        "data.source: every 10th block of 4,096 tokens of the default/stdlib text, never trained on; a different "
        "seed for synthetic; required for shards."),
    "validation.mixed_precision": (
        "Precision of the evaluation: training = as the model trains; bf16 = an fp8 run's matmuls in bf16 (Axolotl's "
        "`bf16: full` evaluation): FP8 Linears run as bf16 Linears and FP8 routed experts as bf16 grouped GEMMs "
        "while evaluating, the same weights. Needs bf16 or fp8 training (with bf16 it changes nothing); turns "
        "float8.enable_fsdp_float8_all_gather='auto' off (gathered float8 weights have no bf16 copy to evaluate "
        "with). docs/fp8.md#evaluating-in-bf16."),
    "distributed.cp": (
        "Context-parallel degree: every sequence is cut into 2 x cp chunks, each rank holding two (i and 2cp-1-i), "
        "with K/V all-gathered in attention; cp ranks join FSDP's shard group "
        "(docs/distributed.md#context-parallel). Not with tp > 1."),
    "distributed.pp_microbatch_size": (
        "With pp > 1: sequences per pipeline microbatch; must divide train.batch_size (microbatches = batch_size / "
        "this)."),
    "distributed.pp_stages_per_rank": (
        "With pp > 1: stages (virtual stages) per pipeline rank; 0 = 1 for GPipe/1F1B, 2 for "
        "Interleaved*/ZBVZeroBubble."),
    "distributed.pp_layers_per_stage": (
        "With pp > 1: the cost of a stage in blocks (of the model's mean block cost), setting the number of stages; "
        "0 = from pp x pp_stages_per_rank."),
    "distributed.pp_embedding_weight": (
        "With pp > 1, automatic split (stages balanced by training FLOPs per token, an MoE block by its active "
        "parameters): the token embedding's cost in blocks (of the mean block cost); -1 = its FLOPs (0: a lookup)."),
    "distributed.pp_head_weight": (
        "With pp > 1, automatic split: the final norm and output head's cost in blocks (of the mean block cost); -1 "
        "= its FLOPs, 6 x dim x vocab per token (about 2 blocks at Llama 3 8B shapes)."),
    "distributed.reshard_after_forward": (
        "FSDP2: free gathered weights after forward (always, ZeRO-3) or keep them for backward (never, ZeRO-2); "
        "default = always unless the shard group has one rank, where resharding saves nothing."),
    "distributed.reduce_dtype": (
        "Dtype FSDP2 reduce-scatters (sums) gradients in. auto = bf16 where the master weights are bf16 and at most "
        "2 ranks are summed (FSDP2 rounds the result to bf16 either way: the same bits, half the bytes), fp32 where "
        "more ranks are summed or the master weights are fp32, the compute dtype where nothing is summed (one rank, "
        "one microbatch); said in the startup line. docs/distributed.md#fsdp2s-automatic-choices. auto never picks "
        "fp8. fp8 (MS-AMP O1's FP8 gradient communication, trainer/parallel/fp8_reduce.py): each FSDP unit's "
        "gradients are cast to float8 e4m3 with one scale from their amax over the shard group (an all-reduce of one "
        "number per unit), exchanged by an all-to-all (NCCL cannot sum float8) and summed in fp32 on the receiving "
        "rank, divided as FSDP2 divides, and written in the master dtype: half the bytes of bf16, and each rank's "
        "gradient carries e4m3's rounding (a relative error of at most 2^-4 per element; e5m2's would be 2^-3) "
        "before the sum. Needs FSDP to shard over more than one rank (distributed.dp_shard x distributed.cp > 1); "
        "under HSDP the all-reduce across replicas stays in the master dtype. On 2x H200 in one machine it costs 7-10% "
        "of the step against bf16's reduce-scatter, and its 1B parity legs sit at the edge of the seed noise "
        "(docs/distributed.md#gradients-reduced-in-fp8): an opt-in for links where the bytes cost."),
    "distributed.master_dtype": (
        "Dtype of the sharded master weights and AdamW moments. auto = bf16 for bf16 and fp8 compute (6 "
        "bytes/parameter less; each update rounded by optimizer.bf16_update, stochastic by default: within the seed "
        "noise of fp32 master weights on two seeds of the 1B parity run, docs/distributed.md#master-weights), fp32 "
        "for fp32 and fp16 compute; fp32 = the opt-in for every precision."),
    "checkpoint.initial_load_path": (
        "Start a new run from the model weights of this checkpoint (no optimizer, no step); the model's shape and "
        "vocabulary are the checkpoint's (a [model] or [moe] shape key set to another value is an error)."),
    "checkpoint.restart_data": (
        "On resume, take model, optimizer, LR schedule and step from the checkpoint but start the data from its "
        "beginning: for a relaunch on other data, another data.seed or a longer train.seq_len (a context extension, "
        "docs/checkpointing.md). Without it such a resume is refused."),
    "profiling.trace_dir": (
        "Where traces (rank{r}_step{a}-{b}.pt.trace.json.gz), the kernel summary and memory snapshots go; \"\" = the "
        "run's job.dump_folder/profiler_traces."),
    "metrics.wandb": (
        "Also log what TensorBoard gets to Weights & Biases (rank 0; the optional extra: pip install "
        "'trainer[wandb]'). A resumed run continues the same W&B run (its id is in "
        "{job.dump_folder}/wandb_run.json); WANDB_MODE=offline writes under {job.dump_folder}/wandb without a "
        "network. A W&B failure is one warning and training goes on."),
    "metrics.fp8_stats_freq": (
        "Every this many steps (fp8 runs): FP8 health per layer group (input and gradient amax, scale, fractions "
        "that underflow or saturate) and weight amax/scale, to metrics.jsonl and TensorBoard, with a warning line "
        "for a bad layer. That step runs eagerly: on 8B shapes it costs ~3 steps and nearly twice the peak memory "
        "(docs/benchmarks.md), so it is off by default; 100 costs ~2.3%. 0 = off."),
    "metrics.kurtosis_warn": (
        "At the FP8 stats steps (metrics.fp8_stats_freq), each block's input kurtosis across its channels is logged "
        "(fp8_health/block_input/*: FOG's outlier metric, the kurtosis of the channels' RMS over the tokens, between 1 "
        "and model.dim; docs/fp8.md); a warning line names the worst block where one passes this. 0 = off (the "
        "default: what is alarming depends on the width; 100 at dim 4096 flags one channel ~28x the others' RMS)."),
}
