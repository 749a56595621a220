"""A training checkpoint is a dict of parts: each the DCP `Stateful` of one feature, owning its state.

    name            what it holds                                         its part
    model           the weights, plain tensors by clean fqn              ModelPart, here
    optimizer       AdamW's moments and steps by parameter fqn            trainer.optim.part.OptimizerPart
    lr_scheduler    the schedule's position and its arguments             trainer.optim.schedule.SchedulerPart
    dataloader      the data position (or checkpoint.restart_data)        trainer.data.loader.DataPosition
    train_state     the step, tokens trained, the precision saved with    trainer.run.train_state.TrainState
    loss_scaler     fp16's loss scale                                     trainer.run.step.LossScalerPart
    rng             the process's random generators                       RngPart, here
    float8_scaling  FP8 delayed scaling's amax histories and scales       DelayedScalingPart, here (the hook's own state)

The run builds the dict (trainer/run/train.py); `CheckpointState` saves `{name: part.state_dict()}` (a part with nothing
to save is left out): tensors through DCP as `{name}.{key}`, every other value into state.json
(trainer/checkpoint/state.py). A resume loads the same parts in the same order.

A part may also reconcile a resume across configs (moments saved in another dtype, delayed scaling on or off, a
precision schedule's next phase): `reconcile(sd, saved) -> str | None` is called before the load with the state
dict the part just gave and the checkpoint's DCP entries under its name (`saved`: {key after "{name}.":
metadata}). It may change `sd` to ask only for what it can take (stage an entry in the checkpoint's dtype, drop one
the checkpoint lacks; emptied, the part loads nothing and its `load_state_dict` is not called) and returns a line
for the log. Its `load_state_dict` then gets what was loaded, and finishes what `reconcile` started.

Every value a part loads is checked before any part takes it (trainer/tensor_values.py): a floating tensor must be
finite, and a part may say more of each tensor with `tensor_rule(key, *, step) -> TensorRule | None` (`key` after
"{name}.", `step` the checkpoint's): a range (AdamW's second moment >= 0, its step a whole number up to the
checkpoint's), the dtypes its file may hold, a generator state torch takes. The manager checks the stored dtypes
against the index before any tensor is read and the values once DCP has loaded them, and names the checkpoint and
the key in one line.

What the index check expects of each DCP entry is the checkpoint's format (trainer/checkpoint/format.py), so a
checkpoint is checked the same with or without the run that wrote it: model entries have the model's shapes;
per-parameter state (`{name}.state.{fqn}.{key}`) is a scalar `step`, a tensor of its parameter's shape, or the block
scales of an e4m3 one; a part's other tensors are compared by DCP with the tensors the part loads them into.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import set_model_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from trainer.checkpoint.state import model_state_dict
from trainer.tensor_values import FINITE, TensorRule


@runtime_checkable
class Reconciles(Protocol):
    """A part that reconciles a resume across configs (see the module docstring)."""

    def reconcile(self, sd: dict[str, Any], saved: dict[str, TensorStorageMetadata]) -> str | None: ...


@runtime_checkable
class ValueRules(Protocol):
    """A part that says what its loaded tensors' values must be (see the module docstring)."""

    def tensor_rule(self, key: str, *, step: int) -> TensorRule | None: ...


class StepPart(Protocol):
    """What the checkpoint reads of the run's train-state part (trainer.run.train_state.TrainState): the step it
    resumed at and the precision that step was saved with."""

    step: int
    resumed_mixed_precision: str | None


class CheckpointState(Stateful):
    """The one object a resume loads: the run's parts (the model's first), in the order they load."""

    def __init__(self, model: nn.Module, parts: dict[str, Stateful]):
        self.model = model
        self.parts: dict[str, Stateful] = {"model": ModelPart(model), **parts}

    @property
    def train_state(self) -> StepPart:
        """The part that knows the step (trainer.run.train_state.TrainState)."""
        return self.parts["train_state"]

    def state_dict(self) -> dict[str, Any]:
        return {name: sd for name, part in self.parts.items() if (sd := part.state_dict())}

    def reconcile(self, sd: dict[str, Any], entries: dict[str, TensorStorageMetadata]) -> list[str]:
        """Each part's reconcile with this run's `sd` (about to be loaded) and its share of the checkpoint's DCP
        entries; the lines to log."""
        notes = []
        for name, part in self.parts.items():
            if not isinstance(part, Reconciles):
                continue
            prefix = f"{name}."
            part_sd = sd.get(name, {})
            if note := part.reconcile(part_sd, {k[len(prefix):]: md for k, md in entries.items()
                                                 if k.startswith(prefix)}):
                notes.append(note)
            if not part_sd:
                sd.pop(name, None)
        return notes

    def tensor_rules(self, tensors: dict[str, Any], *, step: int) -> dict[str, tuple[torch.Tensor, TensorRule]]:
        """{DCP key: (tensor, its rule)} of the tensors about to be loaded (`tensors`: split_tensors' nested dicts by
        part name): each part's rule, else finite for a floating tensor (module docstring)."""
        rules = {}
        for name, part_tensors in tensors.items():
            part = self.parts[name]
            for key, t in _flat(part_tensors):
                rule = part.tensor_rule(key, step=step) if isinstance(part, ValueRules) else FINITE
                if rule is not None:
                    rules[f"{name}.{key}"] = (t, rule)
        return rules

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        for name, part in self.parts.items():
            if name in sd:
                part.load_state_dict(sd[name])


