"""One run per dump folder: an exclusive lock file that global rank 0 holds for the life of the job.

Two runs writing one folder interleave metrics and can publish a checkpoint whose
shards came from both. The lock is a file created with O_EXCL (atomic on local
filesystems and on NFSv3+), holding who owns it, so the second run fails at once
with one line naming the first. A heartbeat thread refreshes its mtime; a lock whose
owner is gone is reclaimed with a log line, so a SIGKILLed job never blocks the next
one for long. On the same host the owner is known by more than its pid, which the
system reuses (after a reboot, or in a fresh container whose first processes get the
same small pids): the lock records the boot id and the process's start time
(/proc/PID/stat), so a lock from before a reboot, or whose pid now belongs to another
program, is stale. A lock without them (written by an older version) whose pid is alive
is stale once it has had no heartbeat for `stale_seconds`, as is one from another host.
A `.trainer.lock` that is not a regular file (a directory, a link) is no lock this
trainer wrote: refused in one line, and left alone.

A checkpoint folder outside the dump folder (an absolute `checkpoint.folder`, or `..`) is
locked too (`lock_run_folders`): two runs with different dump folders would otherwise resume
each other's checkpoints. A checkpoint folder inside another live run's folder is refused,
also where that folder lies inside this run's own (a relative `checkpoint.folder` such as
`other/checkpoint`), and so is a live lock in this run's own checkpoint folder (another run
uses it as its checkpoint folder). Paths are resolved before they are compared.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import stat
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

from trainer.errors import UserError
from trainer.files.confine import special_file_problem
from trainer.files.json_object import read_json_object

if TYPE_CHECKING:
    from trainer.config import JobConfig

logger = logging.getLogger(__name__)

LOCK_NAME = ".trainer.lock"
MAX_LOCK_BYTES = 2**16  # a lock holds a few hundred bytes of JSON


class RunLockError(UserError):
    """Another live run holds the dump folder."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        return True
    return True


def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:  # not Linux
        return None


def _process_start(pid: int) -> int | None:
    """When the process started, in clock ticks after boot (field 22 of /proc/PID/stat); None if unknown."""
    try:
        # The command name (field 2) may hold spaces and parentheses: count from the last ")".
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


_FILE_TYPES = ((stat.S_ISDIR, "a directory"), (stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a named pipe"),
               (stat.S_ISSOCK, "a socket"))


class RunLock:
    def __init__(self, folder: str | Path, *, key: str = "job.dump_folder", heartbeat_seconds: float = 30.0,
                 stale_seconds: float = 300.0):
        """`key` names the config key that chose `folder`, for the messages."""
        self.path = Path(folder) / LOCK_NAME
        self.key = key
        self.heartbeat_seconds, self.stale_seconds = heartbeat_seconds, stale_seconds
        self.owner = {"host": socket.gethostname(), "pid": os.getpid(),
                      "start_time": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
                      "boot_id": _boot_id(), "process_start_ticks": _process_start(os.getpid())}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(2):  # the second try follows reclaiming a stale lock
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                self._check_type()
                holder = self._read_holder()
                why = self._stale_reason(holder)
                if why is None:
                    raise RunLockError(f"{self.path.parent} is in use by another run ({_describe(holder)}); wait for "
                                       f"it to finish or use another {self.key}") from None
                logger.warning("reclaiming the stale lock %s (%s)", self.path, why)
                self.path.unlink(missing_ok=True)
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(self.owner, f)
            self._thread = threading.Thread(target=self._heartbeat, name="run-lock-heartbeat", daemon=True)
            self._thread.start()
            return
        raise RunLockError(f"could not take the lock {self.path}: another run keeps creating it")

    def _check_type(self) -> None:
        """A lock that is not a small regular file was not written by a run: refused in one line (never removed)."""
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return  # released meanwhile: the next try takes it
        if not stat.S_ISREG(st.st_mode):
            kind = next((name for test, name in _FILE_TYPES if test(st.st_mode)), "not a regular file")
        elif st.st_size > MAX_LOCK_BYTES:
            kind = f"a file of {st.st_size:,} bytes"
        else:
            return
        raise RunLockError(f"{self.path} is {kind}, not a lock file that a run writes: remove it if no run uses "
                           f"{self.path.parent} (rm -r {self.path}), or use another {self.key}")

    def live_holder(self) -> dict | None:
        """Who holds this lock, if a live run does (without taking it); None if nobody or only a stale lock."""
        if not os.path.lexists(self.path):
            return None
        self._check_type()
        holder = self._read_holder()
        return holder if self._stale_reason(holder) is None else None

    def _read_holder(self) -> dict:
        """Who the lock names, read as untrusted data (trainer/files); {} for a lock half-written by a run killed while
        taking it (_check_type refused anything but a small regular file first)."""
        if special_file_problem(self.path, max_bytes=MAX_LOCK_BYTES):
            return {}
        try:
            return read_json_object(self.path, what="a run lock", error=ValueError)
        except (OSError, ValueError):
            return {}

    def _stale_reason(self, holder: dict) -> str | None:
        pid = holder.get("pid")
        if holder.get("host") == self.owner["host"] and isinstance(pid, int):
            boot_id = holder.get("boot_id")
            if boot_id and self.owner["boot_id"] and boot_id != self.owner["boot_id"]:
                return f"it was taken by pid {pid} before this host rebooted"
            if not _pid_alive(pid):
                return f"pid {pid} on this host is gone"
            recorded, started = holder.get("process_start_ticks"), _process_start(pid)
            if isinstance(recorded, int) and started is not None:
                # The pid was reused (a reboot, a container): the process that has it now started at another time.
                return None if started == recorded else f"pid {pid} on this host is now another program"
            # A lock without a start time (an older version wrote it): a live owner refreshes it every heartbeat.
        try:
            age = time.time() - self.path.stat().st_mtime
        except FileNotFoundError:
            return "it disappeared"
        if age > self.stale_seconds:
            return f"no heartbeat from host {holder.get('host', '?')} pid {pid or '?'} for {age:.0f} s"
        return None

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.heartbeat_seconds):
            try:
                os.utime(self.path)
            except OSError:
                pass  # a vanished folder: release() and the save path report real problems

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            # Remove only our own lock: a reclaimer may have replaced a lock we were too slow to refresh.
            if self._read_holder().get("pid") == self.owner["pid"]:
                self.path.unlink(missing_ok=True)


