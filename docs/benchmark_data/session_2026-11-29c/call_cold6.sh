#!/bin/bash
# one GPU, cold start from the launch (torchrun both), main with inductor's compile workers started at the
# Trainer's start, beside torchtitan 0.2.2, alternated ABBA; $1 = the precision
p=$1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
i=0
for who in ours peer peer ours ours peer; do
  i=$((i+1))
  if [ $who = peer ]; then
    PEER_WHEELS=.gpu_peer PEER_LAYERS=8 PEER_AC=none PEER_PRECISIONS=$p bash scripts/gpu_checks.sh peer8b > /dev/null 2>&1
    mv $OUT/peer8b_${p}_ac_none_8l.log $OUT/peer_${p}_$i.log
    echo "[$i peer $p] $(python3 scripts/peer_step1.py $OUT/peer_${p}_$i.log) | $(grep -m1 -o 'tflops: [0-9.]*' $OUT/peer_${p}_$i.log | tail -1)"
  else
    COLD_PY="torchrun --standalone --nproc_per_node=1" COLD_RUNS="$p auto" COLD_STEPS=10 bash scripts/gpu_checks.sh coldstart > /dev/null 2>&1
    mv $OUT/coldstart_${p}_auto_8l.log $OUT/ours_${p}_$i.log
    echo "[$i ours $p] $(tail -1 $OUT/coldstart.log | cut -c1-200)"
    grep -E "step 1 done|step +10/" $OUT/ours_${p}_$i.log | cut -c1-230 | sed "s/^/[$i ours $p] /"
  fi
done
grep -h "launch to step 1" $OUT/peer8b.log
cd $OUT && tar czf logs_$p.tgz *.log && rm -f *.log
