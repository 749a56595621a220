"""Time one context-parallel rank's attention (fwd + bwd, bf16) at Llama 3 8B's attention shapes on one GPU.

    python scripts/bench_cp_attention.py --seq 131072 --cp 8

Runs `trainer.parallel.context_parallel.chunk_attention` (the core each rank runs after its K/V
all-gather) for the rank with the most work and the one with the least, and prints milliseconds,
TFLOP/s of the unmasked work, and the bytes the K/V all-gather moves per layer, for the worked
example in docs/distributed.md#context-parallel.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from trainer.parallel.context_parallel import ContextParallel, chunk_attention  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq", type=int, default=131072)
    parser.add_argument("--cp", type=int, default=8)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    args = parser.parse_args()
    s, n, h, hk, d = args.seq, args.cp, args.heads, args.kv_heads, args.head_dim
    k, v = (torch.randn(1, hk, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    for rank in (0, n - 1):
        layout = ContextParallel(group=None, rank=rank, size=n)
        q = torch.randn(1, h, s // n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        probe = torch.randn_like(q)

        def run():
            chunk_attention(q, k, v, chunks=layout.chunks()).backward(probe)

        for _ in range(3):
            run()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            run()
        end.record()
        torch.cuda.synchronize()
        ms = start.elapsed_time(end) / 10
        c = s // (2 * n)
        pairs = sum(c * (j + 1) * c - c * (c - 1) / 2 for j in layout.chunks())  # unmasked query-key pairs
        flops = 4 * pairs * h * d * 3.5  # fwd 2 matmuls, bwd ~2.5x fwd
        print(f"seq {s}, cp {n}, rank {rank} (chunks {layout.chunks()}): {ms:.1f} ms fwd+bwd, "
              f"{flops / ms / 1e9:.0f} TFLOP/s")
    gathered = 2 * s * hk * d * 2 * (n - 1) / n
    print(f"K/V all-gather per layer per rank: {gathered / 2**20:.0f} MiB received (bf16, {hk} kv heads)")


if __name__ == "__main__":
    main()
