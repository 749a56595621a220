#!/bin/bash
# one GPU, fp8 cold start from the launch, alternated: main (old), the head graph without pointwise autotuning (new), torchtitan 0.2.2
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
ROOT=$PWD; i=0
for who in old peer new old peer new; do
  i=$((i+1))
  if [ $who = peer ]; then
    (export PYTHONPATH=/tmp/site:$ROOT; PEER_WHEELS=.gpu_peer PEER_LAYERS=8 PEER_AC=none PEER_PRECISIONS=fp8 bash scripts/gpu_checks.sh peer8b 2>&1 | grep -E "launch|step 1 after|step: +10 " | cut -c1-250 | sed "s/^/[$i] /")
    for f in $OUT/peer8b_fp8_ac_none*.log; do mv "$f" "${f%.log}_$i.log"; done
  else
    (cd tmp_gpu/$who && export PYTHONPATH=/tmp/site:$PWD && COLD_PY="torchrun --standalone --nproc_per_node=1" COLD_RUNS="fp8 auto" COLD_STEPS=10 bash scripts/gpu_checks.sh coldstart 2>&1 | grep -E "launch|step 1 done|step +10/" | cut -c1-300 | sed "s/^/[$i $who] /")
    mv $OUT/coldstart_fp8_auto_8l.log $OUT/coldstart_fp8_8l_${who}_$i.log
  fi
done
ls $OUT
