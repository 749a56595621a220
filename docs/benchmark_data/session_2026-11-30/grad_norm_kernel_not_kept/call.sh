# The gradient norm's sum-of-squares kernel (new) against 65d248c (old, torch's _foreach_norm): the norm alone, the
# GPU tests, dp_shard=2 fp8 old/new alternated.
set -o pipefail
source scripts/gpu_torchao.sh
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/inductor NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p $OUT/logs
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python3 -c "import torch, torchao, triton; print(torch.__version__, torch.version.cuda, torchao.__version__, triton.__version__)"; } > $OUT/logs/env.txt
CUDA_VISIBLE_DEVICES=0 python3 tmp_gpu/normbench.py 2>&1 | tee $OUT/logs/normbench.log
python3 -m pytest -q -m gpu tests/gpu/test_optim_kernel_gpu.py 2>&1 | tail -2 | tee $OUT/logs/gpu_tests.log
NEW=$PWD OLD=$PWD/tmp_gpu/old2
ARGS="--precisions fp8 --warmup 6 --steps 20 --config configs/train/llama3_8b.toml -- --model.n_layers=8 --train.batch_size=4 --train.seq_len=4096 --data.source=synthetic --train.activation_checkpointing=none --train.compile_model=true --checkpoint.enable=false"
for t in old new old new; do tree=$OLD; [ $t = new ] && tree=$NEW; echo "== dp2 fp8 $t"
  (cd $tree && PYTHONPATH=$PWD:$PYTHONPATH torchrun --standalone --nproc_per_node=2 scripts/benchmark.py --json $OUT/ab.jsonl --label "dp2-$t" $ARGS 2>&1) \
    | tee -a $OUT/logs/ab_$t.log | grep -E "^fp8 " | grep -v "peak GiB" | cut -c1-220
  tar czf $OUT/logs.tgz -C $OUT logs; done
