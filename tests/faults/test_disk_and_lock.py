"""Issue 25, items 4, 6 and 7: export/import never replace checkpoints, a lock that survives pid reuse, a full disk.

- `convert_checkpoint.py export|import` into a folder of checkpoints, a step folder, a run's
  folder or one holding other files: refused in one line, nothing touched; an earlier export
  or import is moved aside to `{out}.old`, never deleted.
- The run lock: a lock naming a live pid that is another program now (pid reuse after a
  reboot or in a container) is reclaimed; a `.trainer.lock` directory is one line.
- A write that runs out of space (ENOSPC injected into the real file writes under DCP,
  EFBIG from `ulimit -f`) is the docs' one line, with what pruning would free; a warning
  comes before a save that will not fit; a run whose final save failed under
  `on_save_error = "continue"` exits 2.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import resource
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import FileSystem

from tests.helpers import REPO, TRAIN, env, hooks_env, load_script, read_metrics
from trainer.checkpoint import CheckpointError, CheckpointManager, RunInfo, load_model, save_model_only
from trainer.config import CheckpointSection
from trainer.models.llama import FLAVORS
from trainer.run.lock import LOCK_NAME, RunLock, RunLockError, lock_run_folders, release_all
from trainer.validate.options import checkpoint_options

DEBUG = FLAVORS["debug"]
ARGS = [
    "--config", str(REPO / "configs" / "train" / "debug_model.toml"), "--train.seq_len=32", "--train.batch_size=2",
    "--metrics.log_freq=1", "--metrics.enable_tensorboard=false", "--train.mixed_precision=fp32",
    "--checkpoint.enable=true", "--checkpoint.interval=2",
]


def _convert():
    return load_script("convert_checkpoint")


def _tree(folder: Path) -> dict[str, int]:
    """Every file under folder with its size: what must be unchanged after a refusal."""
    return {str(p.relative_to(folder)): p.stat().st_size for p in sorted(folder.rglob("*")) if p.is_file()}


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())

    @property
    def text(self) -> str:
        return "\n".join(self.lines)


@pytest.fixture
def log():
    """What the trainer's loggers say (setup_logging stops them from propagating to caplog's root handler)."""
    handler, logger = _Lines(), logging.getLogger("trainer")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)


@pytest.fixture(scope="module")
def run_folder(tmp_path_factory) -> Path:
    """A run's dump folder: config.toml and checkpoint/step-2, step-4, step-10 (model-only: what the guard sees)."""
    from trainer.hf import expected_shapes

    run = tmp_path_factory.mktemp("run")
    torch.manual_seed(0)
    weights = {k: torch.randn(shape) for k, shape in expected_shapes(DEBUG).items()}
    info = RunInfo(flavor="debug", model_args=DEBUG, mixed_precision="fp32")
    first = save_model_only(run / "model", weights, run=info, source="test")
    for step in (2, 4, 10):
        shutil.copytree(first, run / "checkpoint" / f"step-{step}")
    shutil.rmtree(first)
    (run / "config.toml").write_text("[job]\n")
    return run


