import hashlib
import importlib.util
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers import load_script
from trainer.data import (
    ByteTokenizer, DataError, DefaultTextSource, HFTokenizer, ShardSource, SyntheticSource, TokenDataLoader,
    build_data_loader, build_source, build_tokenizer, open_shard, tokenizer_fingerprint, write_shard,
)
from trainer.data import shards

BYTE = ByteTokenizer.fingerprint


def _load_prepare_data():
    return load_script("prepare_data")


prepare_data = _load_prepare_data()


def _arange_source(tmp_path, num_tokens=101, seq_len=4):
    """A shard whose token i is i, so a sample is identified by its first token (= index * seq_len)."""
    path = write_shard(tmp_path / "a.bin", np.arange(num_tokens), vocab_size=1024, tokenizer_fingerprint=BYTE)
    return ShardSource([path], vocab_size=1024, tokenizer_fingerprint=BYTE)


def _loader(source, **overrides):
    kwargs = dict(seq_len=4, batch_size=4, grad_accum_steps=1, dp_rank=0, dp_degree=1, seed=0)
    return TokenDataLoader(source, **{**kwargs, **overrides})


def _step_rows(source, step, *, dp_degree, **overrides):
    """All rows (inputs + last label) of one step over every rank, in (microbatch, rank) order."""
    rows = {}
    for rank in range(dp_degree):
        loader = _loader(source, dp_rank=rank, dp_degree=dp_degree, **overrides)
        for _ in range(step):
            loader.next_batch()
        for m, (inputs, labels) in enumerate(loader.next_batch()):
            rows[m, rank] = torch.cat([inputs, labels[:, -1:]], dim=1)
    return torch.cat([rows[key] for key in sorted(rows)])


def _assert_one_line_naming(excinfo, name):
    message = str(excinfo.value)
    assert str(name) in message and "\n" not in message, message


# --- tokenizers -------------------------------------------------------------------------------------------------


def test_byte_tokenizer_roundtrip_and_specials():
    tok = build_tokenizer("byte")
    ids = tok.encode("héllo")
    assert ids == list("héllo".encode()) and (tok.bos_id, tok.eos_id, tok.vocab_size) == (256, 257, 258)
    assert tok.decode(ids + [tok.eos_id]) == "héllo"
    assert tok.fingerprint == tokenizer_fingerprint("byte") == "byte-v1"


def test_tokenizer_missing_file_is_named(tmp_path):
    with pytest.raises(DataError) as excinfo:
        build_tokenizer(str(tmp_path / "nope.json"))
    _assert_one_line_naming(excinfo, tmp_path / "nope.json")


def test_hf_fingerprint_is_file_hash_and_needs_no_package(tmp_path):
    path = tmp_path / "tokenizer.json"
    path.write_text("{}")
    assert tokenizer_fingerprint(str(path)) == "hf-sha256:" + hashlib.sha256(b"{}").hexdigest()[:16]


def test_hf_tokenizer_without_package_says_how_to_install(tmp_path):
    if importlib.util.find_spec("tokenizers") is not None:
        pytest.skip("tokenizers is installed")
    path = tmp_path / "tokenizer.json"
    path.write_text("{}")
    with pytest.raises(DataError, match=r"pip install 'trainer\[tokenizers\]'"):
        HFTokenizer(path)


# --- shards -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("vocab_size, dtype", [(258, np.uint16), (65536, np.uint16), (100_000, np.uint32)])
def test_shard_roundtrip(tmp_path, vocab_size, dtype):
    tokens = np.random.default_rng(0).integers(0, vocab_size, 1000)
    write_shard(tmp_path / "s.bin", tokens, vocab_size=vocab_size, tokenizer_fingerprint="hf-sha256:abc")
    shard = open_shard(tmp_path / "s.bin")
    assert shard.tokens.dtype == dtype and np.array_equal(shard.tokens, tokens)
    assert (shard.num_tokens, shard.vocab_size, shard.max_token_id, shard.tokenizer_fingerprint) == (
        1000, vocab_size, tokens.max(), "hf-sha256:abc")
    assert (tmp_path / "s.bin").stat().st_size == shards.HEADER_BYTES + 1000 * np.dtype(dtype).itemsize
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.bin"]  # the temporary file was renamed away


def _missing(path):
    pass


