#!/bin/bash
# one GPU, cold start from the launch (torchrun): main (old), compile workers started at the Trainer's start (new),
# and with inductor's source-hash keys prefetched too (new2); torchtitan 0.2.2 once; dynamo's table at exit (tmp_gpu/sc)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
ROOT=$PWD; i=0
python3 -c "import torch._inductor.codecache as c, torch._inductor.config as cf; print('prefetch:', hasattr(c.torch_key,'prefetch'), 'threads', __import__('torch._inductor.async_compile',fromlist=['x']).get_compile_threads() if hasattr(__import__('torch._inductor.async_compile',fromlist=['x']),'get_compile_threads') else '?', cf.worker_start_method)"
for wp in old:bf16 new:bf16 new2:bf16 peer:bf16 new2:bf16 new:bf16 old:bf16 new2:fp8 old:fp8; do
  i=$((i+1)); who=${wp%:*}; p=${wp#*:}
  if [ $who = peer ]; then
    (export PYTHONPATH=/tmp/site:$ROOT:$ROOT/tmp_gpu/sc; PEER_WHEELS=.gpu_peer PEER_LAYERS=8 PEER_AC=none PEER_PRECISIONS=$p bash scripts/gpu_checks.sh peer8b > /dev/null 2>&1)
    log=$OUT/peer_${p}_$i.log; mv $OUT/peer8b_${p}_ac_none_8l.log $log
    echo "[$i peer $p] $(python3 scripts/peer_step1.py $log) | $(tail -2 $OUT/peer8b.log | head -1 | cut -c1-60)"
  else
    (cd tmp_gpu/$who && export PYTHONPATH=/tmp/site:$PWD:$ROOT/tmp_gpu/sc && COLD_PY="torchrun --standalone --nproc_per_node=1" COLD_RUNS="$p auto" COLD_STEPS=10 bash scripts/gpu_checks.sh coldstart > /dev/null 2>&1)
    log=$OUT/${who}_${p}_$i.log; mv $OUT/coldstart_${p}_auto_8l.log $log
    echo "[$i $who $p] $(tail -1 $OUT/coldstart.log | cut -c40-200)"
    grep -E "step 1 done|step +10/" $log | cut -c20-230 | sed "s/^/[$i $who $p] /"
  fi
  grep -h "\[sc pid\|\[new2\]" $log | sed "s/^/[$i $who $p] /" | cut -c1-250
  grep -hE "^(_compile.compile_inner|OutputGraph.call_user_compiler|create_aot_dispatcher_function|compile_fx.<locals>.fw_compiler_base|compile_fx.<locals>.bw_compiler|compile_fx_inner|GraphLowering.compile_to_module|async_compile.wait|inductor_codecache_torch_key|CacheBase.get_system.triton_key|bytecode_tracing|PyCodeCache.load_by_key_path|Scheduler.__init__|GraphLowering.run|_recursive_joint_graph_passes|min_cut_rematerialization_partition|CachingAutotuner.benchmark_all_configs|inductor_import|TritonBundler.read_and_emit|aot_trace_joint_graph|backward._backward_impl)," $log | tr '\n' ';' | sed "s/^/[$i $who $p] /"; echo
done
