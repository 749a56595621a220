"""A JSON object from a file someone else wrote (a checkpoint's checkpoint.json and state.json, a Hugging Face
config.json or safetensors index, a tokenizer.json, a profiler trace, a run's wandb_run.json and .trainer.lock), read
as data: nothing in it runs, and every way it is not an object is one line. `json_lines` reads a JSON-lines file (a
run's metrics.jsonl) the same way, a line at a time: each line that is not an object is one line naming the file and
the line, and a file of any size needs the memory of one line.

The caller confines the read first (trainer/files/confine.py: no symlink out of its folder, no FIFO, no file of absurd
size), says what a missing file means, and checks the object's fields; the error type is the caller's own
(CheckpointError, ExportError, DataError, ValueError), so this module imports nothing of the trainer.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MAX_LINE_BYTES = 2**20
"""The longest line `json_lines` parses (a metrics row is well under 10 KiB); a longer one is a problem, skipped
without being held in memory."""


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


@dataclass(frozen=True)
class JsonLine:
    """One line of a JSON-lines file: where it is, and its object or why it is not one."""

    number: int
    """1 for the first line."""
    start: int
    end: int
    """Its bytes in the file: [start, end), its newline included."""
    value: dict[str, Any] | None
    problem: str | None
    """None with a value; else one line naming the file and the line: "{file} line 7 is not UTF-8 text (...)"."""
    ended: bool
    """It ends with a newline: a last line without one may be a write cut short."""


class _NotAnObject(Exception):
    pass


def json_lines(path: Path, *, what: str, max_line_bytes: int = MAX_LINE_BYTES) -> Iterator[JsonLine]:
    """Each line of the JSON-lines file `path` as a `JsonLine`: its object (`what`, "a metrics row"), or the problem
    (not UTF-8, not JSON, nested too deeply, not an object, empty, longer than `max_line_bytes`). The caller confines
    the read first (trainer/files/confine.py: a regular file; a FIFO would block here)."""
    with open(path, "rb") as f:
        number, offset = 0, 0
        while raw := f.readline(max_line_bytes + 1):
            number, start = number + 1, offset
            where = f"{path} line {number}"
            long = len(raw) > max_line_bytes and not raw.endswith(b"\n")
            while long and not raw.endswith(b"\n") and (more := f.readline(max_line_bytes)):
                offset, raw = offset + len(raw), more  # the rest of the long line, a piece at a time
            offset += len(raw)
            ended = raw.endswith(b"\n")
            if long:
                yield JsonLine(number, start, offset, None, f"{where} is longer than {max_line_bytes:,} bytes, "
                               f"more than {what} may be", ended)
                continue
            value, problem = None, None
            try:
                text = raw.decode("utf-8")
                if not text.strip():
                    raise _NotAnObject(f"{where} is empty, not {what}")
                value = json_object(text, source=where, what=what, error=_NotAnObject)
            except UnicodeDecodeError as e:
                problem = f"{where} is not UTF-8 text ({e.reason} at byte {e.start}), not {what}"
            except _NotAnObject as e:
                problem = str(e)
            yield JsonLine(number, start, offset, value, problem, ended)
