#!/bin/bash
# one GPU, cold caches each: inductor's pointwise autotuning off vs the defaults, fp8 8B shapes x 8 layers
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
PW=--inductor=triton.autotune_pointwise=false
VARIANT_STEPS=20 VARIANT_COLD_CACHE=1 SCALING_VARIANTS="1 fp8 defaults;1 fp8 pw-off $PW;1 fp8 pw-off-again $PW;1 fp8 defaults-again" \
  bash scripts/gpu_checks.sh scaling_variants 2>&1 | grep -v "^\[rank" | tail -12
grep -h -B1 -A2 "step 1 s" $OUT/variant_*.log | head -30
