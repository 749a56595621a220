"""train.ema_decay (trainer/checkpoint/ema.py), one process: the average equals one computed by hand in float64, a
skipped step leaves it, swapping it in restores the weights bit for bit; the key is checked in one line; the memory
plan has its row."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from trainer.checkpoint.ema import EMAPart, EMAWeights
from trainer.config import load_job_config
from trainer.errors import ConfigError
from trainer.validate import validate_job
from tests.helpers import FAST


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
    model[1].weight = nn.Parameter(model[1].weight[:, :16])  # a parameter of its own; names below are clean
    return model


def test_ema_equals_the_average_by_hand_and_a_skipped_step_leaves_it() -> None:
    model, decay = _model(), 0.75
    ema = EMAWeights(model, decay=decay)
    reference = {k: p.detach().double().clone() for k, p in model.named_parameters()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(1, 5):
        optimizer.zero_grad()
        model(torch.randn(3, 8)).square().mean().backward()
        optimizer.step()
        skipped = step == 3  # a non-finite step: the optimizer skipped it, the average must too
        ema.after_optimizer_step(step, torch.tensor(skipped))
        if not skipped:
            reference = {k: decay * reference[k] + (1 - decay) * p.detach().double()
                         for k, p in model.named_parameters()}
    assert set(ema.ema) == set(reference)
    for k, ref in reference.items():
        assert ema.ema[k].dtype == torch.float32
        torch.testing.assert_close(ema.ema[k].double(), ref, rtol=1e-6, atol=1e-7)
        assert not torch.equal(ema.ema[k], dict(model.named_parameters())[k].detach())  # an average, not the weights


def test_swapped_in_holds_the_average_and_restores_the_weights_bit_for_bit() -> None:
    model = _model()
    ema = EMAWeights(model, decay=0.5)
    trained = {k: p.detach().clone() for k, p in model.named_parameters()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) / 3)  # weights that are not the average
    ema.after_optimizer_step(1, torch.tensor(False))
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    with ema.swapped_in():
        for k, p in model.named_parameters():
            assert torch.equal(p, ema.ema[k])
            torch.testing.assert_close(p, (trained[k] + before[k]) / 2)
    for k, p in model.named_parameters():
        assert torch.equal(p, before[k])


def test_what_derives_from_the_weights_is_refreshed_after_each_swap() -> None:
    """fp8 all-gather's precomputed scales (Float8ScalePrecompute.refresh, wired by the trainer) follow the weights:
    recomputed from the average once it is in, and from the trained weights once they are back."""
    model = _model()
    ema = EMAWeights(model, decay=0.5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    ema.after_optimizer_step(1, torch.tensor(False))
    seen: list[torch.Tensor] = []
    ema.after_swap = [lambda: seen.append(model[0].weight.detach().clone())]
    trained = model[0].weight.detach().clone()
    with ema.swapped_in():
        assert len(seen) == 1 and torch.equal(seen[0], ema.ema["0.weight"])
    assert len(seen) == 2 and torch.equal(seen[1], trained)


@pytest.mark.parametrize("decay", ["1.0", "-0.1", "1.5"])
def test_ema_decay_out_of_range_is_one_line_naming_the_key(decay: str) -> None:
    with pytest.raises(ConfigError, match=r"^train\.ema_decay=.* must be in \[0, 1\)") as e:
        validate_job(load_job_config([*FAST, f"--train.ema_decay={decay}"]), world_size=1)
    assert "\n" not in str(e.value)


def test_memory_plan_has_the_ema_row() -> None:
    plain = validate_job(load_job_config(FAST), world_size=1).memory_plan
    plan = validate_job(load_job_config([*FAST, "--train.ema_decay=0.99"]), world_size=1).memory_plan
    rows = {r.what: r for r in plan.rows}
    assert rows["EMA weights"].bytes == plan.params_per_rank * 4, plan.table()
    assert "EMA weights" not in {r.what for r in plain.rows}
    assert plan.optimizer_step_bytes == plain.optimizer_step_bytes + plan.params_per_rank * 4


def test_a_new_run_starts_from_its_loaded_weights_and_a_resume_keeps_the_saved_average() -> None:
    """The average of a new run is the weights of its first step (after checkpoint.initial_load_path's load); a
    checkpoint's average, once loaded, is kept; a checkpoint without one starts it from the resumed weights."""
    model = _model()
    ema = EMAWeights(model, decay=0.9)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # weights loaded after the average was built
    with ema.step_context(1):
        pass
    assert all(torch.equal(ema.ema[k], p) for k, p in model.named_parameters())
    part = EMAPart(ema)
    sd = part.state_dict()
    assert part.reconcile(sd, {k: None for k in sd}) is None and sd  # the checkpoint has it: loaded in place
    ema.restart = True
    part.load_state_dict(sd)
    assert ema.restart is False
    sd = part.state_dict()
    assert "has no EMA weights" in part.reconcile(sd, {}) and not sd and ema.restart
    assert "are not used" in EMAPart(None).reconcile({}, {"x": None})
