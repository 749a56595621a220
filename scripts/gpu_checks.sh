#!/usr/bin/env bash
# Every GPU check and benchmark in one call (a GPU machine's time is scarce: batch the steps).
# Two one-GPU steps at once, one per GPU of a 2-GPU machine: scripts/gpu_tracks.sh.
#   bash scripts/gpu_checks.sh [tests] [bench8b] [bench8b_bf16m] [bench8b_ce] [bench1b] [accuracy] [ac] [pp]   (default: tests bench8b bench1b accuracy ac)
#   PARITY_LEGS=bf16,tensorwise bash scripts/gpu_checks.sh parity1b   (1B FP8 parity legs; needs data/py_bpe)
#   ARGS_8B="--distributed.master_dtype=bf16" bash scripts/gpu_checks.sh trainlog8b bench8b bench8b_ce
#       (ARGS_8B: more overrides for every 8B-shapes step; this one is docs/benchmarks/2026-11-23-h100-throughput-levers.md)
#   bash scripts/gpu_checks.sh optim8b    (fp8, fp32 master weights: optimizer.implementation fused vs triton)
#   bash scripts/gpu_checks.sh optstates_tests optstates  (1 GPU: low-precision optimizer states: GPU tests, then 8B shapes x
#       8 layers per state dtype, OPTSTATES_RUNS=bf16m-auto,bf16m-fp8 to pick; PARITY_LEGS=fp8-exp-avg-fp8,fp8-exp-avg-sq-bf16
#       ... parity1b for their parity legs)
#   bash scripts/gpu_checks.sh coldstart  (time to step 1 with cold and warm compile caches; COLD_LAYERS=32 for the whole 8B)
#   PEER_WHEELS=DIR bash scripts/gpu_checks.sh coldpeer  (every GPU: cold start from the launch beside torchtitan 0.2.2,
#       alternated ours / peer / peer / ours / ours / peer, fp8 and bf16; COLD_ORDER, COLD_PRECISIONS, COLD_LAYERS)
#   bash scripts/gpu_checks.sh weights_per_step  (1 GPU: float8.weights_per_step on vs off, dense 8B x 8 and moe_16b x 8
#       layers, with and without gradient accumulation)
#   bash scripts/gpu_checks.sh resume_check  (1 GPU: a resume's probe check against a resume without it, 8B x 8 layers)
#   bash scripts/gpu_checks.sh blockwise_tests blockwise_bench  (blockwise FP8: its GPU tests, then 8B shapes x 8 layers bf16 / fp8 tensorwise /
#       fp8 blockwise in one sitting; PARITY_LEGS=bf16,bf16-seed2,fp8-blockwise ... parity1b for its parity leg)
#   bash scripts/gpu_checks.sh fp8knobs_tests fp8knobs  (1 GPU: our tensorwise FP8 linear's GPU tests, then 8B shapes x 8 layers,
#       batch 4, compiled, no AC: torchao tensorwise dynamic, our linear dynamic, float8.scaling=delayed, float8.save_fp8_activations,
#       and eager torchao vs save_fp8_activations; FP8KNOBS="torchao-dynamic delayed" runs only those (each variant is one process
#       with its own compile, ~1-1.5 min); PARITY_LEGS=bf16,bf16-seed2,tensorwise,fp8-delayed ... parity1b for the parity leg)
#   bash scripts/gpu_checks.sh fp8roles   (1 GPU: float8.forward / float8.backward = bf16 and float8.bf16_first/last_blocks against
#       all-FP8 at fp8knobs' shapes; FP8ROLES="all-fp8 bwd-bf16" picks; PARITY_LEGS=bf16,bf16-seed2,fp8-bwd-bf16,fp8-fwd-bf16,
#       fp8-bf16-ends,fp8-decay-bf16 parity1b for their accuracy)
#   bash scripts/gpu_checks.sh recipe7b   (4+ GPUs: the 16-GPU fp8 recipe under a 16x H100 memory cap)
#   bash scripts/gpu_checks.sh moe_profile  (2 GPUs: moe_16b x 8 layers, fp8, ep=1 then ep=2, 2 steps traced per rank, the
#       traces copied out, which rank the others wait for; MOE_PROFILE_RUNS="1,2 --moe.dispatch=sized" picks)
#   bash scripts/gpu_checks.sh moe_fp8    (1 GPU: FP8 routed experts: GPU tests, micro-benchmark, moe_16b x 8 off vs rowwise)
#   bash scripts/gpu_checks.sh parity_moe (1 GPU: moe_small, bf16 vs fp8 with bf16 / FP8 experts; PARITY_MOE_STEPS=500)
#   bash scripts/gpu_checks.sh parity_dispatch (2 GPUs: moe_small at ep=2, bf16 x2 seeds vs fp8 with moe.dispatch_dtype fp8 / bf16)
#   bash scripts/gpu_checks.sh moe16b     (4+ GPUs: moe_16b with ep = every GPU, bf16 vs fp8; docs/moe.md)
#   bash scripts/gpu_checks.sh moe_dispatch  (2 GPUs: moe_16b x 8 layers, ep=2, fp8: moe.dispatch_dtype bf16 vs fp8, with
#       the experts bf16 and FP8 rowwise; tokens/s per GPU and the all-to-all's share of a profiled step; docs/moe.md)
#   bash scripts/gpu_checks.sh fp8_casts  (1 GPU: the casts to e5m2 that also write a transposed copy, inductor's against
#       Triton kernels of ours: scripts/bench_fp8_casts.py)
#   bash scripts/gpu_checks.sh inductor_options  (1 GPU: 8B shapes x 8 layers fp8 under inductor options, each with a cold
#       compile cache and its kernel summary; INDUCTOR_VARIANTS="LABEL [KEY=VALUE ...];..." picks)
#   bash scripts/gpu_checks.sh memplan    (1 GPU: the dry run's memory estimate against the measured peak, other shapes)
#   bash scripts/gpu_checks.sh families   (1 GPU: DeepSeek-V3, Qwen3-MoE and GPT-OSS published-size flavors x 8 layers,
#       bf16 / fp8 tokens/s and peak beside the plan; then PEER_WHEELS=DIR PEER_MODEL=deepseek_v3 PEER_FLAVOR=16B
#       PEER_LAYERS=8 PEER_BATCH=2 ... peer8b: torchtitan's DeepSeek-V3 16B x 8 layers; PARITY_FAMILY=deepseek_v3 ...
#       parity_family: a family's bf16 x2 seeds vs fp8 legs at moe_small's size)
#   bash scripts/gpu_checks.sh memory_peak  (1 GPU: 8B-shape and moe_16b peaks and what is live at them: scripts/memory_peak.py)
#   bash scripts/gpu_checks.sh docmask    (1 GPU: document masking's GPU test, then 8B shapes x 8 layers on the stdlib text
#       (byte tokens, documents of the standard library's files and pydoc topics): causal vs document-masked, bf16 and fp8)
# The multi-GPU tables (docs/benchmarks.md "Multi-GPU"; each table is one step, run in one sitting on every GPU of the
# machine, $NGPU; a 2-, 4- or 8-GPU H200 kind):
#   bash scripts/gpu_checks.sh full8b     (1: the whole Llama 3 8B, FSDP2 over all GPUs, batch 4 x 4096 per GPU, compile,
#       no AC: bf16 and fp8 model TFLOP/s per GPU; then PEER_WHEELS=DIR bash scripts/gpu_checks.sh peer8b: torchtitan
#       0.2.2's same job in the same sitting)
#   bash scripts/gpu_checks.sh reduce_dtypes  (2 GPUs: 8B shapes x 8 layers on one GPU, then dp_shard=2 with each
#       distributed.reduce_dtype, bf16 and fp8; then PARITY_LEGS=... bash scripts/gpu_checks.sh parity1b_reduce: the 1B
#       parity legs at dp_shard=2, bf16 x2 seeds against fp8 gradient reduces; needs data/py_bpe)
#   bash scripts/gpu_checks.sh scaling    (2: that job on 1, 2, 4, 8 GPUs up to $NGPU: tokens/s per GPU and the efficiency
#       against one GPU, fp8 with its all-gather in fp8 and in bf16; SCALING_GPUS="1 4" picks the counts)
#   bash scripts/gpu_checks.sh ckpt_stall (3: the whole 8B on all GPUs, async pinned-memory checkpoints every 30 steps:
#       how long each save blocks training, the first save and the rest; STALL_ARGS: more overrides, STALL_STEPS and
#       STALL_INTERVAL the run's length and checkpoint.interval, STALL_DIR its folder)
#   bash scripts/gpu_checks.sh ckpt_speed (1 or more GPUs: each async save's write speed in GB/s per rank and how long it
#       blocked training, beside dd of as many bytes per rank into the same folder, and what allocating the host buffers
#       in the background cost the steps beside it; the whole 8B by default: CKPT_ARGS="--model.n_layers=8" on one GPU or
#       a small disk; CKPT_DIR the folder (the disk measured; 2 checkpoints: 96 GB for the whole 8B), CKPT_STEPS,
#       CKPT_INTERVAL, CKPT_MODE=async / disabled; a baseline: the same step with an older trainer/checkpoint checked out)
#   bash scripts/gpu_checks.sh pp         (4: 4 GPUs: dp_shard=4 against pp=2 x dp_shard=2, 1F1B and Interleaved1F1B)
#   bash scripts/gpu_checks.sh moe16b recipe7b   (5: moe_16b with ep = every GPU; the 16-GPU fp8 recipe under its cap)
#   bash scripts/gpu_checks.sh cp         (6: 8B shapes at 32K and 128K tokens with distributed.cp = every GPU: tokens/s
#       and peak memory, and the losses against cp=1 on one GPU where that fits; CP_SEQS="32768" picks lengths)
#   GPU_CHECKS_DRY_RUN=8 bash scripts/gpu_checks.sh full8b scaling ...   (no GPU needed: every launch of those steps is
#       validated by its --dry-run for the ranks it would start, $GPU_CHECKS_DRY_RUN standing for $NGPU, on GPUs of
#       GPU_GIB GiB (default 139.8: an H200); each prints its memory plan; nothing is trained)
# Writes logs and JSON under ${OUT:-/tmp/gpu_out}; prints a short table last. Exit status: 0, or 1 when a step failed
# (each named last), or 3 when none failed but a parity step's verdict was INCONCLUSIVE (scripts/fp8_parity.py's codes).
set -uo pipefail
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/inductor NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
  NVSHMEM_DISABLE_NVLS=1
