#!/bin/bash
# 1x H200: the model families at ep=2 as rank 0 of 2 on the fake process group, moe.overlap_all_to_all on (the
# default): each compiles and steps on CUDA, and where its GEMMs sit between each all-to-all's start and wait.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor PYTHONUNBUFFERED=1
start=$(date +%s)
for f in deepseek_v3_16b qwen3_30b_a3b gpt_oss_20b; do
  [ $(( $(date +%s) - start )) -gt 420 ] && { echo "stopped before $f: time"; break; }
  log=$OUT/family_$f.log
  TORCH_LOGS=output_code python3 tmp_gpu/fake_moe.py 2 fp8 --model.flavor=$f --model.n_layers=4 --checkpoint.enable=false > $log 2>&1
  echo "== $f rc=$?"
  grep -h "^SPEED\|Error\|error" $log | tail -2 | cut -c1-300
  grep -h "torch.compile:\|expert parallel:" $log | head -2 | cut -c1-250
  python3 tmp_gpu/windows.py $log | sort -u | head -4
  grep -v "__output_code" $log > $log.short; rm $log
done
cd $OUT && tar czf family_logs.tgz family_*.short && rm -f family_*.short
