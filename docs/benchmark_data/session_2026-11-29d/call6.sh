#!/bin/bash
# 1x H200: 8B shapes x 8 layers step time as one GPU and as rank 0 of dp_shard=2 on the fake process group (FSDP's
# local work, no communication); fp8 1, 2f, 2f, 1, then bf16 1, 2f
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor PYTHONUNBUFFERED=1
start=$(date +%s)
for run in "1 fp8" "2 fp8" "2 fp8" "1 fp8" "1 bf16" "2 bf16"; do
  [ $(( $(date +%s) - start )) -gt 470 ] && { echo "stopped before $run: time"; break; }
  set -- $run
  python3 tmp_gpu/fake_speed.py $1 $2 > $OUT/speed_$1_$2_$(date +%s).log 2>&1
  grep -h "^SPEED\|Error" $OUT/speed_$1_$2_*.log | tail -1 | cut -c1-300
  grep -h "FSDP2 automatic\|float8 all-gather\|all-gather" $OUT/speed_$1_$2_*.log | head -2 | cut -c1-250
done
cd $OUT && tar czf speed_logs.tgz speed_*.log && rm -f speed_*.log
