"""A checkpoint's tokenizer is its own copy: a crafted checkpoint.json cannot make an export copy a host file, and
every crafted tokenizer field, special file or oversized file is one line (issue 36, item 1; items 3 and 4 for the
tokenizer file). Export and generation run as commands (exit 2, one line, no traceback), all cases of a test in
one subprocess."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.faults.test_hostile_checkpoint import ARGS, _rewrite_checksums
from tests.helpers import REPO, env, launch

pytestmark = pytest.mark.slow

_SCRIPT_CASES = """
import contextlib, importlib.util, io, json, sys
results = {}
for name, (script, argv) in json.loads(sys.argv[1]).items():
    spec = importlib.util.spec_from_file_location(f"s_{name}", f"scripts/{script}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            rc = module.main(argv)
        except SystemExit as e:  # argparse's errors: usage and one line, exit 2
            rc = e.code
        except BaseException as e:  # a traceback the test reports
            import traceback
            traceback.print_exc(file=err)
            rc = -1
    results[name] = {"rc": rc, "stderr": err.getvalue(), "stdout": out.getvalue()}
print(json.dumps(results))
"""


def run_scripts(cases: dict[str, tuple[str, list[str]]]) -> dict[str, dict]:
    """{name: (convert_checkpoint | generate, argv)} -> {name: {"rc", "stderr", "stdout"}} of each script's main, in one
    subprocess, each within the 60 s the issue allows (a FIFO read would hang it: the timeout fails the test)."""
    proc = subprocess.run([sys.executable, "-c", _SCRIPT_CASES, json.dumps(cases)], capture_output=True, text=True,
                          env=env(), cwd=REPO, timeout=60 + 10 * len(cases))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def one_line_error(result: dict, *fragments: str) -> None:
    lines = [line for line in result["stderr"].splitlines() if line.startswith("error:")]
    assert result["rc"] == 2 and len(lines) == 1 and "Traceback" not in result["stderr"], result
    assert all(f in lines[0] for f in fragments), (fragments, lines[0])


def _tokenizer_json(path: Path) -> Path:
    from tests.unit.test_hf_moe import _tokenizer_json as word_level

    return word_level(path)


@pytest.fixture(scope="module")
def tokenizer_run(tmp_path_factory):
    """A 2-step checkpoint of a run on shards made with a tokenizer.json, and that tokenizer's bytes."""
    from trainer.data import tokenizer_fingerprint, write_shard

    tmp = tmp_path_factory.mktemp("tokrun")
    tok = _tokenizer_json(tmp / "tok.json")
    tokens = np.random.default_rng(0).integers(0, 9, 4096)
    (tmp / "data").mkdir()
    write_shard(tmp / "data" / "shard_00000.bin", tokens, vocab_size=9, tokenizer_fingerprint=tokenizer_fingerprint(
        str(tok)))
    proc = launch([*ARGS, "--data.source=shards", f"--data.path={tmp / 'data'}", f"--data.tokenizer={tok}",
                   "--train.steps=2", "--checkpoint.enable=true", "--checkpoint.interval=2",
                   f"--job.dump_folder={tmp / 'run'}"], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    original = tok.read_bytes()
    tok.write_text(tok.read_text().replace("experts", "expert"))  # edited after the run: the copy is the run's
    return tmp / "run" / "checkpoint" / "step-2", original


def test_a_checkpoint_holds_its_tokenizer_and_exports_it_when_the_original_is_gone(tokenizer_run, tmp_path):
    ckpt, original = tokenizer_run
    info = json.loads((ckpt / "checkpoint.json").read_text())
    assert info["tokenizer"]["spec"] == "tokenizer.json" and "tokenizer.json" in info["files"]
    assert (ckpt / "tokenizer.json").read_bytes() == original
    results = run_scripts({"export": ("convert_checkpoint", ["export", str(ckpt), str(tmp_path / "hf"),
                                                             "--dtype=float32"])})
    assert results["export"]["rc"] == 0, results
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == original


def _crafted(trained: Path, tmp_path: Path, name: str, tokenizer) -> Path:
    """A copy of the genuine checkpoint whose checkpoint.json records `tokenizer`, checksums rewritten to match."""
    folder = tmp_path / name
    shutil.copytree(trained, folder)
    info = json.loads((folder / "checkpoint.json").read_text())
    info["tokenizer"] = tokenizer
    (folder / "checkpoint.json").write_text(json.dumps(info))
    _rewrite_checksums(folder)
    return folder


def test_a_checkpoint_naming_a_host_file_exports_none_of_it(trained, tmp_path):
    secret = tmp_path / "credentials.json"
    secret.write_text(json.dumps({"aws_secret_access_key": "SECRET-123"}))
    from trainer.data import tokenizer_fingerprint

    outside = _crafted(trained, tmp_path, "outside", {"spec": str(secret), "fingerprint": tokenizer_fingerprint(
        str(secret))})
    cases = {
        "export": ("convert_checkpoint", ["export", str(outside), str(tmp_path / "hf")]),
        "generate": ("generate", [str(outside), "--max-new-tokens=2"]),
        "export_no_tokenizer": ("convert_checkpoint", ["export", str(outside), str(tmp_path / "hf2"),
                                                       "--no-tokenizer"]),
    }
    results = run_scripts(cases)
    for name in ("export", "generate"):
        one_line_error(results[name], f"names its tokenizer by the path '{secret}'", "--tokenizer=PATH")
    assert not (tmp_path / "hf").exists()
    assert results["export_no_tokenizer"]["rc"] == 0  # the user's own choice: no tokenizer
    exported = b"".join(p.read_bytes() for p in (tmp_path / "hf2").iterdir())
    assert b"SECRET-123" not in exported


@pytest.mark.parametrize("tokenizer", ["/etc/passwd", {"fingerprint": "x"}, {"spec": 5}, {"spec": ["a"]},
                                       {"spec": "byte", "fingerprint": 7}, {"spec": "byte", "path": "/etc/passwd"}],
                         ids=["string", "no-spec", "spec-int", "spec-list", "fingerprint-int", "extra-key"])
def test_crafted_tokenizer_fields_are_one_line(trained, tmp_path, tokenizer):
    folder = _crafted(trained, tmp_path, "crafted", tokenizer)
    results = run_scripts({"export": ("convert_checkpoint", ["export", str(folder), str(tmp_path / "hf")]),
                           "generate": ("generate", [str(folder), "--max-new-tokens=2"])})
    for result in results.values():
        one_line_error(result, '"tokenizer" must be null or {"spec": "byte" or "tokenizer.json"')


def test_a_tokenizer_copy_that_is_a_link_out_a_fifo_or_huge_is_refused(tokenizer_run, tmp_path):
    ckpt, _ = tokenizer_run
    secret = tmp_path / "secret.json"
    secret.write_text("{}")
    cases, expected = {}, {}
    for name, make, fragment in [
        ("symlink", lambda p: p.symlink_to(secret), "outside its folder"),
        ("fifo", lambda p: os.mkfifo(p), "is a named pipe (FIFO), not a regular file"),
        ("huge", lambda p: open(p, "wb").truncate(300 * 2**20), "is 300 MiB, more than the 256 MiB a tokenizer.json"),
    ]:
        folder = tmp_path / name
        shutil.copytree(ckpt, folder)
        (folder / "tokenizer.json").unlink()
        make(folder / "tokenizer.json")
        if name == "huge":
            _rewrite_checksums(folder)  # an attacker's sparse 300 MiB file, listed: the size bound still refuses it
        cases[f"{name}-export"] = ("convert_checkpoint", ["export", str(folder), str(tmp_path / f"hf-{name}")])
        cases[f"{name}-generate"] = ("generate", [str(folder), "--max-new-tokens=2"])
        expected[name] = fragment
    for case, result in run_scripts(cases).items():
        one_line_error(result, expected[case.split("-")[0]])


def test_import_refuses_a_tokenizer_linked_out_and_copies_a_genuine_one(trained, tmp_path):
    results = run_scripts({"export": ("convert_checkpoint", ["export", str(trained), str(tmp_path / "hf"),
                                                             "--dtype=float32", "--no-tokenizer"])})
    assert results["export"]["rc"] == 0, results
    hf = tmp_path / "hf"
    linked = tmp_path / "linked"
    shutil.copytree(hf, linked)
    secret = tmp_path / "secret.json"
    secret.write_text("{}")
    (linked / "tokenizer.json").symlink_to(secret)
    genuine = tmp_path / "genuine"
    shutil.copytree(hf, genuine)
    tok = _tokenizer_json(genuine / "tokenizer.json")
    results = run_scripts({
        "linked": ("convert_checkpoint", ["import", str(linked), str(tmp_path / "imported_linked")]),
        "genuine": ("convert_checkpoint", ["import", str(genuine), str(tmp_path / "imported")]),
    })
    one_line_error(results["linked"], f"{linked / 'tokenizer.json'} is a symlink to {secret}")
    assert not (tmp_path / "imported_linked").exists()
    assert results["genuine"]["rc"] == 0, results
    imported = tmp_path / "imported"
    assert (imported / "tokenizer.json").read_bytes() == tok.read_bytes()
    assert json.loads((imported / "checkpoint.json").read_text())["tokenizer"]["spec"] == "tokenizer.json"
