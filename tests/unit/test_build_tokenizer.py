"""scripts/build_tokenizer.py: a local BPE tokenizer and the embedded text's splits as JSONL."""

from __future__ import annotations

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


def _script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("build_tokenizer", REPO / "scripts" / "build_tokenizer.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_added_sources_are_deduplicated_and_split_by_content(tmp_path: Path):
    bt = _script()
    a, b = tmp_path / "a", tmp_path / "b"
    (a / "pkg").mkdir(parents=True)
    b.mkdir()
    files = {f"def f{i}():\n    return {i}\n" for i in range(60)}
    for i, text in enumerate(sorted(files)):
        (a / "pkg" / f"m{i}.py").write_text(text)
    (b / "copy.py").write_text((a / "pkg" / "m0.py").read_text())  # the same file twice: kept once
    (b / "notes.txt").write_text("not python")  # only .py files are read
    (b / "empty.py").write_text("\n")
    train, validation = (bt.source_documents([str(a), str(b)], split) for split in ("train", "validation"))
    assert sorted(train + validation) == sorted(files)  # every distinct file once, in exactly one split
    assert 0 < len(validation) < len(train)
    # The split depends on the content alone, not on where the file lies or what else is read.
    assert bt.source_documents([str(b)], "validation") == [t for t in validation if t == (b / "copy.py").read_text()]
    with pytest.raises(bt.DataError, match="--add-source .* is not a folder"):
        bt.source_documents([str(b / "notes.txt")], "train")


def test_add_source_needs_corpus(tmp_path: Path):
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "build_tokenizer.py"), "--input", "x.txt",
                           "--add-source", str(tmp_path), "--output", str(tmp_path)],
                          capture_output=True, text=True, env=env())
    assert proc.returncode == 2 and "--add-source goes with --corpus" in proc.stderr
