#!/bin/bash
# one GPU, the whole Llama 3 8B (32 layers), batch 4 x 4096, no AC: cold start from the launch (torchrun), fp8, bf16, fp8
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
i=0
for p in fp8 bf16 fp8; do
  i=$((i+1))
  COLD_LAYERS=32 COLD_PY="torchrun --standalone --nproc_per_node=1" COLD_RUNS="$p auto" COLD_STEPS=10 timeout 240 bash scripts/gpu_checks.sh coldstart > /dev/null 2>&1
  mv $OUT/coldstart_${p}_auto_32l.log $OUT/ours_${p}_32l_$i.log
  echo "[$i ours $p 32 layers] $(tail -1 $OUT/coldstart.log | cut -c1-200)"
  grep -E "step 1 done|step +10/|memory plan|Error" $OUT/ours_${p}_32l_$i.log | cut -c1-230 | sed "s/^/[$i ours $p] /"
done
cd $OUT && tar czf logs_8b.tgz *.log && rm -f *.log
