#!/bin/bash
# one GPU, cold caches each, alternated: the head-and-loss graph's pointwise autotuning on (old = 917bcff) / off (new); fp8 8 layers, 20 steps
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
SHAPE="--model.n_layers=8 --train.batch_size=4 --train.seq_len=4096 --data.source=synthetic --train.activation_checkpointing=none --train.compile_model=true --checkpoint.enable=false"
for v in new old new old; do
  i=$((i+1)); rm -rf /tmp/cold_$i
  TORCHINDUCTOR_CACHE_DIR=/tmp/cold_$i/inductor TRITON_CACHE_DIR=/tmp/cold_$i/triton python3 tmp_gpu/$v/scripts/benchmark.py \
    --json $OUT/ab.jsonl --label $v-$i --precisions fp8 --warmup 6 --steps 20 --dump-folder /tmp/ab_dump \
    --config configs/train/llama3_8b.toml -- $SHAPE > $OUT/ab_$v-$i.log 2>&1
  grep -A1 "^precision" $OUT/ab_$v-$i.log | tail -1 | sed "s/^/[$v-$i] /"
  grep -m1 "step 1 done" $OUT/ab_$v-$i.log | cut -c1-200 | sed "s/^/[$v-$i] /"
done
