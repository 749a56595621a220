#!/bin/bash
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor PYTHONUNBUFFERED=1
OUT=$OUT python3 tmp_gpu/mem_rows.py > $OUT/mem_rows.log 2>&1
grep -hE "memory plan|^RESULT|^FAILED|Error" $OUT/mem_rows.log | python3 -c "
import sys, json
for line in sys.stdin:
    if line.startswith('RESULT'):
        r = json.loads(line[7:]); print(r['name'], 'base', round(r['base_gib'], 3), 'peak', round(r['peak_gib'], 3))
    else: print(line.rstrip()[:200])
"