def _flat(tree: dict[str, Any], prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    """(dotted key, tensor) of nested dicts of tensors: DCP's keys of them."""
    out = []
    for key, value in tree.items():
        out += _flat(value, f"{prefix}{key}.") if isinstance(value, dict) else [(f"{prefix}{key}", value)]
    return out


class ModelPart:
    """The model's weights by clean fqn, as plain tensors (`model_state_dict`: DCP loads into them in place)."""

    def __init__(self, model: nn.Module):
        self.model = model

    def state_dict(self) -> dict[str, torch.Tensor]:
        return model_state_dict(self.model)

    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        set_model_state_dict(self.model, sd)  # the tensors were loaded in place by DCP; this checks every key is there


class RngPart:
    """The CPU's and the GPU's random generators. Every rank seeds the same and draws the same numbers, so one RNG
    state serves all layouts."""

    def state_dict(self) -> dict[str, torch.Tensor]:
        rng = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state()
        return rng

    def reconcile(self, sd: dict[str, Any], saved: dict[str, TensorStorageMetadata]) -> str | None:
        if "cuda" not in saved:
            sd.pop("cuda", None)  # saved on a machine without CUDA
        return None

    def tensor_rule(self, key: str, *, step: int) -> TensorRule:
        """A byte tensor the generator of its device takes (torch refuses an all-zero mt19937 state with a
        traceback, and DCP would cast another dtype into the bytes)."""
        return TensorRule(dtypes=(torch.uint8,), accepts=_generator_takes_cuda if key == "cuda" else _generator_takes,
                          why=f"the {key.upper()} random generator's state")

    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        torch.set_rng_state(sd["cpu"])
        if "cuda" in sd and torch.cuda.is_available():
            torch.cuda.set_rng_state(sd["cuda"])


def _generator_takes(state: torch.Tensor, device: str = "cpu") -> str | None:
    """What a fresh generator of `device` says of `state`, or None when it takes it (nothing global changes)."""
    try:
        torch.Generator(device=device).set_state(state.cpu())
    except (RuntimeError, TypeError, ValueError) as e:
        return str(e).splitlines()[0] if str(e) else type(e).__name__
    return None


def _generator_takes_cuda(state: torch.Tensor) -> str | None:
    """A CUDA generator's answer; None without CUDA (the state is then not loaded: RngPart.load_state_dict)."""
    return _generator_takes(state, "cuda") if torch.cuda.is_available() else None


class DelayedScalingPart:
    """float8.scaling='delayed': the amax histories and scales of the hook that keeps them (`scaling`, any Stateful
    whose state is {fqn: {"amax_history", "scale"}}: trainer.parallel.float8's DelayedScaling), saved as
    `float8_scaling.{fqn}.{amax_history,scale}`. A run without delayed scaling (`scaling` None) saves none and leaves a
    checkpoint's unused; a delayed run starts its histories afresh from a checkpoint without them, or with them for
    other layers or another history length. Each case says so in one line."""

    def __init__(self, scaling: Stateful | None):
        self.scaling = scaling

    def state_dict(self) -> dict[str, Any]:
        return self.scaling.state_dict() if self.scaling is not None else {}

    def reconcile(self, sd: dict[str, Any], saved: dict[str, TensorStorageMetadata]) -> str | None:
        if not sd:
            return (f"float8.scaling: the checkpoint's FP8 amax histories ({len(saved) // 2} Linear layers) are not "
                    "used: this run has float8.scaling='dynamic' (or no fp8); a later delayed run from its checkpoints "
                    "starts them afresh") if saved else None
        wanted = {f"{fqn}.{name}": t for fqn, entry in sd.items() for name, t in entry.items()}
        if all(k in saved and tuple(saved[k].size) == tuple(t.shape) for k, t in wanted.items()):
            return None
        sd.clear()
        why = ("has none (saved with float8.scaling='dynamic' or without fp8)" if not saved else
               "has them for other layers or another float8.amax_history_len")
        return (f"float8.scaling: the checkpoint {why}: float8.scaling='delayed' starts its amax histories afresh, "
                "the first resumed step scaled by each tensor's own amax")

    def tensor_rule(self, key: str, *, step: int) -> TensorRule | None:
        """The hook's rule for its histories and scales (trainer.parallel.float8.delayed), else finite."""
        return self.scaling.tensor_rule(key, step=step) if isinstance(self.scaling, ValueRules) else FINITE

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        assert self.scaling is not None
        self.scaling.load_state_dict(sd)
