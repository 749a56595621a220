"""Every rank trains the same job (trainer.validate.ranks): 2 spawned ranks where rank 1 alone gets one more
override stop at start, both with exit 2, rank 0 printing the one line that names the key; nobody hangs. An error the
validation of one rank alone finds (its own GPU, files, config) stops both, printed by that rank (round 5: it was
never printed, and rank 0 waited in the process group's start)."""

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


def _main(rank1_extra: list[str], dump: str, every_extra: tuple[str, ...] = ()) -> tuple[int, str]:
    """trainer.cli.main on this rank (rank 1 with rank1_extra appended, every rank with every_extra): (exit code,
    what it printed)."""
    import contextlib
    import io

    from trainer.cli import main

    extra = [*every_extra, *(rank1_extra if os.environ["RANK"] == "1" else [])]
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


TP3 = "config error{}: world size 2 is not divisible by dp_replicate*cp*tp*pp = 1*1*3*1 = 3"


@pytest.mark.parametrize("rank1, every, printed", [
    (["--distributed.tp=3"], (), (None, TP3.format(" (rank 1)"))),  # rank 1's alone: printed by rank 1, with its rank
    ([], ("--distributed.tp=3",), (TP3.format(""), None)),  # every rank's: once per node, by local rank 0
    (["--data.source=shards", "--data.path=/nonexistent/shards"], (),
     (None, "error (rank 1): no shard files found at data.path='/nonexistent/shards'")),
], ids=["rank-1-config", "every-rank-config", "rank-1-data"])
def test_an_error_one_rank_found_alone_reaches_the_user_and_stops_every_rank(rank1, every, printed,
                                                                            short_tmp: Path) -> None:
    dump = str(short_tmp / "run")
    results = run_distributed(_main, world_size=2, args=(rank1, dump, every), timeout=120)
    assert [rc for rc, _ in results] == [2, 2], [out[-2000:] for _, out in results]
    for (_, out), line in zip(results, printed):
        errors = [x for x in out.splitlines() if "error" in x]
        assert errors == ([] if line is None else [errors[0]]) and (line is None or errors[0].startswith(line)), out
    assert not Path(dump).exists() or not any(Path(dump).glob("*.jsonl"))  # stopped before any model work


def _main_with_an_edit(dump: str) -> tuple[int, str]:
    """_main, with rank 1's trainer/run/step.py edited (uncommitted: the same git commit on both ranks)."""
    from trainer.validate import ranks

    if os.environ["RANK"] == "1":
        version, files = ranks.code_version()
        ranks.code_version = lambda: (version, {**files, "run/step.py": "0123456789abcdef"})
    return _main([], dump)


def test_a_rank_whose_checkout_holds_an_uncommitted_edit_stops_every_rank(short_tmp: Path) -> None:
    """Round 5: the ranks compared `git rev-parse HEAD` only, so an edited file on one node trained with the rest."""
    (rc0, out0), (rc1, out1) = run_distributed(_main_with_an_edit, world_size=2, args=(str(short_tmp / "run"),),
                                               timeout=120)
    assert (rc0, rc1) == (2, 2), (out0[-2000:], out1[-2000:])
    assert out0.splitlines()[-1].startswith(
        "config error: rank 1's trainer.source.run/step.py = \"0123456789abcdef\" differs from rank 0's \"")
    assert "(every rank must run the same code: this file differs between the ranks' checkouts" in out0
    assert "config error" not in out1
