#!/bin/bash
# 1x H200: moe_16b x 8 layers fp8, rank 0 of ep=2 on the fake process group: moe.dispatch auto (the default; its
# startup line), sized, padded: the host sync's cost without communication; ep=1 on one GPU beside
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor PYTHONUNBUFFERED=1
start=$(date +%s)
for run in "2 auto" "2 sized" "1 sized" "2 padded" "2 sized"; do
  [ $(( $(date +%s) - start )) -gt 330 ] && { echo "stopped before $run: time"; break; }
  set -- $run
  log=$OUT/moe_$1_$2_$(date +%s).log
  python3 tmp_gpu/fake_moe.py $1 fp8 --moe.dispatch=$2 > $log 2>&1
  grep -h "^SPEED\|Error" $log | tail -1 | cut -c1-300
  grep -h "expert parallel:" $log | head -1 | cut -c1-400
done
cd $OUT && tar czf moe_logs.tgz moe_*.log && rm -f moe_*.log
