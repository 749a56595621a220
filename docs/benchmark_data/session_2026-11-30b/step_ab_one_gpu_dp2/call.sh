# The fused FP8 head loss (new: working tree) against HEAD c3300c1 (old): GPU tests, one-GPU fp8 old/new side by
# side on the two GPUs (then swapped), dp_shard=2 fp8 old/new.
set -o pipefail
source scripts/gpu_torchao.sh
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p $OUT/logs
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python3 -c "import torch, torchao, triton; print(torch.__version__, torch.version.cuda, torchao.__version__, triton.__version__)"; } > $OUT/logs/env.txt
cat $OUT/logs/env.txt
TORCHINDUCTOR_CACHE_DIR=/tmp/ind_t python3 -m pytest -q -m gpu tests/gpu/test_fused_head_loss_gpu.py -p no:cacheprovider 2>&1 | tail -5 | tee $OUT/logs/gpu_tests.log
NEW=$PWD OLD=$PWD/tmp_gpu/old
ARGS="--precisions fp8 --warmup 6 --steps 20 --config configs/train/llama3_8b.toml -- --model.n_layers=8 --train.batch_size=4 --train.seq_len=4096 --data.source=synthetic --train.activation_checkpointing=none --train.compile_model=true --checkpoint.enable=false"
one() { # tree label gpu
  (cd $1 && CUDA_VISIBLE_DEVICES=$3 TORCHINDUCTOR_CACHE_DIR=/tmp/ind_$2 PYTHONPATH=$PWD:$PYTHONPATH python3 scripts/benchmark.py --json $OUT/ab1.jsonl --label "one-$2-gpu$3" --dump-folder /tmp/dump_$2_$3 $ARGS > $OUT/logs/one_$2_gpu$3.log 2>&1); }
for r in 0 1; do
  if [ $r = 0 ]; then one $OLD old 0 & one $NEW new 1 & else one $OLD old 1 & one $NEW new 0 & fi; wait
  grep -h -E "^fp8 " $OUT/logs/one_old_gpu$r.log $OUT/logs/one_new_gpu$((1-r)).log | grep -v "optimizer step\|peak GiB" | cut -c1-150
done
grep -h "loss as one graph" $OUT/logs/one_new_gpu0.log | head -1
tar czf $OUT/logs.tgz -C $OUT logs
for t in old new; do tree=$OLD; [ $t = new ] && tree=$NEW; echo "== dp2 fp8 $t"
  (cd $tree && TORCHINDUCTOR_CACHE_DIR=/tmp/ind_dp_$t PYTHONPATH=$PWD:$PYTHONPATH torchrun --standalone --nproc_per_node=2 scripts/benchmark.py --json $OUT/ab2.jsonl --label "dp2-$t" --dump-folder /tmp/dump_dp_$t $ARGS 2>&1) \
    | tee -a $OUT/logs/dp2_$t.log | grep -E "^fp8 " | grep -v "optimizer step\|peak GiB" | cut -c1-150
  tar czf $OUT/logs.tgz -C $OUT logs; done
