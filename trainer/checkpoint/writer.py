"""How a rank writes its shards: at the disk's speed, recording the size and crc32 of every file as it is written.

DCP's FileSystemWriter writes a rank's tensors with `torch.save` into `__{rank}_{i}.distcp` files and fsyncs each;
checkpoint.json lists the size and crc32 of every file, which a load verifies. A save ran at 0.4-0.7 GB/s per rank on
an H200 host, into tmpfs as into a disk (docs/benchmarks/2026-11-26-h200-whole-8b-checkpoint-stall-long-context.md):
one thread per rank (DCP's `thread_count=1`) passed over every byte four times, in turn:
- the crc32 torch.save computes for every record of its zip format, which nothing reads (torch.load never checks it;
  the crc32 of the whole file in checkpoint.json is what a load verifies);
- the write;
- reading every file back afterwards, and its crc32.

Here a rank writes with several threads, one file each (`write_threads`: DCP deals the tensors out by size, so the
files are about equal), torch.save's record crc32 is off for the write (`torch.serialization.set_crc32_options`,
which says torch.load still loads such files), and each file's crc32 is taken from the bytes on their way to it
(`_Crc32File`; zlib releases the GIL, so the threads checksum in parallel). Every file is still fsynced before its
rank reports it written, and nothing is published before every rank has (manager.py).

Each rank records what it wrote in `__{rank}_checksums.json` (a sidecar): every file's size and crc32, and how many
bytes it wrote in how many seconds with how many threads. Rank 0 merges them into checkpoint.json and logs the
slowest rank's write speed.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from trainer.checkpoint.format import MAX_SIDECAR_BYTES, METADATA, CheckpointError, disk_error, file_digest
from trainer.files.confine import special_file_problem
from trainer.files.json_object import read_json_object

# A rank writes with one thread (and file) per this many bytes, at most one per tensor, per CPU core it has (the
# host's over its ranks) and MAX_WRITE_THREADS. Smaller files gain nothing from a thread of their own.
BYTES_PER_WRITE_THREAD = 256 * 2**20
MAX_WRITE_THREADS = 8


def write_threads(items: list[WriteItem], *, cores: int | None = None) -> int:
    """How many threads (and files) a rank writes `items` with."""
    # Empty tensors do not count: DCP deals the largest out first, so each file gets one of those.
    sizes = [n for item in items if item.type != WriteItemType.BYTE_IO and (n := _item_bytes(item))]
    if cores is None:
        cores = rank_cores()
    # At least 2 where the bytes ask for it: one thread checksums while another waits on the disk.
    return max(1, min(MAX_WRITE_THREADS, len(sizes), -(-sum(sizes) // BYTES_PER_WRITE_THREAD), max(cores, 2)))


def rank_cores() -> int:
    """The CPU cores this process may run on, over the ranks on this host (torchrun's LOCAL_WORLD_SIZE)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)))


def _item_bytes(item: WriteItem) -> int:
    data = item.tensor_data
    return 0 if data is None else math.prod(data.size) * data.properties.dtype.itemsize


class _Crc32File:
    """A file open for writing that keeps the size and crc32 of the bytes written to it, in order. It cannot seek:
    a rewrite would leave the crc32 of bytes the file no longer holds (DCP and torch.save write front to back)."""

    def __init__(self, f: Any):
        self._f, self.nbytes, self.crc32 = f, 0, 0

    def write(self, data: Any) -> int:
        view = memoryview(data)  # torch.save hands over a view of the tensor's own bytes: no copy
        self.crc32 = zlib.crc32(view, self.crc32)  # releases the GIL: the other writer threads go on meanwhile
        self.nbytes += view.nbytes
        return self._f.write(view)

    def seek(self, *args: Any) -> int:
        raise OSError("a checkpoint file is written front to back (its crc32 is taken on the way)")

    def seekable(self) -> bool:
        return False

    def __getattr__(self, name: str) -> Any:  # tell, flush, fileno (DCP's fsync), close
        return getattr(self._f, name)


class _DigestingFileSystem(FileSystem):
    """DCP's local filesystem whose files opened for writing record their size and crc32 once closed, and the first
    error raised while one was open (a writer thread's error is otherwise only printed: DCP does not join it)."""

    def __init__(self) -> None:
        super().__init__()
        self.digests: dict[str, dict[str, Any]] = {}
        self.errors: list[BaseException] = []
        self._lock = threading.Lock()

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        if mode != "wb":
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        try:
            with super().create_stream(path, mode) as f:
                stream = _Crc32File(f)
                yield stream
        except BaseException as e:
            with self._lock:
                self.errors.append(e)
            raise
        with self._lock:
            self.digests[Path(path).name] = {"bytes": stream.nbytes, "crc32": f"{stream.crc32:08x}"}


@contextmanager
def _torch_save_without_record_crc32() -> Iterator[None]:
    """torch.save without the crc32 of each zip record (process-wide, for the write; one save at a time)."""
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(before)


class ChecksummedWriter(FileSystemWriter):
    """DCP's FileSystemWriter writing with `write_threads` threads (or `thread_count`), recording in this rank's
    sidecar the size and crc32 of every file it wrote, and the write's bytes, seconds and threads."""

    def __init__(self, path: Path, *, step: int, thread_count: int | None = None):
        super().__init__(str(path), single_file_per_rank=True, sync_files=True)
        self.fs = _DigestingFileSystem()
        self.step = step
        self._thread_count = thread_count

    def write_data(self, plan, planner):
        start = time.perf_counter()
        self.thread_count = self._thread_count or write_threads(plan.items)
        try:
            with _torch_save_without_record_crc32():
                future = super().write_data(plan, planner)
            results = future.value()  # FileSystemWriter writes synchronously; the future is already done
            if self.fs.errors:  # a thread other than this one failed: its files' results are missing
                raise self.fs.errors[0]
            if len(results) != len(plan.items):
                raise RuntimeError(f"a checkpoint writer thread failed: {len(results)} of {len(plan.items)} entries "
                                   f"written into {self.path}")
        except Exception as e:
            # torch.save reports a full disk as "unexpected pos 704 vs 598" with the OSError only in __context__,
            # which DCP's pickling to rank 0 drops: raise the OSError itself, its errno survives.
            disk = disk_error(e)
            if disk is None or disk is e:
                raise
            raise disk from e
        root = Path(self.path)
        files = sorted({r.storage_data.relative_path for r in results})
        # The digest taken while writing; reading the file back only for one written some other way.
        digests = {name: self.fs.digests.get(name) or file_digest(root / name) for name in files}
        sidecar = {"files": digests, "bytes": sum(d["bytes"] for d in digests.values()),
                   "seconds": time.perf_counter() - start, "threads": self.thread_count}
        with open(root / f"{plan.storage_data.prefix}checksums.json", "w") as f:  # DCP's prefix: __{rank}_
            json.dump(sidecar, f)
            f.flush()
            os.fsync(f.fileno())
        return future


def sidecar_name(rank: int | str) -> str:
    """The file where rank `rank` records what it wrote (ChecksummedWriter)."""
    return f"__{rank}_checksums.json"


def read_sidecar(path: Path) -> dict[str, Any]:
    """A rank's sidecar: {"files": {name: {"bytes", "crc32"}}, "bytes", "seconds", "threads"}, read back as untrusted
    data (trainer/files): one CheckpointError line if it is not a small regular file holding a JSON object with a
    "files" object."""
    if problem := special_file_problem(path, max_bytes=MAX_SIDECAR_BYTES, what="checksum list"):
        raise CheckpointError(problem)
    sidecar = read_json_object(path, what="a checksum list", error=CheckpointError)
    if not isinstance(sidecar.get("files"), dict):
        raise CheckpointError(f"{path} has no \"files\" object: not a checksum list this trainer writes")
    return sidecar


def collect_checksums(tmp: Path) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
    """Every rank's files (size and crc32) and .metadata's, merged from (and removing) the ranks' sidecars; and each
    rank's write (bytes, seconds, threads)."""
    files: dict[str, dict[str, Any]] = {}
    writes = []
    paths = sorted(tmp.glob(sidecar_name("*")))
    for path in paths:
        sidecar = read_sidecar(path)
        files.update(sidecar["files"])
        writes.append({k: v for k, v in sidecar.items() if k != "files"})
    files[METADATA] = file_digest(tmp / METADATA)
    for path in paths:
        path.unlink()
    return files, writes


def describe_writes(writes: list[dict[str, Any]]) -> str:
    """The slowest rank's write, for the log: 'written at 2.41 GB/s per rank (the slowest: 24.08 GB in 9.99 s, 8
    threads)'."""
    if not writes:
        return "nothing written"
    slowest = max(writes, key=lambda w: w["seconds"])
    speed = slowest["bytes"] / max(slowest["seconds"], 1e-9) / 1e9
    threads = slowest["threads"]
    return (f"written at {speed:.2f} GB/s per rank (the slowest: {slowest['bytes'] / 1e9:.2f} GB in "
            f"{slowest['seconds']:.2f} s, {threads} thread{'s' if threads != 1 else ''})")
