"""Token shard files: a fixed 256-byte header followed by the raw token ids.

Layout (little-endian):

    offset  size  field
         0    13  magic b"TRAINERSHARD\\x00"
        13     4  format version (uint32)
        17     4  dtype code (uint32): 1 = uint16, 2 = uint32
        21     8  num_tokens (uint64)
        29     8  vocab_size (uint64)
        37     8  max_token_id (uint64)
        45    64  tokenizer fingerprint (ascii, NUL-padded)
       109   147  zero padding up to HEADER_BYTES
       256     .  num_tokens token ids of the dtype above

The header is fixed-size so that the tokens can be memory-mapped at a known offset.
"""

import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from trainer.errors import UserError

MAGIC = b"TRAINERSHARD\x00"
FORMAT_VERSION = 1
HEADER_BYTES = 256
_HEADER = struct.Struct("<13sIIQQQ64s")
_DTYPES = {1: np.dtype("<u2"), 2: np.dtype("<u4")}
_FINGERPRINT_BYTES = 64


class DataError(UserError, ValueError):
    """A user-facing data problem (bad shard, bad config, bad input file)."""


@dataclass(frozen=True)
class ShardInfo:
    path: Path
    num_tokens: int
    vocab_size: int
    max_token_id: int
    tokenizer_fingerprint: str
    tokens: np.ndarray
    """Read-only memory map of the token ids (uint16 or uint32)."""


# Token ids are stored as uint16 or uint32: a vocabulary of more ids has no shard format.
MAX_SHARD_VOCAB = 2**32


def _encode_header(*, dtype_code: int, num_tokens: int, vocab_size: int, max_token_id: int,
                   tokenizer_fingerprint: str, version: int = FORMAT_VERSION) -> bytes:
    packed = _HEADER.pack(MAGIC, version, dtype_code, num_tokens, vocab_size, max_token_id,
                          tokenizer_fingerprint.encode("ascii"))
    return packed.ljust(HEADER_BYTES, b"\x00")


def write_shard(path: str | os.PathLike, tokens: np.ndarray, *, vocab_size: int,
                tokenizer_fingerprint: str) -> Path:
    """Write `tokens` as a shard at `path`, atomically: readers never see a partial file."""
    path = Path(path)
    tokens = np.asarray(tokens)
    if tokens.ndim != 1 or tokens.size == 0 or tokens.dtype.kind not in "iu":
        raise DataError(f"cannot write shard {path}: tokens must be a non-empty 1-D integer array, "
                        f"got {tokens.dtype} of shape {tokens.shape}")
    if not tokenizer_fingerprint.isascii() or len(tokenizer_fingerprint) > _FINGERPRINT_BYTES:
        raise DataError(f"cannot write shard {path}: tokenizer fingerprint {tokenizer_fingerprint!r} "
                        f"must be ascii and at most {_FINGERPRINT_BYTES} characters")
    if not 1 <= vocab_size <= MAX_SHARD_VOCAB:
        raise DataError(f"cannot write shard {path}: vocab_size {vocab_size} is outside [1, {MAX_SHARD_VOCAB}] (token "
                        "ids are stored as uint16 or uint32)")
    min_id, max_id = int(tokens.min()), int(tokens.max())
    if min_id < 0 or max_id >= vocab_size:
        raise DataError(f"cannot write shard {path}: token ids span [{min_id}, {max_id}] "
                        f"but vocab_size is {vocab_size}; pass the tokenizer's vocab size")
    # uint16 halves disk and page-cache use for every vocab up to 65536 ids.
    dtype_code = 1 if vocab_size <= 2**16 else 2
    header = _encode_header(dtype_code=dtype_code, num_tokens=tokens.size, vocab_size=vocab_size,
                            max_token_id=max_id, tokenizer_fingerprint=tokenizer_fingerprint)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(header)
            f.write(tokens.astype(_DTYPES[dtype_code], copy=False).tobytes())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)  # only still there when writing failed
    return path


