# dp_shard=2 fp8 new/old again (the other order), then the scaling table with torchtitan (new tree).
set -o pipefail
source scripts/gpu_torchao.sh
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p $OUT/logs
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; } > $OUT/logs/env.txt
NEW=$PWD OLD=$PWD/tmp_gpu/old
ARGS="--precisions fp8 --warmup 6 --steps 20 --config configs/train/llama3_8b.toml -- --model.n_layers=8 --train.batch_size=4 --train.seq_len=4096 --data.source=synthetic --train.activation_checkpointing=none --train.compile_model=true --checkpoint.enable=false"
for t in new old; do tree=$OLD; [ $t = new ] && tree=$NEW; echo "== dp2 fp8 $t"
  (cd $tree && TORCHINDUCTOR_CACHE_DIR=/tmp/ind_dp_$t PYTHONPATH=$PWD:$PYTHONPATH torchrun --standalone --nproc_per_node=2 scripts/benchmark.py --json $OUT/ab2.jsonl --label "dp2-$t" --dump-folder /tmp/dump_dp_$t $ARGS 2>&1) \
    | tee -a $OUT/logs/dp2_$t.log | grep -E "^fp8 " | grep -v "optimizer step\|peak GiB" | cut -c1-150
  tar czf $OUT/logs.tgz -C $OUT logs; done
VARIANT_STEPS=20 SCALING_VARIANTS="1 bf16,fp8 one-gpu;2 bf16,fp8 defaults" PEER_WHEELS=.gpu_peer PEER_LAYERS=8 PEER_PRECISIONS=fp8 PEER_AC=none bash scripts/gpu_checks.sh scaling_variants peer8b 2>&1 | tail -25
cp $OUT/variant_*.log $OUT/peer8b*.log $OUT/variants.jsonl $OUT/logs/ 2>/dev/null; tar czf $OUT/logs.tgz -C $OUT logs
