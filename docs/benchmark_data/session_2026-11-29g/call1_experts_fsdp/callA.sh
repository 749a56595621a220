# Routed experts out of FSDP2 at ep = dp_shard (new) against the one-rank unit (old tree, e3b425c), alternated;
# moe_16b x 8 layers, fp8 (bf16 experts), batch 2 x 4096 per GPU, compile, no AC, padded dispatch (auto).
set -o pipefail
source scripts/gpu_torchao.sh
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/inductor NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p $OUT/logs
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/logs/env.txt; python3 -c "import torch, torchao; print(torch.__version__, torch.version.cuda, torchao.__version__)" >> $OUT/logs/env.txt
ARGS="--precisions fp8 --warmup 6 --steps 10 --config configs/train/moe_16b_4gpu_fp8.toml -- --model.n_layers=8 --data.source=synthetic"
run() { local label=$1 ep=$2 tree=$3; shift 3; echo "== $label"
  if [ $ep = 1 ]; then L=python3; else L="torchrun --standalone --nproc_per_node=2"; fi
  (cd $tree && PYTHONPATH=$PWD:$PYTHONPATH $L scripts/benchmark.py --json $OUT/bench.jsonl --label "$label" "$@" $ARGS --distributed.ep=$ep 2>&1) \
    | tee $OUT/logs/$label.log | grep -E "^fp8 |Error|error|routed experts" | grep -v "optimizer step" | cut -c1-300 | sort -u
  tar czf $OUT/logs.tgz -C $OUT logs; }
NEW=$PWD OLD=$PWD/tmp_gpu/old
run ep2_new_prof 2 $NEW --profile-dir /tmp/prof_new
for f in /tmp/prof_new/fp8/trace*.json.gz; do if [ -f "$f" ]; then cp "$f" $OUT/logs/new_$(basename $f); fi; done
python3 scripts/summarize_trace.py --ranks --top 0 $OUT/logs/new_trace_rank*.json.gz | tail -n 4
tar czf $OUT/logs.tgz -C $OUT logs
run ep2_old_1 2 $OLD
run ep2_new_1 2 $NEW
run ep1_new 1 $NEW
run ep2_old_2 2 $OLD
run ep2_new_2 2 $NEW
