"""Checkpoints outside a training run, in one process without a process group: load a model, read or write weights.

`load_model` is the public way to get a trained model back for evaluation or
generation (dense or MoE), from either of the two formats this trainer writes:

    from trainer.checkpoint import load_model
    model = load_model("outputs/run/checkpoint/step-1000")        # a DCP checkpoint (training or model-only)
    model = load_model("outputs/run/checkpoint")                  # the folder's latest complete checkpoint
    model = load_model("outputs/run/checkpoint/step-1000-hf")     # a Hugging Face export (safetensors)

Both paths run no code from the folder: DCP's index goes through the restricted
unpickler of trainer/checkpoint/verify.py, tensors through `torch.load(weights_only=True)`,
Hugging Face weights through safetensors and config.json through json.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
import warnings
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from trainer.checkpoint.format import (
    CHECKPOINT_JSON, FORMAT, STATE_JSON, CheckpointError, CorruptCheckpointError, write_json,
)
from trainer.checkpoint.ema import EMA_PART
from trainer.checkpoint.state import RunInfo, args_from_json
from trainer.checkpoint.tokenizer import write_tokenizer
from trainer.checkpoint.values import (
    EDITED, check_args_fit_files, check_entry_count, check_host_memory, check_index_entries, model_shapes, nonfinite_problem,
)
from trainer.checkpoint.verify import (
    check_files, data_files, read_checkpoint_json, read_dcp_metadata, safe_load, scan_checkpoints,
)
from trainer.checkpoint.writer import ChecksummedWriter, collect_checksums
from trainer.hf import ExportError, open_hf_folder
from trainer.hf.output_folder import IMPORT, prepare_output, publish_output
from trainer.models.counts import param_count
from trainer.models import build_model as family_model
from trainer.models.layers import Decoder, rope_table_bytes
from trainer.models.llama import ModelArgs, rope_cache

logger = logging.getLogger("trainer.checkpoint")


@contextlib.contextmanager
def _single_process():
    # no_dist=True says it: DCP still warns that no process group exists.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def save_model_only(
    path: Path, weights: dict[str, torch.Tensor], *, run: RunInfo, source: str, step: int = 0
) -> Path:
    """A model-only DCP checkpoint (for checkpoint.initial_load_path) from full tensors, in one process.

    `path` must be new, empty or an earlier import (moved aside to `{path}.old`); anything else, a
    folder of checkpoints above all, is refused in one line (trainer/hf/output_folder.py).
    """
    tmp = prepare_output(path, kind=IMPORT)
    with _single_process():
        dcp.save({"model": weights}, storage_writer=ChecksummedWriter(tmp, step=step), no_dist=True)
    files = collect_checksums(tmp)[0] | write_tokenizer(run.tokenizer, run.tokenizer_fingerprint, tmp)
    write_json(tmp / CHECKPOINT_JSON, {
        "format": FORMAT, "kind": "model_only", "step": step, "model": run.model_json(),
        "mixed_precision": run.mixed_precision, "layout": run.layout, "tokenizer": run.tokenizer_json(),
        "source": source, "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "files": files,
    })
    publish_output(tmp, path, kind=IMPORT)
    return path


def load_full_model_weights(
    path: str | os.PathLike, *, dtype: torch.dtype | None = None, allow_unverified: bool = False,
    extra_bytes: Callable[[ModelArgs, int], tuple[int, str]] | None = None, weights: str = "model",
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(checkpoint.json, {fqn: full tensor}) of a DCP checkpoint's model.

    Verifies every file and checks every value first (trainer/checkpoint/values.py): the model
    arguments, their size against the data files and the host's memory, every index entry against
    a meta-device model of those arguments. `extra_bytes(args, weight_bytes)`: (bytes, what) the
    caller will need besides the weights (load_model: the cast copy and the RoPE table). Needs no
    torchao, even for a checkpoint of an fp8 run. weights="ema": the parameters are the run's EMA of them
    (train.ema_decay, the part `ema`; the buffers stay the model's); a checkpoint without one is refused in one line.
    """
    path = Path(path)
    info = read_checkpoint_json(path, allow_unverified=allow_unverified)
    args = args_from_json(info["model"], where=str(path / CHECKPOINT_JSON))
    metadata = read_dcp_metadata(path, info)
    names = data_files(metadata)
    if info.get("kind") == "training":
        names[STATE_JSON] = 1
    problems = check_files(path, info, names)
    if problems:
        raise CorruptCheckpointError(problems[0])
    data_bytes = sum((path / n).stat().st_size for n in names if n != STATE_JSON)
    check_args_fit_files(args, data_bytes=data_bytes, where=str(path / CHECKPOINT_JSON),
                         files=f"its data files ({', '.join(sorted(n for n in names if n != STATE_JSON))})",
                         error=CheckpointError)
    check_entry_count(metadata, args, path=path)
    check_index_entries(metadata, model_shapes(args), path=path)
    entries = {k[len("model."):]: md for k, md in metadata.state_dict_metadata.items() if k.startswith("model.")}
    ema = _ema_entries(metadata, entries, path=path) if weights == "ema" else {}
    weight_bytes = sum(math.prod(md.size) * md.properties.dtype.itemsize for md in entries.values())
    more, what = extra_bytes(args, weight_bytes) if extra_bytes else (0, "")
    check_host_memory(weight_bytes + more, what=f"the weights{what}", where=str(path), error=CheckpointError)
    sd = {k: torch.empty(tuple(md.size), dtype=md.properties.dtype) for k, md in entries.items() if k not in ema}
    ema_sd = {k: torch.empty(tuple(md.size), dtype=md.properties.dtype) for k, md in ema.items()}
    with _single_process():
        safe_load({"model": sd, **({"ema": ema_sd} if ema_sd else {})}, path, no_dist=True)
    sd.update(ema_sd)
    if dtype is not None:
        sd = {k: v.to(dtype) for k, v in sd.items()}
    return info, sd


