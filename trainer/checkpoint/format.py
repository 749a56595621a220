"""What a checkpoint folder looks like on disk: names, constants, error types, checksums.

Layout under `{job.dump_folder}/{checkpoint.folder}/`:

    step-{N}/                 a complete checkpoint; only ever created by a rename
        .metadata             DCP's index of every tensor chunk (read with a restricted unpickler)
        __{rank}_{i}.distcp   each rank's tensor shards
        state.json            every non-tensor value (step, data position, schedule, optimizer settings)
        checkpoint.json       step, model shape, vocab, mixed_precision, layout, size and crc32 of every file
    step-{N}.tmp/             a save in progress, or one a crash interrupted: ignored with a warning; it holds the
                              marker `.partial` (trainer/files/publish.py) until it is renamed to step-{N}
    step-{N}.incomplete/      what held the name step-{N} without being a complete checkpoint (no checkpoint.json,
                              no .metadata, a user's files), moved aside when a save took the name (never deleted)
    step-{N}.corrupt/         a checkpoint that failed verification, moved aside by a resume (never deleted)
    step-{N}.abandoned/       a later trajectory than the load_step a run resumed, moved aside at its first save
    step-{N}-hf/              a weights-only export, Hugging Face layout: checkpoint.export_interval's (while training,
                              trainer/checkpoint/exports.py) and checkpoint.model_only's (the final weights)

Nothing in a checkpoint is a pickled Python object except DCP's `.metadata`, which is
read through an allowlist of DCP's own metadata classes (trainer/checkpoint/verify.py):
loading a folder someone else wrote never runs code.
"""

from __future__ import annotations

import errno
import json
import os
import re
import zlib
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException

from trainer.errors import UserError

CHECKPOINT_JSON = "checkpoint.json"
STATE_JSON = "state.json"
TOKENIZER_FILE = "tokenizer.json"  # the run's tokenizer.json, copied into each checkpoint (tokenizer.py)
METADATA = ".metadata"
MAX_SIDECAR_BYTES = 64 * 2**20  # a rank's checksums: a few dozen bytes per file it wrote
# 2: non-tensor state moved from pickled DCP entries into state.json.
FORMAT = "trainer-dcp-2"
OLD_FORMATS = ("trainer-dcp-1",)
STEP_DIR = re.compile(r"^step-(\d+)(\.tmp)?$")
# Shape-determining model args: a mismatch in any of them is an error before loading.
SHAPE_KEYS = ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "vocab_size", "ffn_dim", "qk_norm",
              "tie_word_embeddings",  # then the MoE family's:
              "n_experts", "moe_ffn_dim", "n_shared_experts", "n_dense_layers", "sparse_step", "dense_layers")
# What an MoE checkpoint written before a shape argument existed meant by its absence.
MOE_SHAPE_DEFAULTS = {"sparse_step": 1, "dense_layers": []}
# Same shapes, different function: loaded, with a warning.
FUNCTION_KEYS = ("norm_eps", "rope_theta", "rope_scaling")
# Per-parameter state (DCP's optimizer layout; trainer/checkpoint/parts.py): `{part}.state.{fqn}.{name}` holds
# - a scalar, for name `step`;
# - fp32 block scales, for a name ending in SCALE_SUFFIX: one per 1 x STATE_BLOCK elements along the last dim of the
#   parameter, of the float8 e4m3 entry named without the suffix (an fp8 AdamW first moment and its `exp_avg_scale`);
# - else a tensor of the parameter's shape, fp32 or bf16 (or that e4m3 entry).
PER_PARAMETER = re.compile(r"^(?P<part>[^.]+)\.state\.(?P<fqn>.+)\.(?P<name>[^.]+)$")
STEP_KEY, SCALE_SUFFIX, STATE_BLOCK = "step", "_scale", 128
E4M3 = torch.float8_e4m3fn
# A write that failed for lack of space: no space left, past the file size limit (ulimit -f), over quota.
DISK_ERRNOS = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class CheckpointError(UserError, ValueError):
    """A user-facing checkpoint problem (missing, incomplete, corrupted, incompatible, unsafe); one line."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint that fails verification (a file missing, truncated, or not matching its recorded crc32).

    On an automatic resume the trainer falls back to the newest older checkpoint that
    verifies; any other CheckpointError (incompatible, unsafe) stops the run.
    """


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def write_json(path: Path, data: dict[str, Any]) -> None:
    with open(path, "w") as f:
        f.write(json.dumps(data, indent=2) + "\n")
        f.flush()
        os.fsync(f.fileno())


def file_digest(path: Path, chunk_bytes: int = 16 * 2**20) -> dict[str, Any]:
    """Size and crc32 of a file, read in chunks (a save takes its shards' while writing them: writer.py)."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            crc = zlib.crc32(chunk, crc)
    return {"bytes": path.stat().st_size, "crc32": f"{crc:08x}"}


def root_cause(e: BaseException) -> BaseException:
    """The first rank's original exception inside DCP's CheckpointException (a BaseException), else `e`."""
    if isinstance(e, CheckpointException) and e.failures:
        inner = next(iter(e.failures.values()))
        inner = inner[0] if isinstance(inner, tuple) else inner
        if isinstance(inner, BaseException):
            return root_cause(inner)
    return e


def disk_error(e: BaseException) -> OSError | None:
    """The ENOSPC / EFBIG / EDQUOT OSError behind `e` (DCP's CheckpointException, torch.save's RuntimeError, ...).

    Follows DCP's per-rank failures, then `__cause__` / `__context__`; an error that crossed ranks
    keeps only its text, so "No space left on device" in a message counts too.
    """
    seen: set[int] = set()
    cause: BaseException | None = root_cause(e)
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, OSError) and cause.errno in DISK_ERRNOS:
            return cause
        text = str(cause)
        for code in DISK_ERRNOS:
            if os.strerror(code) in text:
                return OSError(code, os.strerror(code), getattr(cause, "filename", None))
        cause = cause.__cause__ or cause.__context__
    return None