def check_writable(folder: str | Path, *, key: str) -> None:
    """Create `folder` if needed and prove a file can be written there; one-line UserError otherwise.

    Runs before the model is built, so a dump folder under a regular file or on a
    read-only mount fails in a second, not at the first checkpoint an hour later.
    """
    path = Path(folder)
    probe = path / f".write-probe-{socket.gethostname()}-{os.getpid()}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise UserError(
            f"{key}={str(folder)!r} is not writable: {e.strerror or e}"
            f"{f' ({e.filename})' if e.filename and str(e.filename) != str(probe) else ''}; "
            f"point {key} at a writable folder"
        ) from None


def _describe(holder: dict) -> str:
    return f"host {holder.get('host', '?')}, pid {holder.get('pid', '?')}, started {holder.get('start_time', '?')}"


def output_folders(cfg: JobConfig) -> list[tuple[str, str]]:
    """Every folder the run will write to, with the config key that names it (train() checks and locks them)."""
    folders = [(cfg.job.dump_folder, "job.dump_folder")]
    if cfg.checkpoint.enable:
        folders.append((str(Path(cfg.job.dump_folder) / cfg.checkpoint.folder), "checkpoint.folder"))
    if cfg.profiling.enable:
        folders.append((cfg.trace_dir, "profiling.trace_dir"))
    return folders


def lock_run_folders(dump_folder: str | Path, checkpoint_folder: str | Path | None) -> list[RunLock]:
    """Global rank 0, before any rank writes: lock the dump folder and, where it lies outside it, the checkpoint
    folder (None: checkpointing is off). The locks taken, to release in reverse order; RunLockError when another
    live run holds either, or the checkpoint folder is inside another live run's folder or is its checkpoint folder.
    """
    dump = Path(os.path.realpath(dump_folder))
    locks = [RunLock(dump)]
    locks[0].acquire()
    try:
        if checkpoint_folder is not None:
            ckpt = Path(os.path.realpath(checkpoint_folder))  # resolved: every spelling compares as the same folder
            inside = dump in ckpt.parents  # under this run's lock, unless another run's folder lies in between
            # Every folder from the checkpoint folder up to this run's own is checked for another live run's lock (a
            # run nested in this one's folder, or holding the checkpoint folder outside it).
            for folder in [ckpt, *ckpt.parents]:
                if folder == dump:
                    break
                if folder == ckpt and not inside:
                    continue  # taken below: acquire says who holds it
                if holder := RunLock(folder).live_holder():
                    if folder == ckpt:
                        raise RunLockError(f"{ckpt} is the checkpoint folder of another run ({_describe(holder)}); "
                                           "wait for it to finish or use another job.dump_folder or checkpoint.folder")
                    raise RunLockError(f"checkpoint.folder {ckpt} is inside {folder}, the folder of another run "
                                       f"({_describe(holder)}); wait for it to finish or use another checkpoint.folder")
            if ckpt != dump and not inside:
                locks.append(RunLock(ckpt, key="checkpoint.folder"))
                locks[-1].acquire()
    except BaseException:
        release_all(locks)
        raise
    return locks


def release_all(locks: list[RunLock]) -> None:
    for lock in reversed(locks):
        lock.release()