def _not_a_shard(path):
    path.write_text("hello world, definitely not tokens\n" * 20)


def _truncated(path):
    write_shard(path, np.arange(100), vocab_size=258, tokenizer_fingerprint=BYTE)
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 10)


def _truncated_header(path):
    write_shard(path, np.arange(100), vocab_size=258, tokenizer_fingerprint=BYTE)
    with open(path, "r+b") as f:
        f.truncate(100)


def _empty(path):
    path.write_bytes(shards._encode_header(dtype_code=1, num_tokens=0, vocab_size=258, max_token_id=0,
                                           tokenizer_fingerprint=BYTE))


def _future_version(path):
    path.write_bytes(shards._encode_header(dtype_code=1, num_tokens=1, vocab_size=258, max_token_id=0,
                                           tokenizer_fingerprint=BYTE, version=99) + b"\x00\x00")


@pytest.mark.parametrize("make, expected", [
    (_missing, "does not exist"),
    (_not_a_shard, "not a trainer token shard; create shards with scripts/prepare_data.py"),
    (_truncated, r"truncated.*\(456 bytes\) but the file has 446 bytes; re-run scripts/prepare_data.py"),
    (_truncated_header, "truncated"),
    (_empty, "is empty"),
    (_future_version, "format version 99"),
])
def test_bad_shard_raises_data_error_naming_the_file(tmp_path, make, expected):
    path = tmp_path / "bad.bin"
    make(path)
    with pytest.raises(DataError, match=expected) as excinfo:
        open_shard(path)
    _assert_one_line_naming(excinfo, path)
    # ShardSource reports the same error at construction, i.e. before training starts.
    with pytest.raises(DataError, match=expected):
        ShardSource([path], vocab_size=258, tokenizer_fingerprint=BYTE)


def test_a_shard_path_that_is_no_file_says_what_it_is(tmp_path):
    """A directory, a FIFO or a device matched as data (data.path=/dev/zero, a folder named x.bin) was reported
    as "does not exist" (issue 39 item 6)."""
    import os

    folder = tmp_path / "folder.bin"
    folder.mkdir()
    fifo = tmp_path / "pipe.bin"
    os.mkfifo(fifo)
    for path, what in ((folder, "a directory"), (fifo, r"a FIFO \(named pipe\)"),
                       (Path("/dev/zero"), "a character device")):
        with pytest.raises(DataError, match=rf"^shard {path} is {what}, not a file; create shards with") as excinfo:
            open_shard(path)
        _assert_one_line_naming(excinfo, path)


def test_write_shard_refuses_ids_outside_vocab(tmp_path):
    with pytest.raises(DataError, match="vocab_size is 258"):
        write_shard(tmp_path / "s.bin", np.array([1, 300]), vocab_size=258, tokenizer_fingerprint=BYTE)
    with pytest.raises(DataError, match="integer array"):
        write_shard(tmp_path / "s.bin", np.array([1.5]), vocab_size=258, tokenizer_fingerprint=BYTE)
    assert not list(tmp_path.iterdir())


def test_shard_source_rejects_token_id_beyond_model_vocab(tmp_path):
    path = write_shard(tmp_path / "s.bin", np.array([1, 128000]), vocab_size=128256, tokenizer_fingerprint=BYTE)
    with pytest.raises(DataError, match="has token id 128000 but the model.s vocabulary has 512 entries; set --model.vocab_size=128256") as excinfo:
        ShardSource([path], vocab_size=512, tokenizer_fingerprint=BYTE)
    _assert_one_line_naming(excinfo, path)


def test_shard_source_rejects_other_tokenizer(tmp_path):
    path = write_shard(tmp_path / "s.bin", np.arange(10), vocab_size=258, tokenizer_fingerprint="hf-sha256:aaaa")
    with pytest.raises(DataError, match="written with tokenizer hf-sha256:aaaa but data.tokenizer is byte-v1") as e:
        ShardSource([path], vocab_size=258, tokenizer_fingerprint=BYTE)
    _assert_one_line_naming(e, path)


# --- sources ----------------------------------------------------------------------------------------------------


