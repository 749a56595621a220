# Cold start at dp_shard=2 beside torchtitan (new tree, the fused FP8 head loss in): the shared libraries' files read
# once first (torch, CUDA, torchao, triton: both trainers load them), then bf16 ours/peer/peer/ours, fp8 peer/ours/ours/peer.
set -o pipefail
source scripts/gpu_torchao.sh
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; } > $OUT/env.txt
python3 -c "import torch, torchao, triton, torch._inductor.compile_fx; torch.zeros(1).cuda(); print('libraries read')"
PEER_WHEELS=.gpu_peer COLD_PRECISIONS=bf16 COLD_ORDER="ours peer peer ours" bash scripts/gpu_checks.sh coldpeer 2>&1 | tail -8
PEER_WHEELS=.gpu_peer COLD_PRECISIONS=fp8 COLD_ORDER="peer ours ours peer" bash scripts/gpu_checks.sh coldpeer 2>&1 | tail -8
cat $OUT/coldpeer.log
