#!/bin/bash
# one GPU: cold start from launch to step 1, ours (fp8, bf16) beside torchtitan 0.2.2 (fp8, bf16), caches cold
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
COLD_RUNS="fp8 auto,bf16 auto" COLD_STEPS=10 bash scripts/gpu_checks.sh coldstart 2>&1 | grep -E "launch|step 1 done|exit" | cut -c1-300
PEER_WHEELS=.gpu_peer PEER_LAYERS=8 PEER_AC=none bash scripts/gpu_checks.sh peer8b 2>&1 | grep -E "launch|step 1 after|step: +30" | cut -c1-250
