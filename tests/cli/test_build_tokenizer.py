"""scripts/build_tokenizer.py run as a command: a local BPE tokenizer and the embedded text's splits as JSONL, the
splits by hash, and its one-line errors (with scripts/prepare_data.py's). Its functions in-process:
tests/unit/test_build_tokenizer.py."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, env
from trainer.data.sources import DefaultTextSource

pytest.importorskip("tokenizers")


def test_bpe_tokenizer_and_splits_feed_prepare_data(tmp_path: Path):
    out = tmp_path / "bpe"
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "build_tokenizer.py"), "--corpus", "default",
                           "--vocab-size", "1024", "--output", str(out)], capture_output=True, text=True, env=env())
    assert proc.returncode == 0, proc.stderr
    from trainer.data import build_tokenizer

    tok = build_tokenizer(str(out / "tokenizer.json"))
    assert tok.vocab_size == 1024 and tok.eos_id is not None
    docs = {split: [json.loads(line)["text"] for line in (out / f"{split}.jsonl").read_text().splitlines()]
            for split in ("train", "validation")}
    # The exported splits are exactly the byte splits training and validation read (EOS between documents).
    for split, source in (("train", DefaultTextSource(vocab_size=258)),
                          ("validation", DefaultTextSource(vocab_size=258, split="validation"))):
        text_bytes = sum(len(d.encode()) for d in docs[split])
        assert text_bytes == pytest.approx(int((source.tokens != 257).sum()), rel=1e-3), split
    sample = docs["validation"][0][:2000]
    ids = tok.encode(sample)
    assert tok.decode(ids) == sample and len(ids) < len(sample.encode()) / 2  # BPE compresses text
    prep = subprocess.run([sys.executable, str(REPO / "scripts" / "prepare_data.py"), "--input",
                           str(out / "validation.jsonl"), "--output", str(tmp_path / "shards"), "--tokenizer",
                           str(out / "tokenizer.json")], capture_output=True, text=True, env=env())
    assert prep.returncode == 0 and "vocab_size 1024" in prep.stdout, prep.stderr


def test_too_small_vocab_is_refused(tmp_path: Path):
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "build_tokenizer.py"), "--corpus", "default",
                           "--vocab-size", "100", "--output", str(tmp_path)], capture_output=True, text=True, env=env())
    assert proc.returncode == 2 and "--vocab-size must be at least 300" in proc.stderr


@pytest.mark.parametrize("argv, message", [
    (["--input", "x.txt", "--add-source", "."], "--add-source goes with --corpus"),
    (["--corpus", "default", "--validation-split"], "--validation-split goes with --input"),
])
def test_options_of_the_other_source_are_refused(tmp_path: Path, argv: list[str], message: str):
    proc = _build(*argv, "--output", str(tmp_path))
    assert proc.returncode == 2 and message in proc.stderr


def _build(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "scripts" / "build_tokenizer.py"), *args],
                          capture_output=True, text=True, env=env(), cwd=REPO)


def _held_out(text: str) -> bool:
    """The split rule, written out again: validation when the SHA-1 of the text's UTF-8 is 9 mod 10."""
    return int.from_bytes(hashlib.sha1(text.encode("utf-8")).digest()[:8], "big") % 10 == 9


def _first(texts, *, validation: bool) -> str:
    return next(t for t in texts if _held_out(t) == validation)


