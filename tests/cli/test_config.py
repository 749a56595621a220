"""A config error from the command line: one line on stderr, exit 2, no traceback (scripts/train.py as a command).
Config loading and checks in-process: tests/unit/test_config.py."""

from __future__ import annotations

import pytest

from tests.helpers import REPO, launch


@pytest.mark.parametrize(
    "args, message",
    [
        (["--train.mixed_precision=FP8"], "config error: train.mixed_precision='FP8' is not one of"),
        (["--train.bach_size=2"], "config error: unknown key [train].bach_size (did you mean batch_size?)"),
        (
            ["--config", str(REPO / "configs/train/7b_16gpu_fp8.toml"), "--distributed.tp=2"],
            "config error: FP8 + Tensor Parallelism is not yet supported",
        ),
    ],
)
def test_cli_prints_one_line_and_exits_nonzero(args: list[str], message: str) -> None:
    proc = launch(args)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert len(proc.stderr.strip().splitlines()) == 1
