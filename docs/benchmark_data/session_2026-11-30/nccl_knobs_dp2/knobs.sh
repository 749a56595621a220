# dp_shard=2 fp8, 8B shapes x 8 layers, batch 4 x 4096 per GPU, compile, no AC: cheap knobs alternated with defaults.
set -o pipefail
source scripts/gpu_torchao.sh
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/inductor NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p $OUT/logs
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python3 -c "import torch, torchao; print(torch.__version__, torch.version.cuda, torchao.__version__, torch.cuda.nccl.version())"; } > $OUT/logs/env.txt
ARGS="--precisions fp8 --warmup 6 --steps ${KSTEPS:-20} --config configs/train/llama3_8b.toml -- --model.n_layers=8 --train.batch_size=4 --train.seq_len=4096 --data.source=synthetic --train.activation_checkpointing=none --train.compile_model=true --checkpoint.enable=false"
run() { local label=$1 w; shift; echo "== $label"; local -a e=() a=()
  for w in "$@"; do case $w in --*) a+=("$w") ;; *) e+=("$w") ;; esac; done
  env "${e[@]}" torchrun --standalone --nproc_per_node=2 scripts/benchmark.py --json $OUT/bench.jsonl --label "$label" $ARGS "${a[@]}" 2>&1 \
    | tee $OUT/logs/$label.log | grep -E "^fp8 |Error|error" | grep -v "optimizer step" | cut -c1-250 | sort -u
  tar czf $OUT/logs.tgz -C $OUT logs; }
# The variants of the call, in order (X=1: no setting; an argument starting with -- goes to the config):
for v in "defaults1 X=1" "highprio TORCH_NCCL_HIGH_PRIORITY=1" "simple NCCL_PROTO=Simple" \
         "fp8ag X=1 --float8.enable_fsdp_float8_all_gather=true" "defaults2 X=1" "highprio2 TORCH_NCCL_HIGH_PRIORITY=1"; do
  set -- $v; label=$1; shift; run $label "$@"
done
cat $OUT/logs/env.txt
