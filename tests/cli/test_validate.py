"""The command line's answers before any training: an unreadable config, --help and no arguments, each as a short
answer with the right exit code (scripts/train.py as a command). The validation pass in-process:
tests/unit/test_validate.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.helpers import launch
from trainer.config import load_job_config
from trainer.errors import ConfigError


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda p: p.write_bytes(b"[train]\nsteps = 1\n# \xff\xfe\n"), "is not UTF-8 text"),
        (lambda p: p.mkdir(), "is not a regular file"),
        (lambda p: os.mkfifo(p), "is not a regular file"),  # a FIFO would hang the read (issue 36, item 3)
        (lambda p: None, "does not exist"),
    ],
    ids=["non-utf8", "directory", "fifo", "missing"],
)
def test_unreadable_config_is_one_line(tmp_path: Path, make, message: str) -> None:
    path = tmp_path / "c.toml"
    make(path)
    with pytest.raises(ConfigError, match=message):
        load_job_config(["--config", str(path)])
    proc = launch(["--config", str(path)])
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"config error: {proc.stderr.strip().removeprefix('config error: ')}"
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr + proc.stdout


def test_help_lists_sections_and_keys() -> None:
    for flag in ("--help", "-h"):
        proc = launch([flag])
        assert proc.returncode == 0, proc.stderr
        assert "usage:" in proc.stdout and "--section.key=value" in proc.stdout and "docs/config.md" in proc.stdout
        assert "  distributed  " in proc.stdout
    proc = launch(["--help", "train"])
    assert proc.returncode == 0
    assert "--train.batch_size=8" in proc.stdout and "--train.steps=100" in proc.stdout
    assert "--optimizer.lr" not in proc.stdout
    bad = launch(["--help", "trian"])
    assert bad.returncode == 2 and "unknown section [trian] (did you mean train?)" in bad.stderr


def test_no_arguments_prints_usage_and_trains_nothing(tmp_path: Path) -> None:
    proc = launch([])
    assert proc.returncode == 2
    assert proc.stderr.startswith("usage:") and proc.stdout == ""
