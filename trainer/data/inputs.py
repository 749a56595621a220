"""Text inputs of the data scripts: files or quoted globs -> validated documents.

`scripts/prepare_data.py` and `scripts/build_tokenizer.py` both read `--input` through here, so they
take the same files (.txt, .jsonl, .parquet) and fail on bad input with the same one-line DataError.
"""

from __future__ import annotations

import glob
import json
from collections.abc import Iterator
from pathlib import Path

from trainer.data.shards import DataError
from trainer.files.confine import special_file_problem

EXTENSIONS = (".txt", ".jsonl", ".parquet")


def expand_inputs(patterns: list[str]) -> list[Path]:
    """The input files: each pattern is a file or a glob (quoted, so the shell leaves it alone) matching some."""
    paths = []
    for pattern in patterns:
        if glob.has_magic(pattern):
            matches = sorted(glob.glob(pattern, recursive=True))
            if not matches:
                raise DataError(f"--input {pattern} matches no files")
        elif not Path(pattern).is_file():
            raise DataError(f"--input {pattern} is not a file (pass files or globs like 'dir/*.jsonl')")
        else:
            matches = [pattern]
        for match in map(Path, matches):
            if match.suffix not in EXTENSIONS:
                raise DataError(f"--input {match} has an unsupported extension; expected one of {', '.join(EXTENSIONS)}")
            if problem := special_file_problem(match, what="data file"):  # a FIFO or /dev/zero never ends
                raise DataError(f"--input {problem}")
            paths.append(match)
    return paths


# One document (a .txt file, a .jsonl line) is read whole: a bound keeps a runaway file from exhausting memory.
MAX_DOCUMENT_BYTES = 256 * 2**20


def _text(value, *, where: str, field: str) -> str:
    if not isinstance(value, str):
        raise DataError(f"{where}: field '{field}' is {type(value).__name__}, not a string")
    return checked_text(value, where=where)


def checked_text(text: str, *, where: str) -> str:
    """`text`, unless it holds a lone surrogate (JSON's "\\ud800" decodes to one): no UTF-8 exists for it, so no
    tokenizer can encode it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise DataError(f"{where}: the text holds a lone surrogate (U+{ord(text[e.start]):04X} at character {e.start}), "
                        "which is not Unicode text; fix or drop the document") from None
    return text


def read_documents(path: Path, *, text_field: str) -> Iterator[str]:
    """Yield the documents of one input file: a .txt is one document, a .jsonl one per line, a .parquet one per row."""
    if path.suffix == ".txt":
        if path.stat().st_size > MAX_DOCUMENT_BYTES:
            raise DataError(f"{path} is {path.stat().st_size / 2**20:,.0f} MiB, more than the "
                            f"{MAX_DOCUMENT_BYTES / 2**20:,.0f} MiB a .txt document may be (it is read whole); "
                            "split it, or write one document per line of a .jsonl")
        try:
            yield path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise DataError(f"{path} is not valid UTF-8 ({e.reason} at byte {e.start})") from None
    elif path.suffix == ".jsonl":
        with open(path, "rb") as f:
            for line_number, raw in enumerate(iter(lambda: f.readline(MAX_DOCUMENT_BYTES + 1), b""), 1):
                where = f"{path}:{line_number}"
                if len(raw) > MAX_DOCUMENT_BYTES:
                    raise DataError(f"{where}: a line longer than {MAX_DOCUMENT_BYTES / 2**20:,.0f} MiB (one document "
                                    "is read whole); split the document")
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise DataError(f"{where}: not valid UTF-8 ({e.reason} at byte {e.start} of the line)") from None
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
                except RecursionError:
                    raise DataError(f"{where}: JSON nested too deeply to be a document record") from None
                if not isinstance(record, dict) or text_field not in record:
                    fields = ", ".join(record) if isinstance(record, dict) else type(record).__name__
                    raise DataError(f"{where}: no field '{text_field}' (found: {fields}); set --text-field")
                yield _text(record[text_field], where=where, field=text_field)
    else:
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise DataError(f"reading {path} needs the optional package pyarrow: pip install pyarrow") from None
        parquet = pq.ParquetFile(path)
        if text_field not in parquet.schema_arrow.names:
            raise DataError(f"{path}: no column '{text_field}' (found: {', '.join(parquet.schema_arrow.names)}); "
                            "set --text-field")
        row = 0
        for batch in parquet.iter_batches(columns=[text_field]):
            for value in batch.column(0).to_pylist():
                yield _text(value, where=f"{path} row {row}", field=text_field)
                row += 1
