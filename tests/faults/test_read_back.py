"""Issue 51, item 7: the files a run reads back, and the flags of generate.py.

Every file the program reads back goes through the one reader of untrusted files (trainer/files/confine.py: a
regular file of a bounded size; trainer/files/json_object.py: UTF-8 JSON objects, each bad line one message naming
the file and the line):

- `metrics.jsonl` with non-UTF-8 bytes, non-object lines or a non-numeric step stopped a resume with a traceback; a
  directory or a FIFO in its place did too, or hung it;
- `wandb_run.json` as a FIFO hung a resume, as a directory was a traceback, as `/dev/zero` filled the memory;
- `.trainer.lock` of gigabytes was read whole;
- `generate.py --temperature nan`, `--seed 2**70` were tracebacks;
- a `checkpoint.folder` inside another live run's folder that lies inside this run's own (`other/checkpoint`,
  relative or through a link) bypassed the lock.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from tests.faults.test_disk_and_lock import log  # noqa: F401 (a fixture)
from tests.helpers import REPO, load_script
from trainer.config import load_job_config
from trainer.metrics.logger import RunFileError, check_run_files, truncate_jsonl
from trainer.metrics.wandb_run import RUN_FILE, _saved_id
from trainer.run.lock import LOCK_NAME, RunLock, RunLockError, lock_run_folders, release_all
from trainer.run.train import train
from trainer.run.train_state import PREEMPTED_MARKER

TAIL = "(a relaunch reads {name} back and writes it again): move it away, or use another job.dump_folder"


def test_a_resume_reads_metrics_jsonl_as_data_and_keeps_what_it_cannot_read(tmp_path, log):  # noqa: F811
    jsonl = tmp_path / "metrics.jsonl"
    lines = [b'{"step": 1}', b"\xff\xfe not UTF-8", b"[1, 2]", b'{"step": "abc"}', b'{"loss": 2.5}', b'{"step": 2}',
             b'{"step": 3}', b'{"step": 4, "lo']  # the last: a write a crash cut short
    jsonl.write_bytes(b"\n".join(lines))
    truncate_jsonl(jsonl, after_step=2)
    # Rows of steps after 2 and the torn last line are dropped; every line it cannot read is kept as it was.
    assert jsonl.read_bytes() == b"\n".join(lines[:6]) + b"\n"
    kept = "kept as it is (a resume drops only rows of steps after 2)"
    assert log.lines == [
        f"{jsonl} line 2 is not UTF-8 text (invalid start byte at byte 0), not a metrics row: {kept}",
        f"{jsonl} line 3 is not a metrics row (a JSON list): {kept}",
        f"{jsonl} line 4 has step='abc', not a step number: {kept}",
        f"{jsonl} line 5 has step=None, not a step number: {kept}",
        "resumed at step 2: dropped 2 metrics.jsonl rows written after it",
    ]
    jsonl.write_bytes(b'{"step": 1}\n{"step": 2}')  # a last row without its newline is kept, and ended
    truncate_jsonl(jsonl, after_step=2)
    assert jsonl.read_bytes() == b'{"step": 1}\n{"step": 2}\n'


def test_run_files_that_are_no_regular_files_are_one_line_before_anything_is_built(tmp_path, log):  # noqa: F811
    def fifo(path: Path) -> None:
        os.mkfifo(path)

    cases = {
        ("metrics.jsonl", "directory"): (os.mkdir, "a directory"),
        ("metrics.jsonl", "fifo"): (fifo, "a named pipe (FIFO)"),
        (RUN_FILE, "fifo"): (fifo, "a named pipe (FIFO)"),
        (RUN_FILE, "directory"): (os.mkdir, "a directory"),
        (RUN_FILE, "/dev/zero"): (lambda p: p.symlink_to("/dev/zero"), "a character device"),
    }
    for (name, label), (make, kind) in cases.items():
        folder = tmp_path / f"{name}-{label.replace('/', '')}"
        folder.mkdir()
        make(folder / name)
        with pytest.raises(RunFileError) as e:
            check_run_files(folder, wandb=True)
        assert str(e.value) == (f"{folder / name} is {kind}, not a regular file; refusing to read it as a {name} "
                                + TAIL.format(name=name)), label
        if name == RUN_FILE:  # read anyway (a direct call): one warning, a new W&B run, no hang
            log.lines.clear()
            assert _saved_id(folder / name) is None
            assert log.lines == [f"metrics.wandb: {folder / name} is {kind}, not a regular file; refusing to read it as "
                                 f"a {RUN_FILE}; a new W&B run starts instead of continuing this job's"]
        else:
            with pytest.raises(RunFileError):
                truncate_jsonl(folder / name, after_step=1)
    check_run_files(tmp_path / f"{RUN_FILE}-fifo", wandb=False)  # W&B's file is not read without metrics.wandb
    marker = tmp_path / "marker"  # preempted.json: a relaunch removes it at its first step (a directory: a traceback)
    (marker / PREEMPTED_MARKER).mkdir(parents=True)
    with pytest.raises(RunFileError, match=f"{PREEMPTED_MARKER} is a directory, not a regular file"):
        check_run_files(marker, wandb=False, markers=(PREEMPTED_MARKER,))
    big = tmp_path / "big"
    big.mkdir()
    (big / RUN_FILE).write_bytes(b" " * 2**17)
    with pytest.raises(RunFileError, match=r"big/wandb_run.json is 131,072 bytes, more than the 65,536 bytes a "
                                           r"wandb_run.json may be; refusing to read it \(a relaunch"):
        check_run_files(big, wandb=True)
    bad = tmp_path / "bad" / RUN_FILE
    bad.parent.mkdir()
    for text, why in (("[1]", "is not a W&B run record (a JSON list)"), ('{"id": "../x"}', '"id"=\'../x\' is not a W&B')):
        bad.write_text(text)
        log.lines.clear()
        assert _saved_id(bad) is None and why in log.lines[0], log.lines
    # The run itself checks them before anything is built (no process group, no lock taken).
    dump = tmp_path / "metrics.jsonl-fifo"
    cfg = load_job_config(["--config", str(REPO / "configs" / "train" / "debug_model.toml"),
                           f"--job.dump_folder={dump}", "--train.steps=1"])
    with pytest.raises(RunFileError, match="metrics.jsonl is a named pipe"):
        train(cfg)
    assert not (dump / LOCK_NAME).exists()


def test_a_huge_lock_file_is_refused_unread(tmp_path):
    lock = tmp_path / LOCK_NAME
    lock.write_bytes(b"{" + b" " * 2**20)
    with pytest.raises(RunLockError) as e:
        RunLock(tmp_path).acquire()
    assert str(e.value).startswith(f"{lock} is a file of 1,048,577 bytes, not a lock file that a run writes")
    assert lock.stat().st_size == 2**20 + 1


def test_a_checkpoint_folder_inside_a_live_run_inside_this_ones_is_refused_however_spelled(tmp_path, monkeypatch):
    """Run A's folder lies inside run B's (x/a in x): B's checkpoint.folder = a/checkpoint was checked only for a lock
    of its own, and B resumed and pruned A's checkpoints."""
    monkeypatch.chdir(tmp_path)
    a = tmp_path / "x" / "a"
    (a / "checkpoint").mkdir(parents=True)
    (tmp_path / "x" / "alias").symlink_to(a)
    me = f"host {socket.gethostname()}, pid {os.getpid()}, started "
    locks = lock_run_folders(a, a / "checkpoint")
    try:
        for spelling in ("x/a/checkpoint", "x/alias/checkpoint", "x/a/../a/checkpoint", str(a / "checkpoint")):
            with pytest.raises(RunLockError) as e:
                lock_run_folders("x", spelling)
            assert str(e.value).startswith(f"checkpoint.folder {a / 'checkpoint'} is inside {a}, the folder of "
                                           f"another run ({me}"), spelling
            assert not (tmp_path / "x" / LOCK_NAME).exists()  # B released its own lock
    finally:
        release_all(locks)
    release_all(lock_run_folders("x", "x/a/checkpoint"))  # A gone: B may use it


def _generate():
    return load_script("generate")


def test_generate_flags_out_of_range_are_one_line(tmp_path, capsys):
    generate = _generate()
    cases = {
        "--temperature=nan": "--temperature=nan must be 0 (greedy) or a number in [0.0001, 10000]",
        "--temperature=inf": "--temperature=inf must be 0 (greedy) or a number in [0.0001, 10000]",
        "--temperature=1e-320": "--temperature=1e-320 must be 0 (greedy) or a number in [0.0001, 10000]",
        f"--seed={2**70}": f"--seed={2**70} must be in [0, {2**64 - 1}] (a torch generator's 64-bit seed)",
        "--seed=-1": f"--seed=-1 must be in [0, {2**64 - 1}] (a torch generator's 64-bit seed)",
        "--top-k=-1": "--max-new-tokens=200 must be >= 1 and --top-k=-1 >= 0 (0 = all tokens)",
        "--device=tpu9": "--device='tpu9' is not a device: use cpu, cuda or cuda:N",
    }
    for flag, line in cases.items():
        capsys.readouterr()
        assert generate.main([str(tmp_path / "no-such-run"), flag]) == 2, flag
        assert capsys.readouterr().err.splitlines()[-1] == f"error: {line}", flag
