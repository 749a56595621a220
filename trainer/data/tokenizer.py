"""Tokenizers: a dependency-free byte tokenizer and a wrapper around a HF tokenizer.json."""

import hashlib
from pathlib import Path

from trainer.data.shards import DataError
from trainer.files.confine import outside_problem, special_file_problem
from trainer.files.json_object import read_json_object

# Tried in order; the first one the vocabulary has is the end-of-document token.
_EOS_TOKENS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>")
_BOS_TOKENS = ("<|begin_of_text|>", "<|startoftext|>", "<s>", "<bos>", "<|bos|>")


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; 256 and 257 are BOS and EOS."""

    vocab_size = 258
    bos_id = 256
    eos_id = 257
    fingerprint = "byte-v1"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        # Special ids have no bytes; a window may also cut a multi-byte character in half.
        return bytes(int(i) for i in ids if i < 256).decode("utf-8", errors="replace")


def bytes_fingerprint(data: bytes) -> str:
    """The fingerprint of a tokenizer.json with these bytes (what shard headers and checkpoints record)."""
    return "hf-sha256:" + hashlib.sha256(data).hexdigest()[:16]


def _file_fingerprint(path: Path) -> str:
    return bytes_fingerprint(path.read_bytes())


class HFTokenizer:
    """A HF `tokenizers` tokenizer.json; needs the optional `tokenizers` package."""

    def __init__(self, path: str | Path):
        path = Path(path)
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise DataError("reading tokenizer.json needs the optional extra: pip install 'trainer[tokenizers]'") from None
        try:
            self._tokenizer = Tokenizer.from_file(str(path))
        except Exception as e:  # the Rust bindings raise a bare Exception for every parse error
            raise DataError(f"could not read tokenizer {path}: {e}") from None
        self.path = path
        self.fingerprint = _file_fingerprint(path)
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        self.bos_id = self._first_token_id(_BOS_TOKENS)
        self.eos_id = self._first_token_id(_EOS_TOKENS)
        if self.eos_id is None:
            raise DataError(f"tokenizer {path} has none of the end-of-document tokens {', '.join(_EOS_TOKENS)}; "
                            "add one to its vocabulary so documents can be separated")

    def _first_token_id(self, candidates) -> int | None:
        ids = (self._tokenizer.token_to_id(t) for t in candidates)
        return next((i for i in ids if i is not None), None)

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)


# More than any tokenizer.json in use (Gemma 3's, among the largest, is 33 MB): reading a bigger "tokenizer" whole
# (it is parsed as JSON) could exhaust the host's memory.
MAX_TOKENIZER_BYTES = 256 * 2**20


def folder_tokenizer_problem(path: Path, folder: Path) -> str | None:
    """Why a tokenizer.json of a checkpoint or model folder is not read (it resolves outside the folder, it is no
    regular file, it is too large), or None."""
    return outside_problem(path, folder=folder) or special_file_problem(path, max_bytes=MAX_TOKENIZER_BYTES,
                                                                        what="tokenizer.json")


def _tokenizer_path(spec: str) -> Path:
    path = Path(spec)
    if problem := special_file_problem(path, max_bytes=MAX_TOKENIZER_BYTES, what="tokenizer.json"):
        raise DataError(problem)
    if not path.is_file():
        raise DataError(f"tokenizer file {spec} not found; set data.tokenizer to 'byte' or the path of a tokenizer.json")
    return path


def build_tokenizer(spec: str) -> ByteTokenizer | HFTokenizer:
    """`spec` is "byte" or a path to a HF tokenizer.json."""
    return ByteTokenizer() if spec == "byte" else HFTokenizer(_tokenizer_path(spec))


def token_ids(path: str | Path) -> dict[str, int]:
    """A tokenizer.json's token ids by text, read as JSON (no `tokenizers` package, nothing run): its model's
    vocabulary (BPE, WordPiece and WordLevel map text to id; Unigram lists [piece, score]), then its added
    tokens, which win."""
    if problem := special_file_problem(Path(path), max_bytes=MAX_TOKENIZER_BYTES, what="tokenizer.json"):
        raise DataError(problem)
    try:
        data = read_json_object(Path(path), what="a tokenizer.json", error=DataError)
    except OSError as e:
        raise DataError(f"tokenizer {path} is not a tokenizer.json ({type(e).__name__}: {e})") from None
    try:
        vocab = (data.get("model") or {}).get("vocab")
        ids = {piece[0]: i for i, piece in enumerate(vocab)} if isinstance(vocab, list) else {}
        ids |= {k: int(v) for k, v in vocab.items()} if isinstance(vocab, dict) else {}
        return ids | {t["content"]: int(t["id"]) for t in data.get("added_tokens") or []}
    except (ValueError, TypeError, KeyError, AttributeError, IndexError) as e:
        raise DataError(f"tokenizer {path} is not a tokenizer.json ({type(e).__name__}: {e})") from None


def eos_id(spec: str) -> int:
    """The end-of-document id of tokenizer `spec` ("byte" or a tokenizer.json): the first of _EOS_TOKENS it has."""
    if spec == "byte":
        return ByteTokenizer.eos_id
    ids = token_ids(_tokenizer_path(spec))
    found = next((ids[t] for t in _EOS_TOKENS if t in ids), None)
    if found is None:
        raise DataError(f"tokenizer {spec} has none of the end-of-document tokens {', '.join(_EOS_TOKENS)}, which "
                        "data.eod_mask_loss needs")
    return found


def tokenizer_fingerprint(spec: str) -> str:
    """The fingerprint `build_tokenizer(spec)` would have, without needing the `tokenizers` package.

    Training only compares fingerprints against shard headers, so it should not need the
    optional package that only data preparation uses.
    """
    return ByteTokenizer.fingerprint if spec == "byte" else _file_fingerprint(_tokenizer_path(spec))
