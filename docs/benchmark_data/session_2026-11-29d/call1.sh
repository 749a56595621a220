#!/bin/bash
# 1x H200: (1) rank 0 of moe_16b x 8 layers at ep=2 on the fake process group, sized and padded, with what is live at
# the peak; (2) gpu_checks.sh coldpeer, ours then the peer, bf16 (the step's first run)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor PYTHONUNBUFFERED=1
OUT=$OUT python3 scripts/memory_peak.py --fake-world 2 moe16b_8L_b2_fp8_ep2_sized moe16b_8L_b2_fp8_ep2_padded > $OUT/memory_fake.log 2>&1
grep -E "memory plan|^RESULT|^FAILED|Error" $OUT/memory_fake.log | cut -c1-3000
COLD_ORDER="ours peer" COLD_PRECISIONS=bf16 PEER_WHEELS=.gpu_peer bash scripts/gpu_checks.sh coldpeer > $OUT/coldpeer_run.log 2>&1; echo "coldpeer exit $?"
tail -12 $OUT/coldpeer_run.log
cd $OUT && tar czf logs.tgz *.log && rm -f coldpeer_*.log coldstart*.log peer8b*.log
