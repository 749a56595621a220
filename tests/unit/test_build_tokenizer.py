"""scripts/build_tokenizer.py's sources, loaded in-process: --add-source folders deduplicated and split by content.
The script as a command (the tokenizer, the splits, its errors): tests/cli/test_build_tokenizer.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import load_script

pytest.importorskip("tokenizers")


def _script():
    return load_script("build_tokenizer")


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