DRY=${GPU_CHECKS_DRY_RUN:-}
source scripts/gpu_torchao.sh || exit 1
export PYTHONPATH=$PWD:${PYTHONPATH:-}
STEPS=${@:-tests bench8b bench1b accuracy ac}
if [ -n "$DRY" ]; then NGPU=$DRY GIB=${GPU_GIB:-139.8}; echo "dry run: $NGPU GPUs of $GIB GiB planned, nothing runs" > "$OUT/env.txt"
else
read -r NGPU GIB < <(python3 -c "import torch; n = torch.cuda.device_count(); print(n, torch.cuda.get_device_properties(0).total_memory / 2**30 if n else 0)")
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, torchao, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'torchao', torchao.__version__, 'triton', triton.__version__)"
} 2>&1 | tee "$OUT/env.txt"
fi
shown() {  # shown PATTERN: the log lines a step prints (grep -E); a dry run's plans whole
  if [ -n "$DRY" ]; then cat; else grep -E "$1"; fi
}
launch() {  # launch N SCRIPT ARGS...: SCRIPT on the first N visible GPUs (torchrun for N > 1; CUDA_VISIBLE_DEVICES=2,3
  # before the script: those two, so that two steps share a 4-GPU machine); GPU_CHECKS_DRY_RUN: its dry run instead
  local n=$1 visible; shift
  visible=$(python3 -c "import sys; v = sys.argv[1].split(',') if sys.argv[1] else [str(i) for i in range($NGPU)]; print(','.join(v[:$n]))" "${CUDA_VISIBLE_DEVICES:-}")
  if [ -n "$DRY" ]; then python3 "$@" --dry-run --world-size "$n" --gpu-memory-gib "$GIB"
  elif [ "$n" = 1 ]; then CUDA_VISIBLE_DEVICES=$visible python3 "$@"
  else CUDA_VISIBLE_DEVICES=$visible torchrun --standalone --nproc_per_node="$n" "$@"; fi
}
stamped() {  # stdin to stdout, each line prefixed "@EPOCH " as it arrives (scripts/peer_step1.py --launched reads them)
  python3 -u -c 'import sys, time
for line in sys.stdin: sys.stdout.write(f"@{time.time():.2f} {line}")'
}
B="python3 scripts/benchmark.py --json $OUT/bench.jsonl"
SHAPE_8B="--model.n_layers=8 --train.batch_size=4 --train.seq_len=4096 --data.source=synthetic --train.activation_checkpointing=none --train.compile_model=true --checkpoint.enable=false ${ARGS_8B:-}"
BENCH_8B="--config configs/train/llama3_8b.toml -- $SHAPE_8B"
FULL_8B="--config configs/train/llama3_8b.toml -- --train.batch_size=4 --train.seq_len=4096 --data.source=synthetic --train.activation_checkpointing=none --train.compile_model=true --checkpoint.enable=false"
BENCH_1B="--config configs/train/llama3_1b.toml -- --train.batch_size=8 --train.seq_len=4096 --data.source=synthetic --train.activation_checkpointing=none --train.compile_model=true --checkpoint.enable=false"
FAILED=()  # steps whose command failed: the script's exit status is 1 when any did
INCONCLUSIVE=()  # parity steps whose verdict was INCONCLUSIVE (and none failed): exit status 3, as fp8_parity.py's
failed() { FAILED+=("$1"); echo "[gpu_checks] step $1 FAILED (exit $2)"; }
run_variants() {  # run_variants STEP "GPUS PRECISIONS LABEL [OVERRIDES...];...": scaling_variants' job under each setting;
  # an override --inductor=KEY=VALUE is benchmark.py's (an inductor option), the others the config's.
  # VARIANT_PROFILE="LABEL ..." (or all): those also trace 2 steps per rank (the kernel summaries in their logs);
  # VARIANT_COLD_CACHE=1: each run compiles with an empty inductor cache of its own. The runs' dump folder is
  # this process's own, so that two tracks of scripts/gpu_tracks.sh running variants at once do not share one.
  local step=$1 v n precisions label w cache; local -a variants bench config
  IFS=';' read -ra variants <<< "$2"
  for v in "${variants[@]}"; do
    set -- $v; n=$1; precisions=$2; label=$3; shift 3
    bench=(); config=(); for w in "$@"; do case $w in --inductor=*) bench+=("$w") ;; *) config+=("$w") ;; esac; done
    local prof=(); case " ${VARIANT_PROFILE:-} " in *" $label "*|*" all "*) prof=(--profile-dir /tmp/variants_prof_$$/$label) ;; esac
    cache=$TORCHINDUCTOR_CACHE_DIR; [ -z "${VARIANT_COLD_CACHE:-}" ] || cache=/tmp/variants_cache_$$/$label
    TORCHINDUCTOR_CACHE_DIR=$cache launch $n scripts/benchmark.py --json $OUT/variants.jsonl --label "$label" \
      --precisions $precisions --warmup 6 --steps ${VARIANT_STEPS:-10} --dump-folder /tmp/variants_dump_$$ "${prof[@]}" \
      "${bench[@]}" $BENCH_8B "${config[@]}" > "$OUT/variant_$label.log" 2>&1 || failed "$step $label" $?
    grep -A3 "^precision" "$OUT/variant_$label.log" | grep -v "^precision" | sed "s/^/[$n GPU $label] /"
  done
}
for s in $STEPS; do case $s in
  tests) python3 -m pytest -q -m gpu tests/gpu -s 2>&1 | tee "$OUT/gpu_tests.log" | tail -40 ;;
  bench8b) $B --label "8B shapes, 8 layers, batch 4, seq 4096${ARGS_8B:+, $ARGS_8B}" --warmup 6 --steps 10 --profile-dir /tmp/prof8b $BENCH_8B 2>&1 | tee "$OUT/bench8b.log" | grep -v "^\[rank" ;;
  blockwise_tests)  # float8.recipe=blockwise: torchao's kernels vs our emulation and a compiled profiled train
    python3 -m pytest -q -m gpu tests/gpu/test_float8_blockwise_gpu.py -s 2>&1 | tee "$OUT/gpu_tests_blockwise.log" | tail -20 ;;
  blockwise_bench)  # 1x H100, Llama 3 8B shapes x 8 layers, batch 4 x 4096, compile, no AC: bf16, tensorwise, blockwise
    CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} $B --label "8B shapes, 8 layers, batch 4, seq 4096, bf16 / fp8 tensorwise / fp8 blockwise${ARGS_8B:+, $ARGS_8B}" \
      --precisions bf16,fp8:tensorwise,fp8:blockwise --warmup 6 --steps 10 --profile-dir /tmp/prof8b_blockwise $BENCH_8B 2>&1 \
      | tee "$OUT/bench8b_blockwise.log" | grep -v "^\[rank" ;;
  fp8knobs_tests)  # our Float8TensorwiseLinear on cuBLAS: torchao's numbers, delayed scales, compiled, no host sync
    python3 -m pytest -q -m gpu tests/gpu/test_float8_scaling_gpu.py -s 2>&1 | tee "$OUT/gpu_tests_fp8knobs.log" | tail -20 ;;
  fp8knobs)  # docs/fp8.md "The FP8 options": 1x H100, 8B shapes x 8 layers, batch 4 x 4096, compiled, no AC, one process
    # each (its own compile); tokens/s and peak GiB in each log's table. Then eager (the only place save_fp8_activations
    # can change what is saved: tests/unit/test_float8_scaling_compile.py), torchao vs fp8 inputs saved.
    export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
    for v in "torchao-dynamic" "ours-dynamic --own-fp8-linear" "delayed -- --float8.scaling=delayed" \
             "save-fp8 -- --float8.save_fp8_activations=true" "delayed-save-fp8 -- --float8.scaling=delayed --float8.save_fp8_activations=true" \
             "eager-torchao -- --train.compile_model=false" \
             "eager-save-fp8 -- --train.compile_model=false --float8.save_fp8_activations=true"; do
      set -- $v; name=$1; shift; flags=(); extra=()
      case " ${FP8KNOBS:-$name} " in *" $name "*) ;; *) continue ;; esac  # FP8KNOBS="a b": only those variants
      while [ $# -gt 0 ] && [ "$1" != "--" ]; do flags+=("$1"); shift; done; [ $# -gt 0 ] && shift; extra=("$@")
      $B --label "fp8knobs $name: 8B shapes, 8 layers, batch 4, seq 4096" --precisions fp8 --warmup 6 --steps 10 "${flags[@]}" \
        $BENCH_8B "${extra[@]}" 2>&1 | tee "$OUT/bench8b_fp8knobs_$name.log" | grep -v "^\[rank"
    done ;;
  fp8roles)  # docs/fp8.md "Precision per block and per GEMM" (issue 54), speed: fp8knobs' job (1x H100, 8B shapes x 8
    # layers, batch 4 x 4096, compiled, no AC), all-FP8 against each bf16 role and the bf16 first and last blocks;
    # FP8ROLES="all-fp8 bwd-bf16" runs only those. Their accuracy: PARITY_LEGS=bf16,bf16-seed2,fp8-bwd-bf16,... parity1b.
    export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
    for v in "all-fp8" "fwd-bf16 --float8.forward=bf16" "bwd-bf16 --float8.backward=bf16" \
             "fwd-bf16-rowwise --float8.recipe=rowwise --float8.forward=bf16" "bwd-bf16-rowwise --float8.recipe=rowwise --float8.backward=bf16" \
             "bf16-ends --float8.bf16_first_blocks=1 --float8.bf16_last_blocks=1"; do
      set -- $v; name=$1; shift
      case " ${FP8ROLES:-$name} " in *" $name "*) ;; *) continue ;; esac
      $B --label "fp8roles $name: 8B shapes, 8 layers, batch 4, seq 4096" --precisions fp8 --warmup 6 --steps 10 \
        $BENCH_8B "$@" 2>&1 | tee "$OUT/bench8b_fp8roles_$name.log" | grep -v "^\[rank"
    done ;;
  weights_per_step)  # issue 50 item 1: float8.weights_per_step=on against off, one GPU, in one sitting: 8B shapes x 8
    # layers at 16K tokens a step as one microbatch of 4 and as 4 of 1, and moe_16b x 8 layers (FP8 experts rowwise) as 1
    # microbatch of 2 and 2 of 1; step time and peak beside the plan (its row "FP8 weights kept through the step").
    # WPS_RUNS="dense-accum4 moe-accum2" picks
    MOE_8L="--config configs/train/moe_16b_4gpu_fp8.toml -- --model.n_layers=8 --distributed.ep=1 --data.source=synthetic
            --train.activation_checkpointing=none --train.compile_model=true --checkpoint.enable=false --float8.moe_experts=rowwise --float8.enable_fsdp_float8_all_gather=false"
    for v in "dense-accum1 $BENCH_8B" "dense-accum4 $BENCH_8B --train.batch_size=1 --train.grad_accum_steps=4" \
             "moe-accum1 $MOE_8L --train.batch_size=2" "moe-accum2 $MOE_8L --train.batch_size=1 --train.grad_accum_steps=2"; do
      set -- $v; name=$1; shift
      case " ${WPS_RUNS:-$name} " in *" $name "*) ;; *) continue ;; esac
      for w in on off; do
        launch 1 scripts/benchmark.py --json $OUT/weights_per_step.jsonl --label "weights_per_step=$w $name" --precisions fp8 \
          --warmup 6 --steps 10 "$@" --float8.weights_per_step=$w 2>&1 | tee "$OUT/wps_${name}_$w.log" | grep -v "^\[rank" \
          || failed "weights_per_step $name $w" $?
      done
    done ;;
  resume_check)  # issue 53 item 4's cost at a resume: 8B shapes x 8 layers saves at step 10, then two relaunches resume
    # it for 2 more steps, with checkpoint.resume_check on and off; the log lines' times from "resumed from checkpoint" to
    # "step 11" (the probe's forward is the difference)
    RC="--config configs/train/llama3_8b.toml $SHAPE_8B --checkpoint.enable=true --checkpoint.interval=10
        --metrics.log_freq=1 --metrics.enable_tensorboard=false --job.dump_folder=/tmp/resume_check_run"
    rm -rf /tmp/resume_check_run
    launch 1 scripts/train.py $RC --train.steps=10 > "$OUT/resume_check_save.log" 2>&1 || failed "resume_check save" $?
    for c in true false; do
      launch 1 scripts/train.py $RC --train.steps=12 --checkpoint.resume_check=$c > "$OUT/resume_check_$c.log" 2>&1 \
        || failed "resume_check $c" $?
      grep -E "resumed from checkpoint|resume check|step +11/" "$OUT/resume_check_$c.log" | cut -c1-200 | sed "s/^/[resume_check=$c] /"
      rm -rf /tmp/resume_check_run/checkpoint/step-12 /tmp/resume_check_run/checkpoint/step-11
    done
    rm -rf /tmp/resume_check_run ;;
  coldstart)  # 8B shapes x 8 layers, batch 4 x 4096, the defaults: time from "training steps" to the end of step 1
    # with cold inductor and Triton caches, fp8 / bf16 x bf16 (default) / fp32 master weights, then the fp8 default
    # again on its warm caches; each line: step 1's time and its compile line, then the steps' TFLOP/s.
    # COLD_RUNS: other "precision master_dtype" pairs; COLD_ARGS: more overrides (COLD_LAYERS=32: the whole 8B; "8 32":
    # each in turn);
    # COLD_PY: the interpreter command (a wrapper that prints dynamo's compile-time table, say); COLD_GPUS=N: FSDP2 over
    # the first N visible GPUs (torchrun; COLD_PY unused), beside the peer's cold start (peer8b's "step 1 after" line).
    IFS=, read -ra runs <<< "${COLD_RUNS:-fp8 auto,bf16 auto,fp8 fp32,bf16 fp32,fp8 auto warm}"
    ngpu=${COLD_GPUS:-1}; cmd=(${COLD_PY:-python3} scripts/train.py); [ "$ngpu" -gt 1 ] && cmd=(launch "$ngpu" scripts/train.py)
    gpus=""; [ "$ngpu" -gt 1 ] && gpus="_${ngpu}gpu"
    for layers in ${COLD_LAYERS:-8}; do
      CS="--config configs/train/llama3_8b.toml $SHAPE_8B --model.n_layers=$layers --train.steps=${COLD_STEPS:-30}
          --metrics.log_freq=10 --metrics.enable_tensorboard=false ${COLD_ARGS:-}"
      for run in "${runs[@]}"; do set -- $run; p=$1; m=$2; cache=/tmp/coldstart_${p}_$m
        tag="$p master=$m ${3:-cold}, $layers layers${gpus:+, $ngpu GPUs}"; log="$OUT/coldstart_${p}_${m}_${layers}l${gpus}${3:+_$3}.log"
        [ "${3:-}" = warm ] || rm -rf "$cache"
        start=$(date +%s.%N)
        PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=$cache/inductor TRITON_CACHE_DIR=$cache/triton "${cmd[@]}" $CS \
          --train.mixed_precision=$p --distributed.master_dtype=$m --job.dump_folder=/tmp/coldstart_run 2>&1 | stamped > "$log"
        rc=${PIPESTATUS[0]}; end=$(date +%s.%N)
        grep -E "step +(1|10|20|30)/|compiling|Error" "$log" | cut -c1-220 | sed "s/^/[coldstart $tag] /" | tee -a "$OUT/coldstart.log"
        echo "[coldstart $tag] exit $rc, process wall $(python3 -c "print(round($end - $start, 1))") s;" \
          "$(python3 scripts/peer_step1.py "$log" --launched "$start")" | tee -a "$OUT/coldstart.log"
        rm -rf /tmp/coldstart_run
      done
    done ;;
  coldpeer)  # cold start beside torchtitan 0.2.2, the two alternated: for each of COLD_PRECISIONS (default "fp8 bf16"),
    # the runs in COLD_ORDER (default "ours peer peer ours ours peer": neither always first), each a coldstart run (its
    # default master weights, 10 steps) or a peer8b run (PEER_AC, one mode, default none), both launched by torchrun on
    # every GPU with empty compile caches, COLD_LAYERS of the 8B's layers (default 8; 32 the whole 8B); needs
    # PEER_WHEELS. Each run's log: $OUT/coldpeer_P_I_WHO.log; the table (scripts/multigpu_tables.py coldpeer): each
    # run's seconds to step 1 from the launch and from its own training start, and the mean of each trainer.
    if [ -n "$DRY" ] || [ -z "${PEER_WHEELS:-}" ]; then echo "[coldpeer] skipped: $([ -n "$DRY" ] && echo "a dry run" || echo "no PEER_WHEELS")"; continue; fi
    layers=${COLD_LAYERS:-8}; gpus=""; [ "$NGPU" -gt 1 ] && gpus="_${NGPU}gpu"
    for p in ${COLD_PRECISIONS:-fp8 bf16}; do i=0
      for who in ${COLD_ORDER:-ours peer peer ours ours peer}; do i=$((i+1)); log="$OUT/coldpeer_${p}_${i}_$who.log"
        if [ "$who" = peer ]; then summary=$OUT/peer8b.log; made="$OUT/peer8b_${p}_ac_${PEER_AC:-none}_${layers}l.log"
        else summary=$OUT/coldstart.log; made="$OUT/coldstart_${p}_auto_${layers}l$gpus.log"; fi
        seen=$(cat "$summary" 2>/dev/null | wc -l)  # this run's launch line is the first after these
        if [ "$who" = peer ]; then
          PEER_LAYERS=$layers PEER_AC=${PEER_AC:-none} PEER_PRECISIONS=$p bash scripts/gpu_checks.sh peer8b
        else
          COLD_GPUS=$NGPU COLD_PY="torchrun --standalone --nproc_per_node=1" COLD_RUNS="$p auto" COLD_STEPS=10 \
            COLD_LAYERS=$layers bash scripts/gpu_checks.sh coldstart
        fi >> "$OUT/coldpeer_calls.log" 2>&1
        mv "$made" "$log" || failed "coldpeer $p $i $who" 1
        from_launch=$(tail -n +$((seen + 1)) "$summary" 2>/dev/null | grep -o -m1 "launch to step 1: [^;]*")
        if [ "$who" = peer ]; then own=$(python3 scripts/peer_step1.py "$log" 2>/dev/null)
        else own=$(grep -o -m1 "step 1 done [0-9.]* s" "$log" 2>/dev/null); fi
        echo "[coldpeer $p $i $who] ${from_launch:-launch to step 1: no line}; own: ${own:-none}" | tee -a "$OUT/coldpeer.log"
      done
    done
    python3 scripts/multigpu_tables.py coldpeer "$OUT/coldpeer.log" | tee "$OUT/coldpeer_table.md" ;;
  optim8b)  # fp8, fp32 master weights: torch's fused AdamW kernel (optimizer.implementation=fused) vs our Triton one
    for impl in fused triton; do
      $B --label "8B shapes, 8 layers, batch 4, seq 4096, fp8, fp32 master, optimizer $impl" --precisions fp8 --warmup 6 --steps 10 \
        ${BENCH_8B} --distributed.master_dtype=fp32 --optimizer.implementation=$impl 2>&1 | tee "$OUT/bench8b_optim_$impl.log" | grep -v "^\[rank"
    done ;;
  optstates_tests)  # low-precision optimizer states: their GPU tests and the AdamW kernel's (which now runs them too)
    python3 -m pytest -q -m gpu tests/gpu/test_optim_states_gpu.py tests/gpu/test_optim_kernel_gpu.py -s 2>&1 \
      | tee "$OUT/gpu_tests_optim_states.log" | tail -5 ;;
  optstates)  # low-precision optimizer states (docs/fp8.md): fp8 at 8B shapes x 8 layers, batch 4, peak memory and step
    # time of bf16 master weights with the bf16 (auto) vs fp8 first moment, fp32 master weights with fp32 (auto) vs
    # bf16 moments vs an fp8 first moment, and each run's "Optimizer state" startup line (dtypes, B/param, which
    # update runs). OPTSTATES_RUNS picks runs (comma-separated labels) to spread them over calls.
    for v in "bf16m-auto" "bf16m-fp8 --optimizer.exp_avg_dtype=fp8" \
             "fp32m-auto --distributed.master_dtype=fp32" \
             "fp32m-bf16 --distributed.master_dtype=fp32 --optimizer.exp_avg_dtype=bf16 --optimizer.exp_avg_sq_dtype=bf16" \
             "fp32m-fp8 --distributed.master_dtype=fp32 --optimizer.exp_avg_dtype=fp8 --optimizer.exp_avg_sq_dtype=bf16"; do
      set -- $v; label=$1; shift
      case ",${OPTSTATES_RUNS:-$label}," in *",$label,"*) ;; *) continue ;; esac
      log="$OUT/bench8b_optstates_$label.log"
      $B --label "8B shapes, 8 layers, batch 4, seq 4096, optimizer states $label" --precisions fp8 --warmup 6 --steps 10 \
        ${BENCH_8B} "$@" > "$log" 2>&1
      grep -m1 "Optimizer state" "$log" | cut -c1-400 | sed "s/^/[optstates $label] /"
      grep -v "^\[rank" "$log" | tail -6
    done 2>&1 | tee -a "$OUT/optstates.log" ;;
  bench8b_ag)  # fp8 with bf16 all-gather, explicitly (the "auto" default also turns it off with one rank)
    $B --label "8B shapes, 8 layers, batch 4, seq 4096, fp8 all-gather off" --precisions fp8 --warmup 6 --steps 10 ${BENCH_8B} --float8.enable_fsdp_float8_all_gather=false 2>&1 | tee "$OUT/bench8b_ag.log" | grep -v "^\[rank" ;;
  bench8b_bf16m)  # fp8, bf16 master weights and moments, each bf16_update (all-gather off as in bench8b_ag)
    for u in stochastic kahan nearest; do
      $B --label "8B shapes, 8 layers, batch 4, seq 4096, fp8 all-gather off, bf16 master ($u)" --precisions fp8 --warmup 6 --steps 10 ${BENCH_8B} --float8.enable_fsdp_float8_all_gather=false --distributed.master_dtype=bf16 --optimizer.bf16_update=$u 2>&1 | tee "$OUT/bench8b_bf16m_$u.log" | grep -v "^\[rank"
    done ;;
  bench8b_ce)  # fp8, 8B shapes x 8 layers: plain loss vs train.loss_chunk_tokens at batch 4, then at larger batches
    # CE_CHUNK: tokens per chunk (default 4096: 4 chunks at batch 4 x 4096); CE_BATCHES: the larger per-GPU batches,
    # each tried both ways. A run that does not fit says so (benchmark.py dies of OutOfMemoryError).
    for b in 4 ${CE_BATCHES:-6 8}; do for c in 0 ${CE_CHUNK:-4096}; do
      tag="batch $b x 4096, loss_chunk_tokens=$c${ARGS_8B:+, $ARGS_8B}"; log="$OUT/ce8b_b${b}_c$c.log"
      $B --label "8B shapes, 8 layers, fp8, $tag" --precisions fp8 --warmup 6 --steps 10 ${BENCH_8B} \
        --train.batch_size=$b --train.loss_chunk_tokens=$c > "$log" 2>&1; rc=$?
      grep -v "^\[rank" "$log" | grep -B1 -A1 "^precision"
      if [ $rc -ne 0 ]; then
        if grep -q "OutOfMemoryError" "$log"; then echo "[bench8b_ce] $tag: did not fit (OutOfMemoryError)"
        else echo "[bench8b_ce] $tag: failed (exit $rc), see $log"; fi
      fi
    done; done 2>&1 | tee "$OUT/bench8b_ce.log" ;;
  trainlog8b)  # the train.py log line on the same shape, for agreement with benchmark.py
    for p in bf16 fp8; do
      python3 scripts/train.py --config configs/train/llama3_8b.toml $SHAPE_8B --train.steps=20 --metrics.log_freq=10 \
        --metrics.enable_tensorboard=false --train.mixed_precision=$p --job.dump_folder=/tmp/tl_$p 2>&1 \
        | grep -E "step +(10|20)/" | sed "s/^/[train.py $p] /" | tee -a "$OUT/trainlog8b.log"
    done ;;
  bench1b) $B --label "1B, batch 8, seq 4096" --warmup 6 --steps 10 $BENCH_1B 2>&1 | tee "$OUT/bench1b.log" | grep -v "^\[rank" ;;
  bench1b_ag)  # fp8 with bf16 all-gather (casts inside the compiled graphs instead of before the gather)
    $B --label "1B, batch 8, seq 4096, fp8 all-gather off" --precisions fp8 --warmup 6 --steps 10 ${BENCH_1B} --float8.enable_fsdp_float8_all_gather=false 2>&1 | tee "$OUT/bench1b_ag.log" | grep -v "^\[rank" ;;
  accuracy)
    for run in "bf16 0" "fp8 0" "bf16 1"; do set -- $run; p=$1; seed=$2
      python3 scripts/train.py --config configs/train/llama3_1b.toml --data.source=${ACC_DATA:-stdlib} --train.steps=300 \
        --model.vocab_size=512 --train.batch_size=8 --train.seq_len=1024 --train.compile_model=true \
        --train.mixed_precision=$p --train.seed=$seed --scheduler.warmup_steps=100 --optimizer.lr=3e-4 \
        --checkpoint.enable=false --metrics.log_freq=1 --metrics.enable_tensorboard=false \
        --job.dump_folder=/tmp/acc_${p}_$seed 2>&1 | grep -E "step +[0-9]+00/|Applied|converted" | tee "$OUT/accuracy_${p}_$seed.log" | tail -1
      cp /tmp/acc_${p}_$seed/metrics.jsonl "$OUT/accuracy_${p}_$seed.jsonl"
    done ;;
  ckpt)  # bf16 -> fp8 (compiled) -> bf16 by checkpoint and relaunch, async pinned-memory saves
    A="--config configs/train/llama3_1b.toml --model.n_layers=2 --data.source=stdlib --train.seq_len=1024 --train.batch_size=4 --train.steps=30 --scheduler.decay_type=constant --checkpoint.enable=true --checkpoint.interval=10 --checkpoint.async_mode=async_with_pinned_mem --metrics.log_freq=5 --job.dump_folder=/tmp/ckpt_run"
    rm -rf /tmp/ckpt_run
    { python3 scripts/train.py $A --train.mixed_precision=bf16 --train.steps=10
      python3 scripts/train.py $A --train.mixed_precision=fp8 --train.compile_model=true --train.steps=20
      python3 scripts/train.py $A --train.mixed_precision=bf16 --checkpoint.model_only=true
      ls /tmp/ckpt_run/checkpoint; python3 -m pytest -q tests/unit/test_checkpoint.py tests/cli/test_checkpoint.py; } 2>&1 \
      | grep -E "resumed|Applied Float8|step +(10|20|30)/|saved|export|passed|failed|Error|error|step-" | tee "$OUT/ckpt.log" ;;
  moe16b)  # moe_16b, ep = all GPUs, batch 2 x 4096 per GPU, compile, no AC: bf16 vs fp8, then 30 steps for load imbalance
    M="--config configs/train/moe_16b_4gpu_fp8.toml"
    launch $NGPU scripts/benchmark.py --json $OUT/bench.jsonl --label "moe_16b, ep=$NGPU, batch 2, seq 4096" \
      --warmup 6 --steps 10 $M -- --distributed.ep=$NGPU --data.source=synthetic ${MOE_ARGS:-} 2>&1 | tee "$OUT/bench_moe16b.log" | grep -v "^\[rank"
    rm -rf /tmp/moe_run
    launch $NGPU scripts/train.py $M --distributed.ep=$NGPU --data.source=synthetic ${MOE_ARGS:-} \
      --train.steps=30 --metrics.log_freq=10 --job.dump_folder=/tmp/moe_run 2>&1 \
      | shown "step +[0-9]+/|converted|MoE|expert parallel|FSDP2|Error|error" | tee "$OUT/moe16b_train.log"
    [ -n "$DRY" ] || cp /tmp/moe_run/metrics.jsonl "$OUT/moe16b_metrics.jsonl" ;;
  moe_dispatch)  # FP8 token dispatch (issue 50 item 3): moe_16b x 8 layers, ep=2 on 2 GPUs, batch 2 x 4096 per GPU, compile,
    # no AC, fp8: moe.dispatch_dtype bf16 vs fp8 (both sized: fp8 is), experts off (bf16) and rowwise; one sitting, profiles
    for mode in ${DISPATCH_EXPERTS:-off rowwise}; do  # DISPATCH_EXPERTS: the float8.moe_experts modes to run
      for dispatch in bf16 fp8; do
        launch 2 scripts/benchmark.py --json $OUT/bench.jsonl \
          --label "moe_16b x 8 layers, ep=2, batch 2, seq 4096, moe.dispatch_dtype=$dispatch, float8.moe_experts=$mode" \
          --precisions fp8 --warmup 6 --steps 10 --profile-dir /tmp/prof_dispatch_${dispatch}_$mode \
          --config configs/train/moe_16b_4gpu_fp8.toml -- --model.n_layers=8 --distributed.ep=2 --data.source=synthetic \
          --moe.dispatch_dtype=$dispatch --moe.dispatch=sized --float8.moe_experts=$mode ${MOE_ARGS:-} 2>&1 \
          | tee "$OUT/bench_moe_dispatch_${dispatch}_$mode.log" | grep -E "^precision|^fp8|dispatched|host blocked|Error|error"
        # each rank's trace (under 1 MB each): where one rank's host lags the other's (docs/debug.md, host waits)
        for f in /tmp/prof_dispatch_${dispatch}_$mode/fp8/trace*.json.gz; do
          [ -f "$f" ] && cp "$f" "$OUT/prof_dispatch_${dispatch}_${mode}_$(basename "$f")"
        done
      done
    done ;;
  moe_padded)  # moe.dispatch sized vs padded (docs/moe.md): moe_16b x 8 layers, batch 2 x 4096 per GPU, compile, no AC,
    # fp8 (bf16 experts): ep=1 on one GPU, then ep=2 on 2 GPUs sized, padded, padded, sized (the run-to-run spread);
    # MOE_PADDED_RUNS: other "ep dispatch [overrides...]" runs, comma-separated (e.g. "2 auto --moe.overlap_all_to_all=false")
    IFS=, read -ra runs <<< "${MOE_PADDED_RUNS:-1 sized,2 sized,2 padded,2 padded,2 sized}"
    for run in "${runs[@]}"; do set -- $run
      launch $1 scripts/benchmark.py --json $OUT/bench.jsonl --label "moe_16b x 8 layers, ep=$1, batch 2, seq 4096, moe.dispatch=$2 ${*:3}" \
        --precisions fp8 --warmup 6 --steps 10 --config configs/train/moe_16b_4gpu_fp8.toml -- --model.n_layers=8 \
        --distributed.ep=$1 --data.source=synthetic --moe.dispatch=$2 "${@:3}" ${MOE_ARGS:-} 2>&1 \
        | tee -a "$OUT/bench_moe_padded.log" | grep -E "^precision|^fp8|host blocked|Error|error"
    done ;;
  moe_profile)  # where ep=2 loses against ep=1 (docs/moe.md): moe_16b x 8 layers, batch 2 x 4096 per GPU, compile, no AC, fp8
    # (bf16 experts), moe.dispatch auto: ep=1 on one GPU, then ep=2, each with 2 steps traced per rank; every trace is
    # copied to $OUT (scripts/summarize_trace.py reads them: communication, exposed, device idle per rank);
    # MOE_PROFILE_RUNS: other "ep [overrides...]" runs, comma-separated
    IFS=, read -ra runs <<< "${MOE_PROFILE_RUNS:-1,2}"
    i=0; for run in "${runs[@]}"; do set -- $run; i=$((i + 1)); rm -rf /tmp/prof_moe_$i
      launch $1 scripts/benchmark.py --json $OUT/bench.jsonl --label "moe_16b x 8 layers, ep=$1, batch 2, seq 4096 ${*:2}" \
        --precisions fp8 --warmup 6 --steps 10 --profile-dir /tmp/prof_moe_$i --config configs/train/moe_16b_4gpu_fp8.toml -- \
        --model.n_layers=8 --distributed.ep=$1 --data.source=synthetic "${@:2}" ${MOE_ARGS:-} 2>&1 \
        | tee "$OUT/moe_profile_$i.log" | grep -E "^precision|^fp8|host blocked|communication|device idle|Error|error"
      for f in /tmp/prof_moe_$i/fp8/trace*.json.gz; do if [ -f "$f" ]; then cp "$f" "$OUT/prof_moe_${i}_ep$1_$(basename "$f")"; fi; done
      if [ "$1" -gt 1 ] && [ -z "$DRY" ]; then  # which rank the others wait for (docs/debug.md)
        python3 scripts/summarize_trace.py --ranks --top 0 "$OUT"/prof_moe_${i}_ep$1_trace_rank*.json.gz \
          | tail -n $(($1 + 2)) | tee -a "$OUT/moe_profile_$i.log"
      fi
    done ;;
  moe_fp8)  # FP8 routed experts (float8.moe_experts; docs/fp8.md): GPU tests, the expert micro-benchmark, then moe_16b x 8
    # layers on one GPU (ep=1, batch 2 x 4096, compile, no AC): bf16, fp8 with the experts off, fp8 with rowwise: tokens/s, peak memory
    python3 -m pytest -q -m gpu tests/gpu/test_moe_fp8_gpu.py -s 2>&1 | tee "$OUT/moe_fp8_tests.log" | tail -20
    python3 scripts/bench_moe_experts.py --json "$OUT/bench_moe_experts.jsonl" --profile bf16,fp8 > "$OUT/moe_fp8_micro.log" 2>&1
    sed '/^--- /,$d' "$OUT/moe_fp8_micro.log"  # the kernel tables stay in the log
    for mode in off rowwise; do  # off: bf16 too (issue 21's 1-GPU MoE target), rowwise: fp8 only
      $B --label "moe_16b x 8 layers, ep=1, batch 2, seq 4096, float8.moe_experts=$mode" \
        --precisions $([ $mode = off ] && echo bf16,fp8 || echo fp8) --warmup 6 --steps 10 --profile-dir /tmp/prof_moe_$mode \
        --config configs/train/moe_16b_4gpu_fp8.toml -- --model.n_layers=8 --distributed.ep=1 --data.source=synthetic \
        --float8.moe_experts=$mode ${MOE_ARGS:-} > "$OUT/bench_moe_fp8_$mode.log" 2>&1
      grep -A4 "^precision" "$OUT/bench_moe_fp8_$mode.log"
    done ;;
  families)  # the model families users bring, on one GPU: each one's published-size flavor x FAMILY_LAYERS (default 8)
    # layers, batch 2 x 4096, compile, no AC, ep=1: bf16 and fp8 tokens/s, the measured peak beside the dry run's plan
    # (the memory plan's check for each family); FAMILY_FLAVORS picks (default: deepseek_v3_16b qwen3_30b_a3b
    # gpt_oss_20b), FAMILY_ARGS: more overrides. The peer: PEER_MODEL=deepseek_v3 PEER_FLAVOR=16B PEER_LAYERS=8 ... peer8b
    for f in ${FAMILY_FLAVORS:-deepseek_v3_16b qwen3_30b_a3b gpt_oss_20b}; do
      launch 1 scripts/benchmark.py --json $OUT/families.jsonl --label "$f x ${FAMILY_LAYERS:-8} layers, batch 2 x 4096" \
        --precisions bf16,fp8 --warmup 6 --steps 10 --config configs/train/moe_16b_4gpu_fp8.toml -- --model.flavor=$f \
        --model.n_layers=${FAMILY_LAYERS:-8} --distributed.ep=1 --data.source=synthetic --checkpoint.enable=false \
        ${FAMILY_ARGS:-} 2>&1 | tee "$OUT/family_$f.log" | grep -v "^\[rank" || failed "families $f" $?
    done ;;
  parity_family)  # a model family's FP8 accuracy at moe_small's size (dim 1024, 16 blocks of 16 heads, 32 experts of 512
    # top-4, vocabulary 128,256; one GPU): bf16 x2 seeds vs fp8, PARITY_MOE_STEPS (500) steps of the stdlib text, as
    # parity_moe. PARITY_FAMILY=deepseek_v3 (MLA, 4 groups top-2, one MTP module) | qwen3_moe | gpt_oss.
    fam=${PARITY_FAMILY:-deepseek_v3}
    case $fam in
      deepseek_v3) shape=(--model.flavor=deepseek_v3_16b --deepseek_v3.kv_lora_rank=256 --deepseek_v3.qk_nope_head_dim=64
                          --deepseek_v3.qk_rope_head_dim=32 --deepseek_v3.v_head_dim=64 --deepseek_v3.n_group=4
                          --deepseek_v3.topk_group=2 --moe.n_shared_experts=1) ;;
      qwen3_moe) shape=(--model.flavor=qwen3_30b_a3b --model.head_dim=64 --model.n_kv_heads=4) ;;
      gpt_oss) shape=(--model.flavor=gpt_oss_20b --model.head_dim=64 --model.n_kv_heads=8) ;;
      *) echo "[parity_family] PARITY_FAMILY=$fam: not deepseek_v3, qwen3_moe or gpt_oss"; failed parity_family 2; continue ;;
    esac
    python3 scripts/fp8_parity.py --config configs/train/debug_moe.toml --out "$OUT/parity_$fam" --seeds 1 --tolerance 0.01 \
      "${shape[@]}" --model.dim=1024 --model.n_layers=16 --model.n_heads=16 --model.vocab_size=128256 \
      --moe.n_experts=32 --moe.top_k=4 --moe.moe_ffn_dim=512 --moe.dense_ffn_dim=4096 \
      --train.steps=${PARITY_MOE_STEPS:-500} --train.batch_size=8 --train.seq_len=2048 \
      --train.compile_model=true --scheduler.warmup_steps=50 --optimizer.lr=1e-3 --data.source=stdlib \
      --validation.freq=100 --validation.steps=8 --metrics.log_freq=10 --metrics.enable_tensorboard=false \
      ${PARITY_LEGS:+--legs $PARITY_LEGS} 2>&1 | tee "$OUT/parity_$fam.log" | tail -12 ;;
  parity_moe)  # FP8 experts' accuracy: moe_small (1 GPU), bf16 x2 seeds vs fp8 with the experts bf16 and with FP8 experts
    # PARITY_LEGS picks legs; legs finished in an earlier call and copied to docs/benchmark_data/parity_moe are reused.
    [ -d docs/benchmark_data/parity_moe ] && cp -r docs/benchmark_data/parity_moe "$OUT/"
    python3 scripts/fp8_parity.py --config configs/train/debug_moe.toml --out "$OUT/parity_moe" --seeds 1 --tolerance 0.01 \
      --model.flavor=moe_small --train.steps=${PARITY_MOE_STEPS:-500} --train.batch_size=8 --train.seq_len=2048 \
      --train.compile_model=true --scheduler.warmup_steps=50 --optimizer.lr=1e-3 --data.source=stdlib \
      --validation.freq=100 --validation.steps=8 --metrics.log_freq=10 --metrics.enable_tensorboard=false \
      --variant "experts-bf16=--float8.moe_experts=off" --variant "experts-fp8=--float8.moe_experts=rowwise" \
      ${PARITY_LEGS:+--legs $PARITY_LEGS} \
      2>&1 | tee "$OUT/parity_moe.log" | tail -12 ;;
  parity_dispatch)  # FP8 token dispatch's accuracy (issue 50 item 3): moe_small at ep=2 on 2 GPUs, 4 x 2,048 tokens per GPU
    # (parity_moe's 8 a step in all), 500 steps of the stdlib text: bf16 x2 seeds (bf16 dispatch) vs fp8 compute with
    # moe.dispatch_dtype fp8 and with bf16 (what the dispatch alone changes); ~3 min a leg, so two calls (finished
    # legs in docs/benchmark_data/parity_dispatch are reused; PARITY_LEGS picks)
    [ -d docs/benchmark_data/parity_dispatch ] && cp -r docs/benchmark_data/parity_dispatch "$OUT/"
    python3 scripts/fp8_parity.py --config configs/train/debug_moe.toml --out "$OUT/parity_dispatch" --seeds 1 --tolerance 0.01 \
      --nproc-per-leg 2 --model.flavor=moe_small --distributed.ep=2 --moe.dispatch=sized --train.steps=${PARITY_MOE_STEPS:-500} \
      --train.batch_size=4 --train.seq_len=2048 --train.compile_model=true --scheduler.warmup_steps=50 --optimizer.lr=1e-3 \
      --data.source=stdlib --validation.freq=100 --validation.steps=8 --metrics.log_freq=10 \
      --metrics.enable_tensorboard=false --variant "dispatch-fp8=--moe.dispatch_dtype=fp8" \
      --variant "dispatch-bf16=--moe.dispatch_dtype=bf16" ${PARITY_LEGS:+--legs $PARITY_LEGS} \
      2>&1 | tee "$OUT/parity_dispatch.log" | tail -12 ;;
  parity1b)  # docs/fp8.md "Check that FP8 did not hurt": 1B, 1,000 steps x 16K tokens of BPE text (data/py_bpe, built
    # by scripts/build_tokenizer.py), bf16 x2 seeds vs each FP8 setting and bf16 master weights (the *-seed1 legs: the
    # two stochastic bf16-master legs again with train.seed=1, the seed of bf16-seed2; the variant's override comes
    # last and wins). PARITY_LEGS picks legs (comma-separated) so the legs can be spread over calls; the verdict is
    # computed where all legs are. fp32 master weights unless the leg says otherwise (the recorded legs ran so; the
    # default became bf16 for bf16 and fp8 compute after them).
    python3 scripts/fp8_parity.py --config configs/train/llama3_1b.toml --out "$OUT/parity1b" --seeds 1 --tolerance 0.005 \
      --model.vocab_size=32768 --train.steps=1000 --train.batch_size=4 --train.seq_len=4096 --scheduler.warmup_steps=100 \
      --data.source=shards --data.path=data/py_bpe/train --data.tokenizer=data/py_bpe/tokenizer.json \
      --validation.path=data/py_bpe/validation --validation.freq=100 --validation.steps=16 \
      --metrics.log_freq=10 --metrics.enable_tensorboard=false --distributed.master_dtype=fp32 \
      --variant tensorwise= \
      --variant "rowwise=--float8.recipe=rowwise --float8.enable_fsdp_float8_all_gather=false" \
      --variant "rowwise_gw_hp=--float8.recipe=rowwise_with_gw_hp --float8.enable_fsdp_float8_all_gather=false" \
      --variant "tensorwise-head-bf16=--float8.exclude_fqns=output_head.proj" \
      --variant "fp8-blockwise=--float8.recipe=blockwise --float8.enable_fsdp_float8_all_gather=false" \
      --variant "fp8-delayed=--float8.scaling=delayed" \
      --variant "fp8-bf16-master=--float8.enable_fsdp_float8_all_gather=false --distributed.master_dtype=bf16 --optimizer.bf16_update=stochastic" \
      --variant "bf16-master=--train.mixed_precision=bf16 --distributed.master_dtype=bf16 --optimizer.bf16_update=stochastic" \
      --variant "bf16-master-nearest=--train.mixed_precision=bf16 --distributed.master_dtype=bf16 --optimizer.bf16_update=nearest" \
      --variant "fp8-bf16-master-seed1=--float8.enable_fsdp_float8_all_gather=false --distributed.master_dtype=bf16 --optimizer.bf16_update=stochastic --train.seed=1" \
      --variant "bf16-master-seed1=--train.mixed_precision=bf16 --distributed.master_dtype=bf16 --optimizer.bf16_update=stochastic --train.seed=1" \
      --variant "fp8-e4m3=--float8.format=e4m3" \
      --variant "fp8-exp-avg-fp8=--float8.enable_fsdp_float8_all_gather=false --distributed.master_dtype=bf16 --optimizer.bf16_update=stochastic --optimizer.exp_avg_dtype=fp8" \
      --variant "fp8-exp-avg-sq-bf16=--optimizer.exp_avg_dtype=bf16 --optimizer.exp_avg_sq_dtype=bf16" \
      --variant "fp8-bwd-bf16=--float8.backward=bf16 --float8.enable_fsdp_float8_all_gather=false" \
      --variant "fp8-fwd-bf16=--float8.forward=bf16 --float8.enable_fsdp_float8_all_gather=false" \
      --variant "fp8-bf16-ends=--float8.bf16_first_blocks=1 --float8.bf16_last_blocks=1" \
      --variant "fp8-decay-bf16=--train.precision_schedule=fp8:decay,bf16 --checkpoint.enable=true --checkpoint.interval=1000 --checkpoint.keep_latest_k=1" \
      --variant "wsd-bf16=--train.mixed_precision=bf16 --scheduler.decay_type=wsd" \
      --variant "wsd-fp8=--scheduler.decay_type=wsd" \
      --variant "wsd-fp8-decay-fwd-bf16=--scheduler.decay_type=wsd --train.precision_schedule=fp8:decay,fp8-bwd --checkpoint.enable=true --checkpoint.interval=1000 --checkpoint.keep_latest_k=1" \
      ${PARITY_LEGS:+--legs $PARITY_LEGS} 2>&1 | tee "$OUT/parity1b.log"
    for f in "$OUT"/parity1b/*.log; do grep -E "step +[0-9]+00/|Applied|converted|Error|error" "$f" | sed "s|^|[$(basename $f .log)] |"; done ;;
  recipe7b)  # 4+ GPUs: configs/train/7b_16gpu_fp8.toml as a 16x H100 job would run it (memory capped per process to
    # what one of 16 80 GB GPUs has free for this job), shipped settings first, then the candidates; synthetic tokens.
    for v in "shipped" \
             "ac-selective-b4-accum4 --train.activation_checkpointing=selective --train.batch_size=4 --train.grad_accum_steps=4" \
             "ac-none-b2-accum8 --train.activation_checkpointing=none --train.batch_size=2 --train.grad_accum_steps=8" \
             "ac-selective-b8-chunked --train.activation_checkpointing=selective --train.loss_chunk_tokens=4096"; do
      set -- $v; label=$1; shift
      launch $NGPU scripts/benchmark.py --json $OUT/bench.jsonl --emulate-gpus 16 \
        --label "7b_16gpu_fp8 as 16x H100, $label" --precisions fp8 --warmup 4 --steps 6 \
        --config configs/train/7b_16gpu_fp8.toml -- --data.source=synthetic --checkpoint.enable=false "$@" 2>&1 \
        | tee "$OUT/recipe7b_$label.log" | grep -v "^\[rank" | tail -4
    done ;;
  memory_peak)  # the peaks trainer/validate/plan.py was read against, with what is live at them
    # MEMORY_PEAK_GPUS=2: under torchrun (the pipeline configs; each rank's line)
    # MEMORY_PEAK_FAKE_WORLD=N: one GPU as rank 0 of N (its --fake-world: the moe16b_*_ep2_* configs)
    mp=(python3 scripts/memory_peak.py); [ "${MEMORY_PEAK_GPUS:-1}" -gt 1 ] && mp=(launch "$MEMORY_PEAK_GPUS" scripts/memory_peak.py)
    [ -n "${MEMORY_PEAK_FAKE_WORLD:-}" ] && mp+=(--fake-world "$MEMORY_PEAK_FAKE_WORLD")
    OUT=$OUT "${mp[@]}" ${MEMORY_PEAK_CONFIGS:-} 2>&1 | tee "$OUT/memory_peak.log" | grep -E "^(RESULT|FAILED)" | cut -c1-200 ;;
  docmask)
    python3 -m pytest -q -m gpu tests/gpu/test_documents_gpu.py -s 2>&1 | tee "$OUT/gpu_tests_documents.log" | tail -5
    # Two corpora of byte tokens: the stdlib text (Python's files and pydoc topics: long documents) and web-like
    # lengths (lognormal: median ~700 tokens, like a Llama-3-tokenized web corpus).
    python3 -c "
import numpy as np; from trainer.data.shards import write_shard; from trainer.data.sources import StdlibTextSource
def lengths(t): ends = np.flatnonzero(t == 257); return np.diff(np.concatenate([[-1], ends]))
rng = np.random.default_rng(0); parts = []
while sum(len(p) for p in parts) < 2_000_000:
    parts.append(np.append(rng.integers(0, 256, max(1, int(rng.lognormal(np.log(700), 1.0)))), 257))
import os; os.makedirs('/tmp/docmask_web', exist_ok=True)
t = np.concatenate(parts); write_shard('/tmp/docmask_web/a.bin', t, vocab_size=258, tokenizer_fingerprint='byte-v1')
for name, t in (('stdlib', StdlibTextSource(vocab_size=258).tokens), ('web-like', t)):
    n = lengths(t); print(f'{name} documents: {len(n)}, tokens per document: median {int(np.median(n))}, mean {int(n.mean())}, p90 {int(np.percentile(n, 90))}')
" | tee "$OUT/docmask_lengths.log"
    for data in "stdlib --data.source=stdlib" "web-like --data.source=shards --data.path=/tmp/docmask_web"; do
      set -- $data; name=$1; shift
      for masking in false true; do
        CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} $B --label "8B shapes, 8 layers, batch 4, seq 4096, $name text, document_masking=$masking" \
          --precisions bf16,fp8 --warmup 6 --steps 10 --config configs/train/llama3_8b.toml -- $SHAPE_8B "$@" \
          --data.document_masking=$masking 2>&1 | tee "$OUT/docmask_${name}_$masking.log" | grep -v "^\[rank" | grep -E "^(bf16|fp8) " | grep -v optimizer | sed "s/^/[$name masking=$masking] /"
      done
    done ;;
  memplan)  # the dry run's estimate (plan GiB) beside the measured peak, on shapes the plan was not read from
    S="--data.source=synthetic --train.compile_model=true --checkpoint.enable=false"
    for v in "1b-b8-selective --config configs/train/llama3_1b.toml -- $S --train.batch_size=8 --train.seq_len=4096 --train.activation_checkpointing=selective" \
             "8b-4l-seq8192-b2 --config configs/train/llama3_8b.toml -- $S --model.n_layers=4 --train.batch_size=2 --train.seq_len=8192 --train.activation_checkpointing=none" \
             "8b-8l-b2-accum2-kahan --config configs/train/llama3_8b.toml -- $S --model.n_layers=8 --train.batch_size=2 --train.seq_len=4096 --train.grad_accum_steps=2 --optimizer.bf16_update=kahan --train.activation_checkpointing=none" \
             "8b-6l-b6-chunk8192 --config configs/train/llama3_8b.toml -- $S --model.n_layers=6 --train.batch_size=6 --train.seq_len=4096 --train.loss_chunk_tokens=8192 --train.activation_checkpointing=none" \
             "moe16b-4l-b4-selective --config configs/train/moe_16b_4gpu_fp8.toml -- $S --model.n_layers=4 --distributed.ep=1 --float8.moe_experts=off --train.batch_size=4 --train.activation_checkpointing=selective" \
             "moe_small-b8-full --config configs/train/moe_16b_4gpu_fp8.toml -- $S --model.flavor=moe_small --distributed.ep=1 --float8.moe_experts=off --train.batch_size=8 --train.activation_checkpointing=full"; do
      set -- $v; label=$1; shift
      CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} $B --label "memplan $label" --precisions bf16,fp8 --warmup 3 --steps 2 "$@" 2>&1 \
        | tee "$OUT/memplan_$label.log" | grep -E "^(bf16|fp8) |Error|error" | grep -v "optimizer step" | sed "s/^/[$label] /" | tee -a "$OUT/memplan.log"
    done ;;
  ac)
    for v in "compile none --train.compile_model=true --train.activation_checkpointing=none" \
             "eager none --train.compile_model=false --train.activation_checkpointing=none" \
             "compile selective --train.compile_model=true --train.activation_checkpointing=selective" \
             "compile full --train.compile_model=true --train.activation_checkpointing=full" \
             "compile none-fp8 --train.compile_model=true --train.activation_checkpointing=none --train.mixed_precision=fp8"; do
      set -- $v; label="$1 AC=$2"; shift 2
      torchrun --standalone --nproc_per_node=$NGPU scripts/train.py --config configs/train/llama3_1b.toml \
        --data.source=synthetic --train.steps=50 --train.batch_size=4 --train.seq_len=4096 --checkpoint.enable=false \
        --metrics.log_freq=10 --job.dump_folder=/tmp/ac_run "$@" 2>&1 | grep -E "step +50/" | sed "s/^/[$label] /" | tee -a "$OUT/ac.log"
      rm -rf /tmp/ac_run
    done ;;
  pp2)  # 2 GPUs, Llama 3 8B shapes x PP2_LAYERS layers, global batch 8 x 4096: dp_shard=2 against pp=2 (1F1B, 8 microbatches)
    for v in "dp_shard=2 --distributed.dp_shard=2 --train.batch_size=4" \
             "pp=2-1F1B --distributed.pp=2 --distributed.dp_shard=1 --distributed.pipeline_schedule=1F1B --train.batch_size=8 --distributed.pp_microbatch_size=1"; do
      set -- $v; label=$1; shift
      for p in bf16 fp8; do
        torchrun --standalone --nproc_per_node=2 scripts/train.py --config configs/train/llama3_8b.toml --model.n_layers=${PP2_LAYERS:-16} \
          --data.source=synthetic --train.steps=20 --train.seq_len=4096 --train.mixed_precision=$p --train.compile_model=true \
          --checkpoint.enable=false --metrics.log_freq=10 --metrics.enable_tensorboard=false --job.dump_folder=/tmp/pp_run "$@" 2>&1 \
          | grep -E "step +20/|pipeline|Error|error" | sed "s/^/[$label $p] /" | tee -a "$OUT/pp2.log"
        rm -rf /tmp/pp_run
      done
    done ;;
  health8b)  # FP8 health overhead: 8B shapes x 8 layers, one GPU, stats every 10 steps vs never (30 steps)
    for f in 0 10; do
      CUDA_VISIBLE_DEVICES=0 python3 scripts/train.py --config configs/train/llama3_8b.toml --model.n_layers=8 --train.batch_size=4 --train.seq_len=4096 \
        --data.source=synthetic --train.activation_checkpointing=none --train.compile_model=true --checkpoint.enable=false \
        --train.steps=40 --metrics.log_freq=10 --metrics.enable_tensorboard=false --train.mixed_precision=fp8 \
        --metrics.fp8_stats_freq=$f --job.dump_folder=/tmp/health_$f 2>&1 | grep -E "step +(20|30|40)/|fp8 health|Error" | sed "s/^/[fp8_stats_freq=$f] /" | tee -a "$OUT/health8b.log"
      cp /tmp/health_$f/metrics.jsonl "$OUT/health_$f.jsonl"
    done ;;
  pp)  # Llama 3 8B on 4 GPUs at one global batch (16 x 4096 tokens): dp_shard=4 against pp=2 x dp_shard=2
    for v in "dp_shard=4 --distributed.dp_shard=4 --train.batch_size=4" \
             "pp2x2-1F1B --distributed.pp=2 --distributed.pipeline_schedule=1F1B --train.batch_size=8 --distributed.pp_microbatch_size=2" \
             "pp2x2-Interleaved1F1B --distributed.pp=2 --distributed.pipeline_schedule=Interleaved1F1B --train.batch_size=8 --distributed.pp_microbatch_size=2"; do
      set -- $v; label=$1; shift
      for p in bf16 fp8; do
        launch 4 scripts/train.py --config configs/train/llama3_8b.toml \
          --data.source=synthetic --train.steps=30 --train.seq_len=4096 --train.mixed_precision=$p \
          --checkpoint.enable=false --metrics.log_freq=10 --job.dump_folder=/tmp/pp_run "$@" 2>&1 \
          | shown "step +30/|pipeline:|Error" | sed "s/^/[$label $p] /" | tee -a "$OUT/pp.log"
        rm -rf /tmp/pp_run
      done
    done ;;
  full8b)  # table 1: the whole Llama 3 8B, FSDP2 over every GPU (dp_shard = all), batch 4 x 4096 per GPU, compile, no AC
    launch $NGPU scripts/benchmark.py --json $OUT/bench.jsonl --label "Llama 3 8B, FSDP2 over $NGPU GPUs, batch 4 x 4096 per GPU" \
      --precisions bf16,fp8 --warmup 6 --steps 10 $FULL_8B 2>&1 | tee "$OUT/full8b.log" | grep -v "^\[rank" ;;
  peer8b)  # table 1's peer in the same sitting: torchtitan 0.2.2's Llama 3 8B, the same job (FSDP2 over every GPU, batch
    # 4 x 4096 per GPU, compile, no AC), bf16 and fp8 tensorwise with its recommended fp8 all-gather and precomputed scales.
    # PEER_WHEELS=DIR: torchtitan-0.2.2 and what the image lacks (checked with torchdata 0.11.0, datasets 3.6.0, tyro 1.0.17,
    # docstring-parser 0.18.0, typeguard 4.6.1, dill 0.3.8, multiprocess 0.70.16; 1.5 MB); its tokenizer is a byte-level tokenizer.json written here, its data Python's own files as
    # c4_test-style JSON lines (the model's vocab stays 128,256). tok/s and TFLOP/s from its log line, steps 20-30.
    # PEER_FLAVOR=debugmodel checks the step on one GPU (torchtitan's whole 8B at batch 4 does not fit one).
    if [ -n "$DRY" ] || [ -z "${PEER_WHEELS:-}" ]; then echo "[peer8b] skipped: $([ -n "$DRY" ] && echo "a dry run" || echo "no PEER_WHEELS")"; continue; fi
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/peer "$PEER_WHEELS"/*.whl || continue
    python3 - <<'PY'
import glob, json, os, sysconfig
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
os.makedirs("/tmp/peer_assets", exist_ok=True); os.makedirs("/tmp/peer_c4", exist_ok=True)
byte_vocab = {c: i for i, c in enumerate(pre_tokenizers.ByteLevel.alphabet())}
tok = Tokenizer(models.BPE(vocab=byte_vocab, merges=[]))
tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
tok.add_special_tokens(["<|begin_of_text|>", "<|end_of_text|>"]); tok.save("/tmp/peer_assets/tokenizer.json")
json.dump({"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}, open("/tmp/peer_assets/tokenizer_config.json", "w"))
with open("/tmp/peer_c4/c4.json", "w") as f:
    for path in sorted(glob.glob(sysconfig.get_paths()["stdlib"] + "/**/*.py", recursive=True)):
        f.write(json.dumps({"text": open(path, errors="replace").read()}) + "\n")
        if f.tell() > 50_000_000:  # 50 MB: more than 30 steps read
            break
