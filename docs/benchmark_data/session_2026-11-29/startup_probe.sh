#!/bin/bash
# where the time before our training start goes on the GPU host
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
cat > /tmp/probe.py <<'PY'
import os, sys, time
t0 = float(os.environ["T0"]); t = time.time(); print(f"interpreter up {t - t0:.2f}", flush=True)
import torch; t1 = time.time(); print(f"import torch {t1 - t:.2f}", flush=True)
import trainer.run.train; t2 = time.time(); print(f"import trainer.run.train {t2 - t1:.2f}", flush=True)
torch.cuda.init(); torch.zeros(1, device="cuda"); t3 = time.time(); print(f"cuda init {t3 - t2:.2f}", flush=True)
if "RANK" in os.environ:
    import torch.distributed as dist
    dist.init_process_group("nccl", device_id=torch.device("cuda", 0)); dist.barrier(); t4 = time.time(); print(f"nccl init+barrier {t4 - t3:.2f}", flush=True)
t4 = time.time(); import torchao.float8; t5 = time.time(); print(f"import torchao.float8 {t5 - t4:.2f} total {t5 - t0:.2f}", flush=True)
PY
for i in 1 2; do
  echo "== python3 $i"; T0=$(date +%s.%N) python3 /tmp/probe.py
  echo "== torchrun $i"; T0=$(date +%s.%N) torchrun --standalone --nproc_per_node=1 /tmp/probe.py 2>&1 | grep -v Warn
done
cat > /tmp/probe2.py <<'PY'
import os, time
t0 = float(os.environ["T0"]); t = time.time(); print(f"bare interpreter up {t - t0:.2f}", flush=True)
PY
echo "== torchrun bare"; T0=$(date +%s.%N) torchrun --standalone --nproc_per_node=1 /tmp/probe2.py
echo "== cuda init alone"; python3 -c "
import time; t=time.time(); import torch; t1=time.time(); torch.zeros(1, device='cuda'); t2=time.time(); print(f'torch {t1-t:.2f} cuda {t2-t1:.2f}')"
