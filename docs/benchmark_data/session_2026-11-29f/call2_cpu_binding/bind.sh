#!/usr/bin/env bash
# torchrun --no-python tmp_gpu/bind.sh SCRIPT ARGS: run python3 SCRIPT on the CPUs local to GPU $LOCAL_RANK
bus=$(nvidia-smi --query-gpu=pci.bus_id --format=csv,noheader -i "$LOCAL_RANK" | tr 'A-Z' 'a-z'); bus=${bus#0000}
cpus=$(cat /sys/bus/pci/devices/$bus/local_cpulist)
echo "[bind] local rank $LOCAL_RANK gpu $bus cpus $cpus" >&2
exec taskset -c "$cpus" python3 "$@"