PY
    # PEER_LAYERS=N: its flavor's shapes with N layers (a flavor "<flavor>_NL" added before torchtitan's main runs), our
    # 8-layer tables ("8 all": 8 layers, then the flavor whole). PEER_MODEL: torchtitan's model (default llama3;
    # deepseek_v3 with PEER_FLAVOR=16B for the MoE families' proxy, PEER_BATCH=2 as our families step); its args dict
    # is <model>_args (deepseekv3_args).
    model=${PEER_MODEL:-llama3}; base=${PEER_FLAVOR:-8B}; argsdict=${model//_/}_args
    for layers in ${PEER_LAYERS:-all}; do
      flavor=$base; entry=(-m torchtitan.train); tag=""
      if [ "$layers" != all ]; then
        flavor=${base}_${layers}L; entry=(/tmp/peer_main.py); tag="_${layers}l"
        printf '%s\n' "import dataclasses" "from torchtitan.models.$model import $argsdict" \
          "$argsdict['$flavor'] = dataclasses.replace($argsdict['$base'], n_layers=${layers})" \
          "from torchtitan.train import Trainer, main" "main(Trainer)" > /tmp/peer_main.py
      fi
      # PEER_AC: the AC modes to try in order, the next only when the last ran out of memory (default "none selective":
      # the least AC that fits; its fp32 master weights and moments take 8 B per parameter more than our bf16 defaults)
      for p in ${PEER_PRECISIONS:-bf16 fp8}; do
        conv=(); [ $p = fp8 ] && conv=(--model.converters quantize.linear.float8 --quantize.linear.float8.enable_fsdp_float8_all_gather
                                     --quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp)
        for ac in ${PEER_AC:-none selective}; do
          log="$OUT/peer8b_${p}_ac_$ac$tag.log"; label="[peer8b torchtitan $flavor $p, AC $ac] "
          rm -rf /tmp/peer_run /tmp/peer_cache  # its caches cold each run, as coldstart's are (a cold start beside ours)
          start=$(date +%s.%N)
          PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/peer_cache/inductor TRITON_CACHE_DIR=/tmp/peer_cache/triton \
          PYTHONPATH=/tmp/peer:$PYTHONPATH torchrun --standalone --nproc_per_node=$NGPU "${entry[@]}" \
            --model.name $model --model.flavor $flavor \
            --model.hf_assets_path /tmp/peer_assets --training.dataset c4_test --training.dataset_path /tmp/peer_c4 \
            --training.local_batch_size ${PEER_BATCH:-4} --training.seq_len 4096 --training.steps 30 --parallelism.data_parallel_shard_degree -1 \
            --compile.enable --activation_checkpoint.mode $ac --metrics.log_freq 10 --job.dump_folder /tmp/peer_run "${conv[@]}" \
            2>&1 | stamped > "$log"
          grep -E "step: +(10|20|30) |Traceback|rror:" "$log" | grep -v lspci | sed "s/^/$label/" | cut -c1-250 | tee -a "$OUT/peer8b.log"
          python3 scripts/peer_step1.py "$log" --launched "$start" | sed "s/^/$label/" | tee -a "$OUT/peer8b.log"
          grep -q "OutOfMemoryError" "$log" || break
        done
      done
    done ;;
  scaling_profile)  # where dp_shard=2 loses against one GPU: 8B shapes x 8 layers, batch 4 x 4096 per GPU, compile, no AC,
    # bf16 and fp8 on one GPU then dp_shard=2, each with 2 steps traced per rank and the kernel summary (communication and
    # how much of it is exposed); PROFILE_ARGS: more overrides for both, PROFILE_PRECISIONS (default bf16,fp8),
    # PROFILE_GPUS (default "1 2"); the fp8 traces are copied to $OUT
    for n in ${PROFILE_GPUS:-1 2}; do
      launch $n scripts/benchmark.py --json $OUT/profile.jsonl --label "profile: 8B shapes x 8 layers, $n GPUs${PROFILE_ARGS:+, $PROFILE_ARGS}" \
        --precisions ${PROFILE_PRECISIONS:-bf16,fp8} --warmup 6 --steps 10 --profile-dir /tmp/prof_$n $BENCH_8B ${PROFILE_ARGS:-} 2>&1 \
        | tee "$OUT/profile_$n.log" | grep -v "^\[rank"
      for f in /tmp/prof_$n/fp8/trace*.json.gz; do [ -f "$f" ] && cp "$f" "$OUT/prof${n}_$(basename $f)"; done
    done ;;
  fp8_casts)  # 1 GPU: the FP8 casts that write a transposed copy, inductor's against Triton kernels of ours (the head's
    # logits gradient, SwiGLU's backward; scripts/bench_fp8_casts.py)
    python3 scripts/bench_fp8_casts.py 2>&1 | tee "$OUT/fp8_casts.log" ;;
  inductor_options)  # 1 GPU: 8B shapes x 8 layers, fp8, under inductor options (benchmark.py --inductor), run_variants'
    # runs with a cold compile cache each and 2 steps traced (the kernel summary in its log: the FP8 casts that
    # transpose); INDUCTOR_VARIANTS="LABEL [KEY=VALUE ...];..." (default: the defaults, three tiling options, the
    # defaults again)
    spec=""; IFS=';' read -ra ivs <<< "${INDUCTOR_VARIANTS:-defaults;nd-tiling triton.prefer_nd_tiling=true;block-ptr triton.use_block_ptr=true;max-tiles-3 triton.max_tiles=3;defaults-again}"
    for v in "${ivs[@]}"; do set -- $v; spec+="${spec:+;}1 fp8 $1"; shift; for o in "$@"; do spec+=" --inductor=$o"; done; done
    VARIANT_STEPS=${VARIANT_STEPS:-20} VARIANT_PROFILE=all VARIANT_COLD_CACHE=1 run_variants inductor_options "$spec" ;;
  scaling_variants)  # one sitting of 8B shapes x 8 layers, batch 4 x 4096 per GPU, compile, no AC, under several settings:
    # SCALING_VARIANTS="GPUS PRECISIONS LABEL [OVERRIDES...];..." (e.g. "1 bf16,fp8 one-gpu;2 fp8 never
    # --distributed.reshard_after_forward=never"), each a benchmark.py process; the table at the end (tokens/s per GPU)
    run_variants scaling_variants "${SCALING_VARIANTS:-1 bf16,fp8 one-gpu;2 bf16,fp8 defaults}" ;;
  reduce_dtypes)  # issue 49 item 3, speed: scaling_variants' job on one GPU, then at dp_shard=2 with each
    # distributed.reduce_dtype (auto is bf16 there: bf16 master weights summed over 2 ranks), bf16 and fp8 compute, in one
    # sitting; REDUCE_DTYPES="auto fp32 bf16 fp8" picks (default "auto fp32 fp8"); logs variant_reduce-*.log
    spec="1 bf16,fp8 one-gpu"
    for r in ${REDUCE_DTYPES:-auto fp32 fp8}; do spec+=";2 bf16,fp8 reduce-$r --distributed.reduce_dtype=$r"; done
    run_variants reduce_dtypes "$spec" ;;
  parity1b_reduce)  # issue 49 item 3, accuracy: parity1b's job on 2 GPUs per leg (dp_shard=2, batch 2 x 4096 per GPU: the
    # same 16K tokens a step), bf16 master weights (the default): bf16 x2 seeds (reduce auto = bf16, bit for bit fp32's
    # at 2 ranks: tests/distributed/test_reduce_dtype.py) against fp8 gradient reduces; PARITY_LEGS picks legs
    # (bf16,bf16-seed2,bf16-reduce-fp8,fp8,fp8-reduce-fp8); legs run one after another on a 2-GPU machine
    python3 scripts/fp8_parity.py --config configs/train/llama3_1b.toml --out "$OUT/parity1b_reduce" --seeds 1 \
      --tolerance 0.005 --nproc-per-leg 2 --distributed.dp_shard=2 \
      --model.vocab_size=32768 --train.steps=1000 --train.batch_size=2 --train.seq_len=4096 --scheduler.warmup_steps=100 \
      --data.source=shards --data.path=data/py_bpe/train --data.tokenizer=data/py_bpe/tokenizer.json \
      --validation.path=data/py_bpe/validation --validation.freq=100 --validation.steps=16 \
      --metrics.log_freq=10 --metrics.enable_tensorboard=false \
      --variant "bf16-reduce-fp8=--train.mixed_precision=bf16 --distributed.reduce_dtype=fp8" \
      --variant fp8= \
      --variant "fp8-reduce-fp8=--distributed.reduce_dtype=fp8" \
      ${PARITY_LEGS:+--legs $PARITY_LEGS} 2>&1 | tee "$OUT/parity1b_reduce.log"
    for f in "$OUT"/parity1b_reduce/*.log; do grep -E "step +[0-9]+00/|gradients reduced|Error|error" "$f" | sed "s|^|[$(basename $f .log)] |"; done ;;
  scaling)  # table 2: the full8b job on 1, 2, 4, 8 GPUs (up to $NGPU): bf16, fp8; beyond one GPU fp8 again with a bf16 all-gather
    for n in ${SCALING_GPUS:-1 2 4 8}; do
      [ "$n" -le "$NGPU" ] || continue
      launch $n scripts/benchmark.py --json $OUT/scaling.jsonl --label "scaling: Llama 3 8B, $n GPUs, batch 4 x 4096 per GPU" \
        --precisions bf16,fp8 --warmup 6 --steps 10 $FULL_8B 2>&1 | tee "$OUT/scaling_$n.log" | grep -v "^\[rank"
      [ "$n" -gt 1 ] && launch $n scripts/benchmark.py --json $OUT/scaling.jsonl --precisions fp8 --warmup 6 --steps 10 \
        --label "scaling: Llama 3 8B, $n GPUs, batch 4 x 4096 per GPU, fp8 all-gather off" $FULL_8B \
        --float8.enable_fsdp_float8_all_gather=false 2>&1 | tee "$OUT/scaling_${n}_ag_off.log" | grep -v "^\[rank"
    done
    [ -n "$DRY" ] || python3 scripts/multigpu_tables.py scaling "$OUT/scaling.jsonl" | tee "$OUT/scaling_table.md" ;;
  ckpt_stall)  # table 3: the whole 8B on every GPU, async pinned-memory checkpoints every 30 steps (time to write the last one
    # in the background) and at the last step: how long each save blocks training (the wait for the previous save, the
    # state dict, then staging: the copy of this rank's shards to pinned host memory, the GPU idle); the folder keeps one
    # checkpoint besides the new one. STALL_DIR=/dev/shm/stall_run where the disk is slow or small (a 1-GPU proxy:
    # STALL_ARGS="--model.n_layers=8" STALL_STEPS=150 STALL_INTERVAL=50,
    # docs/benchmarks/2026-11-26-h200-whole-8b-checkpoint-stall-long-context.md)
    S=${STALL_DIR:-/tmp/stall_run}; rm -rf "$S"
    launch $NGPU scripts/train.py --config configs/train/llama3_8b.toml --train.batch_size=4 --train.seq_len=4096 \
      --data.source=synthetic --train.activation_checkpointing=none --train.compile_model=true --train.steps=${STALL_STEPS:-100} \
      --checkpoint.enable=true --checkpoint.interval=${STALL_INTERVAL:-30} --checkpoint.keep_latest_k=1 --checkpoint.async_mode=async_with_pinned_mem \
      --metrics.log_freq=10 --metrics.enable_tensorboard=false --job.dump_folder="$S" ${STALL_ARGS:-} 2>&1 \
      | tee "$OUT/ckpt_stall.log" | shown "step +[0-9]+/|checkpoint|Error|error" | grep -v "^\[rank[1-9]" | cut -c1-220
    [ -n "$DRY" ] || python3 scripts/multigpu_tables.py stall "$OUT/ckpt_stall.log" | tee "$OUT/ckpt_stall_table.md"
    rm -rf "$S" ;;
  ckpt_speed)  # checkpoint writes at disk speed: the ckpt_stall job saving every CKPT_INTERVAL steps (one kept besides
    # the new one); the table: GB/s per rank of each save (its slowest rank's write, fsync included) and what it blocked,
    # then one dd per rank at once of the bytes a rank wrote, into the same folder, then the steps beside the buffers'
    # background allocation against the others
    S=${CKPT_DIR:-/tmp/ckpt_speed}; rm -rf "$S"
    launch $NGPU scripts/train.py --config configs/train/llama3_8b.toml --train.batch_size=4 --train.seq_len=4096 \
      --data.source=synthetic --train.activation_checkpointing=none --train.compile_model=true --train.steps=${CKPT_STEPS:-40} \
      --checkpoint.enable=true --checkpoint.interval=${CKPT_INTERVAL:-10} --checkpoint.keep_latest_k=1 \
      --checkpoint.async_mode=${CKPT_MODE:-async_with_pinned_mem} --metrics.log_freq=1 --metrics.enable_tensorboard=false \
      --job.dump_folder="$S" ${CKPT_ARGS:-} 2>&1 | tee "$OUT/ckpt_speed.log" | shown "checkpoint|Error|error" \
      | grep -v "^\[rank[1-9]" | cut -c1-250
    if [ -z "$DRY" ]; then
      rm -rf "$S/checkpoint"; n=$(python3 scripts/multigpu_tables.py rank_bytes "$OUT/ckpt_speed.log") || n=0
      for r in $(seq 0 $((NGPU - 1))); do  # one dd per rank, at once, as the ranks write
        dd if=/dev/zero of="$S/dd_$r" bs=16M count=$(( (n + 2**24 - 1) / 2**24 )) conv=fdatasync 2>&1 | tail -1 &
      done > "$OUT/ckpt_speed_dd.log"; wait
      python3 scripts/multigpu_tables.py speed "$OUT/ckpt_speed.log" "$OUT/ckpt_speed_dd.log" | tee "$OUT/ckpt_speed_table.md"
    fi
    rm -rf "$S" ;;
  cp)  # table 6: 8B at 32K and 128K tokens per sequence, distributed.cp = every GPU (configs/train/llama3_8b_128k_cp8.toml:
    # full AC, chunked loss, batch 1), 20 steps of synthetic tokens: tokens/s and peak memory from the log line; then
    # cp=1 on one GPU where its dry run says it fits, and the two runs' losses step by step
    for seq in ${CP_SEQS:-32768 131072}; do
      C="--config configs/train/llama3_8b_128k_cp8.toml --train.seq_len=$seq --data.source=synthetic --train.steps=${CP_STEPS:-20}
         --checkpoint.enable=false --checkpoint.restart_data=false --scheduler.warmup_steps=5 --metrics.log_freq=1
         --metrics.enable_tensorboard=false ${CP_ARGS:-}"
      ns=$NGPU; [ "$NGPU" = 1 ] || ns="$NGPU 1"  # on one GPU: the cp=1 leg only
      for n in $ns; do
        if [ "$n" = 1 ] && [[ "$(python3 scripts/train.py $C --distributed.cp=1 --dry-run --gpu-memory-gib "$GIB" 2>&1)" \
                              != *"fits "* ]]; then
          echo "[cp seq=$seq cp=1] skipped: one GPU does not hold it (its dry run)" | tee -a "$OUT/cp.log"; continue
        fi
        rm -rf /tmp/cp_run_$n
        launch $n scripts/train.py $C --distributed.cp=$n --job.dump_folder=/tmp/cp_run_$n 2>&1 | tee "$OUT/cp_${seq}_cp$n.log" \
          | shown "step +[0-9]+/|memory plan|step 1 done|Error|error" | grep -v "^\[rank[1-9]" | cut -c1-220 | sed "s/^/[cp seq=$seq cp=$n] /" | tee -a "$OUT/cp.log"
      done
      if [ -z "$DRY" ] && [ "$NGPU" != 1 ] && [ -f /tmp/cp_run_1/metrics.jsonl ] && [ -f /tmp/cp_run_$NGPU/metrics.jsonl ]; then
        echo "[cp seq=$seq] losses, cp=1 vs cp=$NGPU: $(python3 scripts/multigpu_tables.py losses /tmp/cp_run_1 /tmp/cp_run_$NGPU)" | tee -a "$OUT/cp.log"
      fi
      for n in $ns; do [ -f /tmp/cp_run_$n/metrics.jsonl ] && cp /tmp/cp_run_$n/metrics.jsonl "$OUT/cp_${seq}_cp$n.jsonl"; rm -rf /tmp/cp_run_$n; done
    done ;;
  *) echo "[gpu_checks] unknown step $s"; false ;;
esac; rc=$?
case "$s:$rc" in
  *:0) ;;
  parity*:3) INCONCLUSIVE+=("$s")  # scripts/fp8_parity.py's exit 3: no leg failed, more seeds would decide
    echo "[gpu_checks] step $s INCONCLUSIVE (scripts/fp8_parity.py exit 3: no FAIL; its verdict line says how many seeds would decide)" ;;
  *) failed "$s" $rc ;;
esac; done
echo "== summary =="; cat "$OUT/env.txt"; grep -h "passed\|failed" "$OUT/gpu_tests.log" 2>/dev/null | tail -1
grep -h "passed\|failed\|real vs" "$OUT/gpu_tests_blockwise.log" 2>/dev/null
grep -h "passed\|failed" "$OUT/gpu_tests_fp8knobs.log" 2>/dev/null | tail -1
for f in "$OUT"/bench*.log; do [ -f "$f" ] && grep -A4 "^precision\|: --" "$f" | grep -v "^\[rank"; done
for f in "$OUT"/accuracy_*.log; do [ -f "$f" ] && echo "$(basename $f): $(tail -1 "$f")"; done
[ -f "$OUT/bench8b_ce.log" ] && grep "^\[bench8b_ce\]" "$OUT/bench8b_ce.log"
[ -f "$OUT/ac.log" ] && cat "$OUT/ac.log"
[ -f "$OUT/trainlog8b.log" ] && cat "$OUT/trainlog8b.log"
[ -f "$OUT/pp2.log" ] && cat "$OUT/pp2.log"
[ -f "$OUT/health8b.log" ] && cat "$OUT/health8b.log"
[ -f "$OUT/moe16b_train.log" ] && cat "$OUT/moe16b_train.log"
[ -f "$OUT/moe_fp8_tests.log" ] && tail -1 "$OUT/moe_fp8_tests.log"
[ -f "$OUT/moe_fp8_micro.log" ] && cat "$OUT/moe_fp8_micro.log"
[ -f "$OUT/ckpt.log" ] && cat "$OUT/ckpt.log"
[ -f "$OUT/coldstart.log" ] && cat "$OUT/coldstart.log"
for f in coldpeer_table.md peer8b.log scaling_table.md ckpt_stall_table.md ckpt_speed_table.md cp.log; do [ -f "$OUT/$f" ] && cat "$OUT/$f"; done
if [ ${#FAILED[@]} -gt 0 ]; then echo "== FAILED steps: ${FAILED[*]} =="; exit 1; fi
if [ ${#INCONCLUSIVE[@]} -gt 0 ]; then echo "== INCONCLUSIVE parity steps: ${INCONCLUSIVE[*]} =="; exit 3; fi
exit 0
