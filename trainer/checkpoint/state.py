"""What a checkpoint holds: the one `Stateful` a resume loads, the run description, and the tensor/JSON split.

Resuming is one `Stateful`, `CheckpointState`: model, optimizer, LR schedule, data
position, RNG, loss scale and the trainer's `TrainState`. The model is saved as plain
tensors (torchao's float8 all-gather wrapper is unwrapped, sharing storage), so keys
and dtypes are the same for bf16 and fp8 runs and a checkpoint loads in a process that
never imported torchao. DCP reshards on load: a checkpoint saved at one parallel
layout loads at any other.

Only tensors go through DCP. Every other value (step, data position, schedule and
optimizer settings) is JSON in `state.json` (`split_tensors`/`merge_tensors`): DCP would
pickle them, and unpickling a file someone else wrote can run code.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from trainer.distributed import plain_tensor
from trainer.checkpoint.format import TOKENIZER_FILE
from trainer.models.llama import ModelArgs, RopeScaling

logger = logging.getLogger("trainer.checkpoint")

_JSON_SCALARS = (str, int, float, bool, type(None))


def model_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Sharded model state by clean fqn (no `_orig_mod.`/`_checkpoint_wrapped_module.`), plain tensors.

    The values share storage with the parameters, so DCP loads into them in place.
    """
    return {k: plain_tensor(v) for k, v in get_model_state_dict(model).items()}


def split_tensors(tree: dict[str, Any], path: str = "") -> tuple[dict[str, Any], dict[str, Any]]:
    """(the nested dicts holding only tensors, everything else): the first goes to DCP, the second to JSON.

    Tensors may only sit in dicts (asserted), so `merge_tensors` puts them back exactly.
    """
    tensors: dict[str, Any] = {}
    rest: dict[str, Any] = {}
    for key, value in tree.items():
        where = f"{path}{key}"
        assert isinstance(key, str), f"state key {where!r} is not a string"
        if isinstance(value, torch.Tensor):
            tensors[key] = value
        elif isinstance(value, dict):
            t, r = split_tensors(value, where + ".")
            if t:
                tensors[key] = t
            if r or not t:
                rest[key] = r
        else:
            rest[key] = _json_value(value, where)
    return tensors, rest


