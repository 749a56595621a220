"""Every rank trains the same job (trainer.validate.ranks): 2 spawned ranks where rank 1 alone gets one more
override stop at start, both with exit 2, rank 0 printing the one line that names the key; nobody hangs."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from tests.distributed.spawn import run_distributed
from tests.helpers import FAST
from trainer.config import load_job_config

ARGS = [*FAST, "--train.steps=2"]


def _main(rank1_extra: list[str], dump: str) -> tuple[int, str]:
    """trainer.cli.main on this rank (rank 1 with rank1_extra appended): (exit code, what it printed)."""
    import contextlib
    import io

    from trainer.cli import main

    extra = rank1_extra if os.environ["RANK"] == "1" else []
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(err):
        rc = main([*ARGS, f"--job.dump_folder={dump}", *extra])
    return rc, err.getvalue()


@pytest.fixture
def short_tmp():
    """A folder whose paths stay under the line's 80 characters per value (pytest's tmp_path is longer under
    pytest-xdist, and the line elides a longer value in the middle)."""
    folder = Path(tempfile.mkdtemp(prefix="ranks-"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.parametrize("key, value", [("optimizer.lr", 1e-2), ("train.seq_len", 32), ("train.steps", 3),
                                        ("job.dump_folder", "elsewhere")])
def test_a_rank_with_another_job_stops_every_rank_in_one_line(key: str, value, short_tmp: Path) -> None:
    dump = str(short_tmp / "run")
    if key == "job.dump_folder":
        value = str(short_tmp / value)
    # The collective timeout of a start (distributed.init_timeout_seconds) is far longer: a hang fails here first.
    (rc0, out0), (rc1, out1) = run_distributed(_main, world_size=2, args=([f"--{key}={value}"], dump), timeout=120)
    assert (rc0, rc1) == (2, 2), (out0[-2000:], out1[-2000:])
    ours = getattr(getattr(load_job_config([*ARGS, f"--job.dump_folder={dump}"]), key.split(".")[0]),
                   key.split(".")[1])
    show = (lambda v: f'"{v}"') if isinstance(ours, str) else str
    line = (f"config error: rank 1's {key} = {show(value)} differs from rank 0's {show(ours)} "
            "(every rank must run the same job)")
    assert out0.splitlines()[-1] == line, out0[-2000:]
    assert out0.count("config error") == 1 and "config error" not in out1  # one line per node: local rank 0's
    assert not any(Path(dump).glob("*.jsonl")) and "step " not in out0  # stopped before any model work


def test_the_same_job_given_in_other_words_trains(tmp_path: Path) -> None:
    """Ranks compare the values they will use, not the command lines: 3e-3 and 0.003 are one learning rate."""
    dump = str(tmp_path / "run")
    (rc0, out0), (rc1, _) = run_distributed(_main, world_size=2, args=(["--optimizer.lr=0.003"], dump), timeout=120)
    assert (rc0, rc1) == (0, 0), out0[-2000:]
    assert "training finished at step 2" in out0
