"""The run's tokenizer in a Hugging Face export: its token ids in config.json, its files beside the weights.

A `tokenizer.json` (data.tokenizer) is copied as is, with a `tokenizer_config.json` naming
its BOS/EOS tokens, so `AutoTokenizer.from_pretrained(export)` loads it. The built-in byte
tokenizer has no file: the export then holds no tokenizer files, and config.json names
its BOS/EOS ids (256, 257). Read without the `tokenizers` package (training does not
need it either): ids come from the file's JSON, by the candidates the trainer's own
`HFTokenizer` tries.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from trainer.export.folder import FILE_MODE, ExportError


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
            return "no tokenizer files (the built-in byte tokenizer: ids 0-255 are UTF-8 bytes, 256 BOS, 257 EOS)"
        return f"tokenizer.json copied from {self.spec}"


def resolve_tokenizer(spec: str, *, fingerprint: str | None = None, where: str = "the run") -> ExportTokenizer:
    """The tokenizer `spec` names ('byte' or a tokenizer.json), checked against the run's `fingerprint` if given."""
    from trainer.data.tokenizer import _BOS_TOKENS, _EOS_TOKENS, ByteTokenizer, tokenizer_fingerprint

    if spec == "byte":
        return ExportTokenizer("byte", ByteTokenizer.bos_id, ByteTokenizer.eos_id)
    path = Path(spec)
    if not path.is_file():
        raise ExportError(f"tokenizer {path} (recorded by {where}) does not exist; pass --tokenizer=PATH of the "
                          "run's tokenizer.json, or --no-tokenizer")
    if fingerprint is not None and tokenizer_fingerprint(str(path)) != fingerprint:
        raise ExportError(f"tokenizer {path} has changed since {where} (fingerprint {tokenizer_fingerprint(str(path))}"
                          f", the run's {fingerprint}); pass --tokenizer=PATH of the run's tokenizer.json, or "
                          "--no-tokenizer")
    try:
        data = json.loads(path.read_text())
        ids = {t["content"]: int(t["id"]) for t in data.get("added_tokens") or []}
        vocab = (data.get("model") or {}).get("vocab")
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError, AttributeError) as e:
        raise ExportError(f"tokenizer {path} is not a tokenizer.json ({type(e).__name__}: {e})") from None
    if isinstance(vocab, dict):  # BPE, WordPiece, WordLevel; Unigram's is a list of [piece, score]
        ids = {**vocab, **ids}
    elif isinstance(vocab, list):
        ids = {**{piece[0]: i for i, piece in enumerate(vocab)}, **ids}
    bos = next((t for t in _BOS_TOKENS if t in ids), None)
    eos = next((t for t in _EOS_TOKENS if t in ids), None)
    return ExportTokenizer(str(path.resolve()), ids.get(bos), ids.get(eos), bos, eos)


def write_tokenizer_files(tok: ExportTokenizer, *, folder: Path, max_seq_len: int) -> None:
    """tokenizer.json and tokenizer_config.json into `folder` (nothing for the byte tokenizer)."""
    if not tok.is_file:
        return
    shutil.copyfile(tok.spec, folder / "tokenizer.json")
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