def test_quoted_glob_reads_every_matching_file_and_an_empty_glob_is_one_line(tmp_path: Path):
    (tmp_path / "c").mkdir()
    for name in ("a", "b"):
        (tmp_path / "c" / f"{name}.jsonl").write_text("".join(json.dumps({"body": f"{name} line {i}"}) + "\n"
                                                             for i in range(30)))
    (tmp_path / "c" / "notes.txt").write_text("not matched by the glob")
    proc = _build("--input", str(tmp_path / "c" / "*.jsonl"), "--text-field", "body", "--vocab-size", "300",
                  "--output", str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr
    assert "read 60 documents from 2 files" in proc.stdout and (tmp_path / "out" / "tokenizer.json").exists()
    assert not (tmp_path / "out" / "train.jsonl").exists()  # no --validation-split: nothing exported
    empty = _build("--input", str(tmp_path / "c" / "*.parquet"), "--output", str(tmp_path / "none"))
    assert empty.returncode == 2 and "Traceback" not in empty.stderr
    assert empty.stderr == f"error: --input {tmp_path / 'c' / '*.parquet'} matches no files\n"
    assert not (tmp_path / "none").exists()


def test_bad_input_is_the_same_error_as_prepare_data(tmp_path: Path):
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"body": "no text field"}\n')
    build = _build("--input", str(tmp_path / "bad.jsonl"), "--output", str(tmp_path / "bpe"))
    prepare = subprocess.run([sys.executable, str(REPO / "scripts" / "prepare_data.py"), "--input",
                              str(tmp_path / "bad.jsonl"), "--output", str(tmp_path / "shards")],
                             capture_output=True, text=True, env=env(), cwd=REPO)
    message = f"{tmp_path / 'bad.jsonl'}:2: no field 'text' (found: body); set --text-field\n"
    assert (build.returncode, build.stderr) == (2, f"error: {message}")
    assert (prepare.returncode, prepare.stderr) == (2, f"prepare_data.py: error: {message}")


def test_validation_split_by_hash_and_the_tokenizer_sees_train_only(tmp_path: Path):
    # The plain documents use neither q nor z; a validation document repeats "qzqzqz", a train one "kpkpkp".
    plain = [f"line {i} of some ordinary text for the trainer" for i in range(80)]
    secret = _first((f"{'qzqzqz ' * 50}{k}" for k in range(1000)), validation=True)
    control = _first((f"{'kpkpkp ' * 50}{k}" for k in range(1000)), validation=False)
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in [*plain[:40], secret, plain[0]]))
    (tmp_path / "b.txt").write_text(control)
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in [*plain[40:], secret]))
    out = tmp_path / "out"
    proc = _build("--input", str(tmp_path / "*.jsonl"), str(tmp_path / "b.txt"), "--validation-split",
                  "--vocab-size", "400", "--output", str(out))
    assert proc.returncode == 0, proc.stderr
    splits = {split: [json.loads(line)["text"] for line in (out / f"{split}.jsonl").read_text().splitlines()]
              for split in ("train", "validation")}
    distinct = {*plain, secret, control}
    # Each distinct document is in exactly one file, once, and the file is the one its hash names.
    assert sorted(splits["train"] + splits["validation"]) == sorted(distinct)
    assert all(not _held_out(t) for t in splits["train"]) and all(_held_out(t) for t in splits["validation"])
    assert secret in splits["validation"] and control in splits["train"] and len(splits["train"]) > 10
    assert "read 84 documents from 3 files, 2 of them repeats (kept once)" in proc.stdout
    assert f"wrote {out / 'validation.jsonl'}: {len(splits['validation'])} documents" in proc.stdout
    vocab = json.loads((out / "tokenizer.json").read_text())["model"]["vocab"]
    assert any("kpkp" in t for t in vocab)  # a repeated train word does become a token
    assert not [t for t in vocab if len(t) > 1 and ("q" in t or "z" in t)]  # nothing learnt from validation


def test_help_keeps_the_example_command_lines():
    proc = _build("--help")
    assert proc.returncode == 0
    lines = proc.stdout.splitlines()
    first = "    python scripts/prepare_data.py --input data/stdlib_bpe/train.jsonl --output data/stdlib_bpe/train \\"
    assert first in lines and lines[lines.index(first) + 1] == "        --tokenizer data/stdlib_bpe/tokenizer.json"
    assert ("    python scripts/build_tokenizer.py --corpus stdlib --vocab-size 32768 --output data/py_bpe \\"
            in lines)
