r"""Train a byte-level BPE tokenizer locally, and export the embedded text for realistic runs.

    pip install -e '.[tokenizers]'
    python scripts/build_tokenizer.py --corpus stdlib --vocab-size 16384 --output data/stdlib_bpe
    python scripts/prepare_data.py --input data/stdlib_bpe/train.jsonl --output data/stdlib_bpe/train \
        --tokenizer data/stdlib_bpe/tokenizer.json
    python scripts/prepare_data.py --input data/stdlib_bpe/validation.jsonl --output data/stdlib_bpe/validation \
        --tokenizer data/stdlib_bpe/tokenizer.json
    python scripts/train.py --config configs/train/llama3_1b.toml --model.vocab_size=16384 \
        --data.path=data/stdlib_bpe/train --data.tokenizer=data/stdlib_bpe/tokenizer.json \
        --validation.enable=true --validation.path=data/stdlib_bpe/validation

`--corpus default|stdlib` exports the embedded text (Python's documentation, plus the
standard library's source for stdlib) as `train.jsonl` and `validation.jsonl` with the same
split training uses (validation = every 10th block of 4,096 bytes, never trained on) and
trains the tokenizer on the train part only. `--add-source DIR ...` adds every .py file under
those folders (e.g. the standard library's tests, an installed package's source) as more
documents: identical files are kept once, and a file goes to validation when the SHA-1 of its
content is 9 mod 10, so no file is in both splits.

`--input FILE|GLOB ...` trains on your own documents instead: the inputs scripts/prepare_data.py
takes (.txt, .jsonl and .parquet with --text-field; quote a glob so the shell leaves it alone).
It exports nothing, unless `--validation-split` is given: then identical documents are kept once,
a document goes to validation.jsonl when the SHA-1 of its text is 9 mod 10 and to train.jsonl
otherwise (the --add-source rule), and the tokenizer is trained on train.jsonl's part only:

    python scripts/build_tokenizer.py --input 'corpus/*.jsonl' --validation-split --vocab-size 32768 \
        --output data/my_bpe

No download either way. Bad input prints one line `error: ...` and exits 2.

The realistic FP8 parity data (docs/benchmarks/2026-11-23-fp8-parity-1b.md: 20.6M training and 3.0M validation tokens
with Python 3.11.7, torch 2.13.0, numpy 2.4.6, networkx 3.6.1) adds the stdlib tests and three packages:

    SP=$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    python scripts/build_tokenizer.py --corpus stdlib --vocab-size 32768 --output data/py_bpe \
        --add-source "$(dirname "$SP")/test" "$SP/torch" "$SP/numpy" "$SP/networkx"
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

# The checkout this script is in comes first, even when another copy of trainer is installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.data import DataError  # noqa: E402
from trainer.data.inputs import MAX_DOCUMENT_BYTES, expand_inputs, read_documents  # noqa: E402
from trainer.data.sources import DefaultTextSource, StdlibTextSource  # noqa: E402
from trainer.data.tokenizer import ByteTokenizer  # noqa: E402
from trainer.files.confine import special_file_problem  # noqa: E402

EOS = "<|endoftext|>"


def corpus_documents(corpus: str, split: str) -> list[str]:
    """The embedded corpus's documents of one split, as text (byte blocks decoded as UTF-8)."""
    source = (DefaultTextSource if corpus == "default" else StdlibTextSource)(vocab_size=258, split=split)
    tokens = source.tokens
    eos = ByteTokenizer.eos_id
    docs, start = [], 0
    boundaries = (tokens == eos).nonzero()[0].tolist() + [len(tokens)]
    for end in boundaries:
        if end > start:
            # A held-out block can cut a multi-byte character: replace, never fail.
            docs.append(bytes(tokens[start:end].astype("uint8")).decode("utf-8", errors="replace"))
        start = end + 1
    return docs


def held_out(digest: bytes) -> bool:
    """The split of --add-source and --validation-split: validation when the content's SHA-1 is 9 mod 10."""
    return int.from_bytes(digest[:8], "big") % 10 == 9


# More entries than any tokenizer in use; far larger values make the tokenizers library abort the process.
MAX_VOCAB_SIZE = 2**21


