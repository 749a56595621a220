#!/usr/bin/env bash
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
source scripts/gpu_torchao.sh || exit 1
export TORCHINDUCTOR_CACHE_DIR=/tmp/ind
T="--config configs/train/llama3_1b.toml --model.n_layers=2 --train.steps=6 --train.batch_size=2 --train.seq_len=2048 --data.source=synthetic --checkpoint.enable=false --metrics.log_freq=1 --train.compile_model=false --train.mixed_precision=fp8"
torchrun --standalone --nproc_per_node=2 scripts/train.py $T --job.dump_folder=/tmp/d1 > $OUT/train_plain.log 2>&1
torchrun --standalone --nproc_per_node=2 tmp_gpu/early.py scripts/train.py $T --job.dump_folder=/tmp/d2 > $OUT/train_early.log 2>&1
grep -o "step .*grad_norm *[0-9.]*" $OUT/train_plain.log > /tmp/a; grep -o "step .*grad_norm *[0-9.]*" $OUT/train_early.log > /tmp/b
echo "plain vs early losses:"; paste -d'\n' /tmp/a /tmp/b | head -14
BENCH="--config configs/train/llama3_8b.toml -- --model.n_layers=8 --train.batch_size=4 --train.seq_len=4096 --data.source=synthetic --train.activation_checkpointing=none --train.compile_model=true --checkpoint.enable=false"
run() { local label=$1 envs=$2; shift 2
  env $envs torchrun --standalone --nproc_per_node=2 "$@" --json $OUT/v.jsonl --label $label --precisions fp8 --warmup 6 --steps 20 --dump-folder /tmp/vd $BENCH > $OUT/$label.log 2>&1
  echo "$label: $(grep -A1 '^precision' $OUT/$label.log | tail -1)"; grep EARLY $OUT/$label.log | head -1; }
for v in ${VARIANTS:-base early ctas8 ctas16 early2 base2}; do
  case $v in
    base*) run $v X=1 scripts/benchmark.py ;;
    early*) run $v X=1 tmp_gpu/early.py scripts/benchmark.py ;;
    ctas*) run $v NCCL_MAX_CTAS=${v#ctas} scripts/benchmark.py ;;
  esac
done
