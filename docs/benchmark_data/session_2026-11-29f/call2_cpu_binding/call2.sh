set -o pipefail
source scripts/gpu_torchao.sh
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/inductor NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=$PWD:$PYTHONPATH
mkdir -p $OUT/logs
{ nvidia-smi topo -m; lscpu | grep -i -E 'numa|socket|model name|^cpu\(s\)'; for i in 0 1; do b=$(nvidia-smi --query-gpu=pci.bus_id --format=csv,noheader -i $i | tr A-Z a-z); echo "gpu $i $b numa $(cat /sys/bus/pci/devices/${b#0000}/numa_node) cpus $(cat /sys/bus/pci/devices/${b#0000}/local_cpulist)"; done; torchrun --help | grep -i numa; } > $OUT/topo.txt 2>&1
cat $OUT/topo.txt
ARGS="--precisions fp8 --warmup 6 --steps 10 --config configs/train/moe_16b_4gpu_fp8.toml -- --model.n_layers=8 --data.source=synthetic"
run() { # label, launcher...
  local label=$1; shift
  echo "== $label"
  "$@" --json $OUT/bench.jsonl --label "$label" $ARGS --distributed.ep=${EP:-2} 2>&1 | tee $OUT/logs/$label.log | grep -E "^fp8 |\[bind\]|Error|error" | grep -v "optimizer step"
}
T="torchrun --standalone --nproc_per_node=2"
run ep2_plain_1 $T scripts/benchmark.py
run ep2_bound_1 $T --no-python tmp_gpu/bind.sh scripts/benchmark.py
EP=1 run ep1_gpu0 python3 scripts/benchmark.py
EP=1 CUDA_VISIBLE_DEVICES=1 run ep1_gpu1 python3 scripts/benchmark.py
run ep2_bound_2 $T --no-python tmp_gpu/bind.sh scripts/benchmark.py
run ep2_plain_2 $T scripts/benchmark.py
run ep2_bound_prof $T --no-python tmp_gpu/bind.sh scripts/benchmark.py --profile-dir /tmp/prof_bound
cp /tmp/prof_bound/fp8/trace*.json.gz $OUT/ 2>/dev/null
tar czf $OUT/logs.tgz -C $OUT logs; rm -rf $OUT/logs