def source_documents(folders: list[str], split: str) -> list[str]:
    """Every distinct .py file under `folders` whose content hash puts it in `split` (9 mod 10 = validation)."""
    docs, seen = [], set()
    for folder in map(Path, folders):
        if not folder.is_dir():
            raise DataError(f"--add-source {folder} is not a folder")
        for path in sorted(folder.rglob("*.py")):
            if problem := special_file_problem(path, max_bytes=MAX_DOCUMENT_BYTES, what="source file"):
                raise DataError(f"--add-source: {problem}")
            raw = path.read_bytes()
            digest = hashlib.sha1(raw).digest()
            if digest in seen or not raw.strip():
                continue
            seen.add(digest)
            if held_out(digest) == (split == "validation"):
                docs.append(raw.decode("utf-8", errors="replace"))
    return docs


def input_documents(patterns: list[str], *, text_field: str) -> tuple[list[str], int]:
    """The non-empty documents of the --input files or globs, and how many files they came from."""
    paths = expand_inputs(patterns)
    docs = [text for path in paths for text in read_documents(path, text_field=text_field) if text]
    if not docs:
        raise DataError(f"the {len(paths)} input files hold no non-empty documents")
    return docs, len(paths)


def split_by_hash(docs: list[str]) -> dict[str, list[str]]:
    """Identical documents once; each in validation when its text's SHA-1 is 9 mod 10, else in train."""
    splits: dict[str, list[str]] = {"train": [], "validation": []}
    for doc in dict.fromkeys(docs):  # keeps the first of identical documents, in reading order
        splits["validation" if held_out(hashlib.sha1(doc.encode("utf-8")).digest()) else "train"].append(doc)
    return splits


def train_bpe(texts, *, vocab_size: int):
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError:
        raise DataError("training a BPE tokenizer needs the tokenizers package: pip install -e '.[tokenizers]'") from None
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def write_splits(out: Path, splits: dict[str, list[str]]) -> None:
    for split, docs in splits.items():
        with open(out / f"{split}.jsonl", "w", encoding="utf-8") as f:
            f.writelines(json.dumps({"text": d}) + "\n" for d in docs)
        print(f"wrote {out / (split + '.jsonl')}: {len(docs)} documents, {sum(map(len, docs)):,} characters")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--corpus", choices=("default", "stdlib"), help="the embedded text (exported too)")
    source.add_argument("--input", nargs="+", metavar="FILE|GLOB",
                        help="your own .txt / .jsonl / .parquet files or quoted globs (as prepare_data.py takes)")
    parser.add_argument("--add-source", nargs="+", default=[], metavar="DIR",
                        help="with --corpus: also every .py file under these folders (split by content hash)")
    parser.add_argument("--validation-split", action="store_true",
                        help="with --input: write train.jsonl and validation.jsonl (split by content hash) "
                             "and train on train.jsonl's part")
    parser.add_argument("--text-field", default="text", help="JSON field / parquet column holding the text")
    parser.add_argument("--vocab-size", type=int, default=16384)
    parser.add_argument("--output", required=True, help="folder for tokenizer.json (and the exported splits)")
    args = parser.parse_args(argv)
    if args.add_source and not args.corpus:
        parser.error("--add-source goes with --corpus (with --input, list the files yourself)")
    if args.validation_split and not args.input:
        parser.error("--validation-split goes with --input (--corpus always writes its splits)")
    if args.vocab_size < 300:
        parser.error("--vocab-size must be at least 300 (256 bytes, the EOS token and some merges)")
    if args.vocab_size > MAX_VOCAB_SIZE:
        parser.error(f"--vocab-size must be at most {MAX_VOCAB_SIZE:,} (the largest tokenizers in use have about "
                     "256,000 entries)")
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    out = Path(args.output)
    try:
        if args.corpus:
            splits = {split: corpus_documents(args.corpus, split) + source_documents(args.add_source, split)
                      for split in ("train", "validation")}
        else:
            docs, num_files = input_documents(args.input, text_field=args.text_field)
            splits = split_by_hash(docs) if args.validation_split else {"train": docs}
            print(f"read {len(docs):,} documents from {num_files} files"
                  + (f", {len(docs) - sum(map(len, splits.values())):,} of them repeats (kept once)"
                     if args.validation_split else ""))
            if not splits["train"]:
                raise DataError(f"all {len(splits['validation'])} distinct documents went to validation; "
                                "the tokenizer needs some to train on (add documents)")
        out.mkdir(parents=True, exist_ok=True)
        if args.corpus or args.validation_split:
            write_splits(out, splits)
        tok = train_bpe(splits["train"], vocab_size=args.vocab_size)
        tok.save(str(out / "tokenizer.json"))
    except (DataError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out / 'tokenizer.json'}: byte-level BPE, {tok.get_vocab_size()} entries, EOS {EOS!r}"
          + (f", trained on {out / 'train.jsonl'}" if "validation" in splits else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
