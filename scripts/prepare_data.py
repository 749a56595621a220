"""Tokenize text into trainer token shards.

    python scripts/prepare_data.py --input 'data/*.jsonl' --output data/shards --tokenizer byte

Inputs: .txt (one document per file), .jsonl (one document per line, field --text-field),
.parquet (column --text-field; needs pyarrow). An EOS token follows every document.
"""

import argparse
import sys
from pathlib import Path

import numpy as np

# The checkout this script is in comes first, even when another copy of trainer is installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.data import DataError, build_tokenizer, write_shard  # noqa: E402
from trainer.data.inputs import expand_inputs, read_documents  # noqa: E402
from trainer.data.shards import MAX_SHARD_VOCAB  # noqa: E402


class ShardWriter:
    """Cut a token stream into shards of exactly `shard_tokens` tokens (the last may be shorter)."""

    def __init__(self, output: Path, *, shard_tokens: int, vocab_size: int, fingerprint: str):
        self.output, self.shard_tokens = output, shard_tokens
        self.vocab_size, self.fingerprint = vocab_size, fingerprint
        self.pending: list[np.ndarray] = []
        self.num_pending = 0
        self.paths: list[Path] = []

    def add(self, tokens: np.ndarray) -> None:
        self.pending.append(tokens)
        self.num_pending += len(tokens)
        while self.num_pending >= self.shard_tokens:
            self._flush(self.shard_tokens)

    def close(self) -> None:
        if self.num_pending:
            self._flush(self.num_pending)

    def _flush(self, num_tokens: int) -> None:
        stream = np.concatenate(self.pending)
        path = self.output / f"shard_{len(self.paths):05d}.bin"
        write_shard(path, stream[:num_tokens], vocab_size=self.vocab_size, tokenizer_fingerprint=self.fingerprint)
        self.paths.append(path)
        self.pending, self.num_pending = [stream[num_tokens:]], len(stream) - num_tokens


def prepare(*, inputs: list[str], output: str, tokenizer: str, text_field: str, shard_tokens: int,
            vocab_size: int | None) -> str:
    """Tokenize `inputs` into shards under `output`; return a one-line summary."""
    tok = build_tokenizer(tokenizer)
    vocab_size = tok.vocab_size if vocab_size is None else vocab_size
    if vocab_size < tok.vocab_size:
        raise DataError(f"--vocab-size {vocab_size} is smaller than the tokenizer's vocab size {tok.vocab_size}")
    if shard_tokens < 1:
        raise DataError(f"--shard-tokens {shard_tokens} must be >= 1")
    paths = expand_inputs(inputs)
    out = Path(output)
    # Training loads every *.bin in the directory, so old shards would silently mix with new ones.
    if stale := sorted(out.glob("*.bin")):
        raise DataError(f"--output {out} already holds {len(stale)} .bin files (e.g. {stale[0].name}); "
                        "use an empty directory or delete them")
    created = [folder for folder in (out, *out.parents) if not folder.exists()]  # what a failure takes back
    out.mkdir(parents=True, exist_ok=True)
    writer = ShardWriter(out, shard_tokens=shard_tokens, vocab_size=vocab_size, fingerprint=tok.fingerprint)
    num_documents = num_empty = num_tokens = 0
    try:
        for path in paths:
            for text in read_documents(path, text_field=text_field):
                if not text:
                    num_empty += 1
                    continue
                ids = np.array(tok.encode(text) + [tok.eos_id], dtype=np.int64)
                writer.add(ids)
                num_documents += 1
                num_tokens += len(ids)
        if num_documents == 0:
            raise DataError(f"the {len(paths)} input files hold no non-empty documents")
        writer.close()
    except BaseException:
        # A partial dataset would load without complaint at training time; leave none behind, nor the folders
        # this run made for it (an empty --output left after an error reads as a dataset that came out empty).
        for written in writer.paths:
            written.unlink(missing_ok=True)
        for folder in created:  # innermost first; only if empty (another process may have written there since)
            try:
                folder.rmdir()
            except OSError:
                break
        raise
    return (f"wrote {len(writer.paths)} shards to {out}: {num_documents:,} documents, {num_tokens:,} tokens "
            f"from {len(paths)} files (skipped {num_empty} empty documents); tokenizer {tok.fingerprint}, "
            f"vocab_size {vocab_size}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--input", nargs="+", required=True, help="input files or globs (.txt, .jsonl, .parquet)")
    parser.add_argument("--output", required=True, help="directory for shard_00000.bin, ...")
    parser.add_argument("--tokenizer", default="byte", help="'byte' or a path to a HF tokenizer.json")
    parser.add_argument("--text-field", default="text", help="JSON field / parquet column holding the text")
    parser.add_argument("--shard-tokens", type=int, default=100_000_000, help="maximum tokens per shard")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="vocab size recorded in the shards (default: the tokenizer's); every id must be below it")
    args = parser.parse_args(argv)
    if args.vocab_size is not None and not 1 <= args.vocab_size <= MAX_SHARD_VOCAB:
        parser.error(f"--vocab-size must be in [1, {MAX_SHARD_VOCAB:,}]: shards store token ids as uint16 or uint32")
    try:
        summary = prepare(inputs=args.input, output=args.output, tokenizer=args.tokenizer,
                          text_field=args.text_field, shard_tokens=args.shard_tokens, vocab_size=args.vocab_size)
    except (DataError, OSError) as e:
        print(f"prepare_data.py: error: {e}", file=sys.stderr)
        return 2
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
