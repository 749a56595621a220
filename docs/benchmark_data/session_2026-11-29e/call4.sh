#!/bin/bash
# 1x H200: moe_16b x 8 layers fp8, rank 0 of ep=2 on the fake process group (nothing sent): moe.overlap_all_to_all
# on/off alternated (padded), sized with it on; where the GEMMs sit between each all-to-all's start and wait.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor PYTHONUNBUFFERED=1
python3 -c "import torch, torch._inductor.comms as c; print(torch.__version__, [hasattr(c, p) for p in ('reorder_communication_preserving_peak_memory', 'sink_waits_iterative')])"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
start=$(date +%s)
for run in "padded true" "sized true"; do
  [ $(( $(date +%s) - start )) -gt 470 ] && { echo "stopped before $run: time"; break; }
  set -- $run
  log=$OUT/moe_$1_$2_$(date +%s).log
  TORCH_LOGS=output_code python3 tmp_gpu/fake_moe.py 2 fp8 --moe.dispatch=$1 --moe.overlap_all_to_all=$2 > $log 2>&1
  echo "== $run"
  grep -h "^SPEED\|Error" $log | tail -1 | cut -c1-300
  grep -h "torch.compile:" $log | head -1 | cut -c1-300
  python3 tmp_gpu/windows.py $log | sort -u | head -6
  grep -v "__output_code" $log > $log.short; rm $log
done
cd $OUT && tar czf moe_logs.tgz moe_*.short && rm -f moe_*.short
