"""trainer/run/step.py: gradient accumulation, the grad norm, clipping, the non-finite skip and fp16 loss scaling.

The unit tests drive TrainStep on a two-layer fp32 model (no process group: plain tensors; the grad norm is
computed in fp32, which takes no float64 gradients), so each comparison with a hand computation holds to fp32
rounding; the last two run the debug model's Trainer.
"""

from __future__ import annotations

import functools
import logging
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.helpers import DEBUG_CONFIG
from trainer.config import load_job_config
from trainer.data import DataError, write_shard
from trainer.data.tokenizer import ByteTokenizer
from trainer.distributed import destroy_distributed
from trainer.optim.adamw import AdamW
from trainer.run.step import LossScaler, NonFiniteError, StepResult, TrainStep, grad_norm
from trainer.run.train import Trainer, build_trainer

VOCAB, DIM = 11, 6
# fp32 means over 20-40 tokens, summed in another order: a few eps (1.2e-7) of values of order 0.01-1.
TIGHT = dict(rtol=1e-6, atol=1e-7)
# A weight's move read as the difference of two fp32 weights (|w| up to ~4, N(0, 1) embeddings): 4 x eps absolute.
MOVE = dict(rtol=1e-6, atol=5e-7)


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Embedding(VOCAB, DIM), nn.Linear(DIM, VOCAB))


