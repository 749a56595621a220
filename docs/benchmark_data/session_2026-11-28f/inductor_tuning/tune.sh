#!/usr/bin/env bash
source scripts/gpu_torchao.sh || exit 1
BENCH="--config configs/train/llama3_8b.toml -- --model.n_layers=8 --train.batch_size=4 --train.seq_len=4096 --data.source=synthetic --train.activation_checkpointing=none --train.compile_model=true --checkpoint.enable=false"
for v in ${VARIANTS:-base cd mp base2}; do
  case $v in base*) E="X=1";; cd) E="TORCHINDUCTOR_COORDINATE_DESCENT_TUNING=1";; mp) E="TORCHINDUCTOR_MAX_AUTOTUNE_POINTWISE=1";; esac
  env $E TORCHINDUCTOR_CACHE_DIR=/tmp/ind_$v python3 scripts/benchmark.py --precisions fp8 --warmup 6 --steps 20 --label $v \
     --dump-folder /tmp/dump_$v --profile-dir /tmp/prof_$v $BENCH > $OUT/$v.log 2>&1
  echo "$v: $(grep -A1 '^precision' $OUT/$v.log | tail -1)"
done