def test_export_and_import_never_replace_a_folder_of_checkpoints(run_folder, tmp_path, capsys):
    convert = _convert()
    ckpt = run_folder / "checkpoint"
    other = tmp_path / "notes"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    hf = tmp_path / "hf"
    assert convert.main(["export", str(ckpt / "step-10"), str(hf)]) == 0
    before = _tree(run_folder)
    tail = "; nothing was changed: name a new or empty folder, or an earlier {} (moved aside to NAME.old, never deleted)"
    cases = {
        ("export", ckpt): "it holds checkpoints (step-10, step-2, step-4)",
        ("export", ckpt / "step-10"): f"it is named like a training checkpoint (step-10), which a run resuming from "
                                      f"{ckpt} would take for its own",
        ("export", ckpt / "step-12"): f"it is named like a training checkpoint (step-12), which a run resuming from "
                                      f"{ckpt} would take for its own",
        ("export", ckpt / "step-10" / "hf"): f"it is inside the checkpoint {ckpt / 'step-10'}",
        ("export", run_folder): "it holds files that are not a Hugging Face export (checkpoint/, config.toml)",
        ("export", other): "it holds files that are not a Hugging Face export (notes.txt)",
        ("import", ckpt): "it holds checkpoints (step-10, step-2, step-4)",
        ("import", ckpt / "step-4"): f"it is named like a training checkpoint (step-4), which a run resuming from "
                                     f"{ckpt} would take for its own",
        ("import", run_folder): "it holds files that are not an imported model-only checkpoint (checkpoint/, "
                                "config.toml)",
        ("import", hf): "it holds files that are not an imported model-only checkpoint (config.json, "
                        "model.safetensors)",
    }
    capsys.readouterr()
    for (command, out), why in cases.items():
        argv = ([command, str(ckpt / "step-10"), str(out)] if command == "export"
                else [command, str(hf), str(out), "--flavor=debug"])
        rc = convert.main(argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and err == [f"error: refusing to {command} into {out}: {why}{tail.format(command)}"], \
            (command, out, err)
    assert _tree(run_folder) == before and (other / "notes.txt").read_text() == "mine"
    assert load_model(ckpt / "step-10").args == DEBUG  # still a checkpoint


def test_an_earlier_export_or_import_is_moved_aside_not_deleted(run_folder, tmp_path, capsys):
    convert = _convert()
    source = run_folder / "checkpoint" / "step-2"
    out, init = tmp_path / "hf", tmp_path / "init"
    for _ in range(2):
        assert convert.main(["export", str(source), str(out)]) == 0
        assert convert.main(["import", str(out), str(init), "--flavor=debug"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "hf.old", "init", "init.old"]
    for folder in (out, tmp_path / "hf.old", init, tmp_path / "init.old"):
        assert load_model(folder).args.n_layers == DEBUG.n_layers
    said = capsys.readouterr().out  # the CLI logs to stdout
    assert f"WARNING: moved the earlier export {out} aside to {out}.old (delete it when done)" in said
    assert f"WARNING: moved the earlier import {init} aside to {init}.old (delete it when done)" in said
    assert convert.main(["export", str(source), str(out)]) == 0  # a third: .old is taken, so .old-2
    assert (tmp_path / "hf.old-2" / "model.safetensors").is_file()


# -- the run lock ------------------------------------------------------------


def _proc_start(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])


def _write_lock(folder: Path, **holder) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_NAME
    path.write_text(json.dumps({"host": socket.gethostname(), "start_time": "2026-01-01 00:00:00 UTC", **holder}))
    return path


def _boot_id() -> str:
    return Path("/proc/sys/kernel/random/boot_id").read_text().strip()


def test_a_lock_whose_pid_is_another_program_now_is_reclaimed(tmp_path, log):
    other = os.getppid()  # alive, and not the run that wrote the lock: the pid was reused
    cases = {
        "reused pid": ({"pid": other, "boot_id": _boot_id(), "process_start_ticks": _proc_start(other) + 1},
                       f"pid {other} on this host is now another program"),
        "rebooted": ({"pid": other, "boot_id": "0" * 8, "process_start_ticks": _proc_start(other)},
                     f"it was taken by pid {other} before this host rebooted"),
        "old lock, no heartbeat": ({"pid": other}, f"no heartbeat from host {socket.gethostname()} pid {other} for"),
    }
    for name, (holder, why) in cases.items():
        path = _write_lock(tmp_path / name.replace(" ", "_"), **holder)
        os.utime(path, (1, 1))  # an old lock: only the "no heartbeat" case depends on it
        lock = RunLock(path.parent, heartbeat_seconds=3600)
        log.lines.clear()
        lock.acquire()
        try:
            assert f"reclaiming the stale lock {path} ({why}" in log.text, (name, log.text)
            mine = json.loads(path.read_text())
            assert mine["pid"] == os.getpid() and mine["process_start_ticks"] == _proc_start(os.getpid())
        finally:
            lock.release()
        assert not path.exists()


def test_a_live_holder_is_still_refused_and_a_lock_directory_is_one_line(tmp_path):
    me = os.getpid()
    path = _write_lock(tmp_path / "live", pid=me, boot_id=_boot_id(), process_start_ticks=_proc_start(me))
    os.utime(path, (1, 1))  # the start time, not the heartbeat, identifies a live holder on this host
    with pytest.raises(RunLockError, match=rf"is in use by another run \(host {socket.gethostname()}, pid {me}, "):
        RunLock(path.parent).acquire()
    assert json.loads(path.read_text())["pid"] == me
    stale = tmp_path / "dir" / LOCK_NAME
    stale.mkdir(parents=True)
    (stale / "x").write_text("")
    os.utime(stale, (1, 1))
    with pytest.raises(RunLockError) as e:
        RunLock(stale.parent, stale_seconds=1).acquire()
    assert str(e.value) == (f"{stale} is a directory, not a lock file that a run writes: remove it if no run uses "
                            f"{stale.parent} (rm -r {stale}), or use another job.dump_folder")
    assert (stale / "x").exists()


def test_a_checkpoint_folder_outside_the_dump_folder_is_locked_too(tmp_path):
    """Two runs with other dump folders and one checkpoint folder (absolute, or `..`) used to both start, and one
    resumed the other's checkpoint. Each case: run A holds its locks, run B is refused in one line and leaves no
    lock of its own behind."""
    def refused(dump: Path, ckpt: Path) -> str:
        with pytest.raises(RunLockError) as e:
            lock_run_folders(dump, ckpt)
        assert not (dump / LOCK_NAME).exists()  # B released its dump folder's lock
        return str(e.value)

    me = f"host {socket.gethostname()}, pid {os.getpid()}, started "
    for a_dump, a_ckpt, b_dump, b_ckpt, line in [
        # The same absolute checkpoint folder.
        ("a", "shared", "b", "shared", f"{tmp_path / 'shared'} is in use by another run ({me}"),
        # checkpoint.folder = "..": both in the parent of the dump folders.
        ("x/a", "x/a/..", "x/b", "x/b/..", f"{tmp_path / 'x'} is in use by another run ({me}"),
        # Inside another run's dump folder (its own checkpoint folder), which holds no lock of its own.
        ("a", "a/checkpoint", "b", "a/checkpoint", f"checkpoint.folder {tmp_path / 'a' / 'checkpoint'} is inside "
                                                   f"{tmp_path / 'a'}, the folder of another run ({me}"),
        # The other way round: B's dump folder holds the checkpoint folder A already locked.
        ("b", "a/checkpoint", "a", "a/checkpoint", f"{tmp_path / 'a' / 'checkpoint'} is the checkpoint folder of "
                                                   f"another run ({me}"),
    ]:
        for name in (a_ckpt, b_ckpt):
            (tmp_path / name).mkdir(parents=True, exist_ok=True)
        locks = lock_run_folders(tmp_path / a_dump, tmp_path / a_ckpt)
        try:
            assert line in refused(tmp_path / b_dump, tmp_path / b_ckpt)
        finally:
            release_all(locks)
        assert not list(tmp_path.rglob(LOCK_NAME))
    # A checkpoint folder that is the dump folder, or inside it, is under the one lock.
    locks = lock_run_folders(tmp_path / "c", tmp_path / "c" / "checkpoint")
    release_all(locks)
    assert [lock.path for lock in locks] == [tmp_path / "c" / LOCK_NAME]


# -- a full disk -------------------------------------------------------------


class _FullFile:
    """A file on a disk with `room` bytes left: a write past them fails, as the kernel's does (ENOSPC or EFBIG)."""

    def __init__(self, f, room: int, code: int):
        self._f, self._room, self._code = f, room, code

    def write(self, data) -> int:
        n = memoryview(data).nbytes
        if n > self._room:
            raise OSError(self._code, os.strerror(self._code))
        self._room -= n
        return self._f.write(data)

    def __getattr__(self, name):
        return getattr(self._f, name)


@pytest.fixture
def full_disk(monkeypatch):
    """full_disk(code): every DCP shard file takes 4 KiB, then fails with `code`: torch.save's "unexpected pos"."""

    def arm(code: int) -> None:
        real = FileSystem.create_stream

        @contextlib.contextmanager
        def create_stream(self, path, mode):
            with real(self, path, mode) as f:
                yield _FullFile(f, 4096, code) if str(path).endswith(".distcp") else f

        monkeypatch.setattr(FileSystem, "create_stream", create_stream)

    return arm


class _State:
    """The part of CheckpointState a save reads."""

    def __init__(self):
        self.tensors = {"model": {"w": torch.ones(512, 256)}, "train_state": {"step": 0}}

    def state_dict(self):
        return self.tensors


@pytest.fixture
def one_process():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _manager(dump: Path, **section) -> CheckpointManager:
    return CheckpointManager(checkpoint_options(CheckpointSection(enable=True, interval=1, **section),
                                                dump_folder=str(dump)),
                             state=_State(), run=RunInfo(flavor="debug", model_args=DEBUG, mixed_precision="fp32"))


UNTOUCHED = "; earlier checkpoints are untouched (checkpoint.on_save_error=continue would keep training)"


@pytest.mark.parametrize("async_mode", ["disabled", "async"])
def test_enospc_mid_write_is_the_no_space_line_with_what_pruning_frees(tmp_path, one_process, full_disk, async_mode):
    manager = _manager(tmp_path, keep_latest_k=1, async_mode=async_mode)
    manager.save(1)
    manager.wait()
    full_disk(errno.ENOSPC)
    with pytest.raises(CheckpointError) as e:
        manager.save(2)
        manager.wait()
    ckpt = tmp_path / "checkpoint"
    free = shutil.disk_usage(ckpt).free / 2**20
    kept = sum(p.stat().st_size for p in (ckpt / "step-1").iterdir()) / 2**20
    assert str(e.value) == (f"checkpoint step-2 failed to save into {ckpt / 'step-2.tmp'}: no space left on device "
                            f"(this checkpoint needs about 0.5 MiB; {free:,.1f} MiB free); keep_latest_k=1 deletes "
                            f"step-1 ({kept:,.1f} MiB) only once this save completes: deleting it first would make "
                            f"room; removed the partial step-2.tmp{UNTOUCHED}")
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-1"]
    manager.close()


def test_efbig_is_the_file_size_limit_line(tmp_path, one_process, full_disk):
    manager = _manager(tmp_path)
    full_disk(errno.EFBIG)
    with pytest.raises(CheckpointError) as e:
        manager.save(1)
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    cap = ("the filesystem's largest file" if limit == resource.RLIM_INFINITY
           else f"ulimit -f allows {limit / 2**20:,.1f} MiB per file")
    assert str(e.value) == (f"checkpoint step-1 failed to save into {tmp_path / 'checkpoint' / 'step-1.tmp'}: file "
                            f"too large ({cap}; this checkpoint needs about 0.5 MiB): raise the limit; removed the "
                            f"partial step-1.tmp{UNTOUCHED}")


def test_a_save_that_will_not_fit_is_warned_about_first(tmp_path, one_process, monkeypatch, log):
    manager = _manager(tmp_path, keep_latest_k=2)
    manager.save(1)
    manager.save(2)
    ckpt = tmp_path / "checkpoint"
    kept = sum(p.stat().st_size for p in (ckpt / "step-1").iterdir()) / 2**20
    monkeypatch.setattr("trainer.checkpoint.space.free_bytes", lambda path: 2**16)
    log.lines.clear()
    manager.save(3)  # the check only warns: this filesystem has room after all
    assert (f"checkpoint step-3 needs about 0.5 MiB and {ckpt} has 0.1 MiB free: the save will likely fail; "
            f"keep_latest_k=2 deletes step-1 ({kept:,.1f} MiB) only once this save completes: deleting it first would "
            "make room") in log.text
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-2", "step-3"]


def test_a_failed_last_save_under_continue_is_an_error(tmp_path, one_process, full_disk):
    manager = _manager(tmp_path, on_save_error="continue")
    manager.save(1)
    full_disk(errno.ENOSPC)
    manager.save(2)  # logged; training would go on
    with pytest.raises(CheckpointError) as e:
        manager.require_saved(2)
    assert str(e.value) == (f"training reached its last step 2, but checkpoint step-2 failed to save (see above), so "
                            f"steps after step-1 are in no checkpoint: make room in {tmp_path / 'checkpoint'} and "
                            "relaunch the same command to redo them")
    manager.close()


# -- the same, end to end -----------------------------------------------------


def _one_line_error(proc: subprocess.CompletedProcess) -> str:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, (proc.returncode, proc.stderr[-3000:])
    return lines[0]


@pytest.mark.slow
def test_a_run_whose_final_save_fails_under_continue_exits_2(tmp_path):
    dump = tmp_path / "run"
    proc = subprocess.run([sys.executable, TRAIN, *ARGS, "--train.steps=4", "--checkpoint.async_mode=async",
                           "--checkpoint.on_save_error=continue", f"--job.dump_folder={dump}"], capture_output=True,
                          text=True, timeout=300, cwd=REPO, env=hooks_env(TRAINER_TEST_SAVE_ERROR="4"))
    line = _one_line_error(proc)
    assert line == (f"error (rank 0): training reached its last step 4, but checkpoint step-4 failed to save (see "
                    f"above), so steps after step-2 are in no checkpoint: make room in {dump / 'checkpoint'} and "
                    "relaunch the same command to redo them")
    assert "ERROR: checkpoint step-4 failed to save into" in proc.stdout
    assert sorted(p.name for p in (dump / "checkpoint").iterdir()) == ["step-2"]
    assert [r["step"] for r in read_metrics(dump)] == [1, 2, 3, 4]


@pytest.mark.slow
def test_ulimit_f_is_the_file_size_limit_line(tmp_path):
    """Python ignores SIGXFSZ from startup, so a write past `ulimit -f` fails with EFBIG (inside torch.save's
    "unexpected pos" RuntimeError): the line says so, not the RuntimeError."""
    dump = tmp_path / "run"

    def limit_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (2**20, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    proc = subprocess.run([sys.executable, TRAIN, *ARGS, "--train.steps=2", f"--job.dump_folder={dump}"],
                          capture_output=True, text=True, timeout=300, cwd=REPO, env=env(), preexec_fn=limit_files)
    line = _one_line_error(proc)
    tmp = dump / "checkpoint" / "step-2.tmp"
    assert line.startswith(f"error (rank 0): checkpoint step-2 failed to save into {tmp}: file too large (ulimit -f "
                           "allows 1.0 MiB per file; this checkpoint needs about "), line
    assert line.endswith(f" MiB): raise the limit; removed the partial step-2.tmp{UNTOUCHED}"), line
    assert list((dump / "checkpoint").iterdir()) == []
