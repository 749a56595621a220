"""The fused AdamW over local shards equals torch's fused AdamW, skip and loss-scale protocol included."""

from __future__ import annotations

import pytest
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


def _train_pair(ours_cls, ref_cls, dtype=torch.float32, **ours_kw):
    torch.manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(7, 5, dtype=dtype)), torch.nn.Parameter(torch.randn(3, dtype=dtype)),
            torch.nn.Parameter(torch.randn(7, 5, dtype=dtype))]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    kw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    a, b = ours_cls(ours, **kw, **ours_kw), ref_cls(ref, **kw)
    for i in range(5):
        for p, q in zip(ours, ref):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        for opt in (a, b):
            opt.grad_scale = torch.tensor(2.0)
            opt.found_inf = torch.tensor(1.0 if i == 2 else 0.0)  # step 3 skipped
            opt.param_groups[0]["lr"] = 1e-2 * (i + 1)  # a new lr each step (a new value, not a new graph)
        a.step()
        b.step()
    return a, b, ours, ref


def test_compiled_adamw_function_equals_torch_fused_adamw() -> None:
    """CompiledAdamW's update, run eagerly: torch's AdamW to fp32 rounding, the skip and loss-scale protocol and the
    state (so checkpoints of either load into the other) included."""
    from trainer.optim import CompiledAdamW

    a, b, ours, ref = _train_pair(CompiledAdamW, LocalFusedAdamW, compile=False)
    for p, q in zip(ours, ref):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    for p, q in zip(ours, ref):
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(a.state[p][key], b.state[q][key], rtol=1e-6, atol=1e-9)
    assert a.state[ours[0]]["step"].item() == b.state[ref[0]]["step"].item() == 4
    assert a.state_dict()["state"][0].keys() == b.state_dict()["state"][0].keys()


@pytest.mark.slow
def test_compiled_adamw_compiled_equals_its_eager_function(tmp_path, monkeypatch) -> None:
    from trainer.optim import CompiledAdamW

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    compiled = _train_pair(CompiledAdamW, lambda p, **kw: CompiledAdamW(p, **kw, compile=False))
    for p, q in zip(compiled[2], compiled[3]):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    assert compiled[0].state[compiled[2][0]]["step"].item() == 4


def test_auto_implementation_is_compiled_only_for_a_compiled_model_on_a_gpu() -> None:
    from trainer.optim import resolve_implementation

    assert resolve_implementation("auto", compile_model=True, device_type="cuda") == "compiled"
    assert resolve_implementation("auto", compile_model=False, device_type="cuda") == "fused"
    assert resolve_implementation("auto", compile_model=True, device_type="cpu") == "fused"
    assert resolve_implementation("torch_fused", compile_model=True, device_type="cuda") == "torch_fused"