def _loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The mean over the valid labels (F.cross_entropy's mean; -100 is ignored)."""
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


class _SumLoss:
    """What TrainStep calls (trainer.loss.LossFn's interface): `.sum` is the summed loss of the valid labels."""

    def sum(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")

    __call__ = staticmethod(_loss_fn)


def _batch(rows: int, seq: int = 5, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (rows, seq + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, *, max_norm: float = 0.0, fused: bool = False,
          scaler: LossScaler | None = None) -> TrainStep:
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    return TrainStep(model=model, loss_fn=_SumLoss(), optimizer=optimizer, scheduler=scheduler,
                     scaler=scaler or LossScaler(enabled=False, device=torch.device("cpu")), max_norm=max_norm,
                     fused=fused, device=torch.device("cpu"))


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def test_accumulated_microbatches_give_the_gradient_and_loss_of_one_large_batch() -> None:
    inputs, labels = _batch(8)
    whole, split = _model(), _model()
    loss_whole = _step(whole, torch.optim.SGD(whole.parameters(), lr=0.1)).forward_backward([(inputs, labels)])
    micro = [(inputs[i:i + 2], labels[i:i + 2]) for i in range(0, 8, 2)]
    loss_split = _step(split, torch.optim.SGD(split.parameters(), lr=0.1)).forward_backward(micro)
    # Equal-sized microbatches: the mean of their means is the mean over the batch, and so are the gradients.
    torch.testing.assert_close(loss_split, loss_whole, **TIGHT)
    for a, b in zip(_grads(split), _grads(whole)):
        torch.testing.assert_close(a, b, **TIGHT)


def test_microbatches_of_different_valid_token_counts_give_the_mean_over_every_valid_token() -> None:
    """Masked labels (-100: the token after an EOS, padding) leave 8, 1, 5 and 10 valid tokens in four microbatches
    of 10: the step's loss and gradients are those of one batch's mean over its 24 valid tokens, not the mean of the
    four microbatch means (6.6% lower on this batch)."""
    inputs, labels = _batch(8)
    labels = labels.clone()
    for row, masked in enumerate([1, 1, 5, 4, 0, 5, 0, 0]):  # rows 2i and 2i+1 form microbatch i
        labels[row, :masked] = -100
    whole, split = _model(), _model()
    micro = [(inputs[i:i + 2], labels[i:i + 2]) for i in range(0, 8, 2)]
    loss = _step(split, torch.optim.SGD(split.parameters(), lr=0.1)).forward_backward(micro)
    reference = _loss_fn(whole(inputs), labels)
    reference.backward()
    torch.testing.assert_close(loss, reference.detach(), **TIGHT)
    for a, b in zip(_grads(split), _grads(whole)):
        torch.testing.assert_close(a, b, **TIGHT)
    with torch.no_grad():
        mean_of_means = torch.stack([_loss_fn(whole(x), y) for x, y in micro]).mean()
    assert abs(mean_of_means / reference - 1) > 0.05  # what the old average gave: the test tells them apart


def test_grad_norm_is_the_l2_norm_over_every_gradient_and_skips_parameters_without_one() -> None:
    params = [nn.Parameter(torch.zeros(3, 4)), nn.Parameter(torch.zeros(5)), nn.Parameter(torch.zeros(2))]
    params[0].grad = torch.arange(12.0).view(3, 4)
    params[1].grad = torch.full((5,), -2.0)
    # params[2] has no gradient (a frozen or unused parameter): it adds nothing.
    hand = math.sqrt(sum(i * i for i in range(12)) + 5 * 4.0)
    norm = grad_norm(params)
    assert norm.item() == pytest.approx(hand, rel=1e-6)  # fp32 result: ~6e-8 relative rounding


@pytest.mark.parametrize("max_norm", [0.05, 1e9, 0.0])
def test_clipping_scales_the_update_to_max_norm(max_norm: float) -> None:
    """SGD with lr=1 moves each weight by exactly its (clipped) gradient: the move is checked against
    g * min(1, max_norm / ||g||) computed here; max_norm=0 turns clipping off."""
    model = _model()
    step = _step(model, torch.optim.SGD(model.parameters(), lr=1.0), max_norm=max_norm)
    before = [p.detach().clone() for p in model.parameters()]
    step.forward_backward([_batch(4)])
    grads = _grads(model)
    hand_norm = math.sqrt(sum(float((g * g).sum()) for g in grads))
    norm, found_inf = step.optimizer_step(1)
    assert norm.item() == pytest.approx(hand_norm, rel=1e-6) and not found_inf
    factor = min(1.0, max_norm / hand_norm) if max_norm > 0 else 1.0
    assert (factor < 1.0) == (max_norm == 0.05)  # the small max_norm really clips, the others do not
    for p, p0, g in zip(model.parameters(), before, grads):
        # The fp32 clip factor is ~1e-7 relative; the difference of two weights keeps their own rounding.
        torch.testing.assert_close(p0 - p.detach(), g * factor, **MOVE)
    assert all(p.grad is None for p in model.parameters())  # gradients freed for the next step


def test_fused_clipping_equals_clipping_the_gradients_first() -> None:
    """The fused AdamW gets the clip factor as grad_scale; torch's AdamW on gradients clipped here must agree."""
    ours, ref = _model(), _model()
    kw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    step = _step(ours, AdamW(ours.parameters(), implementation="fused", **kw), max_norm=0.05, fused=True)
    reference = torch.optim.AdamW(ref.parameters(), **kw)
    for seed in range(3):
        batch = _batch(4, seed=seed)
        step.forward_backward([batch])
        step.optimizer_step(seed + 1)
        _loss_fn(ref(batch[0]), batch[1]).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        reference.step()
        reference.zero_grad()
    for p, q in zip(ours.parameters(), ref.parameters()):
        # Adam's update divides by sqrt(v): relative rounding of the fp32 clip factor (~1e-7) reaches the weights.
        torch.testing.assert_close(p, q, **TIGHT)


@pytest.mark.parametrize("fused", [True, False])
def test_a_non_finite_gradient_skips_the_whole_update(fused: bool) -> None:
    model = _model()
    opt_cls = functools.partial(AdamW, implementation="fused") if fused else torch.optim.AdamW
    step = _step(model, opt_cls(model.parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1),
                 max_norm=1.0, fused=fused)
    step([_batch(4)], 1)  # one good step: the optimizer has state
    before = [p.detach().clone() for p in model.parameters()]
    state_before = {k: v.clone() for k, v in step.optimizer.state[model[1].weight].items()}
    with torch.no_grad():
        model[1].bias[0] = float("nan")  # every logit row: a NaN loss and NaN gradients
    bad = step([_batch(4, seed=2)], 2)
    assert isinstance(bad, StepResult) and bool(bad.found_inf) and not math.isfinite(bad.grad_norm.item())
    assert math.isnan(bad.loss.item())
    for p, p0 in zip(list(model.parameters())[:2], before[:2]):  # the weights the NaN did not touch
        assert torch.equal(p, p0)
    state = step.optimizer.state[model[1].weight]
    for key, value in state_before.items():  # the moments and the step counter stay as they were
        assert torch.equal(state[key], value), key


def test_check_finite_stops_naming_the_step_or_skips_and_counts(caplog) -> None:
    model = _model()
    step = _step(model, torch.optim.SGD(model.parameters(), lr=0.1))
    one = torch.tensor(1.0)  # the step's valid labels
    step._pending_norms[:] = [(1, torch.tensor(2.0), one), (2, torch.tensor(float("inf")), one),
                              (3, torch.tensor(1.0), one)]
    with pytest.raises(NonFiniteError, match=r"^non-finite loss or gradient at step 2 \(grad_norm=inf\).*"
                                             r"train.on_nonfinite='skip'"):
        step.check_finite(on_nonfinite="stop", record=lambda: None)
    counted = []
    step._pending_norms[:] = [(4, torch.tensor(float("nan")), one), (5, torch.tensor(1.0), one),
                              (6, torch.tensor(-math.inf), one)]
    with caplog.at_level(logging.WARNING, logger="trainer"):
        assert step.check_finite(on_nonfinite="skip", record=lambda: counted.append(1)) == 2
    assert len(counted) == 2
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == [
        "non-finite loss or gradient at step 4", "non-finite loss or gradient at step 6"]
    assert step.check_finite(on_nonfinite="stop", record=lambda: None) == 0  # the pending norms were read once


@pytest.mark.parametrize("fused", [True, False])
def test_a_step_with_no_valid_label_is_skipped_and_stops_the_run(fused: bool) -> None:
    """Every label masked (data.eod_mask_loss on end-of-document tokens alone): the loss reads 0 and AdamW would still
    move every weight by its momentum and weight decay. The step is skipped on the device like a non-finite one (the
    weights and moments stay), and the next check stops the run in one line naming it; a microbatch with no label
    beside one with labels trains as before."""
    model = _model()
    opt_cls = functools.partial(AdamW, implementation="fused") if fused else torch.optim.AdamW
    step = _step(model, opt_cls(model.parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1),
                 fused=fused)
    inputs, labels = _batch(4, seed=2)
    masked = torch.full_like(labels, -100)
    step([(inputs, masked), _batch(4)], 1)  # one microbatch without labels, one with: a step like any other
    before = [p.detach().clone() for p in model.parameters()]
    state_before = {k: v.clone() for k, v in step.optimizer.state[model[1].weight].items()}
    result = step([(inputs, masked)], 2)
    assert bool(result.found_inf) and result.loss.item() == 0.0
    assert all(torch.equal(p, p0) for p, p0 in zip(model.parameters(), before))
    assert all(torch.equal(step.optimizer.state[model[1].weight][k], v) for k, v in state_before.items())
    with pytest.raises(DataError, match=r"^step 2 has nothing to learn from: every label of its global batch is "
                                        r"masked \(IGNORE_INDEX; data.eod_mask_loss .*\), and it was skipped; check "
                                        r"the data and data.eod_mask_loss"):
        step.check_finite(on_nonfinite="skip", record=lambda: None)
    assert step.check_finite(on_nonfinite="stop", record=lambda: None) == 0  # read once


def test_a_run_on_end_of_document_tokens_alone_stops_at_step_1(tmp_path: Path) -> None:
    """data.eod_mask_loss on shards of EOS tokens only: the run logged loss 0.0000 for every step and exited 0; now
    step 1 stops it with the DataError (exit 2 on the command line), before any metric or checkpoint is written."""
    data = tmp_path / "data"
    data.mkdir()
    write_shard(data / "a.bin", np.full(4_000, ByteTokenizer.eos_id), vocab_size=ByteTokenizer.vocab_size,
                tokenizer_fingerprint=ByteTokenizer.fingerprint)
    cfg = load_job_config(["--config", DEBUG_CONFIG, "--train.steps=3", "--train.seq_len=32", "--data.source=shards",
                           f"--data.path={data}", "--data.eod_mask_loss=true", "--checkpoint.enable=true",
                           "--checkpoint.interval=1", f"--job.dump_folder={tmp_path / 'run'}",
                           "--metrics.enable_tensorboard=false"])
    trainer = build_trainer(cfg)
    try:
        before = trainer.model.tok_embeddings.weight.to_local().clone()
        with pytest.raises(DataError, match=r"^step 1 has nothing to learn from"):
            trainer.run()
        assert torch.equal(before, trainer.model.tok_embeddings.weight.to_local())
    finally:
        trainer.close()
        destroy_distributed()
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == ""
    assert not (tmp_path / "run" / "checkpoint").exists() or not any((tmp_path / "run" / "checkpoint").iterdir())


def test_fp16_overflow_halves_the_scale_and_is_not_counted_as_non_finite(caplog) -> None:
    model = _model()
    scaler = LossScaler(enabled=True, device=torch.device("cpu"), init_scale=2.0**10, growth_interval=3)
    step = _step(model, torch.optim.SGD(model.parameters(), lr=1.0), scaler=scaler)
    batch = _batch(4)
    before = [p.detach().clone() for p in model.parameters()]
    step.forward_backward([batch])
    scaled = _grads(model)
    reference = _model()
    _loss_fn(reference(batch[0]), batch[1]).backward()
    for g, r in zip(scaled, _grads(reference)):  # the backward ran on loss x scale
        torch.testing.assert_close(g, r * 2.0**10, **TIGHT)
    norm, _ = step.optimizer_step(1)
    hand = math.sqrt(sum(float((r * r).sum()) for r in _grads(reference)))
    assert norm.item() == pytest.approx(hand, rel=1e-6)  # reported without the loss scale
    for p, p0, r in zip(model.parameters(), before, _grads(reference)):  # the update used unscaled gradients
        torch.testing.assert_close(p0 - p.detach(), r, **MOVE)
    step._pending_norms[:] = [(2, torch.tensor(float("inf")), torch.tensor(1.0))]
    scaler.update(torch.tensor(True))
    counted = []
    with caplog.at_level(logging.WARNING, logger="trainer"):
        assert step.check_finite(on_nonfinite="stop", record=lambda: counted.append(1)) == 1  # no raise
    assert counted == [] and "fp16 overflow" in caplog.text and "loss scale now 512" in caplog.text


def test_loss_scaler_halves_on_overflow_and_doubles_after_growth_interval_good_steps() -> None:
    scaler = LossScaler(enabled=True, device=torch.device("cpu"), init_scale=8.0, growth_interval=2)
    scales = []
    for inf in [False, True, False, False, False, False]:
        scaler.update(torch.tensor(inf))
        scales.append(scaler.scale.item())
    # An overflow halves and restarts the count; every 2nd good step in a row doubles.
    assert scales == [8.0, 4.0, 4.0, 8.0, 8.0, 16.0]
    restored = LossScaler(enabled=True, device=torch.device("cpu"))
    scaler.update(torch.tensor(False))
    restored.load_state_dict(scaler.state_dict())
    assert restored.state_dict() == {"scale": 16.0, "good_steps": 1}
    off = LossScaler(enabled=False, device=torch.device("cpu"))
    off.update(torch.tensor(True))
    assert off.scale.item() == 1.0  # bf16/fp8/fp32 runs never scale


def _trainer_with_nan(tmp_path: Path, on_nonfinite: str) -> Trainer:
    cfg = load_job_config(["--config", DEBUG_CONFIG, "--train.steps=3", "--train.seq_len=32", "--metrics.log_freq=1",
                           f"--train.on_nonfinite={on_nonfinite}", f"--job.dump_folder={tmp_path}",
                           "--metrics.enable_tensorboard=false"])
    trainer = build_trainer(cfg)
    weight = trainer.model.layers["1"].mlp.up_proj.weight
    with torch.no_grad():
        weight.to_local()[0, 0] = float("nan")
    return trainer


def test_nonfinite_stops_naming_the_step(tmp_path: Path) -> None:
    trainer = _trainer_with_nan(tmp_path, "stop")
    try:
        with pytest.raises(NonFiniteError, match=r"non-finite loss or gradient at step 1 .*train.on_nonfinite='skip'"):
            trainer.run()
    finally:
        trainer.close()
        destroy_distributed()


def test_nonfinite_skip_counts_and_keeps_weights(tmp_path: Path) -> None:
    """Every step skipped: no optimizer update reached the weights, and the run says it trained nothing instead of
    finishing as a success (issue 39 item 5: it exited 0)."""
    trainer = _trainer_with_nan(tmp_path, "skip")
    try:
        before = trainer.model.tok_embeddings.weight.to_local().clone()
        with pytest.raises(NonFiniteError, match=r"^every one of this run's 3 steps had a non-finite loss or gradient "
                                                 r"and was skipped \(train.on_nonfinite='skip'\): nothing was trained"):
            trainer.run()
        assert torch.equal(before, trainer.model.tok_embeddings.weight.to_local())
        assert trainer.metrics.num_nonfinite == 3
    finally:
        trainer.close()
        destroy_distributed()
