# callA.sh's comparison again on another machine, no profile: new, old, ep=1, new, old.
set -o pipefail
source scripts/gpu_torchao.sh
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/inductor NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p $OUT/logs
ARGS="--precisions fp8 --warmup 6 --steps 10 --config configs/train/moe_16b_4gpu_fp8.toml -- --model.n_layers=8 --data.source=synthetic"
run() { local label=$1 ep=$2 tree=$3; echo "== $label"
  if [ $ep = 1 ]; then L=python3; else L="torchrun --standalone --nproc_per_node=2"; fi
  (cd $tree && PYTHONPATH=$PWD:$PYTHONPATH $L scripts/benchmark.py --json $OUT/bench.jsonl --label "$label" $ARGS --distributed.ep=$ep 2>&1) \
    > $OUT/logs/$label.log; grep -E "^fp8 " $OUT/logs/$label.log | grep -v "optimizer step"; tar czf $OUT/logs.tgz -C $OUT logs; }
NEW=$PWD OLD=$PWD/tmp_gpu/old
run ep2_new_1 2 $NEW; run ep2_old_1 2 $OLD; run ep1 1 $NEW; run ep2_new_2 2 $NEW; run ep2_old_2 2 $OLD
