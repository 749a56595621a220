#!/bin/bash
# 2x H200: moe_16b x 8 layers fp8 at ep=2 (moe.dispatch auto = padded), moe.overlap_all_to_all on/off alternated, ep=1 between
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
start=$(date +%s)
for run in "2 auto" "2 auto --moe.overlap_all_to_all=false" "1 sized" "2 auto" "2 auto --moe.overlap_all_to_all=false"; do
  [ $(( $(date +%s) - start )) -gt 330 ] && { echo "stopped before $run: time"; break; }
  echo "== $run ($(( $(date +%s) - start )) s)"
  MOE_PADDED_RUNS="$run" OUT=$OUT bash scripts/gpu_checks.sh moe_padded
done
cd $OUT && ls
