"""scripts/prepare_data.py run as a command: text and JSONL in, token shards out; bad JSON is one line, exit 2.
The data pipeline and the script's main in-process: tests/unit/test_data.py."""

import json
import subprocess
import sys

import numpy as np

from tests.helpers import REPO
from tests.unit.test_data import BYTE
from trainer.data import ByteTokenizer, ShardSource

SCRIPT = REPO / "scripts" / "prepare_data.py"


def _run_prepare(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], cwd=REPO, capture_output=True, text=True,
                          timeout=60)


def test_prepare_data_end_to_end(tmp_path):
    docs = ["A whole text file.\n", "first json doc", "second — with ünïcode", "third"]
    (tmp_path / "a.txt").write_text(docs[0])
    (tmp_path / "b.jsonl").write_text("".join(json.dumps({"body": d, "id": i}) + "\n" for i, d in enumerate(docs[1:])))
    result = _run_prepare("--input", tmp_path / "a.txt", tmp_path / "*.jsonl", "--output", tmp_path / "out",
                          "--text-field", "body", "--shard-tokens", "20")
    assert result.returncode == 0, result.stderr
    tok = ByteTokenizer()
    expected = [i for d in docs for i in tok.encode(d) + [tok.eos_id]]
    assert f"4 documents, {len(expected)} tokens" in result.stdout
    paths = sorted((tmp_path / "out").glob("*.bin"))
    assert [p.name for p in paths[:2]] == ["shard_00000.bin", "shard_00001.bin"]
    assert len(paths) == -(-len(expected) // 20) and f"wrote {len(paths)} shards" in result.stdout
    source = ShardSource(paths, vocab_size=258, tokenizer_fingerprint=BYTE)
    assert np.concatenate([s.tokens for s in source.shards]).tolist() == expected
    assert np.array_equal(source.get_sample(0, 5), expected[:6])


def test_prepare_data_bad_json_exits_2_with_one_line(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"text": oops}\n')
    result = _run_prepare("--input", tmp_path / "bad.jsonl", "--output", tmp_path / "out" / "shards",
                          "--shard-tokens", "4")  # shards of the first document are written before the error
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.count("\n") == 1 and f"{tmp_path / 'bad.jsonl'}:2: invalid JSON" in result.stderr
    # Nothing left behind: not the shards, nor the folders the run made (an empty one reads as an empty dataset).
    assert not (tmp_path / "out").exists()
    # A folder that was there before stays, as it was.
    (tmp_path / "mine").mkdir()
    result = _run_prepare("--input", tmp_path / "bad.jsonl", "--output", tmp_path / "mine", "--shard-tokens", "4")
    assert result.returncode == 2 and (tmp_path / "mine").is_dir() and not list((tmp_path / "mine").iterdir())
