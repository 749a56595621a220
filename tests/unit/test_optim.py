"""trainer/optim/build.py: the fused AdamW over local shards equals torch's fused AdamW (skip and loss-scale protocol
included), which optimizer a config builds, the learning-rate schedule and the groups' line.
(BF16AdamW, trainer/optim/update.py: tests/unit/test_bf16_master.py; the Triton kernel of TritonAdamW and BF16AdamW:
tests/unit/test_optim_kernel.py.)"""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from trainer.optim import build_lr_scheduler, build_optimizer, describe_param_groups, lr_lambda
from trainer.optim.build import LocalFusedAdamW, TritonAdamW
from trainer.optim.update import BF16AdamW


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


def test_auto_implementation_is_the_triton_kernel_on_a_gpu_and_torchs_fused_kernel_on_a_cpu() -> None:
    from trainer.optim import resolve_implementation

    assert resolve_implementation("auto", device_type="cuda") == "triton"
    assert resolve_implementation("auto", device_type="cpu") == "fused"
    assert resolve_implementation("torch_fused", device_type="cuda") == "torch_fused"


def test_triton_on_a_cpu_is_a_config_error_naming_the_key() -> None:
    from trainer.config import load_job_config
    from trainer.errors import ConfigError
    from trainer.validate.options import resolve_options

    cfg = load_job_config(["--config", "configs/train/debug_model.toml", "--optimizer.implementation=triton"])
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the Triton kernel runs")
    with pytest.raises(ConfigError, match=r"^optimizer.implementation='triton' runs a GPU kernel"):
        resolve_options(cfg, bf16_master=False)


def _two_layers() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2, bias=False))


@pytest.mark.parametrize("implementation, bf16_update, cls, fused, foreach", [
    ("fused", None, LocalFusedAdamW, True, None),
    ("triton", None, TritonAdamW, True, None),
    ("torch_fused", None, torch.optim.AdamW, True, False),
    ("foreach", None, torch.optim.AdamW, False, True),
    ("fused", "nearest", LocalFusedAdamW, True, None),  # nearest: plain AdamW on the bf16 weights
    ("fused", "stochastic", BF16AdamW, None, None),
    ("foreach", "kahan", BF16AdamW, None, None),
])
def test_build_optimizer_picks_the_implementation(implementation, bf16_update, cls, fused, foreach) -> None:
    model = _two_layers()
    opt = build_optimizer(model, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                          implementation=implementation, bf16_update=bf16_update)
    assert type(opt) is cls
    group = opt.param_groups[0]
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == (1e-3, (0.9, 0.95), 1e-8, 0.1)
    assert [id(p) for p in group["params"]] == [id(p) for p in model.parameters()]
    if fused is not None:
        assert bool(group["fused"]) == fused
    if foreach is not None:
        assert bool(group["foreach"]) == foreach
    if cls is BF16AdamW:
        assert opt.update == bf16_update


def test_param_groups_line_counts_tensors_and_parameters() -> None:
    model = _two_layers()
    opt = build_optimizer(model, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, implementation="fused")
    schedule = dict(warmup_steps=0, total_steps=10, decay_type="constant", min_lr_ratio=0.1, wsd_decay_ratio=0.2)
    # 4x8 weight + 8 bias + 8x2 weight: 3 tensors, 56 parameters.
    line = describe_param_groups(opt, build_lr_scheduler(opt, **schedule).schedule)
    assert line.startswith("LocalFusedAdamW, 1 group: 3 tensors, 56 parameters, weight_decay=0.1; lr 0.001 peak"), line
    two = torch.optim.AdamW([{"params": list(model[0].parameters())},
                             {"params": list(model[1].parameters()), "weight_decay": 0.0}], lr=1e-3, weight_decay=0.1)
    line = describe_param_groups(two, build_lr_scheduler(two, **schedule).schedule)
    assert line.startswith("AdamW, 2 groups: group 0: 2 tensors, 40 parameters, weight_decay=0.1; group 1: 1 tensors, "
                           "16 parameters, weight_decay=0; lr 0.001 peak"), line


@pytest.mark.parametrize("decay_type", ["cosine", "linear", "wsd", "constant"])
def test_optimizer_line_says_the_peak_lr_and_where_the_schedule_changes(decay_type: str) -> None:
    from trainer.optim import build_lr_scheduler, describe_param_groups

    schedule = dict(warmup_steps=100, total_steps=1000, decay_type=decay_type, min_lr_ratio=0.1, wsd_decay_ratio=0.2)
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))], lr=3e-4, weight_decay=0.1)
    line = describe_param_groups(optimizer, build_lr_scheduler(optimizer, **schedule).schedule)
    # The group's lr is now warmup's first (3e-6): the line must say the configured peak, not that.
    assert optimizer.param_groups[0]["lr"] == pytest.approx(3e-6) and "3e-06" not in line
    assert line.startswith("AdamW, 1 group: 1 tensors, 3 parameters, weight_decay=0.1; lr 0.0003 peak, warmup 100 "
                           "steps linear, "), line

    def lr_at(step: int) -> float:  # the log's 1-based step
        return lr_lambda(step - 1, **schedule)

    assert lr_at(99) < 1.0 == lr_at(100)  # the peak is first reached at step 100
    if decay_type == "constant":
        assert line.endswith("then constant") and lr_at(1000) == 1.0
        return
    first, last = map(int, re.search(r"decay to 3e-05 over steps (\d+)-(\d+)$", line).groups())
    assert last == 1000 and lr_at(first - 1) == 1.0 == lr_at(first) > lr_at(first + 1)  # decay starts after `first`
    assert lr_at(1000) == pytest.approx(0.1, abs=0.9 / (1000 - first))  # one step's decay short of the floor
    if decay_type == "wsd":
        assert f"constant to step {first - 1}, then linear decay" in line
