set -o pipefail
source scripts/gpu_torchao.sh
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/inductor NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=$PWD:$PYTHONPATH
mkdir -p $OUT/logs
{ lscpu; cat /sys/devices/system/cpu/cpu0/topology/thread_siblings_list /sys/devices/system/cpu/cpu16/topology/thread_siblings_list; which numactl; nproc; } > $OUT/logs/cpu.txt 2>&1
ARGS="--precisions fp8 --warmup 6 --steps 10 --config configs/train/moe_16b_4gpu_fp8.toml -- --model.n_layers=8 --data.source=synthetic --distributed.ep=2"
run() { local label=$1; shift; echo "== $label"
  "$@" --json $OUT/bench.jsonl --label "$label" $ARGS 2>&1 | tee $OUT/logs/$label.log | grep -E "^fp8 |\[bind\]|Error|error|numa" | grep -v "optimizer step"; tar czf $OUT/logs.tgz -C $OUT logs; }
T="torchrun --standalone --nproc_per_node=2"
run plain_1 $T scripts/benchmark.py
BIND=split run split_1 $T --no-python tmp_gpu/bind.sh scripts/benchmark.py
BIND=reverse run reverse_1 $T --no-python tmp_gpu/bind.sh scripts/benchmark.py
run plain_2 $T scripts/benchmark.py
BIND=split run split_2 $T --no-python tmp_gpu/bind.sh scripts/benchmark.py
run numa_exclusive $T --numa-binding=exclusive scripts/benchmark.py
BIND=reverse run reverse_2 $T --no-python tmp_gpu/bind.sh scripts/benchmark.py
tar czf $OUT/logs.tgz -C $OUT logs; rm -rf $OUT/logs
