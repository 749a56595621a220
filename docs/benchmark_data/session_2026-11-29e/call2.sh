#!/bin/bash
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor PYTHONUNBUFFERED=1
log=$OUT/dbg.log
TORCH_LOGS=output_code python3 tmp_gpu/dbg_moe.py tmp_gpu/fake_moe.py 2 fp8 --moe.dispatch=padded --moe.overlap_all_to_all=true > $log 2>&1
grep -h "^SPEED\|Error\|^PASS" $log | cut -c1-400
python3 tmp_gpu/extract.py $log $OUT/code
python3 tmp_gpu/windows.py $log
grep -v "__output_code" $log > $log.short; rm $log
cd $OUT && tar czf dbg.tgz code_*.txt dbg.log.short && rm -f code_*.txt dbg.log.short
