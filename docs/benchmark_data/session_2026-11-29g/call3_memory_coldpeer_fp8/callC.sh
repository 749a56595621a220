# The memory plan's ep=2 rows with the experts out of FSDP2 (sized + fp8 all-gather, padded + fp8 all-gather), then
# issue 49 item 7 at dp_shard=2: cold start beside torchtitan, fp8.
set -o pipefail
source scripts/gpu_torchao.sh
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/inductor NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p $OUT/logs
for run in "sized true" "padded true"; do set -- $run
  torchrun --standalone --nproc_per_node=2 scripts/benchmark.py --json $OUT/bench_mem.jsonl --label "moe_16b x 8 layers, ep=2, $1, all_gather $2" \
    --precisions fp8 --warmup 6 --steps 10 --config configs/train/moe_16b_4gpu_fp8.toml -- --model.n_layers=8 --data.source=synthetic \
    --distributed.ep=2 --moe.dispatch=$1 --float8.enable_fsdp_float8_all_gather=$2 2>&1 | tee $OUT/logs/mem_$1_$2.log | grep -E "^fp8 |Error|error" | grep -v "optimizer step"
done
tar czf $OUT/logs.tgz -C $OUT logs
PEER_WHEELS=.gpu_peer COLD_PRECISIONS=fp8 timeout 420 bash scripts/gpu_checks.sh coldpeer 2>&1 | grep -E "coldpeer|\|" | tail -20
