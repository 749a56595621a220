"""Every value a checkpoint's files give, checked by type and range before anything is allocated.

A checkpoint folder may be crafted, and its checksums rewritten to match, so nothing in it is trusted:

- the model arguments of checkpoint.json follow the rules of the TOML `[model]` section
  (`trainer.model_values`), and the parameters they imply must fit in the checkpoint's data files
  (`check_args_fit_files`) and, for a load into this process, in the host's memory (`check_host_memory`);
- every `.metadata` entry of the model and of per-parameter state has the shape of a model built on the meta
  device from those arguments, and a dtype this trainer writes (`check_index_entries`);
- `state.json`'s step, data and schedule positions and loss scale are in range and agree (`check_state_values`).

Each failure is one CheckpointError line naming the file and the field.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata

from trainer.checkpoint.format import (
    CHECKPOINT_JSON, E4M3, PER_PARAMETER, SCALE_SUFFIX, STATE_BLOCK, STEP_KEY, CheckpointError,
)
from trainer.model_values import EDITED, MAX_COUNTER, SAVED_INTEGERS, ModelArgs, Rule, rule_problem, size_text
from trainer.models.counts import files_fit_problem, num_tensors
from trainer.models import build_model
from trainer.seeds import MAX_DATA_SEED

# The dtypes this trainer writes model weights, expert biases and per-parameter state in (the master dtype, or
# optimizer.exp_avg_dtype / exp_avg_sq_dtype; an e4m3 entry is allowed with its block scales alone: format.py).
INDEX_DTYPES = (torch.float32, torch.bfloat16)
_gib = size_text


def check_args_fit_files(args: ModelArgs, *, data_bytes: int, where: str, files: str, error: type[Exception],
                         tied: bool = False) -> None:
    """The parameters `args` imply, at 2 bytes each at least, fit in the `data_bytes` the data files hold
    (trainer.model_values.files_fit_problem, the rule a Hugging Face folder's config.json is held to as well)."""
    if problem := files_fit_problem(args, data_bytes=data_bytes, files=files, tied=tied):
        raise error(f"{where}: {problem}")


def available_memory_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (Linux), else free physical pages; None where neither is known."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_host_memory(need_bytes: int, *, what: str, where: str, error: type[Exception]) -> None:
    """Refuse a load that needs more host memory than is available (an estimate: `what` says of what)."""
    free = available_memory_bytes()
    if free is not None and need_bytes > free:
        raise error(f"{where}: loading it needs about {_gib(need_bytes)} of memory ({what}) but {_gib(free)} is "
                    "available on this host; load it on a larger host (or with a smaller max_seq_len)")


def model_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Every state-dict entry of the model these args build, by fqn: built on the meta device (allocates nothing).

    Call after `check_args_fit_files`: building a model of a crafted n_layers would take as long as its layers.
    """
    with torch.device("meta"):
        model = build_model(args)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def check_index_entries(metadata: Metadata, shapes: dict[str, tuple[int, ...]], *, path: Path,
                        all_keys: set[str] | None = None) -> None:
    """Every model entry and per-parameter state entry of the index has the shape the format gives it
    (trainer/checkpoint/format.py) and a dtype this trainer writes.

    shapes: {fqn: shape} of the model (this rank's tensors under pipeline parallelism, with all_keys
    the fqns of every rank together). Per-parameter state is `{part}.state.{fqn}.{name}` (the optimizer's): a
    scalar `step`, a tensor of the parameter's shape, or an e4m3 one's block scales. A part's other tensors are
    loaded into this process's own, whose shapes DCP compares.
    """
    file = path / ".metadata"
    entries = metadata.state_dict_metadata
    saved = {k[len("model."):]: md for k, md in entries.items() if k.startswith("model.")}
    keys = all_keys if all_keys is not None else set(shapes)
    missing = sorted(k for k in keys if k not in saved)
    unexpected = [k for k in saved if k not in keys]
    if missing or unexpected:
        raise CheckpointError(
            f"{file}: model keys do not match: {len(missing)} missing (first: {missing[0] if missing else '-'}), "
            f"{len(unexpected)} unexpected (first: {unexpected[0] if unexpected else '-'})"
        )
    for key, md in entries.items():
        scaled = False
        if key.startswith("model."):
            fqn, want = key[len("model."):], shapes.get(key[len("model."):])
        elif m := PER_PARAMETER.match(key):
            part, fqn, name = m.group("part", "fqn", "name")
            if fqn not in keys:
                raise CheckpointError(f"{file}: {key} is the {part} state of {fqn!r}, which the model has not")
            if fqn not in shapes:
                continue  # another pipeline stage's parameter: that rank checks it
            want, scaled = () if name == STEP_KEY else shapes[fqn], f"{key}{SCALE_SUFFIX}" in entries
            if name.endswith(SCALE_SUFFIX):  # an e4m3 entry's block scales
                if len(want) < 2 or want[-1] % STATE_BLOCK:
                    raise CheckpointError(f"{file}: {key} holds block scales of a tensor of shape {list(want)}, "
                                          f"which has no whole 1x{STATE_BLOCK} blocks ({EDITED})")
                want = (*want[:-1], want[-1] // STATE_BLOCK)
        else:
            continue  # rng, FP8 delayed scaling: loaded into this process's own tensors, whose shapes DCP compares
        if want is not None and tuple(md.size) != tuple(want):
            raise CheckpointError(f"{file}: {key} has shape {list(md.size)} in the checkpoint but "
                                  f"{list(want)} in this model ({EDITED}, or another model's)")
        if md.properties.dtype == E4M3 and not scaled and PER_PARAMETER.match(key):
            raise CheckpointError(f"{file}: {key} is stored as {E4M3} without its block scales ({key}{SCALE_SUFFIX} "
                                  f"is missing) ({EDITED})")
        if md.properties.dtype not in INDEX_DTYPES and not (scaled and md.properties.dtype == E4M3):
            raise CheckpointError(f"{file}: {key} is stored as {md.properties.dtype}, not one of "
                                  f"{', '.join(map(str, INDEX_DTYPES))} ({EDITED})")
        base = entries.get(key[:-len(SCALE_SUFFIX)]) if key.endswith(SCALE_SUFFIX) else None
        if base is not None and getattr(base.properties, "dtype", None) != E4M3:
            raise CheckpointError(f"{file}: {key} holds block scales of {key[:-len(SCALE_SUFFIX)]}, which is stored "
                                  f"as {getattr(base.properties, 'dtype', None)}, not {E4M3} ({EDITED})")


def check_entry_count(metadata: Metadata, args: ModelArgs, *, path: Path) -> None:
    """As many model entries as the arguments imply (counted in closed form, before a model is built)."""
    have = sum(1 for k in metadata.state_dict_metadata if k.startswith("model."))
    want = num_tensors(args)
    if have != want:
        raise CheckpointError(f"{path / CHECKPOINT_JSON}: the model arguments (n_layers={args.n_layers}) imply "
                              f"{want:,} model tensors but {path / '.metadata'} holds {have:,}; the arguments are "
                              f"not this model's ({EDITED})")


def _counter(tree: Any, dotted: str, *, file: Path, low: int = 0) -> int:
    value: Any = tree
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            raise CheckpointError(f"{file}: {dotted} is missing ({EDITED})")
        value = value[part]
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= MAX_COUNTER:
        raise CheckpointError(f"{file}: {dotted}={value!r} must be an integer in [{low}, 2**63-1] ({EDITED})")
    return value


# Every field of checkpoint.json and state.json that reaches code, by dotted path ("[]": each item of a list, ".*":
# each value of an object), in the rules of the model arguments' table (trainer/model_values.py). Lengths are
# bounded (the work a file can cause); the files themselves are bounded in size before they are parsed. The integers
# are that module's SAVED_INTEGERS, whose rules the config keys they come from obey too.
_FLAG, _LR = Rule("bool"), Rule("float", low=0, high=1e6)
_SAVED_STATE = {k: rule for k, rule in SAVED_INTEGERS.items() if not k.startswith("layout.")}
_MAYBE_FLAG, _NAME = Rule("bool", optional=True), Rule("str", high=1000)
CHECKPOINT_FIELDS: dict[str, Rule] = {
    "kind": Rule("choice", choices=("training", "model_only")),
    "mixed_precision": Rule("str", high=64, optional=True),
    "layout": Rule("dict", optional=True),
    "layout.*": SAVED_INTEGERS["layout.*"],
    "source": Rule("str", high=4096, optional=True),
    "saved_at": Rule("str", high=64, optional=True),
}
STATE_FIELDS: dict[str, Rule] = {
    "optimizer": Rule("dict"),
    "optimizer.param_groups": Rule("list", high=10_000),
    "optimizer.param_groups[]": Rule("dict"),
    **{f"optimizer.param_groups[].{k}": _LR for k in ("lr", "initial_lr", "weight_decay")},
    "optimizer.param_groups[].eps": Rule("float", low=0, high=1),
    "optimizer.param_groups[].betas": Rule("list", high=2),
    "optimizer.param_groups[].betas[]": Rule("float", low=0, high=1),
    "optimizer.param_groups[].params": Rule("list", high=10**7),
    "optimizer.param_groups[].params[]": _NAME,
    **{f"optimizer.param_groups[].{k}": _FLAG for k in ("amsgrad", "maximize", "capturable", "differentiable",
                                                         "decoupled_weight_decay")},
    **{f"optimizer.param_groups[].{k}": _MAYBE_FLAG for k in ("foreach", "fused")},
    # LambdaLR.load_state_dict copies every key into the scheduler (an "optimizer" key replaced its optimizer):
    # strict, below.
    "lr_scheduler": Rule("dict"),
    "lr_scheduler.base_lrs": Rule("list", high=10_000),
    "lr_scheduler.base_lrs[]": _LR,
    "lr_scheduler._last_lr": Rule("list", high=10_000),
    "lr_scheduler._last_lr[]": _LR,
    **{f"lr_scheduler.{k}": _FLAG for k in ("_is_initial", "_get_lr_called_within_step", "verbose")},
    "lr_scheduler.lr_lambdas": Rule("list", high=10_000),
    "lr_scheduler.lr_lambdas[]": Rule("dict", optional=True),
    "lr_scheduler.schedule": Rule("dict", optional=True),
    "lr_scheduler.schedule.decay_type": Rule("str", high=64),
    "lr_scheduler.schedule.min_lr_ratio": Rule("float", low=0, high=1),
    "lr_scheduler.schedule.wsd_decay_ratio": Rule("float", low=0, high=1),
    "dataloader": Rule("dict"),
    "dataloader.seed": Rule("int", low=0, high=MAX_DATA_SEED),  # data.seed's range
    "dataloader.shuffle": _FLAG,
    "train_state": Rule("dict"),
    "train_state.mixed_precision": Rule("str", high=64, optional=True),
    "train_state.tokens": Rule("int", low=0, high=MAX_COUNTER),  # absent in checkpoints of earlier versions
    "loss_scaler": Rule("dict", optional=True),
    # checkpoint.resume_check's record (trainer/run/resume_check.py): absent when it was off.
    "resume_check": Rule("dict", optional=True),
    "resume_check.loss": Rule("float", low=0, high=1e6),
    "resume_check.rows": Rule("int", low=1, high=MAX_COUNTER),
    "resume_check.seq_len": Rule("int", low=1, high=MAX_COUNTER),
    "resume_check.precision": Rule("dict"),
    "resume_check.precision.*": Rule("str", high=1000),
    "resume_check.kernels": Rule("dict"),
    "resume_check.kernels.*": Rule("str", high=1000),
    "resume_check.layout": Rule("dict"),
    "resume_check.layout.*": SAVED_INTEGERS["layout.*"],
    "resume_check.model": Rule("dict"),
    "resume_check.model.*": Rule("str", high=1000),
    **_SAVED_STATE,
}
STRICT_STATE = ("lr_scheduler", "lr_scheduler.schedule")


def check_fields(tree: dict[str, Any], rules: dict[str, Rule], *, file: Path, strict: tuple[str, ...] = ()) -> None:
    """Each field of `tree` that has a rule obeys it, and the objects named in `strict` hold no other field; one
    CheckpointError line naming the file and the field otherwise. Only paths that lead to a rule are walked."""
    prefixes = {p for path in rules for p in _prefixes(path)}

    def walk(node: Any, pattern: str, shown: str) -> None:
        rule = rules.get(pattern) or rules.get(pattern.rpartition(".")[0] + ".*")
        if rule is not None and (problem := rule_problem(rule, node, key=shown)):
            raise CheckpointError(f"{file}: {problem} ({EDITED})")
        if isinstance(node, dict):
            for key, value in node.items():
                child = f"{pattern}.{key}" if pattern else str(key)
                if pattern in strict and child not in rules:
                    raise CheckpointError(f"{file}: {shown}.{str(key)[:80]} is not a field this trainer writes "
                                          f"({EDITED})")
                if child in prefixes or f"{pattern}.*" in rules:
                    walk(value, child, f"{shown}.{key}" if shown else str(key))
        elif isinstance(node, list) and f"{pattern}[]" in prefixes:
            for i, item in enumerate(node):
                walk(item, f"{pattern}[]", f"{shown}[{i}]")

    walk(tree, "", "")


def _prefixes(path: str) -> list[str]:
    """"a.b[].c" -> ["a", "a.b", "a.b[]", "a.b[].c"]: the patterns walked on the way to a rule."""
    out = []
    for m in re.finditer(r"\.|\[\]", path):
        out += [path[:m.start()]] if m.group() == "." else [path[:m.start()], path[:m.end()]]
    return [*dict.fromkeys([*out, path])]


def check_state_values(state: dict[str, Any], info: dict[str, Any], *, path: Path) -> None:
    """state.json's step, data position, schedule position and loss scale: in range and consistent with each other
    (the step the one checkpoint.json records, a data position past 0, the scheduler at that step, a usable scale)."""
    file = path / "state.json"
    step = _counter(state, "train_state.step", file=file)
    if step != info.get("step"):
        raise CheckpointError(f"{file}: train_state.step={step} but {path / CHECKPOINT_JSON} records step "
                              f"{info.get('step')!r} ({EDITED})")
    samples = _counter(state, "dataloader.consumed_samples", file=file)
    if step > 0 and samples == 0:  # every step reads at least one sample; a restarted data position too
        raise CheckpointError(f"{file}: dataloader.consumed_samples=0 at step {step}: the run would read its data "
                              f"again from the start ({EDITED})")
    position = _counter(state, "lr_scheduler.last_epoch", file=file)
    if position != step:  # the scheduler steps once per optimizer step, skipped ones included
        raise CheckpointError(f"{file}: lr_scheduler.last_epoch={position} but the checkpoint is at step {step}: "
                              f"the learning rate would resume at another point of its schedule ({EDITED})")
    scaler = state.get("loss_scaler")
    if scaler is not None:
        scale = scaler.get("scale") if isinstance(scaler, dict) else None
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
            raise CheckpointError(f"{file}: loss_scaler.scale={scale!r} must be a finite number > 0 (else every fp16 "
                                  f"step would be skipped) ({EDITED})")
        _counter(scaler, "good_steps", file=file)
    check_fields(state, STATE_FIELDS, file=file, strict=STRICT_STATE)  # every other field that is read


def nonfinite_counts(weights: dict[str, torch.Tensor]) -> dict[str, tuple[int, int]]:
    """{name: (NaN elements, Inf elements)} of the tensors (plain or a rank's shards) that hold any."""
    return {name: (int(torch.isnan(t).sum()), int(torch.isinf(t).sum())) for name, t in weights.items()
            if t.is_floating_point() and not bool(torch.isfinite(t).all())}


def nonfinite_line(counts: dict[str, tuple[int, int]], numels: dict[str, int], *, where: str) -> str | None:
    """None without non-finite counts, else one line naming the tensors that hold NaN or Inf, and how many."""
    if not counts:
        return None
    bad = [f"{name} ({nan:,} NaN, {inf:,} Inf of {numels[name]:,})" for name, (nan, inf) in sorted(counts.items())]
    more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
    return (f"{where}: the weights are not finite: {len(bad)} of {len(numels)} tensors hold NaN or Inf: "
            f"{', '.join(bad[:3])}{more} (a run that diverged, or a damaged file)")


def nonfinite_problem(weights: dict[str, torch.Tensor], *, where: str) -> str | None:
    """None when every weight is finite, else `nonfinite_line`."""
    return nonfinite_line(nonfinite_counts(weights), {k: t.numel() for k, t in weights.items()}, where=where)
