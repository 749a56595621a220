# A/B on 2 GPUs: the head in the root (tmp_gpu/old = 04e607e) against its own unit (the working tree), fp8 and bf16.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
source scripts/gpu_torchao.sh || exit 1
SHAPE="--model.n_layers=8 --train.batch_size=4 --train.seq_len=4096 --data.source=synthetic --train.activation_checkpointing=none --train.compile_model=true --checkpoint.enable=false"
IFS=';' read -ra specs <<< "${AB:-old fp8;new fp8}"
for s in "${specs[@]}"; do
  set -- $s; which=$1; prec=$2; shift 2; label="ab-$which-$prec${AB_TAG:-}"
  script=scripts/benchmark.py; [ "$which" = old ] && script=tmp_gpu/old/scripts/benchmark.py
  torchrun --standalone --nproc_per_node=2 $script --json $OUT/ab.jsonl --label "$label" --precisions $prec --warmup 6 \
    --steps ${AB_STEPS:-20} --dump-folder /tmp/ab_dump --config configs/train/llama3_8b.toml -- $SHAPE "$@" > $OUT/$label.log 2>&1 \
    || echo "[ab] $label FAILED"
  grep -A2 "^precision" $OUT/$label.log | grep -v "^precision" | sed "s/^/[$label] /"
  grep -m1 "FSDP2:" $OUT/$label.log | cut -c1-160
done
