"""Context-parallel attention on the GPU (run on an H100/H200: `pytest -m gpu tests/gpu`), all ranks in one process.

NCCL cannot put two ranks on one GPU, so this runs every cp rank's share of a 32K-token sequence in one
process through the same `chunk_attention` the trainer runs after its K/V all-gather (SDPA with the
lower-right causal mask on the flash kernel), against plain causal SDPA over the whole sequence:
each rank's output chunks, and the K/V gradients summed over the ranks (what the all-gather's
backward, a reduce-scatter, adds up), are within 1.5x SDPA's own bf16-vs-fp32 error.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from trainer.parallel.context_parallel import ContextParallel, chunk_attention

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("cp", [2, 4])
def test_cp_attention_of_every_rank_matches_sdpa_at_32k(cp: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    seq, heads, kv_heads, head_dim = 32768, 32, 8, 128  # Llama 3 8B's attention
    q32, k32, v32 = (torch.randn(1, h, seq, head_dim, device="cuda", generator=g)
                     for h in (heads, kv_heads, kv_heads))
    probe = torch.randn(1, heads, seq, head_dim, device="cuda", generator=g)

    def sdpa(dtype):
        q, k, v = (t.to(dtype).clone().requires_grad_() for t in (q32, k32, v32))
        if dtype == torch.float32:  # no fp32 flash kernel: the memory-efficient one, which wants K/V per query head
            groups = heads // kv_heads
            out = F.scaled_dot_product_attention(q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1),
                                                 is_causal=True)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        (out.float() * probe).sum().backward()
        return out.detach(), k.grad, v.grad

    ref_out, ref_dk, ref_dv = sdpa(torch.float32)
    bf_out, bf_dk, bf_dv = sdpa(torch.bfloat16)
    k, v = (t.bfloat16().clone().requires_grad_() for t in (k32, v32))
    outs = []
    for rank in range(cp):
        layout = ContextParallel(group=None, rank=rank, size=cp)
        q = layout.shard(q32.bfloat16(), dim=2)
        out = chunk_attention(q, k, v, chunks=layout.chunks())
        (out.float() * layout.shard(probe, dim=2)).sum().backward()  # K/V gradients accumulate over the ranks
        outs.append((layout, out.detach()))
    for layout, out in outs:
        want, bf = layout.shard(ref_out, dim=2), layout.shard(bf_out, dim=2)
        assert _rel(out, want) <= 1.5 * _rel(bf, want) + 1e-6, layout.rank
    assert _rel(k.grad, ref_dk) <= 1.5 * _rel(bf_dk, ref_dk)
    assert _rel(v.grad, ref_dv) <= 1.5 * _rel(bf_dv, ref_dv)
    print(f"cp={cp}: output rel err {max(_rel(o, l.shard(ref_out, dim=2)) for l, o in outs):.2e} "
          f"(SDPA bf16 {_rel(bf_out, ref_out):.2e}), dK {_rel(k.grad, ref_dk):.2e} (SDPA {_rel(bf_dk, ref_dk):.2e}), "
          f"dV {_rel(v.grad, ref_dv):.2e} (SDPA {_rel(bf_dv, ref_dv):.2e})")
