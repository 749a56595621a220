"""A JSON object from a file someone else wrote (a checkpoint's checkpoint.json and state.json, a Hugging Face
config.json or safetensors index, a tokenizer.json, a profiler trace), read as data: nothing in it runs, and every way
it is not an object is one line.

The caller confines the read first (trainer/files/confine.py: no symlink out of its folder, no FIFO, no file of absurd
size), says what a missing file means, and checks the object's fields; the error type is the caller's own
(CheckpointError, ExportError, DataError, ValueError), so this module imports nothing of the trainer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def json_object(text: str, *, source: Path | str, what: str, error: type[Exception],
                corrupt: type[Exception] | None = None) -> dict[str, Any]:
    """`text` (read from `source`) parsed as `what` ("a checkpoint description"), a JSON object, else one line:

        {source} is corrupted (not valid JSON: ...)            raised as `corrupt` (a torn or truncated write), or `error`
        {source} nests its values too deeply to be {what}      raised as `error` (Python's parser recurses per level)
        {source} is not {what} (a JSON list)                   raised as `error`
    """
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise (corrupt or error)(f"{source} is corrupted (not valid JSON: {e})") from None
    except RecursionError:
        raise error(f"{source} nests its values too deeply to be {what}") from None
    if not isinstance(value, dict):
        raise error(f"{source} is not {what} (a JSON {type(value).__name__})")
    return value


def read_json_object(path: Path, *, what: str, error: type[Exception],
                     corrupt: type[Exception] | None = None) -> dict[str, Any]:
    """The JSON object in the UTF-8 file `path`, or one line as `json_object` says (bytes that are not UTF-8 are
    corrupted too). A missing file raises FileNotFoundError: what its absence means is the caller's to say."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise (corrupt or error)(f"{path} is corrupted (not valid JSON: {e})") from None
    return json_object(text, source=path, what=what, error=error, corrupt=corrupt)
