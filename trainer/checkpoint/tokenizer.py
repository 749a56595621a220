"""The run's tokenizer inside each checkpoint: copied in at save, read from there, never from a path a file names.

checkpoint.json's `"tokenizer"` is `{"spec": "tokenizer.json" | "byte", "fingerprint": ...}`, or null for a run
of synthetic tokens. A tokenizer.json is the checkpoint's own copy, listed and checksummed with its other files,
written from the bytes the run read at its start (so a tokenizer edited mid-run is not what the checkpoint
says it trained with). Export and generation read that copy only: a checkpoint.json that names any other path
(an edited file pointing at `/home/me/.aws/credentials`, or a checkpoint written before the copy existed) is
refused in one line, and a path outside is used only when the user names it (`--tokenizer=PATH`).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

from trainer.checkpoint.format import CHECKPOINT_JSON, TOKENIZER_FILE, CheckpointError, file_digest
from trainer.checkpoint.verify import check_files
from trainer.data.tokenizer import _tokenizer_path, bytes_fingerprint, folder_tokenizer_problem


def write_tokenizer(spec: str, fingerprint: str, folder: Path) -> dict[str, dict[str, Any]]:
    """Copy the run's tokenizer.json into a checkpoint folder being written; its {name: digest} for the files
    list ({} for 'byte' or none)."""
    if not spec or spec == "byte":
        return {}
    target = folder / TOKENIZER_FILE
    target.write_bytes(_run_tokenizer_bytes(spec, fingerprint))
    os.chmod(target, 0o644)
    return {TOKENIZER_FILE: file_digest(target)}


@functools.lru_cache(maxsize=2)
def _run_tokenizer_bytes(spec: str, fingerprint: str) -> bytes:
    """The run's tokenizer.json as it was when first read (the run reads it at its start: `remember_tokenizer`)."""
    data = _tokenizer_path(spec).read_bytes()
    if bytes_fingerprint(data) != fingerprint:
        raise CheckpointError(f"tokenizer {spec} has changed since the run started (fingerprint "
                              f"{bytes_fingerprint(data)}, the run's {fingerprint}): restore it, or restart the run "
                              "from its latest checkpoint with the new one")
    return data


def remember_tokenizer(spec: str, fingerprint: str) -> None:
    """Read the run's tokenizer.json now, at the start, for every later save to copy."""
    if spec and spec != "byte":
        _run_tokenizer_bytes(spec, fingerprint)


def why_no_tokenizer(info: dict[str, Any]) -> str:
    """Why a checkpoint records no tokenizer (recorded_tokenizer's None), from its checkpoint.json."""
    if info.get("mixed_precision") == "hf-import":
        source = info.get("source")
        return (f"imported from {source if isinstance(source, str) and source else 'a Hugging Face folder'}, which "
                "holds no tokenizer.json")
    return "its run trained on synthetic tokens, which no tokenizer made, or it predates recorded tokenizers"


def recorded_tokenizer(folder: Path, info: dict[str, Any]) -> tuple[str, str | None] | None:
    """(spec, fingerprint) of the tokenizer a checkpoint records: 'byte', or the path of its own tokenizer.json
    copy (inside the folder, a regular file of bounded size, listed and checksummed); None if it records none.
    Anything else is a CheckpointError line."""
    where, entry = folder / CHECKPOINT_JSON, info.get("tokenizer")
    if entry is None:
        return None
    if (not isinstance(entry, dict) or not isinstance(entry.get("spec"), str)
            or not isinstance(entry.get("fingerprint", ""), str) or set(entry) - {"spec", "fingerprint"}):
        shown = repr(entry) if len(repr(entry)) <= 80 else repr(entry)[:77] + "..."
        raise CheckpointError(f'{where}: "tokenizer" must be null or {{"spec": "byte" or "{TOKENIZER_FILE}", '
                              f'"fingerprint": "..."}}, not {shown} (an edited or foreign file)')
    spec, fingerprint = entry["spec"], entry.get("fingerprint") or None
    if spec == "byte":
        return spec, fingerprint
    if spec != TOKENIZER_FILE:
        raise CheckpointError(
            f"{where} names its tokenizer by the path {spec[:200]!r}, not the {TOKENIZER_FILE} a checkpoint holds "
            "(an edited file, or one written before checkpoints held their tokenizer): refusing to read a file a "
            f"checkpoint points at; pass --tokenizer=PATH to name the tokenizer yourself, or --no-tokenizer")
    path = folder / TOKENIZER_FILE
    if problem := folder_tokenizer_problem(path, folder):
        raise CheckpointError(problem)
    if not path.is_file():
        raise CheckpointError(f"{where} records a {TOKENIZER_FILE} that {folder} does not hold; pass "
                              "--tokenizer=PATH of the run's tokenizer.json, or --no-tokenizer")
    problems = check_files(folder, info, {TOKENIZER_FILE: 1})
    if problems:
        raise CheckpointError(problems[0])
    return str(path), fingerprint
