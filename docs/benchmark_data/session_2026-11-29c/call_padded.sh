#!/bin/bash
# 2x H200: moe.dispatch sized vs padded at ep=2 (scripts/gpu_checks.sh moe_padded), ep=1 first
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
date -u
bash scripts/gpu_checks.sh moe_padded
date -u
