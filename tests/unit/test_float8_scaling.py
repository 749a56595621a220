"""Our tensorwise FP8 Linear (trainer.parallel.float8.tensorwise): bit for bit torchao's dynamic path, delayed scales
against an independent history, FP8 inputs saved for backward, the histories in checkpoints, the config keys.
Compiled runs and activation checkpointing: tests/unit/test_float8_scaling_compile.py; several ranks:
tests/distributed/test_float8_scaling.py."""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.helpers import DEBUG_CONFIG, read_metrics
from trainer.config import load_job_config
from trainer.errors import ConfigError

E4M3_MAX, E5M2_MAX = 448.0, 57344.0


@pytest.fixture(autouse=True)
def aten_scaled_mm():
    """torch._scaled_mm through aten's CPU kernel, as apply_float8 sets it on a CPU (oneDNN's is a slow loop)."""
    before = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = False
    yield
    torch.backends.mkldnn.enabled = before


def converted(model: nn.Module, *, emulate: bool = False, fp8_format: str = "hybrid", ours: bool = True,
              delayed: bool = False, save_fp8_input: bool = False) -> nn.Module:
    from torchao.float8 import CastConfig, Float8LinearConfig, convert_to_float8_training
    from torchao.float8.config import e4m3_dtype

    from trainer.parallel.float8.tensorwise import convert_to_tensorwise

    grads = {"cast_config_grad_output": CastConfig(target_dtype=e4m3_dtype)} if fp8_format == "e4m3" else {}
    model = copy.deepcopy(model)
    convert_to_float8_training(model, config=Float8LinearConfig(emulate=emulate, **grads))
    if ours:
        convert_to_tensorwise(model, delayed=delayed, save_fp8_input=save_fp8_input)
    return model


def mlp(dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128, bias=False), nn.GELU(), nn.Linear(128, 32, bias=False)).to(dtype)


