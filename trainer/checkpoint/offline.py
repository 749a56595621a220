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
import os
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from trainer.checkpoint.format import (
    CHECKPOINT_JSON, FORMAT, STATE_JSON, CheckpointError, ChecksummedWriter, CorruptCheckpointError,
    collect_checksums, first_line, root_cause, write_json,
)
from trainer.checkpoint.state import RunInfo, args_from_json
from trainer.checkpoint.verify import (
    SafeReader, check_files, data_files, read_checkpoint_json, read_dcp_metadata, scan_checkpoints,
)
from trainer.models.layers import Decoder
from trainer.output_folder import IMPORT, prepare_output, publish_output
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
    folder of checkpoints above all, is refused in one line (trainer/output_folder.py).
    """
    tmp = prepare_output(path, kind=IMPORT)
    with _single_process():
        dcp.save({"model": weights}, storage_writer=ChecksummedWriter(tmp, step=step), no_dist=True)
    write_json(tmp / CHECKPOINT_JSON, {
        "format": FORMAT, "kind": "model_only", "step": step, "model": run.model_json(),
        "mixed_precision": run.mixed_precision, "layout": run.layout, "tokenizer": run.tokenizer_json(),
        "source": source,
        "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "files": collect_checksums(tmp),
    })
    publish_output(tmp, path, kind=IMPORT)
    return path


def load_full_model_weights(
    path: str | os.PathLike, *, dtype: torch.dtype | None = None, allow_unverified: bool = False
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(checkpoint.json, {fqn: full tensor}) of a DCP checkpoint's model.

    Verifies every file first. Needs no torchao, even for a checkpoint of an fp8 run.
    """
    path = Path(path)
    info = read_checkpoint_json(path, allow_unverified=allow_unverified)
    metadata = read_dcp_metadata(path, info)
    names = data_files(metadata)
    if info.get("kind") == "training":
        names[STATE_JSON] = 1
    problems = check_files(path, info, names)
    if problems:
        raise CorruptCheckpointError(problems[0])
    sd = {}
    for key, md in metadata.state_dict_metadata.items():
        if key.startswith("model."):
            sd[key[len("model."):]] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
    try:
        with _single_process():
            dcp.load({"model": sd}, storage_reader=SafeReader(str(path)), no_dist=True)
    except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
        cause = root_cause(e)
        if isinstance(cause, CheckpointError):
            raise type(cause)(str(cause)) from None
        raise CheckpointError(f"failed to read checkpoint {path}: {first_line(cause)}") from e
    if dtype is not None:
        sd = {k: v.to(dtype) for k, v in sd.items()}
    return info, sd


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
    max_seq_len: int | None = None,
) -> Decoder:
    """Our model (Llama or MoETransformer) with the weights of a DCP checkpoint or a Hugging Face export, in eval mode.

    `path`: a step-N folder, a checkpoint folder (its latest complete checkpoint) or an export
    folder (Llama, Ernie4_5_Moe or Glm4Moe layout). The model's arguments come from the
    checkpoint's checkpoint.json (or the export's config.json); `max_seq_len` overrides the
    length of the RoPE table (default: the training run's sequence length, or the export's
    max_position_embeddings). Every file is verified (checksums for DCP, names and shapes
    for both) first; errors are one line naming the file (CheckpointError or ExportError).
    """
    from dataclasses import replace

    from trainer.export import read_hf_config, read_hf_weights

    path = resolve_checkpoint(path)
    if (path / "config.json").is_file() and not (path / CHECKPOINT_JSON).exists():
        args = read_hf_config(path)
        weights = read_hf_weights(path, args=args)
    else:
        info, weights = load_full_model_weights(path)
        args = args_from_json(info["model"])
    if max_seq_len:
        args = replace(args, max_seq_len=max_seq_len)
    return build_model(args, weights, device=device, dtype=dtype)


def build_model(args: ModelArgs, weights: dict[str, torch.Tensor], *, device: torch.device | str = "cpu",
                dtype: torch.dtype = torch.float32) -> Decoder:
    """A plain (unsharded) model of the args' family holding these full weights (by our fqns), in eval mode.

    Parameters are cast to dtype; buffers (the MoE expert biases) stay fp32, as in training:
    a bias rounded to bf16 would choose other experts.
    """
    from trainer.models import build_model as family_model

    with torch.device("meta"):
        model = family_model(args)  # Llama, or MoETransformer for MoE args
    buffers = {name for name, _ in model.named_buffers()}
    model.load_state_dict({k: v.to(device=device, dtype=torch.float32 if k in buffers else dtype)
                           for k, v in weights.items()}, strict=True, assign=True)
    model.rope = rope_cache(args, args.max_seq_len, device=device)
    return model.eval()
