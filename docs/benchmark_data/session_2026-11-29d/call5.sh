#!/bin/bash
# 1x H200: moe_16b x 8 layers ep=1 fp8 (bf16 experts), batch 2 x 4096: before (HEAD's moe_permute.py) / after the
# select_unique_rows backward fix, alternated
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor PYTHONUNBUFFERED=1
i=0
for v in old new new old; do i=$((i+1))
  cp tmp_gpu/moe_permute_$v.py trainer/models/moe_permute.py
  python3 scripts/benchmark.py --json $OUT/bench.jsonl --label "moe_16b x 8 layers, ep=1, batch 2, $v" \
    --precisions fp8 --warmup 6 --steps 10 --config configs/train/moe_16b_4gpu_fp8.toml -- --model.n_layers=8 \
    --distributed.ep=1 --data.source=synthetic > $OUT/bench_${i}_$v.log 2>&1
  echo "[$i $v] $(grep -E '^fp8 ' $OUT/bench_${i}_$v.log | head -1)"
done
cp tmp_gpu/moe_permute_new.py trainer/models/moe_permute.py
