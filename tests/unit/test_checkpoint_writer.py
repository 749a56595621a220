"""trainer/checkpoint/writer.py: a rank's shards written by several threads load exactly as one thread's (and a run
resumed from them continues bit for bit), the size and crc32 taken while writing are the files' own (a flipped byte is
still caught), a failing writer thread fails the save, and the thread count follows the bytes."""

from __future__ import annotations

import errno
import json
import os
import shutil
import threading
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from tests.helpers import DEBUG_CONFIG
from trainer.checkpoint import writer as writer_module
from trainer.checkpoint.format import METADATA, disk_error, file_digest
from trainer.checkpoint.verify import check_file, load_dcp_metadata, safe_load
from trainer.checkpoint.writer import (
    BYTES_PER_WRITE_THREAD, MAX_WRITE_THREADS, ChecksummedWriter, collect_checksums, describe_writes, read_sidecar,
    sidecar_name, write_threads,
)
from trainer.config import load_job_config
from trainer.run.train import train


def _state() -> dict[str, torch.Tensor]:
    """Tensors of every kind a checkpoint holds: weights and moments in bf16 and fp32, an fp8 moment, scalars, one
    empty; some large enough that each thread gets its own."""
    g = torch.Generator().manual_seed(0)
    state = {f"model.layers.{i}.w": torch.randn(96, 64 + i, generator=g).to(torch.bfloat16) for i in range(6)}
    state |= {f"optimizer.state.layers.{i}.exp_avg_sq": torch.rand(96, 64 + i, generator=g) for i in range(6)}
    state["optimizer.state.head.exp_avg"] = torch.randn(40, 128, generator=g).to(torch.float8_e4m3fn)
    state["optimizer.state.head.step"] = torch.tensor(7.0)
    state["model.empty"] = torch.empty(0, 4)
    return state


def _save(folder: Path, state: dict[str, torch.Tensor], threads: int | None) -> Path:
    folder.mkdir(parents=True)
    with warnings.catch_warnings():  # one process: DCP warns that there is no process group
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=ChecksummedWriter(folder, step=1, thread_count=threads), no_dist=True)
    return folder


def _load(folder: Path, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    target = {k: torch.full_like(v, 3) if v.dtype != torch.float8_e4m3fn else torch.zeros_like(v)
              for k, v in like.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        safe_load(target, folder, no_dist=True)
    return target


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(a[k].reshape(-1).view(torch.uint8),
                                                                              b[k].reshape(-1).view(torch.uint8))
        for k in a)


def test_several_threads_write_what_one_thread_writes(tmp_path) -> None:
    state = _state()
    one = _save(tmp_path / "one", state, threads=1)
    four = _save(tmp_path / "four", state, threads=4)
    assert sorted(p.name for p in four.glob("*.distcp")) == [f"__0_{i}.distcp" for i in range(4)]
    assert [p.name for p in one.glob("*.distcp")] == ["__0_0.distcp"]
    loaded_one, loaded_four = _load(one, state), _load(four, state)
    assert _same(loaded_one, state) and _same(loaded_four, state)  # bit for bit, every dtype


def test_the_checksums_taken_while_writing_are_the_files_own(tmp_path) -> None:
    folder = _save(tmp_path / "ckpt", _state(), threads=3)
    sidecar = read_sidecar(folder / sidecar_name(0))
    assert sidecar["threads"] == 3 and sidecar["seconds"] > 0
    assert sorted(sidecar["files"]) == sorted(p.name for p in folder.glob("*.distcp"))
    for name, digest in sidecar["files"].items():
        assert digest == file_digest(folder / name)  # what went to the file is what the file holds
    assert sidecar["bytes"] == sum(d["bytes"] for d in sidecar["files"].values())
    files, writes = collect_checksums(folder)
    assert files[METADATA] == file_digest(folder / METADATA) and not (folder / sidecar_name(0)).exists()
    assert writes == [{k: sidecar[k] for k in ("bytes", "seconds", "threads")}]
    assert describe_writes(writes).startswith("written at ") and "3 threads" in describe_writes(writes)
    assert describe_writes([{"bytes": 10**9, "seconds": 0.5, "threads": 1}, {"bytes": 10**9, "seconds": 0.25,
                                                                          "threads": 1}]) == (
        "written at 2.00 GB/s per rank (the slowest: 1.00 GB in 0.50 s, 1 thread)")


def test_a_flipped_byte_in_a_threads_file_fails_its_crc32(tmp_path) -> None:
    folder = _save(tmp_path / "ckpt", _state(), threads=4)
    files, _ = collect_checksums(folder)
    victim = folder / "__0_2.distcp"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x10
    victim.write_bytes(bytes(data))
    assert "is corrupted: crc32" in check_file(victim, files[victim.name])
    assert all(check_file(folder / n, d) is None for n, d in files.items() if n != victim.name)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # DCP's thread prints it
def test_a_failing_writer_thread_fails_the_save_with_its_error(tmp_path, monkeypatch) -> None:
    """DCP's extra writer threads only print their errors: a full disk in one of them must fail the save (its
    OSError, errno kept), never publish a checkpoint without that thread's tensors."""
    write = writer_module._Crc32File.write

    def full_outside_the_calling_thread(self, data):  # the calling thread writes its files: only DCP's threads fail
        if threading.current_thread() is not threading.main_thread():
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self._f.name)
        return write(self, data)

    monkeypatch.setattr(writer_module._Crc32File, "write", full_outside_the_calling_thread)
    with pytest.raises(BaseException) as raised:  # DCP's CheckpointException is a BaseException
        _save(tmp_path / "ckpt", _state(), threads=3)
    assert disk_error(raised.value).errno == errno.ENOSPC
    assert not (tmp_path / "ckpt" / sidecar_name(0)).exists()  # the rank never reports the save written
    assert torch.serialization.get_crc32_options()  # torch.save's own setting is back


