set -o pipefail
source scripts/gpu_torchao.sh
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/inductor NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=$PWD:$PYTHONPATH
mkdir -p $OUT/logs
ARGS="--precisions fp8 --warmup 6 --steps 10 --config configs/train/moe_16b_4gpu_fp8.toml -- --model.n_layers=8 --data.source=synthetic"
run() { local label=$1 ep=$2 ag=$3; echo "== $label"
  if [ $ep = 1 ]; then L=python3; else L="torchrun --standalone --nproc_per_node=2"; fi
  $L scripts/benchmark.py --json $OUT/bench.jsonl --label "$label" $ARGS --distributed.ep=$ep --float8.enable_fsdp_float8_all_gather=$ag 2>&1 \
    | tee $OUT/logs/$label.log | grep -E "^fp8 |Error|error|fsdp_float8_all_gather=" | grep -v "optimizer step" | sort -u; tar czf $OUT/logs.tgz -C $OUT logs; }
run ep1_true_1 1 true
run ep2_true_1 2 true
run ep2_auto_1 2 auto
run ep1_auto_1 1 auto
run ep2_auto_2 2 auto
run ep2_true_2 2 true
