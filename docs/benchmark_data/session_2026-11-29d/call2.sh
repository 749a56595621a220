#!/bin/bash
# 1x H200, after the select_unique_rows backward fix: moe_16b x 8 layers fp8 at ep=1 (real), and rank 0 of ep=2 on the
# fake process group, sized and padded, each with what is live at its peak
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor PYTHONUNBUFFERED=1
OUT=$OUT python3 scripts/memory_peak.py moe16b_8L_b2_fp8 > $OUT/memory_ep1.log 2>&1
OUT=$OUT python3 scripts/memory_peak.py --fake-world 2 moe16b_8L_b2_fp8_ep2_sized moe16b_8L_b2_fp8_ep2_padded > $OUT/memory_fake.log 2>&1
grep -hE "memory plan|^RESULT|^FAILED|Error" $OUT/memory_ep1.log $OUT/memory_fake.log | python3 -c "
import sys, json
for line in sys.stdin:
    if line.startswith('RESULT'):
        r = json.loads(line[7:]); print(r['name'], 'base', round(r['base_gib'], 3), 'peak', round(r['peak_gib'], 3), 'replay', round(r.get('replay_peak_gib', 0), 3))
        for g, k in r.get('at_peak', [])[:14]: print('   ', g, k[:150])
    else: print(line.rstrip()[:300])
"
