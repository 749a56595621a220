#!/bin/bash
# one GPU, cold start from the launch (torchrun), alternated: main (old) and compile workers started in trainer.cli
# at the Trainer's start, after validation (new); then an error found by validation, timed with each. Pool timings from tmp_gpu/sc.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
ROOT=$PWD; i=0; mkdir -p /tmp/logs
for wp in old:fp8 new:fp8 new:fp8 old:fp8 new:fp8; do
  i=$((i+1)); who=${wp%:*}; p=${wp#*:}
  (cd tmp_gpu/$who && export PYTHONPATH=/tmp/site:$PWD:$ROOT/tmp_gpu/sc && COLD_PY="torchrun --standalone --nproc_per_node=1" COLD_RUNS="$p auto" COLD_STEPS=10 bash scripts/gpu_checks.sh coldstart > /dev/null 2>&1)
  log=/tmp/logs/${who}_${p}_$i.log; mv $OUT/coldstart_${p}_auto_8l.log $log
  echo "[$i $who $p] $(tail -1 $OUT/coldstart.log | cut -c40-200)"
  grep -E "step 1 done|step +10/" $log | cut -c20-200 | sed "s/^/[$i $who $p] /"
  grep -h "\[sc pid" $log | sed "s/^/[$i $who $p] /" | cut -c1-250
  grep -A200 "sc table" $log | grep -E " (_compile.compile_inner|create_aot_dispatcher_function|compile_fx.<locals>.fw_compiler_base|compile_fx.<locals>.bw_compiler|PyCodeCache.load_by_key_path|async_compile.precompile|async_compile.wait) " | awk '{printf "%s=%s  ", $2, $3} END {print ""}' | sed "s/^/[$i $who $p] /"
done
for who in new new; do
  s=$(date +%s.%N); (cd tmp_gpu/$who && PYTHONPATH=/tmp/site:$PWD python3 scripts/train.py --config configs/train/llama3_8b.toml --model.n_layers=8 --distributed.tp=3 > /tmp/logs/err_$who.log 2>&1); rc=$?; e=$(date +%s.%N)
  echo "[error exit $who] rc $rc, $(python3 -c "print(round($e-$s,1))") s: $(tail -1 /tmp/logs/err_$who.log | cut -c1-150)"
done
tar -czf $OUT/logs.tgz -C /tmp logs