def test_shard_source_windows_match_reference(tmp_path):
    seq_len = 3
    streams = [np.arange(10), np.arange(100, 107), np.arange(200, 203), np.arange(300, 304)]
    paths = [write_shard(tmp_path / f"{i}.bin", s, vocab_size=1024, tokenizer_fingerprint=BYTE)
             for i, s in enumerate(streams)]
    # Reversed on purpose: the source orders shards by path. The 3-token shard holds no window.
    source = ShardSource(paths[::-1], vocab_size=1024, tokenizer_fingerprint=BYTE)
    expected = [s[k * seq_len: k * seq_len + seq_len + 1] for s in streams for k in range((len(s) - 1) // seq_len)]
    assert source.num_samples(seq_len) == len(expected) == 3 + 2 + 0 + 1
    for i, want in enumerate(expected):
        got = source.get_sample(i, seq_len)
        assert got.dtype == np.int64 and np.array_equal(got, want)
    with pytest.raises(IndexError):
        source.get_sample(len(expected), seq_len)


def test_shard_source_too_short_for_one_sample(tmp_path):
    path = write_shard(tmp_path / "s.bin", np.arange(8), vocab_size=258, tokenizer_fingerprint=BYTE)
    with pytest.raises(DataError, match=r"seq_len\+1 = 9 tokens"):
        ShardSource([path], vocab_size=258, tokenizer_fingerprint=BYTE).num_samples(8)


def test_default_source_is_pydoc_topics():
    from pydoc_data.topics import topics

    source = DefaultTextSource(vocab_size=258)
    text = "".join(topics[k] + "\0" for k in sorted(topics))  # NUL stands in for EOS
    held_out = DefaultTextSource(vocab_size=258, split="validation")
    assert source.num_tokens + held_out.num_tokens == len(text.encode())
    sample = source.get_sample(5, 64)
    decoded = ByteTokenizer().decode(sample)
    assert len(sample) == 65 and sample.max() < 258 and decoded in text.replace("\0", "")
    assert source.get_sample(0, 64)[0] == topics[sorted(topics)[0]].encode()[0]
    with pytest.raises(DataError, match=r"set --model.vocab_size=258 \(or more\) or --data.source=synthetic"):
        DefaultTextSource(vocab_size=100)


def test_synthetic_source_depends_only_on_seed_and_index():
    a, b = SyntheticSource(vocab_size=50, seed=1), SyntheticSource(vocab_size=50, seed=1)
    assert np.array_equal(a.get_sample(123, 16), b.get_sample(123, 16))
    assert not np.array_equal(a.get_sample(123, 16), a.get_sample(124, 16))
    assert not np.array_equal(a.get_sample(123, 16), SyntheticSource(vocab_size=50, seed=2).get_sample(123, 16))
    assert a.get_sample(0, 1000).max() < 50 and a.num_samples(16) >= 2**35


# --- loader -----------------------------------------------------------------------------------------------------


def test_batch_shapes_and_label_shift(tmp_path):
    batch = _loader(_arange_source(tmp_path), batch_size=3, grad_accum_steps=2).next_batch()
    assert len(batch) == 2
    for inputs, labels in batch:
        assert inputs.shape == labels.shape == (3, 4) and inputs.dtype == labels.dtype == torch.long
        assert torch.equal(inputs[:, 1:], labels[:, :-1]) and torch.equal(labels, inputs + 1)


def test_positions_follow_the_documented_mapping(tmp_path):
    # Reference for the contract in loader.py: position p -> permutation_{p // n}[p % n], where
    # microbatch m of rank r takes step positions [(m * dp + r) * B, (m * dp + r + 1) * B).
    source = _arange_source(tmp_path)
    n, seed, B, dp, accum = source.num_samples(4), 7, 3, 2, 2
    for rank in range(dp):
        loader = _loader(source, seed=seed, batch_size=B, dp_rank=rank, dp_degree=dp, grad_accum_steps=accum)
        for step in range(6):  # 6 steps * 12 samples crosses two epoch boundaries (n = 25)
            for m, (inputs, _) in enumerate(loader.next_batch()):
                start = step * B * dp * accum + (m * dp + rank) * B
                want = [np.random.default_rng([seed, p // n]).permutation(n)[p % n] * 4 for p in range(start, start + B)]
                assert inputs[:, 0].tolist() == want


def test_same_seed_same_batches_other_seed_differs():
    source = DefaultTextSource(vocab_size=258)
    a, b, c = (_loader(source, seed=s, seq_len=32) for s in (1, 1, 2))
    for _ in range(3):
        batch_a, batch_b, batch_c = a.next_batch(), b.next_batch(), c.next_batch()
        assert torch.equal(batch_a[0][0], batch_b[0][0]) and torch.equal(batch_a[0][1], batch_b[0][1])
        assert not torch.equal(batch_a[0][0], batch_c[0][0])


@pytest.mark.parametrize("make_source", [_arange_source, lambda _: SyntheticSource(vocab_size=1000, seed=3)])
def test_step_samples_depend_only_on_global_batch(tmp_path, make_source):
    source = make_source(tmp_path)
    for step in range(3):
        reference = _step_rows(source, step, dp_degree=1, batch_size=8)
        for split in (dict(dp_degree=2, batch_size=4), dict(dp_degree=1, batch_size=4, grad_accum_steps=2),
                      dict(dp_degree=2, batch_size=2, grad_accum_steps=2), dict(dp_degree=4, batch_size=2)):
            rows = _step_rows(source, step, **split)
            assert sorted(map(tuple, rows.tolist())) == sorted(map(tuple, reference.tolist()))  # exact multiset
            assert set(map(tuple, rows.tolist())) == set(map(tuple, reference.tolist()))
            assert torch.equal(rows, reference)  # and even the same order, (microbatch, rank)-major


def test_rank_slices_are_disjoint(tmp_path):
    source = _arange_source(tmp_path, num_tokens=1001)  # 250 samples, no epoch wrap in 3 steps of 32
    seen = [set(), set(), set(), set()]
    for rank in range(4):
        loader = _loader(source, dp_rank=rank, dp_degree=4, batch_size=4, grad_accum_steps=2)
        for _ in range(3):
            seen[rank] |= {row[0] for inputs, _ in loader.next_batch() for row in inputs.tolist()}
    assert all(len(s) == 3 * 2 * 4 for s in seen)
    assert len(set.union(*seen)) == sum(map(len, seen))


def test_epoch_wraparound_covers_every_sample_once_per_epoch(tmp_path):
    source = _arange_source(tmp_path)  # 25 samples; batch 4 does not divide it, so batches straddle epochs
    loader = _loader(source, batch_size=4)
    firsts = [row for _ in range(25) for inputs, _ in loader.next_batch() for row in inputs[:, 0].tolist()]
    epochs = [firsts[i: i + 25] for i in range(0, 100, 25)]
    for epoch in epochs:
        assert sorted(epoch) == [k * 4 for k in range(25)]
    assert len({tuple(e) for e in epochs}) == 4  # a fresh permutation every epoch


def test_no_shuffle_is_sequential(tmp_path):
    loader = _loader(_arange_source(tmp_path), batch_size=10, shuffle=False)
    firsts = [inputs[:, 0].tolist() for _ in range(3) for inputs, _ in loader.next_batch()]
    assert firsts == [[k * 4 for k in range(10)], [k * 4 for k in range(10, 20)],
                      [k * 4 for k in [20, 21, 22, 23, 24, 0, 1, 2, 3, 4]]]


def test_resume_continues_with_the_next_unseen_batch():
    source = DefaultTextSource(vocab_size=258)
    uninterrupted = _loader(source, seq_len=16, seed=5, batch_size=2, grad_accum_steps=2)
    expected = [uninterrupted.next_batch() for _ in range(4)][3]
    first = _loader(source, seq_len=16, seed=5, batch_size=2, grad_accum_steps=2)
    for _ in range(3):
        first.next_batch()
    state = first.state_dict()
    assert state == {"consumed_samples": 12, "seed": 5, "shuffle": True, "seq_len": 16, "global_batch_size": 4,
                     "num_samples": source.num_samples(16)}
    assert all(type(v) in (int, bool) for v in state.values())
    resumed = _loader(source, seq_len=16, seed=5, batch_size=2, grad_accum_steps=2)
    resumed.load_state_dict(state)
    for (x, y), (want_x, want_y) in zip(resumed.next_batch(), expected, strict=True):
        assert torch.equal(x, want_x) and torch.equal(y, want_y)
    # A different global batch size resumes at the same sample position.
    wider = _loader(source, seq_len=16, seed=5, batch_size=4)
    wider.load_state_dict(state)
    assert torch.equal(wider.next_batch()[0][0], torch.cat([x for x, _ in expected]))


@pytest.mark.parametrize("key, value", [("seq_len", 32), ("num_samples", 3), ("seed", 6)])
def test_resume_rejects_mismatched_state(key, value):
    loader = _loader(DefaultTextSource(vocab_size=258), seq_len=16, seed=5)
    state = {**loader.state_dict(), key: value}
    with pytest.raises(DataError, match=f"checkpoint has {key}={value}"):
        loader.load_state_dict(state)


def test_build_source_kinds_and_errors(tmp_path):
    common = dict(seed=0, seq_len=8, vocab_size=258)
    assert isinstance(build_source(source="default", path="", tokenizer="byte", **common), DefaultTextSource)
    assert isinstance(build_source(source="synthetic", path="", tokenizer="byte", **common), SyntheticSource)
    write_shard(tmp_path / "x.bin", np.arange(50), vocab_size=258, tokenizer_fingerprint=BYTE)
    for path in (str(tmp_path), str(tmp_path / "*.bin")):
        source = build_source(source="shards", path=path, tokenizer="byte", **common)
        loader = build_data_loader(source, seed=0, shuffle=True, seq_len=8, batch_size=2, grad_accum_steps=1,
                                   dp_rank=0, dp_degree=1)
        assert loader.num_samples == 6
    with pytest.raises(DataError, match="prepare_data.py") as excinfo:
        build_source(source="shards", path=str(tmp_path / "empty"), tokenizer="byte", **common)
    _assert_one_line_naming(excinfo, tmp_path / "empty")
    with pytest.raises(DataError, match="no full sample of seq_len 64"):
        build_source(source="shards", path=str(tmp_path), tokenizer="byte", **{**common, "seq_len": 64})


def test_vocab_error_names_the_key_and_the_tokenizer_size(tmp_path):
    # A tokenizer of 2020 entries whose data uses ids up to 2004: the fix is the tokenizer's size.
    write_shard(tmp_path / "x.bin", np.arange(2005), vocab_size=2020, tokenizer_fingerprint=BYTE)
    with pytest.raises(DataError) as excinfo:
        build_source(source="shards", path=str(tmp_path), tokenizer="byte", seed=0, vocab_size=512, seq_len=8)
    _assert_one_line_naming(excinfo, tmp_path / "x.bin")
    assert "--model.vocab_size=2020" in str(excinfo.value)


# --- scripts/prepare_data.py -------------------------------------------------------------------------------------


@pytest.mark.parametrize("content, args, expected", [
    (None, [], "is not a file"),
    ('{"body": "x"}\n', [], r"bad.jsonl:1: no field 'text' \(found: body\); set --text-field"),
    ('{"text": 3}\n', [], "field 'text' is int, not a string"),
    ('{"text": "x"}\n', ["--vocab-size", "10"], "smaller than the tokenizer's vocab size"),
])
def test_prepare_data_bad_input(tmp_path, capsys, content, args, expected):
    if content is not None:
        (tmp_path / "bad.jsonl").write_text(content)
    assert prepare_data.main(["--input", str(tmp_path / "bad.jsonl"), "--output", str(tmp_path / "out"), *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert re.search(expected, err), err


def test_prepare_data_leaves_no_partial_dataset_and_refuses_stale_shards(tmp_path, capsys):
    (tmp_path / "a.jsonl").write_text('{"text": "0123456789"}\n' * 5 + "not json\n")
    out = tmp_path / "out"
    assert prepare_data.main(["--input", str(tmp_path / "a.jsonl"), "--output", str(out), "--shard-tokens", "8"]) == 2
    assert not out.exists()  # shards written before the bad line were removed, and the folder made for them
    out.mkdir()
    write_shard(out / "old.bin", np.arange(5), vocab_size=258, tokenizer_fingerprint=BYTE)
    (tmp_path / "b.txt").write_text("fine")
    assert prepare_data.main(["--input", str(tmp_path / "b.txt"), "--output", str(out)]) == 2
    assert "already holds 1 .bin files" in capsys.readouterr().err


def test_stdlib_source_extends_the_default_corpus():
    from trainer.data.sources import DefaultTextSource, StdlibTextSource

    default, stdlib = DefaultTextSource(vocab_size=258), StdlibTextSource(vocab_size=258)
    assert stdlib.num_tokens > 10 * default.num_tokens
    assert np.array_equal(stdlib.tokens[: default.num_tokens], default.tokens)
    text = bytes(stdlib.tokens[default.num_tokens: default.num_tokens + 20000].astype(np.uint8)).decode("utf-8", "replace")
    assert "def " in text and "import" in text  # Python source follows the topics


def _rewrite_header(path: Path, **fields) -> None:
    """Patch header fields in place, keeping the file size consistent (a lying writer)."""
    raw = bytearray(path.read_bytes())
    magic, version, dtype_code, num_tokens, vocab_size, max_token_id, fp = shards._HEADER.unpack_from(raw)
    values = dict(dtype_code=dtype_code, num_tokens=num_tokens, vocab_size=vocab_size, max_token_id=max_token_id)
    values.update(fields)
    raw[:shards.HEADER_BYTES] = shards._encode_header(tokenizer_fingerprint=fp.rstrip(b"\0").decode(), **values)
    path.write_bytes(bytes(raw))


def test_a_header_that_understates_max_token_id_is_caught_before_training(tmp_path):
    path = write_shard(tmp_path / "s.bin", np.array([1, 2, 3, 400, 5, 6]), vocab_size=512, tokenizer_fingerprint=BYTE)
    _rewrite_header(path, max_token_id=100)
    with pytest.raises(DataError) as excinfo:
        ShardSource([path], vocab_size=512, tokenizer_fingerprint=BYTE)
    _assert_one_line_naming(excinfo, path)
    assert "token id 400 at token offset 3, above the max_token_id=100" in str(excinfo.value)


def test_a_switched_dtype_is_caught_before_training(tmp_path):
    # 4 uint16 tokens rewritten as 2 uint32 tokens: same file size, ids far above the vocabulary.
    path = write_shard(tmp_path / "s.bin", np.array([7, 300, 9, 11]), vocab_size=512, tokenizer_fingerprint=BYTE)
    _rewrite_header(path, dtype_code=2, num_tokens=2)
    with pytest.raises(DataError, match="at token offset 0, above the max_token_id=300"):
        ShardSource([path], vocab_size=512, tokenizer_fingerprint=BYTE)


def test_eod_mask_loss_ignores_the_label_after_each_eos(tmp_path: Path) -> None:
    """data.eod_mask_loss: the label after an EOS input is IGNORE_INDEX, every other label is the next token; the EOS
    id comes from the tokenizer (257 for bytes; a tokenizer.json's end-of-document token, read without `tokenizers`),
    and random tokens, which have no documents, are refused in one line."""
    import json

    from trainer.config import ConfigError, load_job_config
    from trainer.data.loader import split_rows
    from trainer.data.tokenizer import eos_id
    from trainer.loss import IGNORE_INDEX

    rows = np.array([[5, 257, 7, 8, 257, 9], [257, 1, 2, 3, 4, 257]])
    inputs, labels = split_rows(rows, eod_mask_id=257)
    assert inputs.tolist() == [[5, 257, 7, 8, 257], [257, 1, 2, 3, 4]]
    assert labels.tolist() == [[257, IGNORE_INDEX, 8, 257, IGNORE_INDEX], [IGNORE_INDEX, 2, 3, 4, 257]]
    assert split_rows(rows)[1].tolist() == rows[:, 1:].tolist()
    assert eos_id("byte") == 257
    spec = tmp_path / "tokenizer.json"
    spec.write_text(json.dumps({"added_tokens": [{"id": 7, "content": "<|begin_of_text|>"},
                                                 {"id": 9, "content": "<|end_of_text|>"}],
                                "model": {"vocab": {"</s>": 3, "a": 4}}}))
    assert eos_id(str(spec)) == 9  # <|end_of_text|> comes before </s> in the order tried
    spec.write_text(json.dumps({"model": {"vocab": {"a": 4}}}))
    with pytest.raises(DataError, match="has none of the end-of-document tokens"):
        eos_id(str(spec))
    with pytest.raises(ConfigError, match=r"^data.eod_mask_loss=true needs documents .* data.source='synthetic'"):
        load_job_config(["--data.source=synthetic", "--data.eod_mask_loss=true"])
