"""BF16AdamW on sharded DTensors (2 gloo ranks) rounds every element exactly as one process does."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from tests.helpers import REPO, env

SCRIPT = textwrap.dedent("""
    import sys
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from trainer.bf16_adamw import BF16AdamW

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,))
    kind = sys.argv[1]
    gen = torch.Generator().manual_seed(0)
    # Uneven shapes: FSDP-style Shard(0) of 7 rows gives ranks 4 and 3 rows.
    full = [torch.randn(7, 5, generator=gen).bfloat16(), torch.randn(9, generator=gen).bfloat16(),
            torch.randn(6, 11, generator=gen).bfloat16()]
    grads = [[torch.randn(t.shape, generator=gen).bfloat16() for t in full] for _ in range(3)]
    placements = [[Shard(0)], [Shard(0)], [Shard(1)]]

    def run(sharded):
        params = [torch.nn.Parameter(distribute_tensor(t.clone(), mesh, pl) if sharded else t.clone())
                  for t, pl in zip(full, placements)]
        opt = BF16AdamW(params, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, update=kind, seed=5)
        for step in grads:
            for p, g, pl in zip(params, step, placements):
                p.grad = distribute_tensor(g, mesh, pl) if sharded else g
            opt.step()
        return [p.detach().full_tensor() if sharded else p.detach() for p in params]

    one, two = run(False), run(True)
    for a, b, start in zip(one, two, full):
        assert torch.equal(a, b), (a - b).abs().max()
        assert not torch.equal(a, start)  # the steps moved the weights
    from trainer.distributed import destroy_distributed
    destroy_distributed()  # barrier first: a rank must not close gloo while its peer still reads
    print("OK")
""")


def _run(kind: str, tmp_path: Path) -> subprocess.CompletedProcess:
    script = tmp_path / "sharded.py"
    script.write_text(SCRIPT)
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script), kind],
        cwd=REPO, env=env(), capture_output=True, text=True, timeout=180,
    )


def test_sharded_rounding_equals_one_process(tmp_path: Path) -> None:
    for kind in ("stochastic", "kahan"):
        proc = _run(kind, tmp_path)
        assert proc.returncode == 0 and proc.stdout.count("OK") == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
