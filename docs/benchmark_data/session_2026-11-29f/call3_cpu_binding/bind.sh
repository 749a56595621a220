#!/usr/bin/env bash
# torchrun --no-python tmp_gpu/bind.sh SCRIPT ARGS: python3 SCRIPT with its threads on a CPU set by $BIND:
# split: local rank r of n on the r-th n-th of the CPUs; reverse: the (n-1-r)-th
n=$(nproc --all); w=$LOCAL_WORLD_SIZE; r=$LOCAL_RANK; [ "$BIND" = reverse ] && r=$((w - 1 - r))
cpus="$((r * n / w))-$(((r + 1) * n / w - 1))"
echo "[bind] local rank $LOCAL_RANK cpus $cpus" >&2
exec taskset -c "$cpus" python3 "$@"
