"""trainer/optim/: AdamW's "fused" implementation over local shards equals torch's fused AdamW (skip and loss-scale
protocol included), which optimizer a config builds and which pairs of keys it refuses, the learning-rate schedule
and the groups' line. (The rounded update, trainer/optim/update.py: tests/unit/test_bf16_master.py; the Triton
kernel: tests/unit/test_optim_kernel.py.)"""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from trainer.config import load_job_config
from trainer.optim import build_lr_scheduler, build_optimizer, describe_param_groups, lr_lambda
from trainer.optim.adamw import AdamW
from trainer.optim.states import StateDtypes


def test_local_fused_adamw_equals_torch_fused_adamw_bit_for_bit() -> None:
    torch.manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(7, 5)), torch.nn.Parameter(torch.randn(3)),
            torch.nn.Parameter(torch.randn(4, dtype=torch.float64))]  # another dtype: its own kernel call
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    kw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    a, b = AdamW(ours, implementation="fused", **kw), torch.optim.AdamW(ref, fused=True, **kw)
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
    assert a.state_dict()["param_groups"] == b.state_dict()["param_groups"]  # state.json as torch's writes it


def test_auto_implementation_is_the_triton_kernel_on_a_gpu_and_torchs_fused_kernel_or_eager_on_a_cpu() -> None:
    from trainer.optim import resolve_implementation

    assert resolve_implementation("auto", device_type="cuda", rounded=False) == "triton"
    assert resolve_implementation("auto", device_type="cpu", rounded=False) == "fused"
    assert resolve_implementation("torch_fused", device_type="cuda", rounded=False) == "torch_fused"
    # A rounded state (bf16 master weights rounded stochastically, moments of their own): the kernel, or on a CPU
    # the eager update (torch's kernels cannot round it).
    assert resolve_implementation("auto", device_type="cuda", rounded=True) == "triton"
    assert resolve_implementation("auto", device_type="cpu", rounded=True) == "eager"


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


@pytest.mark.parametrize("implementation, dtypes, rounding, fused, foreach", [
    ("fused", None, "nearest", None, None),
    ("triton", None, "nearest", None, None),
    ("torch_fused", None, "nearest", True, False),
    ("foreach", None, "nearest", False, True),
    ("fused", StateDtypes("bf16", "bf16", "bf16"), "nearest", None, None),  # nearest: plain AdamW on bf16 weights
    ("eager", StateDtypes("bf16", "bf16", "bf16"), "stochastic", None, None),
    ("triton", StateDtypes("bf16", "bf16", "bf16"), "kahan", None, None),
    ("eager", StateDtypes("fp32", "fp8", "bf16"), "nearest", None, None),  # moments of their own: rounded
])
def test_build_optimizer_builds_what_it_is_asked(implementation, dtypes, rounding, fused, foreach) -> None:
    """One AdamW for every state and rounding ("triton", "eager", "fused"), torch's AdamW as the references; the
    builder runs what validation resolved and overrides nothing."""
    model = _two_layers()
    if dtypes is not None and dtypes.master == "bf16":
        model.to(torch.bfloat16)
    opt = build_optimizer(model, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                          implementation=implementation, dtypes=dtypes, rounding=rounding)
    group = opt.param_groups[0]
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == (1e-3, (0.9, 0.95), 1e-8, 0.1)
    assert [id(p) for p in group["params"]] == [id(p) for p in model.parameters()]
    if implementation in ("torch_fused", "foreach"):
        assert type(opt) is torch.optim.AdamW
        assert (bool(group["fused"]), bool(group["foreach"])) == (fused, foreach)
        return
    assert type(opt) is AdamW and opt.implementation == implementation and opt.rounding == rounding
    assert opt.rounded == (rounding != "nearest" or not dtypes.in_master_dtype if dtypes else False)


@pytest.mark.parametrize("args, keys", [
    (["--optimizer.implementation=fused"], ("optimizer.bf16_update='stochastic'", "optimizer.implementation='fused'")),
    (["--optimizer.implementation=foreach", "--optimizer.bf16_update=kahan"],
     ("optimizer.bf16_update='kahan'", "optimizer.implementation='foreach'")),
    (["--optimizer.implementation=torch_fused"], ("optimizer.bf16_update='stochastic'",
                                                  "optimizer.implementation='torch_fused'")),
    (["--optimizer.implementation=fused", "--distributed.master_dtype=fp32", "--optimizer.exp_avg_dtype=fp8"],
     ("optimizer.exp_avg_dtype='fp8'", "optimizer.implementation='fused'")),
])
def test_an_implementation_that_cannot_run_the_state_is_a_config_error_naming_both_keys(args, keys) -> None:
    """torch's kernels keep the moments in the weights' dtype and round bf16 weights to nearest: asked for with a
    rounded state (bf16 master weights are the default of bf16 compute, rounded stochastically), they used to be
    replaced by another optimizer without a word; now the validation pass refuses the pair in one line."""
    from trainer.errors import ConfigError
    from trainer.validate import validate_job

    cfg = load_job_config(["--config", "configs/train/debug_model.toml", "--train.mixed_precision=bf16", *args])
    with pytest.raises(ConfigError) as e:
        validate_job(cfg, world_size=1)
    assert all(key in str(e.value) for key in keys) and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize("args, implementation", [
    ([], "eager"),  # bf16 master weights, stochastic rounding
    (["--optimizer.bf16_update=nearest"], "fused"),
    (["--optimizer.bf16_update=nearest", "--optimizer.implementation=foreach"], "foreach"),
    (["--distributed.master_dtype=fp32", "--optimizer.implementation=fused"], "fused"),
    (["--distributed.master_dtype=fp32", "--optimizer.exp_avg_dtype=bf16"], "eager"),
])
def test_auto_and_what_can_run_resolve_without_an_error(args, implementation) -> None:
    from trainer.validate import validate_job

    cfg = load_job_config(["--config", "configs/train/debug_model.toml", "--train.mixed_precision=bf16", *args])
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: 'auto' is the Triton kernel")
    assert validate_job(cfg, world_size=1).optimizer.implementation == implementation


def test_param_groups_line_counts_tensors_and_parameters() -> None:
    model = _two_layers()
    opt = build_optimizer(model, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, implementation="fused")
    schedule = dict(warmup_steps=0, total_steps=10, decay_type="constant", min_lr_ratio=0.1, wsd_decay_ratio=0.2)
    # 4x8 weight + 8 bias + 8x2 weight: 3 tensors, 56 parameters.
    line = describe_param_groups(opt, build_lr_scheduler(opt, **schedule).schedule)
    assert line.startswith("AdamW (fp32 master weights), 1 group: 3 tensors, 56 parameters, weight_decay=0.1; lr 0.001 "
                           "peak"), line
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
