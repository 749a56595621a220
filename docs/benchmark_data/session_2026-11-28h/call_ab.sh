#!/bin/bash
# one GPU, cold caches each, alternated: the blocks' pointwise autotuning on (old: main at cd25aa4 + the pipeline change) / off (new); 8B shapes x 8 layers
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
SHAPE="--model.n_layers=8 --train.batch_size=4 --train.seq_len=4096 --data.source=synthetic --train.activation_checkpointing=none --train.compile_model=true --checkpoint.enable=false"
for vp in new:fp8 old:fp8 new:fp8 old:fp8 new:bf16 old:bf16; do
  v=${vp%:*}; p=${vp#*:}
  i=$((i+1)); rm -rf /tmp/cold_$i
  TORCHINDUCTOR_CACHE_DIR=/tmp/cold_$i/inductor TRITON_CACHE_DIR=/tmp/cold_$i/triton python3 tmp_gpu/$v/scripts/benchmark.py \
    --json $OUT/ab.jsonl --label $v-$i --precisions $p --warmup 6 --steps 20 --dump-folder /tmp/ab_dump \
    --config configs/train/llama3_8b.toml -- $SHAPE > $OUT/ab_$v-$i.log 2>&1
  grep -A1 "^precision" $OUT/ab_$v-$i.log | tail -1 | sed "s/^/[$v-$i] /"
done
grep -h "torch.compile: 8" $OUT/ab_*.log | sort | uniq -c