def _ema_entries(metadata: Any, entries: dict[str, Any], *, path: Path) -> dict[str, Any]:
    """The checkpoint's EMA entries (`ema.{fqn}`) by fqn, each a model entry's shape; a one-line CheckpointError when
    it has none (its run had train.ema_decay=0) or they do not fit the model's."""
    prefix = f"{EMA_PART}."
    ema = {k[len(prefix):]: md for k, md in metadata.state_dict_metadata.items() if k.startswith(prefix)}
    if not ema:
        raise CheckpointError(f"{path} holds no EMA weights (its run had train.ema_decay=0): use --weights=model")
    if bad := [k for k, md in ema.items() if k not in entries or tuple(md.size) != tuple(entries[k].size)]:
        raise CheckpointError(f"{path}: EMA entry ema.{bad[0]} is not a model tensor of its shape ({EDITED})")
    return ema


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A step-N folder (or anything else) as is; a checkpoint folder -> its latest complete checkpoint."""
    path = Path(path)
    if (path / CHECKPOINT_JSON).exists() or (path / "config.json").exists() or not path.is_dir():
        return path
    complete, incomplete = scan_checkpoints(path)
    for p, why in incomplete:
        logger.warning("ignoring incomplete checkpoint %s: %s", p, why)
    if not complete:
        raise CheckpointError(f"{path} holds no complete checkpoint (no step-N folder with {CHECKPOINT_JSON})")
    return complete[max(complete)]


def load_model(
    path: str | os.PathLike, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
    max_seq_len: int | None = None, weights: str = "model",
) -> Decoder:
    """Our model (Llama or MoETransformer) with the weights of a DCP checkpoint or a Hugging Face export, in eval mode.

    `path`: a step-N folder, a checkpoint folder (its latest complete checkpoint) or an export
    folder (Llama, Qwen3, Ernie4_5_Moe, Glm4Moe or Qwen3Moe layout). The model's arguments come from the
    checkpoint's checkpoint.json (or the export's config.json); `max_seq_len` overrides the
    length of the RoPE table (default: the training run's sequence length, or the export's
    max_position_embeddings). Every file is verified (checksums for DCP, names and shapes
    for both) first; errors are one line naming the file (CheckpointError or ExportError). weights="ema": a DCP
    checkpoint's EMA of the weights (train.ema_decay); refused in one line where there is none (an export included).
    """
    path = resolve_checkpoint(path)

    def extra_bytes(args: ModelArgs, weight_bytes: int) -> tuple[int, str]:
        # The weights cast to `dtype` (a copy, at worst) and the RoPE table of the length it will have.
        seq_len = max_seq_len or args.max_seq_len
        cast = param_count(args) * dtype.itemsize
        return cast + rope_table_bytes(args, seq_len), f", a {dtype} copy and the RoPE table of {seq_len:,} positions"

    if (path / "config.json").exists() and not (path / CHECKPOINT_JSON).exists():
        if weights == "ema":
            raise CheckpointError(f"{path} is an export, which holds one set of weights and no EMA: use "
                                  "--weights=model, or the training checkpoint's folder")
        args, tensors = _read_hf_folder(path, extra_bytes=extra_bytes)
    else:
        info, tensors = load_full_model_weights(path, extra_bytes=extra_bytes, weights=weights)
        args = args_from_json(info["model"], where=str(path / CHECKPOINT_JSON))
    if problem := nonfinite_problem(tensors, where=str(path)):  # a model that can only produce NaN
        raise CheckpointError(problem)
    if max_seq_len:
        args = replace(args, max_seq_len=max_seq_len)
    return build_model(args, tensors, device=device, dtype=dtype)


def _read_hf_folder(path: Path, *, extra_bytes: Callable[[ModelArgs, int], tuple[int, str]]
                    ) -> tuple[ModelArgs, dict[str, torch.Tensor]]:
    """(args, weights) of a Hugging Face folder, read by the one reader (trainer.hf.open_hf_folder: its config
    checked value by value, against its files' sizes and its tensors' headers) and checked against this host's
    memory before any weight is read."""
    folder = open_hf_folder(path)
    more, what = extra_bytes(folder.args, folder.data_bytes)
    check_host_memory(folder.data_bytes + more, what=f"the weights{what}", where=str(path), error=ExportError)
    return folder.args, folder.read()


def build_model(args: ModelArgs, weights: dict[str, torch.Tensor], *, device: torch.device | str = "cpu",
                dtype: torch.dtype = torch.float32) -> Decoder:
    """A plain (unsharded) model of the args' family holding these full weights (by our fqns), in eval mode.

    Parameters are cast to dtype; buffers (the MoE expert biases) stay fp32, as in training:
    a bias rounded to bf16 would choose other experts.
    """
    with torch.device("meta"):
        model = family_model(args)  # Llama, or MoETransformer for MoE args
    buffers = {name for name, _ in model.named_buffers()}
    model.load_state_dict({k: v.to(device=device, dtype=torch.float32 if k in buffers else dtype)
                           for k, v in weights.items()}, strict=True, assign=True)
    model.tie_weights()  # assign=True gave the embeddings and a tied head a tensor each
    model.rope = rope_cache(args, args.max_seq_len, device=device)
    return model.eval()
