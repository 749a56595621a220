#!/bin/bash
# one GPU: fp8 cold start from the launch, ours (blocks without pointwise autotuning) beside torchtitan 0.2.2, ours again
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
COLD_RUNS="fp8 auto" COLD_STEPS=10 bash scripts/gpu_checks.sh coldstart 2>&1 | grep -E "launch|step 1 done" | cut -c1-300
PEER_WHEELS=.gpu_peer PEER_LAYERS=8 PEER_AC=none PEER_PRECISIONS=fp8 bash scripts/gpu_checks.sh peer8b 2>&1 | grep -E "launch|step 1 after" | cut -c1-250
mv $OUT/coldstart_fp8_auto_8l.log $OUT/coldstart_fp8_auto_8l_first.log
COLD_RUNS="fp8 auto" COLD_STEPS=10 bash scripts/gpu_checks.sh coldstart 2>&1 | grep -E "launch|step 1 done" | cut -c1-300
