"""Where an export or an import writes: a new or empty folder, or an earlier output of the same kind.

`convert_checkpoint.py export RUN/checkpoint/step-10 RUN/checkpoint` once replaced the whole
checkpoint folder (ten checkpoints) with an export, and exited 0. So before anything is
written, the output folder is checked: it may be new, empty, or hold only what an earlier
output of the same kind holds (an export's config.json and safetensors; an import's DCP
files and checkpoint.json). Anything else (checkpoints, a step-N folder, a run's folder, a
folder with other files, a folder inside a checkpoint) is refused in one line and nothing
is touched. An earlier output is moved aside to `{out}.old` (`.old-2`, ...) when the new one
is complete: never deleted. So is a `{out}.tmp` that is not provably an interrupted output of this trainer (it lacks
the marker trainer/files/publish.py writes first: a complete checkpoint someone put there, say): moved aside to
`{out}.tmp.old`, with a warning; only a marked one is removed.

The export (trainer/hf/folder.py) and the import (trainer/checkpoint/offline.py, the model-only checkpoint it
writes) both publish through it; a checkpoint's save publishes with the same primitives (trainer/files/publish.py).
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from trainer.errors import UserError
from trainer.files.publish import PARTIAL, clear_partial, is_partial, publish, start_partial

logger = logging.getLogger("trainer.hf.output_folder")

# The names a training checkpoint folder uses (trainer/checkpoint/format.py STEP_DIR): an output named so would be
# taken for a checkpoint, or be an interrupted save, by the run that owns the folder.
_STEP_NAME = re.compile(r"step-\d+(\.tmp)?")
# Files that mark a DCP checkpoint (ours or anyone's).
_CHECKPOINT_MARKERS = ("checkpoint.json", ".metadata")


class OutputFolderError(UserError, ValueError):
    """An output folder that must not be replaced; one line, nothing touched."""


@dataclass(frozen=True)
class OutputKind:
    """What an earlier output of this kind holds, so it (and only it) may be moved aside and replaced."""

    what: str  # "a Hugging Face export"
    verb: str  # "export"
    files: re.Pattern


EXPORT = OutputKind("a Hugging Face export", "export", re.compile(
    r"config\.json|generation_config\.json|model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json"
    r"|tokenizer\.json|tokenizer_config\.json|special_tokens_map\.json"))
IMPORT = OutputKind("an imported model-only checkpoint", "import", re.compile(
    r"\.metadata|__\d+_\d+\.distcp|__\d+_checksums\.json|checkpoint\.json|tokenizer\.json"))


def _names(folder: Path, limit: int = 3) -> str:
    names = sorted(p.name + ("/" if p.is_dir() else "") for p in folder.iterdir())
    more = f", ... {len(names)} in all" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def _is_earlier(folder: Path, kind: OutputKind) -> bool:
    entries = list(folder.iterdir())
    return all(p.is_file() and kind.files.fullmatch(p.name) for p in entries)


def _why_not(out: Path, kind: OutputKind) -> str | None:
    """Why `out` must not be written (a phrase after "it "), or None."""
    if _STEP_NAME.fullmatch(out.name):
        return (f"is named like a training checkpoint ({out.name}), which a run resuming from {out.parent} would "
                "take for its own")
    for parent in out.parents:
        if any((parent / m).is_file() for m in _CHECKPOINT_MARKERS):
            return f"is inside the checkpoint {parent}"
    if not os.path.lexists(out):
        return None
    if not out.is_dir():
        return "is a file, not a folder"
    if not any(out.iterdir()) or _is_earlier(out, kind):
        return None
    steps = sorted(p.name for p in out.iterdir() if p.is_dir() and _STEP_NAME.fullmatch(p.name.split(".")[0]))
    if steps:
        return f"holds checkpoints ({', '.join(steps[:3])}{f', ... {len(steps)} in all' if len(steps) > 3 else ''})"
    if any((out / m).is_file() for m in _CHECKPOINT_MARKERS):
        return "is a checkpoint"
    return f"holds files that are not {kind.what} ({_names(out)})"


def check_output(out: str | os.PathLike, *, kind: OutputKind) -> Path:
    """`{out}.tmp`, the folder to write, once `out` may be written (see the module docstring).

    Raises OutputFolderError (one line) if `out` or `{out}.tmp` holds anything but an earlier (or
    partial) output of this kind. Cheap: the CLIs call it before reading any weights.
    """
    out = Path(os.path.abspath(out))  # "." and "dir/.." have no name to put ".tmp" after
    why = _why_not(out, kind)
    if why is None and not out.name:
        why = "is the filesystem root"
    tmp = out.with_name(out.name + ".tmp") if out.name else out
    if why is None and os.path.lexists(tmp) and not is_partial(tmp) and not (tmp.is_dir() and _is_earlier(tmp, kind)):
        why = (f"has a {tmp.name} next to it that is not a partial {kind.verb} "
               f"({_names(tmp) if tmp.is_dir() else 'a file'})")
    if why is not None:
        raise OutputFolderError(f"refusing to {kind.verb} into {out}: it {why}; nothing was changed: name a new or "
                                f"empty folder, or an earlier {kind.verb} (moved aside to NAME.old, never deleted)")
    return tmp


def prepare_output(out: str | os.PathLike, *, kind: OutputKind) -> Path:
    """check_output, then a new `{out}.tmp` to write into: an interrupted output of this trainer there is removed,
    anything else (files of this kind without the partial marker: a complete output, say) moved aside to
    `{out}.tmp.old`, never deleted."""
    tmp = check_output(out, kind=kind)
    if aside := clear_partial(tmp, tag="old"):
        logger.warning("moved %s aside to %s: it holds files of %s but not the %s marker of an interrupted %s, so it "
                       "may be a complete one (kept; delete it when done)", tmp, aside, kind.what, PARTIAL, kind.verb)
    start_partial(tmp)
    return tmp


def publish_output(tmp: Path, out: str | os.PathLike, *, kind: OutputKind) -> Path | None:
    """Rename the complete `tmp` to `out`; an earlier output there is moved aside first (returned), never deleted."""
    out = Path(os.path.abspath(out))
    if aside := publish(tmp, out, tag="old"):
        logger.warning("moved the earlier %s %s aside to %s (delete it when done)", kind.verb, out, aside)
    return aside
