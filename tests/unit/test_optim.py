"""The fused AdamW over local shards equals torch's fused AdamW, skip and loss-scale protocol included."""

from __future__ import annotations

import torch

from trainer.optim import LocalFusedAdamW


def test_local_fused_adamw_equals_torch_fused_adamw_bit_for_bit() -> None:
    torch.manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(7, 5)), torch.nn.Parameter(torch.randn(3)),
            torch.nn.Parameter(torch.randn(4, dtype=torch.float64))]  # another dtype: its own kernel call
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    kw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    a, b = LocalFusedAdamW(ours, **kw), torch.optim.AdamW(ref, fused=True, **kw)
    for i in range(5):
        for p, q in zip(ours, ref):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        for opt in (a, b):
            opt.grad_scale = torch.tensor(2.0)  # gradients divided by loss scale x clip
            opt.found_inf = torch.tensor(1.0 if i == 2 else 0.0)  # step 3 skipped
        a.step()
        b.step()
    assert all(torch.equal(p, q) for p, q in zip(ours, ref))
    # The same state, so checkpoints of either load into the other; the skipped step is not counted.
    assert a.state[ours[0]]["step"].item() == b.state[ref[0]]["step"].item() == 4
    assert a.state_dict()["state"][0].keys() == b.state_dict()["state"][0].keys()
