# The AdamW kernel with one launch per kind of layout (new) against HEAD's (old): the kernel alone, its GPU tests,
# then one GPU bf16 and fp8 old/new alternated.
set -o pipefail
source scripts/gpu_torchao.sh
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/inductor NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p $OUT/logs
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python3 -c "import torch, torchao, triton; print(torch.__version__, torch.version.cuda, torchao.__version__, triton.__version__)"; } > $OUT/logs/env.txt
NEW=$PWD OLD=$PWD/tmp_gpu/old
for t in old new; do tree=$OLD; [ $t = new ] && tree=$NEW
  echo "== bench_adamw $t"; (cd $tree && CUDA_VISIBLE_DEVICES=0 python3 scripts/bench_adamw.py 2>&1) | tee $OUT/logs/bench_adamw_$t.log | grep -E "ours|fused"; done
python3 -m pytest -q -m gpu tests/gpu/test_optim_kernel_gpu.py tests/gpu/test_optim_states_gpu.py 2>&1 | tail -3 | tee $OUT/logs/gpu_tests.log
tar czf $OUT/logs.tgz -C $OUT logs
ARGS="--warmup 6 --steps 20 --config configs/train/llama3_8b.toml -- --model.n_layers=8 --train.batch_size=4 --train.seq_len=4096 --data.source=synthetic --train.activation_checkpointing=none --train.compile_model=true --checkpoint.enable=false"
for t in old new old new; do tree=$OLD; [ $t = new ] && tree=$NEW; echo "== one GPU $t"
  (cd $tree && PYTHONPATH=$PWD:$PYTHONPATH python3 scripts/benchmark.py --json $OUT/ab.jsonl --label "one-$t" --precisions ${AB_PRECISIONS:-bf16,fp8} $ARGS 2>&1) \
    | tee -a $OUT/logs/ab1_$t.log | grep -E "^(fp8|bf16) " | grep -v "optimizer step\|peak GiB" | cut -c1-200
  tar czf $OUT/logs.tgz -C $OUT logs; done