def _json_value(value: Any, where: str) -> Any:
    if isinstance(value, _JSON_SCALARS):
        return value
    if isinstance(value, (list, tuple)):
        return [_json_value(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        assert all(isinstance(k, str) for k in value), f"state {where!r} has a non-string key"
        return {k: _json_value(v, f"{where}.{k}") for k, v in value.items()}
    raise AssertionError(f"state {where!r} is a {type(value).__name__}: checkpoints hold only tensors and JSON values")


def merge_tensors(tensors: dict[str, Any], rest: dict[str, Any]) -> dict[str, Any]:
    """The inverse of `split_tensors`."""
    out = dict(rest)
    for key, value in tensors.items():
        out[key] = merge_tensors(value, rest.get(key, {})) if isinstance(value, dict) else value
    return out


@dataclass
class CheckpointState(Stateful):
    """The one object a resume loads: everything that makes step k+1 identical to an uninterrupted run."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    data_loader: Any  # TokenDataLoader
    train_state: Any  # trainer.train_state.TrainState
    loss_scaler: Any  # trainer.train.LossScaler
    restart_data: bool = False
    """Leave the data loader at its start on load (checkpoint.restart_data)."""
    float8_scaling: Any = None
    """float8.scaling='delayed': the amax histories and scales (trainer.parallel.float8.delayed.DelayedScaling), saved
    as `float8_scaling.{fqn}.{amax_history,scale}`; None in other runs, which neither save nor read them."""

    def state_dict(self) -> dict[str, Any]:
        optimizer = get_optimizer_state_dict(self.model, self.optimizer)
        optimizer["state"] = {
            fqn: {k: plain_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in s.items()}
            for fqn, s in optimizer["state"].items()
        }
        # Every rank seeds the same and draws the same numbers, so one RNG state serves all layouts.
        rng = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state()
        return {
            "model": model_state_dict(self.model),
            "optimizer": optimizer,
            "lr_scheduler": self.scheduler.state_dict(),
            "dataloader": self.data_loader.state_dict(),
            "train_state": self.train_state.state_dict(),
            "loss_scaler": self.loss_scaler.state_dict(),
            "rng": rng,
        } | ({"float8_scaling": self.float8_scaling.state_dict()} if self.float8_scaling is not None else {})

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        # The model tensors were loaded in place by DCP; set_* also checks every key is there.
        set_model_state_dict(self.model, sd["model"])
        config_groups = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        set_optimizer_state_dict(self.model, self.optimizer, sd["optimizer"])
        self._keep_config_hyperparameters(config_groups)
        self._load_scheduler(sd["lr_scheduler"])
        if self.restart_data:
            logger.info("checkpoint.restart_data=true: the data starts over (the checkpoint's data position, %s "
                        "samples in, is not used)", sd["dataloader"].get("consumed_samples"))
        else:
            self.data_loader.load_state_dict(sd["dataloader"])
        self.train_state.load_state_dict(sd["train_state"])
        if self.loss_scaler.enabled and sd["train_state"].get("mixed_precision") == "fp16":
            self.loss_scaler.load_state_dict(sd["loss_scaler"])  # otherwise the scaler keeps its initial scale
        if "float8_scaling" in sd:  # absent: a checkpoint without histories (reconcile_float8_scaling said so)
            self.float8_scaling.load_state_dict(sd["float8_scaling"])
        torch.set_rng_state(sd["rng"]["cpu"])
        if "cuda" in sd["rng"] and torch.cuda.is_available():
            torch.cuda.set_rng_state(sd["rng"]["cuda"])

    def _keep_config_hyperparameters(self, config_groups: list[dict]) -> None:
        # The config is the source of truth for hyperparameters (a cooldown relaunch may
        # change them); the checkpoint only supplies the optimizer's moments and step counts.
        changed = set()
        for group, config in zip(self.optimizer.param_groups, config_groups):
            for key, value in config.items():
                saved = group.get(key)
                if isinstance(value, tuple) and isinstance(saved, list):
                    saved = tuple(saved)  # JSON has no tuples (Adam's betas)
                if key != "lr" and saved != value:
                    changed.add(f"{key} {saved} -> {value}")
                group[key] = value
        if changed:
            logger.warning("optimizer settings differ from the checkpoint; using this run's: %s",
                           ", ".join(sorted(changed)))

    def _load_scheduler(self, saved: dict[str, Any]) -> None:
        s = self.scheduler
        config_base_lrs = list(s.base_lrs)
        saved_lr = saved.get("_last_lr")
        saved = dict(saved)
        saved_schedule, schedule = saved.pop("schedule", None), getattr(s, "schedule", None)
        s.load_state_dict({**saved, "base_lrs": config_base_lrs})
        # The lr of the next step from this run's schedule at the saved position; the same
        # expression LambdaLR uses, so an unchanged config gives the bit-identical lr.
        lrs = [base * fn(s.last_epoch) for base, fn in zip(s.base_lrs, s.lr_lambdas)]
        for group, lr in zip(self.optimizer.param_groups, lrs):
            group["lr"] = lr
        s._last_lr = lrs
        if saved_lr is not None and list(saved_lr) != lrs:
            logger.warning("learning rate at step %d is %.3e from this run's schedule (the checkpoint's run had "
                           "%.3e): %s", s.last_epoch, lrs[0], saved_lr[0],
                           _schedule_changes(saved_schedule, schedule, saved.get("base_lrs"), config_base_lrs))


def reconcile_float8_scaling(sd: dict[str, Any], saved: dict[str, Any]) -> str | None:
    """Make `sd` (this run's state, to be loaded) ask only for the FP8 amax histories the checkpoint holds (`saved`:
    DCP's metadata by key); returns the one line to log when the two runs' float8.scaling differ, else None."""
    prefix = "float8_scaling."
    saved_keys = {k: md for k, md in saved.items() if k.startswith(prefix)}
    if "float8_scaling" not in sd:
        return (f"the checkpoint's FP8 amax histories ({len(saved_keys) // 2} Linear layers) are not used: this run "
                "has float8.scaling='dynamic' (or no fp8); a later delayed run from its checkpoints starts them "
                "afresh") if saved_keys else None
    wanted = {f"{prefix}{fqn}.{name}": t for fqn, entry in sd["float8_scaling"].items() for name, t in entry.items()}
    if all(k in saved_keys and tuple(saved_keys[k].size) == tuple(t.shape) for k, t in wanted.items()):
        return None
    del sd["float8_scaling"]
    why = ("has none (saved with float8.scaling='dynamic' or without fp8)" if not saved_keys else
           "has them for other layers or another float8.amax_history_len")
    return (f"the checkpoint {why}: float8.scaling='delayed' starts its amax histories afresh, the first resumed "
            "step scaled by each tensor's own amax")


def _schedule_changes(saved: dict | None, now: dict | None, saved_lrs: list | None, lrs: list) -> str:
    """What differs between the checkpoint's schedule and this run's, by config key."""
    from trainer.optim import SCHEDULE_KEYS

    if saved is None or now is None:  # a checkpoint from before schedules were saved
        return "optimizer/scheduler settings changed"
    changed = [f"{SCHEDULE_KEYS.get(k, k)} {saved.get(k)} -> {v}" for k, v in now.items() if saved.get(k) != v]
    if saved_lrs is not None and list(saved_lrs) != list(lrs):
        changed.append(f"optimizer.lr {saved_lrs[0]:g} -> {lrs[0]:g}")
    return ", ".join(changed) or "optimizer/scheduler settings changed"


@dataclass(frozen=True)
class RunInfo:
    """What checkpoint.json records about a run, and what a load is checked against."""

    flavor: str
    model_args: ModelArgs
    mixed_precision: str
    layout: dict[str, int] = field(default_factory=dict)  # dp_replicate, dp_shard, tp, world_size
    tokenizer: str = ""
    """The run's tokenizer ('byte' or a tokenizer.json's absolute path), copied into each checkpoint
    (trainer/checkpoint/tokenizer.py) and from there into exports; '' = none recorded."""
    tokenizer_fingerprint: str = ""

    def model_json(self) -> dict[str, Any]:
        args = asdict(self.model_args)
        # The run's sequence length (the rope table's size) is recorded but is not part of the weights.
        name = "moe" if "n_experts" in args else "llama3"
        return {"name": name, "flavor": self.flavor, **args, "ffn_dim": self.model_args.ffn_dim,
                "head_dim": self.model_args.head_dim}

    def tokenizer_json(self) -> dict[str, str] | None:
        """checkpoint.json's "tokenizer" entry: what an export made from the checkpoint later copies."""
        if not self.tokenizer:
            return None
        spec = "byte" if self.tokenizer == "byte" else TOKENIZER_FILE  # the checkpoint's own copy
        return {"spec": spec, "fingerprint": self.tokenizer_fingerprint}


def run_tokenizer(source: str, spec: str) -> dict[str, str]:
    """RunInfo's tokenizer fields for data.source / data.tokenizer: none for synthetic tokens, which no tokenizer
    made; a tokenizer.json by its absolute path, so a later export finds it from any directory."""
    from trainer.data.tokenizer import tokenizer_fingerprint

    if source == "synthetic":
        return {}
    resolved = spec if spec == "byte" else str(Path(spec).resolve())
    return {"tokenizer": resolved, "tokenizer_fingerprint": tokenizer_fingerprint(spec)}


def describe_layout(layout: dict[str, int]) -> str:
    degrees = [f"{k}={layout[k]}" for k in ("dp_replicate", "dp_shard", "tp") if k in layout]
    degrees += [f"{k}={layout[k]}" for k in ("cp", "ep", "pp") if layout.get(k, 1) > 1]
    return ", ".join(degrees) + (f" (world size {layout['world_size']})" if "world_size" in layout else "")


def args_from_json(model: dict[str, Any], *, where: str = "checkpoint.json") -> ModelArgs:
    """The ModelArgs (MoEArgs for an MoE checkpoint) recorded in checkpoint.json (for tools that have no job config).

    Every value is checked by type and range with the rules of the TOML [model] section
    (`trainer.model_values`) first: a CheckpointError naming the file (`where`) and the field.
    """
    from trainer.checkpoint.format import CheckpointError
    from trainer.model_values import values_problem
    from trainer.models.moe import MoEArgs

    edited = "not as this trainer writes it: an edited or foreign file"
    if model.get("name", "llama3") not in ("llama3", "moe"):
        raise CheckpointError(f"{where}: model.name={model.get('name')!r} must be 'llama3' or 'moe' ({edited})")
    cls = MoEArgs if model.get("name") == "moe" else ModelArgs
    known = {*cls.__dataclass_fields__, "name", "flavor", "ffn_dim", "head_dim"}
    unknown = sorted(k for k in model if k not in known)
    missing = [k for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size") if k not in model]
    if unknown or missing:
        raise CheckpointError(f"{where}: model.{(unknown or missing)[0]} is "
                              f"{'not an argument of ' + cls.__name__ if unknown else 'missing'} ({edited})")
    scaling = model.get("rope_scaling")
    if isinstance(scaling, dict) and (extra := sorted(set(scaling) - set(RopeScaling.__dataclass_fields__))):
        raise CheckpointError(f"{where}: model.rope_scaling.{extra[0]} is not a RopeScaling field ({edited})")
    if problem := values_problem(model, keys={k: f"model.{k}" for k in model}):
        raise CheckpointError(f"{where}: {problem} ({edited})")
    fields = {k: v for k, v in model.items() if k in cls.__dataclass_fields__}
    if fields.get("rope_scaling") is not None:
        fields["rope_scaling"] = RopeScaling(**fields["rope_scaling"])
    args = cls(**fields)
    for derived in ("ffn_dim", "head_dim"):
        if getattr(args, derived) != model.get(derived, getattr(args, derived)):
            raise CheckpointError(f"{where}: model.{derived}={model[derived]} but the other arguments give "
                                  f"{getattr(args, derived)} ({edited})")
    return args
