"""The run's tokenizer in a Hugging Face export: its token ids in config.json, its files beside the weights.

A `tokenizer.json` (data.tokenizer) is copied as is, with a `tokenizer_config.json` naming
its BOS/EOS tokens, so `AutoTokenizer.from_pretrained(export)` loads it. The built-in byte
tokenizer has no file of its own: the export gets one written here (`byte_tokenizer_json`)
that gives the same ids. Read and written without the `tokenizers` package (training does
not need it either): ids come from the file's JSON, by the candidates the trainer's own
`HFTokenizer` tries.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from trainer.data.shards import DataError
from trainer.data.tokenizer import (
    _BOS_TOKENS, _EOS_TOKENS, ByteTokenizer, folder_tokenizer_problem, token_ids, tokenizer_fingerprint,
)
from trainer.hf.folder import FILE_MODE, ExportError


@dataclass(frozen=True)
class ExportTokenizer:
    spec: str
    """'byte', or the tokenizer.json path."""
    bos_id: int | None
    eos_id: int | None
    bos_token: str | None = None
    eos_token: str | None = None

    @property
    def is_file(self) -> bool:
        return self.spec != "byte"

    def describe(self) -> str:
        if not self.is_file:
            return (f"tokenizer.json of the built-in byte tokenizer (ids 0-255 are UTF-8 bytes, {self.bos_id} "
                    f"{self.bos_token}, {self.eos_id} {self.eos_token})")
        return f"tokenizer.json copied from {self.spec}"


# The byte tokenizer's ids have no names; these are Llama 3's, and both are candidates the trainer's
# HFTokenizer tries (trainer/data/tokenizer.py), so reading the export's tokenizer.json finds the same BOS/EOS.
BYTE_BOS_TOKEN = "<|begin_of_text|>"
BYTE_EOS_TOKEN = "<|end_of_text|>"


def _byte_level_alphabet() -> list[str]:
    """The character ByteLevel (GPT-2's `bytes_to_unicode`) writes for each byte 0..255.

    Printable Latin-1 bytes stand for themselves; the other 68 (controls, space, 0x7f-0xa0,
    0xad) become chr(256 + k) in byte order, so every byte is one visible character.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = (b for b in range(256) if b not in printable)
    alphabet = {b: chr(b) for b in printable} | {b: chr(256 + k) for k, b in enumerate(shifted)}
    return [alphabet[b] for b in range(256)]


def byte_tokenizer_json() -> dict:
    """A tokenizer.json (the `tokenizers` format) that encodes text as our ByteTokenizer does: id = UTF-8 byte.

    A BPE model without merges over ByteLevel's 256 byte characters, id = byte value, after a
    ByteLevel pre-tokenizer without regex split or prefix space: every byte is one token.
    The ByteLevel decoder maps them back to bytes. BOS/EOS are added tokens 256/257; as with
    any HF tokenizer, their literal text in a string encodes as the special id, where
    ByteTokenizer.encode gives its bytes. No post-processor: nothing is added on encode, as in training.
    """
    assert BYTE_BOS_TOKEN in _BOS_TOKENS and BYTE_EOS_TOKEN in _EOS_TOKENS
    special = [(ByteTokenizer.bos_id, BYTE_BOS_TOKEN), (ByteTokenizer.eos_id, BYTE_EOS_TOKEN)]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True} for i, t in special],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {c: b for b, c in enumerate(_byte_level_alphabet())}, "merges": []},
    }


def is_byte_tokenizer_json(path: Path) -> bool:
    """Whether `path` is the tokenizer.json an export of a byte-tokenizer run holds (read as JSON, not run)."""
    try:
        return json.loads(path.read_text(encoding="utf-8")) == byte_tokenizer_json()
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False


def resolve_tokenizer(spec: str, *, fingerprint: str | None = None, where: str = "the run") -> ExportTokenizer:
    """The tokenizer `spec` names ('byte' or a tokenizer.json), checked against the run's `fingerprint` if given."""
    if spec == "byte":
        return ExportTokenizer("byte", ByteTokenizer.bos_id, ByteTokenizer.eos_id, BYTE_BOS_TOKEN, BYTE_EOS_TOKEN)
    path = Path(spec)
    if not path.is_file():
        raise ExportError(f"tokenizer {path} (recorded by {where}) does not exist; pass --tokenizer=PATH of the "
                          "run's tokenizer.json, or --no-tokenizer")
    if fingerprint is not None and tokenizer_fingerprint(str(path)) != fingerprint:
        raise ExportError(f"tokenizer {path} has changed since {where} (fingerprint {tokenizer_fingerprint(str(path))}"
                          f", the run's {fingerprint}); pass --tokenizer=PATH of the run's tokenizer.json, or "
                          "--no-tokenizer")
    try:
        ids = token_ids(path)
    except DataError as e:
        raise ExportError(str(e)) from None
    bos = next((t for t in _BOS_TOKENS if t in ids), None)
    eos = next((t for t in _EOS_TOKENS if t in ids), None)
    return ExportTokenizer(str(path.resolve()), ids.get(bos), ids.get(eos), bos, eos)


def write_tokenizer_files(tok: ExportTokenizer, *, folder: Path, max_seq_len: int) -> None:
    """tokenizer.json (the run's, or the byte tokenizer's written out) and tokenizer_config.json into `folder`."""
    if tok.is_file:
        shutil.copyfile(tok.spec, folder / "tokenizer.json")
    else:
        text = json.dumps(byte_tokenizer_json(), indent=2, ensure_ascii=False)
        (folder / "tokenizer.json").write_text(text + "\n", encoding="utf-8")
    os.chmod(folder / "tokenizer.json", FILE_MODE)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tok.bos_token,
        "eos_token": tok.eos_token,
        "model_max_length": max_seq_len,
        "clean_up_tokenization_spaces": False,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    os.chmod(folder / "tokenizer_config.json", FILE_MODE)


def folder_tokenizer(folder: Path) -> dict[str, str]:
    """RunInfo's tokenizer fields for a Hugging Face folder's tokenizer.json ({} without one), which an import
    copies into its checkpoint: read only from inside the folder, a regular file of bounded size."""
    file = folder / "tokenizer.json"
    if not os.path.lexists(file):
        return {}
    if problem := folder_tokenizer_problem(file, folder):
        raise ExportError(problem)
    if is_byte_tokenizer_json(file):  # an export of a byte-tokenizer run
        return {"tokenizer": "byte", "tokenizer_fingerprint": ByteTokenizer.fingerprint}
    return {"tokenizer": str(file.resolve()), "tokenizer_fingerprint": tokenizer_fingerprint(str(file))}