def _not_a_file(path: Path) -> str:
    """What `path` is instead of a regular file, in words ('does not exist', 'is a FIFO, not a file', ...)."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return "does not exist"
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))
    return f"is {next((name for test, name in kinds if test(mode)), 'not a regular file')}, not a file"


def open_shard(path: str | os.PathLike) -> ShardInfo:
    """Validate the header of the shard at `path` and memory-map its tokens."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"shard {path} {_not_a_file(path)}; create shards with scripts/prepare_data.py")
    with open(path, "rb") as f:
        head = f.read(HEADER_BYTES)
    if not head.startswith(MAGIC):
        raise DataError(f"{path} is not a trainer token shard; create shards with scripts/prepare_data.py")
    if len(head) < HEADER_BYTES:
        raise DataError(f"shard {path} is truncated: {len(head)} bytes is shorter than the "
                        f"{HEADER_BYTES}-byte header; re-run scripts/prepare_data.py")
    _, version, dtype_code, num_tokens, vocab_size, max_token_id, fp = _HEADER.unpack_from(head)
    if version != FORMAT_VERSION:
        raise DataError(f"shard {path} has format version {version} but this trainer reads version "
                        f"{FORMAT_VERSION}; re-run scripts/prepare_data.py")
    if dtype_code not in _DTYPES:
        raise DataError(f"shard {path} has unknown dtype code {dtype_code}; re-run scripts/prepare_data.py")
    if num_tokens == 0:
        raise DataError(f"shard {path} is empty (0 tokens); delete it or re-run scripts/prepare_data.py")
    dtype = _DTYPES[dtype_code]
    expected, actual = HEADER_BYTES + num_tokens * dtype.itemsize, path.stat().st_size
    if actual != expected:
        raise DataError(f"shard {path} is truncated or corrupt: header says {num_tokens} tokens "
                        f"({expected} bytes) but the file has {actual} bytes; re-run scripts/prepare_data.py")
    fingerprint = fp.rstrip(b"\x00")
    if not fingerprint.isascii():
        raise DataError(f"shard {path} is corrupt: its header's tokenizer fingerprint field (bytes 45-108) holds "
                        f"non-ASCII bytes {fingerprint[:16]!r}; re-run scripts/prepare_data.py")
    tokens = np.memmap(path, dtype=dtype, mode="r", offset=HEADER_BYTES, shape=(num_tokens,))
    return ShardInfo(path=path, num_tokens=num_tokens, vocab_size=vocab_size, max_token_id=max_token_id,
                     tokenizer_fingerprint=fingerprint.decode("ascii"), tokens=tokens)


def scan_shard_tokens(shard: ShardInfo, *, chunk_tokens: int = 1 << 26) -> int:
    """Check the tokens against the header's max_token_id, reading the memory map in chunks; returns the tokens'
    checksum in the same pass: their bytes as little-endian 64-bit words (the tail zero-padded), summed modulo 2**64.

    A header can lie (a bad writer, a dtype switched with the size kept consistent): the
    first batch would then index past the embedding table. At ~1 GB/s of page cache this
    costs well under a second per GB of tokens, once, before training starts. The checksum (a shard's fingerprint,
    trainer.data.sources) changes with any byte changed anywhere in the file; it misses whole words trading places.
    """
    tokens, checksum = shard.tokens, 0
    for start in range(0, len(tokens), chunk_tokens):
        chunk = tokens[start:start + chunk_tokens]
        if int(chunk.max()) > shard.max_token_id:
            offset = start + int(np.argmax(chunk > shard.max_token_id))
            raise DataError(
                f"shard {shard.path} holds token id {int(tokens[offset])} at token offset {offset}, above the "
                f"max_token_id={shard.max_token_id} its header declares: the shard is corrupt; re-run "
                "scripts/prepare_data.py"
            )
        checksum += word_sum(np.asarray(chunk).view(np.uint8))
    return checksum % 2**64


def word_sum(data: np.ndarray) -> int:
    """The bytes `data` (uint8) as little-endian 64-bit words, the last zero-padded, summed (numpy wraps the sum
    modulo 2**64, as the caller reduces it)."""
    whole = len(data) // 8 * 8
    return int(data[:whole].view("<u8").sum(dtype=np.uint64)) + int.from_bytes(data[whole:].tobytes(), "little")
