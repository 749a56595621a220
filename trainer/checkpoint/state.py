"""How a checkpoint holds its parts, and the run it describes: the tensor/JSON split, the model's plain tensors, RunInfo.

A resume loads one `Stateful`, `CheckpointState` (trainer/checkpoint/parts.py): a dict of parts, one per feature.
The model is saved as plain tensors (torchao's float8 all-gather wrapper is unwrapped, sharing storage), so keys
and dtypes are the same for bf16 and fp8 runs and a checkpoint loads in a process that
never imported torchao. DCP reshards on load: a checkpoint saved at one parallel
layout loads at any other.

Only tensors go through DCP. Every other value (step, data position, schedule and
optimizer settings) is JSON in `state.json` (`split_tensors`/`merge_tensors`): DCP would
pickle them, and unpickling a file someone else wrote can run code.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from trainer.checkpoint.format import TOKENIZER_FILE, CheckpointError
from trainer.data.tokenizer import tokenizer_fingerprint
from trainer.distributed import plain_tensor
from trainer.model_values import DeepseekV3Args, GptOssArgs, YarnScaling, values_problem
from trainer.models.llama import ModelArgs, RopeScaling
from trainer.models.moe import MoEArgs

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
        # A tuple (dense_layers) as the list JSON reads back, so a checkpoint's saved arguments compare equal.
        args = {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self.model_args).items()}
        # The run's sequence length (the rope table's size) is recorded but is not part of the weights.
        name = ("deepseek_v3" if "kv_lora_rank" in args else "gpt_oss" if "swiglu_limit" in args
                else "moe" if "n_experts" in args else "llama3")
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
    edited = "not as this trainer writes it: an edited or foreign file"
    classes = {"llama3": ModelArgs, "moe": MoEArgs, "deepseek_v3": DeepseekV3Args, "gpt_oss": GptOssArgs}
    if model.get("name", "llama3") not in classes:
        raise CheckpointError(f"{where}: model.name={model.get('name')!r} must be one of "
                              f"{', '.join(map(repr, classes))} ({edited})")
    cls = classes[model.get("name", "llama3")]
    known = {*cls.__dataclass_fields__, "name", "flavor", "ffn_dim", "head_dim"}
    unknown = sorted(k for k in model if k not in known)
    missing = [k for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size") if k not in model]
    if unknown or missing:
        raise CheckpointError(f"{where}: model.{(unknown or missing)[0]} is "
                              f"{'not an argument of ' + cls.__name__ if unknown else 'missing'} ({edited})")
    nested = {"rope_scaling": RopeScaling, "rope_yarn": YarnScaling}
    for key, nested_cls in nested.items():
        value = model.get(key)
        if isinstance(value, dict) and (extra := sorted(set(value) - set(nested_cls.__dataclass_fields__))):
            raise CheckpointError(f"{where}: model.{key}.{extra[0]} is not a {nested_cls.__name__} field ({edited})")
    if problem := values_problem(model, keys={k: f"model.{k}" for k in model}):
        raise CheckpointError(f"{where}: {problem} ({edited})")
    fields = {k: v for k, v in model.items() if k in cls.__dataclass_fields__}
    for key, nested_cls in nested.items():
        if fields.get(key) is not None:
            fields[key] = nested_cls(**fields[key])
    args = cls(**fields)
    for derived in ("ffn_dim", "head_dim"):
        if getattr(args, derived) != model.get(derived, getattr(args, derived)):
            raise CheckpointError(f"{where}: model.{derived}={model[derived]} but the other arguments give "
                                  f"{getattr(args, derived)} ({edited})")
    return args
