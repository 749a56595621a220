#!/bin/bash
# one GPU, cold caches each: pointwise autotuning off in the blocks only / in the head graph only / defaults
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
SHAPE="--model.n_layers=8 --train.batch_size=4 --train.seq_len=4096 --data.source=synthetic --train.activation_checkpointing=none --train.compile_model=true --checkpoint.enable=false"
for v in vblock vhead main vblock-again; do
  d=tmp_gpu/${v%-again}; [ $v = main ] && d=.
  rm -rf /tmp/cold_$v
  TORCHINDUCTOR_CACHE_DIR=/tmp/cold_$v/inductor TRITON_CACHE_DIR=/tmp/cold_$v/triton python3 $d/scripts/benchmark.py \
    --json $OUT/split.jsonl --label $v --precisions fp8 --warmup 6 --steps 20 --dump-folder /tmp/split_dump \
    --config configs/train/llama3_8b.toml -- $SHAPE > $OUT/split_$v.log 2>&1
  grep -A1 "^precision" $OUT/split_$v.log | tail -1 | sed "s/^/[$v] /"
done