def test_a_checkpoint_file_cannot_seek(tmp_path) -> None:
    with open(tmp_path / "f", "wb") as f:
        stream = writer_module._Crc32File(f)
        stream.write(b"abc")
        with pytest.raises(OSError, match="front to back"):
            stream.seek(0)


def _item(name: str, nbytes: int) -> WriteItem:
    return WriteItem(index=MetadataIndex(name), type=WriteItemType.TENSOR, tensor_data=TensorWriteData(
        chunk=ChunkStorageMetadata(offsets=torch.Size([0]), sizes=torch.Size([nbytes // 2])),
        properties=TensorProperties(dtype=torch.bfloat16), size=torch.Size([nbytes // 2])))


def test_the_thread_count_follows_the_bytes_the_tensors_and_the_cores() -> None:
    whole_8b_rank = [_item(f"t{i}", 24 * 2**30 // 900) for i in range(900)]  # the whole 8B over 2 GPUs, per rank
    assert write_threads(whole_8b_rank, cores=16) == MAX_WRITE_THREADS
    assert write_threads(whole_8b_rank, cores=4) == 4
    assert write_threads(whole_8b_rank, cores=1) == 2  # one checksums while the other waits on the disk
    assert write_threads([_item("t", BYTES_PER_WRITE_THREAD * 3)] * 2, cores=16) == 2  # a thread per tensor at most
    assert write_threads([_item(f"t{i}", 2**20) for i in range(50)], cores=16) == 1  # 50 MiB: one file
    assert write_threads([_item("big", 2**30), _item("empty", 0)] * 1, cores=16) == 1  # empty tensors do not count


@pytest.mark.parametrize("async_mode", ["disabled", "async"])
def test_a_run_resumed_from_a_checkpoint_written_by_8_threads_continues_bit_for_bit(tmp_path, monkeypatch,
                                                                                   async_mode) -> None:
    """The debug model trained 4 steps with a checkpoint every 2, each rank's shards written by 8 threads (one per
    4 KiB here); a copy of step-2 resumed in another folder trains steps 3-4 to the same weights and optimizer state,
    bit for bit."""
    monkeypatch.setattr(writer_module, "BYTES_PER_WRITE_THREAD", 4096)
    monkeypatch.setattr(writer_module, "rank_cores", lambda: 8)
    args = ["--config", DEBUG_CONFIG, "--train.seq_len=32", "--train.steps=4", "--train.mixed_precision=fp32",
            "--checkpoint.enable=true", "--checkpoint.interval=2", f"--checkpoint.async_mode={async_mode}",
            "--metrics.enable_tensorboard=false"]
    train(load_job_config([*args, f"--job.dump_folder={tmp_path / 'straight'}"]))
    straight = tmp_path / "straight" / "checkpoint"
    assert len(list((straight / "step-2").glob("__0_*.distcp"))) == 8
    (tmp_path / "resumed").mkdir()
    shutil.copytree(straight / "step-2", tmp_path / "resumed" / "checkpoint" / "step-2")
    train(load_job_config([*args, f"--job.dump_folder={tmp_path / 'resumed'}"]))
    metrics = (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in metrics] == [3, 4]  # it resumed step-2: it did not start over
    ends = [tmp_path / run / "checkpoint" / "step-4" for run in ("straight", "resumed")]
    every = [_every_tensor(end) for end in ends]
    assert every[0].keys() == every[1].keys() and any(k.startswith("optimizer.") for k in every[0])
    assert _same(every[0], every[1])


def _every_tensor(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint, read as saved (through the safe reader)."""
    metadata = load_dcp_metadata(path / METADATA)
    state = {k: torch.empty(tuple(md.size), dtype=md.properties.dtype) for k, md in metadata.state_dict_metadata.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        safe_load(state, path, no_dist=True)
    return state