def forward_backward(model: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
    x = x.detach().clone().requires_grad_()
    out = model(x)
    out.backward(grad)
    return (out, x.grad, *(p.grad for p in model.parameters()))


@pytest.mark.parametrize("emulate", [False, True])
@pytest.mark.parametrize("fp8_format", ["hybrid", "e4m3"])
@pytest.mark.parametrize("save_fp8_input", [False, True])
def test_dynamic_scaling_is_torchaos_tensorwise_bit_for_bit(emulate: bool, fp8_format: str,
                                                            save_fp8_input: bool) -> None:
    base = mlp()
    theirs = converted(base, emulate=emulate, fp8_format=fp8_format, ours=False)
    ours = converted(base, emulate=emulate, fp8_format=fp8_format, save_fp8_input=save_fp8_input)
    for step in range(2):
        x = torch.randn(2, 16, 64, dtype=torch.bfloat16) * (1 + 10 * step)
        grad = torch.randn(2, 16, 32, dtype=torch.bfloat16) * 1e-3
        for a, b in zip(forward_backward(theirs, x, grad), forward_backward(ours, x, grad)):
            assert torch.equal(a, b)


def dequantized(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An independent tensorwise cast: scale, saturate, round to `dtype`, back to fp32 (torchao's emulation)."""
    fmax = torch.finfo(dtype).max
    return (t.float() * scale).clamp(-fmax, fmax).to(dtype).float() / scale


def scale_of(amax: float, fmax: float, margin: int) -> torch.Tensor:
    return torch.tensor(fmax / max(amax, 1e-12) / 2.0 ** margin, dtype=torch.float64).float()


@pytest.mark.parametrize("algo, margin", [("max", 0), ("most_recent", 0), ("max", 2)])
def test_delayed_scales_come_from_an_independent_history_of_earlier_steps(algo: str, margin: int) -> None:
    """A Linear over 6 steps (2 microbatches each, history of 3): every cast of step k uses fp8_max / amax / 2^margin
    of the amaxes of steps k-3..k-1 (max or newest), step 1 its own amax; the layer computes exactly that."""
    from trainer.parallel.float8.delayed import DelayedScaling

    torch.manual_seed(0)
    model = converted(nn.Sequential(nn.Linear(32, 16, bias=False)), emulate=True, delayed=True)
    layer = model[0]
    hook = DelayedScaling(model, history_len=3, algo=algo, margin=margin, group=None)
    history: list[list[float]] = []  # per step: amax of input, weight, grad_output (max over microbatches)
    for step in range(1, 7):
        weight = layer.weight.detach().clone()
        amax = [0.0, weight.abs().max().item(), 0.0]
        for micro in range(2):
            x = torch.randn(8, 32) * (0.5 + step + 3 * micro)
            grad = torch.randn(8, 16) * 10.0 ** -(step % 3)
            out, grad_x, _ = forward_backward(model, x, grad)
            amax[0], amax[2] = max(amax[0], x.abs().max().item()), max(amax[2], grad.abs().max().item())
            if step == 1:  # no history: each tensor scaled by its own amax
                scales = [scale_of(v, m, 0) for v, m in
                          ((x.abs().max().item(), E4M3_MAX), (weight.abs().max().item(), E4M3_MAX),
                           (grad.abs().max().item(), E5M2_MAX))]
            else:
                window = history[-3:]
                pick = [max(h[i] for h in window) if algo == "max" else window[-1][i] for i in range(3)]
                scales = [scale_of(v, m, margin) for v, m in zip(pick, (E4M3_MAX, E4M3_MAX, E5M2_MAX))]
            w_q = dequantized(weight, scales[1], torch.float8_e4m3fn)
            g_q = dequantized(grad, scales[2], torch.float8_e5m2)
            assert torch.equal(out, dequantized(x, scales[0], torch.float8_e4m3fn) @ w_q.t())
            assert torch.equal(grad_x, g_q @ w_q)
        history.append(amax)
        with torch.no_grad():
            layer.weight.mul_(1.5)  # the weight's amax changes every step too
        layer.weight.grad = None
        hook.after_optimizer_step(step, torch.tensor(False))
        assert hook.history[0, :, 0].tolist() == pytest.approx(amax, rel=1e-6)
    # An evaluation (no_grad) between steps records nothing: the next step's scales do not depend on it.
    with torch.no_grad():
        model(torch.full((8, 32), 1e4))
    assert not layer.amax.any()
    # A skipped step (non-finite) records nothing.
    before = hook.history.clone()
    forward_backward(model, torch.full((8, 32), 1e4), torch.randn(8, 16))
    hook.after_optimizer_step(7, torch.tensor(True))
    assert torch.equal(hook.history, before) and not layer.amax.any()


def saved_input_bytes(model: nn.Module, x: torch.Tensor) -> int:
    """Bytes the forward saves for backward, parameters (and views of them) not counted."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x.requires_grad_())
    return sum(seen.values())


def test_fp8_saved_inputs_halve_the_bytes_saved_and_change_no_value() -> None:
    """One Linear: with float8 inputs saved for backward it keeps M*K bytes and a 4-byte scale instead of 2*M*K."""
    base = nn.Sequential(nn.Linear(64, 32, bias=False)).to(torch.bfloat16)
    bf16_saved, fp8_saved = converted(base), converted(base, save_fp8_input=True)
    x = torch.randn(4, 16, 64, dtype=torch.bfloat16)
    assert saved_input_bytes(bf16_saved, x) == 2 * x.numel()
    assert saved_input_bytes(fp8_saved, x) == x.numel() + 4
    grad = torch.randn(4, 16, 32, dtype=torch.bfloat16)
    for a, b in zip(forward_backward(bf16_saved, x, grad), forward_backward(fp8_saved, x, grad)):
        assert torch.equal(a, b)


ARGS = ["--config", DEBUG_CONFIG, "--train.seq_len=64", "--metrics.log_freq=1", "--metrics.enable_tensorboard=false",
        "--train.mixed_precision=fp8", "--checkpoint.enable=true", "--checkpoint.interval=3",
        "--scheduler.decay_type=constant"]  # the learning rate at a step does not depend on train.steps


def run(dump: Path, *overrides: str) -> list[float]:
    from trainer.run.train import train

    train(load_job_config([*ARGS, f"--job.dump_folder={dump}", *overrides]))
    return [r["loss"] for r in read_metrics(dump)]


def test_delayed_scaling_resumes_bit_exact_and_checkpoints_move_between_scalings(tmp_path: Path, caplog) -> None:
    """6 steps in one run == 3 steps, then a resume to 6 (the histories and scales come back from the checkpoint);
    the model's state_dict has no history (exports neither); a dynamic run resumes a delayed checkpoint and a
    delayed run a dynamic one, each saying what happens to the histories in one line."""
    from trainer.checkpoint.verify import load_dcp_metadata

    delayed = ["--float8.scaling=delayed", "--float8.amax_history_len=4"]
    whole = run(tmp_path / "whole", "--train.steps=6", *delayed)
    run(tmp_path / "resumed", "--train.steps=3", *delayed)
    with caplog.at_level(logging.INFO, logger="trainer"):
        resumed = run(tmp_path / "resumed", "--train.steps=6", *delayed)
    assert resumed == whole  # bit for bit: metrics.jsonl continues the first 3 steps
    keys = load_dcp_metadata(tmp_path / "whole/checkpoint/step-6/.metadata").state_dict_metadata
    assert list(keys["float8_scaling.layers.0.attention.q_proj.amax_history"].size) == [3, 4]
    assert not any(k.startswith("model.") and ("amax" in k or k.endswith(".scale")) for k in keys)

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="trainer"):
        run(tmp_path / "resumed", "--train.steps=8")  # a dynamic run from the delayed step-6 checkpoint
    assert any("FP8 amax histories (29 Linear layers) are not used" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="trainer"):
        run(tmp_path / "resumed", "--train.steps=9", *delayed)  # step-8's checkpoint was dynamic
    assert any("starts its amax histories afresh" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("override, message", [
    (["--float8.scaling=delayed", "--float8.recipe=rowwise", "--float8.format=auto"],
     "float8.scaling='delayed' is the tensorwise recipe's"),
    (["--float8.save_fp8_activations=true", "--float8.recipe=blockwise"],
     "float8.save_fp8_activations=true is the tensorwise recipe's"),
    (["--float8.scaling=Delayed"], "float8.scaling='Delayed' is not one of 'dynamic', 'delayed'"),
    (["--float8.amax_compute_algo=mean"], "float8.amax_compute_algo='mean' is not one of 'max', 'most_recent'"),
    (["--float8.amax_history_len=0"], "float8.amax_history_len=0 must be in [1, 16,384]"),
    (["--float8.amax_history_len=1000000000"], "float8.amax_history_len=1000000000 must be in [1, 16,384]"),
    (["--float8.margin=-1"], "float8.margin=-1 must be in [0, 16]"),
    (["--float8.margin=200"], "float8.margin=200 must be in [0, 16]"),
    (["--float8.margin=2000"], "float8.margin=2000 must be in [0, 16]"),
])
def test_config_errors_name_the_key_in_one_line(override: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_job_config(["--config", DEBUG_CONFIG, "--train.mixed_precision=fp8", *override])
    assert message in str(e.value) and "\n" not in str(e.value)


def test_startup_line_and_fp8_layers_json_say_delayed() -> None:
    from trainer.parallel.float8 import DelayedScalingSettings, Float8Options, float8_converters, fp8_layers_json

    options = Float8Options(recipe="tensorwise", enable_fsdp_float8_all_gather=True,
                            delayed=DelayedScalingSettings(16, "most_recent", 1), save_fp8_activations=True)
    assert float8_converters(options)[0].lines()[0].endswith(
        "scaling=delayed (amax_history_len=16, amax_compute_algo=most_recent, margin=1) for inputs and gradients; "
        "weights cast with their current amax before the fp8 all-gather, fp8 inputs saved for backward")
    assert DelayedScalingSettings().as_json() == {"scaling": "delayed", "amax_history_len": 1024,
                                                  "amax_compute_algo": "max", "margin": 0}
    layers = {"output_head.proj": "converted"}
    assert list(fp8_layers_json(options, layers).items()) == [  # fp8_layers.json, in its order
        ("recipe", "tensorwise"), ("format", "hybrid"), ("scaling", "delayed"), ("amax_history_len", 16),
        ("amax_compute_algo", "most_recent"), ("margin", 1), ("save_fp8_activations", True), ("layers", layers)]
