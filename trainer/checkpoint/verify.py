"""Is a checkpoint complete, intact, compatible and safe to read? All of it before any tensor is loaded.

- `scan_checkpoints`: which step folders are complete (cheap: no data read).
- `read_checkpoint_json`: the description, refused when its list of files (sizes and
  crc32) is missing, unless the user explicitly accepts an unverified checkpoint.
- `read_dcp_metadata` / `SafeReader`: DCP's `.metadata` is a pickle. It is read by an
  unpickler that resolves only DCP's own metadata classes, torch dtypes/sizes and
  paths, so a crafted file cannot call anything else; then every entry must be a
  tensor stored in a `__R_I.distcp` file of the folder. DCP would `torch.load(...,
  weights_only=False)` a non-tensor entry, so a checkpoint with one is refused, and
  `SafeReader` refuses to read one even if asked. Every entry's chunks must tile its shape exactly: a gap would
  load as uninitialised memory (export, load_model) or keep fresh values (resume).
- `check_files`: size and crc32 of every data file against checkpoint.json.
"""

from __future__ import annotations

import bisect
import io
import logging
import math
import pickle
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata, Metadata, StorageMeta, TensorProperties, TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType

from trainer.checkpoint.format import (
    CHECKPOINT_JSON, FORMAT, FUNCTION_KEYS, METADATA, MOE_SHAPE_DEFAULTS, OLD_FORMATS, SHAPE_KEYS, STATE_JSON,
    STEP_DIR, CheckpointError, CorruptCheckpointError, file_digest, first_line, root_cause,
)
from trainer.checkpoint.state import RunInfo, args_from_json, model_state_dict
from trainer.checkpoint.values import CHECKPOINT_FIELDS, check_fields, check_index_entries, check_state_values
from trainer.checkpoint.writer import read_sidecar, sidecar_name
from trainer.errors import on_every_rank
from trainer.files.confine import outside_problem, special_file_problem
from trainer.files.json_object import read_json_object
from trainer.files.publish import PARTIAL, is_partial

logger = logging.getLogger("trainer.checkpoint")

# Everything a DCP .metadata written by FileSystemWriter refers to (torch 2.4-2.13).
_DCP = "torch.distributed.checkpoint.metadata"
_ALLOWED_GLOBALS = {
    (_DCP, "Metadata"), (_DCP, "TensorStorageMetadata"), (_DCP, "BytesStorageMetadata"), (_DCP, "TensorProperties"),
    (_DCP, "ChunkStorageMetadata"), (_DCP, "MetadataIndex"), (_DCP, "StorageMeta"), (_DCP, "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"), ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"), ("pathlib._local", "PosixPath"), ("pathlib._local", "WindowsPath"),
    ("collections", "OrderedDict"),
}
_DATA_FILE = re.compile(r"^__\d+_\d+\.distcp$")


class _MetadataUnpickler(pickle.Unpickler):
    """pickle.Unpickler that resolves only `_ALLOWED_GLOBALS` and torch dtypes; anything else is refused."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"it refers to {module}.{name}, which a DCP index never contains")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("it has a persistent id, which a DCP index never contains")


# checkpoint.json and state.json are kilobytes (a file list of 10,000 shards is about 1 MB); DCP's index grows with
# its chunks, about 36 bytes each (Llama 3 8B over 256 ranks: 300K chunks, 10 MiB; 405B over 2,048 ranks: 6.7M, 240
# MiB). Files far beyond are not ours: reading them whole could exhaust memory, and unpickling an index takes about
# 9 s per million chunks on a 2-core host.
MAX_JSON_BYTES = 64 * 2**20
MAX_METADATA_BYTES = 256 * 2**20


def load_dcp_metadata(file: Path) -> Metadata:
    """DCP's index of a checkpoint, read without running code, checked to hold only tensors in .distcp files."""
    if problem := special_file_problem(file, max_bytes=MAX_METADATA_BYTES, what="DCP index"):
        raise CheckpointError(problem)
    try:
        metadata = _MetadataUnpickler(io.BytesIO(file.read_bytes())).load()
    except FileNotFoundError:
        raise CheckpointError(f"{file} is missing") from None
    except Exception as e:  # unpickling garbage raises anything
        raise CheckpointError(f"{file} is not a safe DCP index, refusing to load it ({first_line(e)})") from None
    if type(metadata) is not Metadata or not isinstance(metadata.state_dict_metadata, dict) or not isinstance(
        metadata.storage_data, dict
    ):
        raise CheckpointError(f"{file} is not a DCP index (it holds a {type(metadata).__name__})")
    chunks = sum(len(md.chunks) for md in metadata.state_dict_metadata.values() if isinstance(
        getattr(md, "chunks", None), list))
    if chunks > MAX_CHUNKS:  # each is checked below and planned by DCP: bounded work
        raise CheckpointError(f"{file} holds {chunks:,} chunks, more than the {MAX_CHUNKS:,} a DCP index of this "
                              "trainer holds (an edited or foreign file)")
    for key, md in metadata.state_dict_metadata.items():
        if type(md) is not TensorStorageMetadata:
            raise CheckpointError(
                f"{file}: entry {key!r} is a pickled Python object, not a tensor; refusing to load it (unpickling "
                f"can run code, and this trainer writes only tensors with DCP; checkpoints of format "
                f"{OLD_FORMATS[0]} held such entries)"
            )
        if problem := _entry_problem(md):
            raise CheckpointError(f"{file}: entry {key!r} {problem}; not a DCP index this trainer wrote (an edited "
                                  "or foreign file)")
    for item in metadata.storage_data.values():
        name = getattr(item, "relative_path", None)
        if type(item) is not _StorageInfo or not isinstance(name, str) or not _DATA_FILE.match(name):
            raise CheckpointError(f"{file}: a storage entry names {name!r}, not a __R_I.distcp file of this folder")
        if item.transform_descriptors:
            raise CheckpointError(f"{file}: {name} is stored with transforms {item.transform_descriptors}, which "
                                  "this trainer never writes")
        for what, low in (("offset", 0), ("length", 1)):  # where its bytes are (a read past the end fails cleanly)
            value = getattr(item, what, None)
            if type(value) is not int or not low <= value < 2**63:
                raise CheckpointError(f"{file}: a storage entry of {name} has {what} {value!r}, not an integer >= "
                                      f"{low} (an edited or foreign file)")
    return metadata


def _dims(value: Any) -> bool:
    return isinstance(value, torch.Size) and all(type(d) is int and d >= 0 for d in value)


def _entry_problem(md: TensorStorageMetadata) -> str | None:
    """What is malformed in a tensor entry (its size, dtype, chunks), before anything is allocated by it."""
    if not _dims(md.size):
        return f"has size {md.size!r}, not a list of sizes >= 0"
    if type(md.properties) is not TensorProperties or not isinstance(md.properties.dtype, torch.dtype):
        return f"has properties {md.properties!r}, not a tensor dtype"
    if not isinstance(md.chunks, list):
        return f"has chunks {md.chunks!r}, not a list"
    for chunk in md.chunks:
        if type(chunk) is not ChunkStorageMetadata or not _dims(chunk.offsets) or not _dims(chunk.sizes) or len(
                chunk.offsets) != len(md.size) or len(chunk.sizes) != len(md.size) or any(
                o + n > d for o, n, d in zip(chunk.offsets, chunk.sizes, md.size)):
            return f"has a chunk outside its size {list(md.size)}"
    return _tiling_problem(md.chunks, tuple(md.size))


# A tensor's chunks cut it into at most this many pieces to be checked (DCP writes one chunk per shard: a few
# thousand at most; a crafted index could ask for a grid of billions). DCP's chunks of one tensor form a grid, so
# its pieces are its chunks; a few chunks that cut it into many more pieces are not DCP's.
_MAX_PIECES = 1 << 24
_PIECES_PER_CHUNK = 64
# Chunks in a whole index: one per tensor and rank that holds a shard of it (a 405B model's ~3,300 entries with
# model and optimizer state, over 2,048 shard ranks, is 6.7M).
MAX_CHUNKS = 1 << 23


def _tiling_problem(chunks: list[ChunkStorageMetadata], size: tuple[int, ...]) -> str | None:
    """What is wrong when the chunks do not cover every element of `size` exactly once (else loading would leave
    the rest of the tensor as torch.empty's memory, or read one element from two chunks).

    The chunks' boundaries cut every dim into pieces; each chunk must cover its pieces, and every piece be covered
    once."""
    total = math.prod(size)
    covered = sum(math.prod(c.sizes) for c in chunks)
    if total == 0:
        return None if covered == 0 else f"has chunks of {covered:,} elements in a tensor of none"
    cuts = [sorted({0, d, *(o for c in chunks for o in (c.offsets[i], c.offsets[i] + c.sizes[i]))})
            for i, d in enumerate(size)]
    pieces = math.prod(len(c) - 1 for c in cuts)
    if pieces > min(_MAX_PIECES, _PIECES_PER_CHUNK * max(len(chunks), 1)):
        return f"has {len(chunks):,} chunks that cut it into more pieces than a DCP index of this trainer has"
    count = np.zeros([len(c) - 1 for c in cuts], dtype=np.int64)
    touched = 0
    for c in chunks:
        region = tuple(slice(bisect.bisect_left(cuts[i], o), bisect.bisect_left(cuts[i], o + n))
                       for i, (o, n) in enumerate(zip(c.offsets, c.sizes)))
        touched += math.prod(s.stop - s.start for s in region)
        if touched > pieces:  # more pieces covered than there are: two chunks overlap (and the work stays bounded)
            return (f"has chunks that overlap (they cover {covered:,} elements of its {total:,}, size "
                    f"{list(size)})")
        count[region] += 1
    if (count == 1).all():
        return None
    what = [w for w, bad in (("leave elements out", (count == 0).any()), ("overlap", (count > 1).any())) if bad]
    return (f"has chunks that {' and '.join(what)} (they cover {covered:,} elements of its {total:,}, size "
            f"{list(size)})")


class SafeReader(FileSystemReader):
    """DCP's FileSystemReader that reads `.metadata` with `load_dcp_metadata` and never unpickles an entry.

    Tensors are read by FileSystemReader with `torch.load(weights_only=True)`; a
    non-tensor (BYTE_IO) read would go through `torch.load(weights_only=False)`.
    """

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        assert kwargs.get("rank") is None, "per-rank metadata files are not used"
        metadata = load_dcp_metadata(Path(self.path) / METADATA)
        metadata.storage_meta = StorageMeta(load_id=self.load_id)  # as FileSystemReader.read_metadata does
        return metadata

    def read_data(self, plan, planner):
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:
                raise CheckpointError(f"{Path(self.path) / METADATA}: entry {item.dest_index.fqn!r} is not a tensor; "
                                      "refusing to unpickle it")
        return super().read_data(plan, planner)


def safe_load(state: dict[str, Any], path: Path, *, what: str = "checkpoint", **kwargs: Any) -> None:
    """dcp.load of `state` from `path` through SafeReader; every failure one CheckpointError line ("failed to read
    {what} {path}: ..."), a CheckpointError of our own (a refused entry) as it was raised."""
    try:
        dcp.load(state, storage_reader=SafeReader(str(path)), **kwargs)
    except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
        cause = root_cause(e)
        if isinstance(cause, CheckpointError):
            raise type(cause)(str(cause)) from None
        raise CheckpointError(f"failed to read {what} {path}: {first_line(cause)}") from e


# ---------------------------------------------------------------------------
# Which folders are checkpoints, and are they intact


def scan_checkpoints(folder: Path) -> tuple[dict[int, Path], list[tuple[Path, str]]]:
    """(complete {step: path}, incomplete [(path, why)]) in a checkpoint folder; cheap (no data read)."""
    complete: dict[int, Path] = {}
    incomplete: list[tuple[Path, str]] = []
    if not folder.is_dir():
        return complete, incomplete
    for path in sorted(folder.iterdir()):
        m = STEP_DIR.match(path.name)
        if not m or not path.is_dir():
            continue
        if why := incomplete_reason(path):
            incomplete.append((path, why))
        else:
            complete[int(m.group(1))] = path
    return complete, incomplete


def incomplete_reason(path: Path) -> str | None:
    """Why the folder `path` (named step-N or step-N.tmp) is no complete checkpoint, or None when it is one."""
    if not path.is_dir():
        return "not a folder"
    if path.name.endswith(".tmp"):
        if is_partial(path):
            return "a save that never finished (killed or failed mid-save)"
        return f"named like an unfinished save but without the {PARTIAL} marker every save writes first (kept)"
    if not (path / METADATA).exists():
        return f"no {METADATA}"
    if not (path / CHECKPOINT_JSON).exists():
        return f"no {CHECKPOINT_JSON}"
    return None


def check_file(path: Path, expected: dict[str, Any] | None, *, min_bytes: int = 0) -> str | None:
    """None when the file is intact, else a one-line reason naming it; a CheckpointError if it resolves outside
    its folder (a symlink: unsafe, not corrupt)."""
    if problem := outside_problem(path):
        raise CheckpointError(problem)
    if problem := special_file_problem(path):  # a FIFO would hang the checksum's read
        return problem
    if not path.is_file():
        return f"{path} is missing"
    size = path.stat().st_size
    want = expected["bytes"] if expected else min_bytes
    if size < want or (expected and size != want):
        return f"{path} is truncated or corrupted: {size:,} bytes, expected {want:,}"
    if expected:
        got = file_digest(path)["crc32"]
        if got != expected["crc32"]:
            return f"{path} is corrupted: crc32 {got} does not match {expected['crc32']} recorded when it was saved"
    return None


def read_checkpoint_json(path: Path, *, allow_unverified: bool = False) -> dict[str, Any]:
    """checkpoint.json of a checkpoint folder, or a one-line CheckpointError naming what is wrong.

    A description without its list of files (size and crc32 of each) cannot prove the
    checkpoint complete: refused unless `allow_unverified` (checkpoint.allow_unverified).
    """
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} is not a folder")
    file = path / CHECKPOINT_JSON
    if problem := outside_problem(file) or special_file_problem(file, max_bytes=MAX_JSON_BYTES, what=CHECKPOINT_JSON):
        raise CheckpointError(problem)
    try:
        info = read_json_object(file, what="a checkpoint description", error=CheckpointError,
                                corrupt=CorruptCheckpointError)
    except FileNotFoundError:
        if (path / "config.json").exists():
            raise CheckpointError(
                f"{file} is missing: {path} looks like a Hugging Face model folder; convert it first: "
                f"python scripts/convert_checkpoint.py import {path} OUT, then pass OUT as "
                "checkpoint.initial_load_path (the model's shape comes with it)"
            ) from None
        raise CheckpointError(
            f"{file} is missing: {path} is not a complete checkpoint (an interrupted save, or not written by this "
            "trainer)"
        ) from None
    if info.get("format") in OLD_FORMATS:
        raise CheckpointError(
            f"{file}: format {info['format']} stored pickled Python objects, which this trainer no longer loads "
            "(unpickling a file can run code); resume it with the trainer version that wrote it"
        )
    if info.get("format") != FORMAT:
        raise CheckpointError(f"{file} is not a {FORMAT} checkpoint description (format={info.get('format')!r})")
    if not isinstance(info.get("model"), dict):
        raise CheckpointError(f"{file} has no model description")
    step = info.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < 2**63:
        raise CheckpointError(f"{file}: step={step!r} must be an integer in [0, 2**63-1] (not as this trainer "
                              "writes it: an edited or foreign file)")
    args_from_json(info["model"], where=str(file))  # every model argument by type and range
    check_fields(info, CHECKPOINT_FIELDS, file=file)  # the other fields a load reads
    files = info.get("files")
    if not (isinstance(files, dict) and files and all(
        isinstance(v, dict) and isinstance(v.get("bytes"), int) and isinstance(v.get("crc32"), str)
        for v in files.values()
    )):
        if not allow_unverified:
            raise CorruptCheckpointError(
                f"{file} has no valid \"files\" list (size and crc32 of every file), so {path} cannot be verified "
                "complete; refusing it. Load it unverified only if you trust it: --checkpoint.allow_unverified=true"
            )
        logger.warning("%s has no valid \"files\" list: loading %s UNVERIFIED (checkpoint.allow_unverified=true); "
                       "truncated or corrupted shards will not be detected", file, path)
        info["files"] = None
    return info


def check_model_matches(info: dict[str, Any], run: RunInfo, *, path: Path) -> None:
    """Vocab and shape of the checkpoint against this run's model, from checkpoint.json alone."""
    file = path / CHECKPOINT_JSON
    saved, ours = info["model"], run.model_json()
    if isinstance(saved.get("dim"), int) and isinstance(saved.get("n_heads"), int) and saved["n_heads"] > 0:
        # Written before these arguments existed: what they meant then.
        saved = {"head_dim": saved["dim"] // saved["n_heads"], "qk_norm": False, "tie_word_embeddings": False,
                 **(MOE_SHAPE_DEFAULTS if saved.get("name") == "moe" else {}), **saved}
    if saved.get("vocab_size") != ours["vocab_size"]:
        raise CheckpointError(
            f"{file}: vocab mismatch: the checkpoint has vocab_size={saved.get('vocab_size')}, this run has "
            f"{ours['vocab_size']} (model.vocab_size / the tokenizer must match the checkpoint's)"
        )
    diffs = [f"{k}={saved.get(k)} (this run: {ours.get(k)})" for k in SHAPE_KEYS if saved.get(k) != ours.get(k)]
    if diffs:
        raise CheckpointError(
            f"{file}: model shape mismatch: the checkpoint is {saved.get('name', 'llama3')} {saved.get('flavor')} with "
            f"{', '.join(diffs)}; use the [model] shapes it was trained with (its resolved.toml has them all)"
        )
    changed = [f"{k} {saved.get(k)} -> {ours[k]}" for k in FUNCTION_KEYS if saved.get(k) != ours[k]]
    if changed:
        logger.warning("%s: same shapes but %s differs from the checkpoint's model", file, ", ".join(changed))


def read_dcp_metadata(path: Path, info: dict[str, Any]) -> Metadata:
    """The checkpoint's `.metadata`, checked against checkpoint.json and read safely (`load_dcp_metadata`)."""
    file = path / METADATA
    files = info.get("files")
    problem = check_file(file, files.get(METADATA) if files is not None else None)
    if files is not None and not problem and METADATA not in files:
        problem = f"{file} is not listed in {path / CHECKPOINT_JSON}"
    if problem:
        raise CorruptCheckpointError(problem)
    return load_dcp_metadata(file)


def data_files(metadata: Metadata) -> dict[str, int]:
    """{file name: the least size it must have} of every data file the index refers to."""
    min_bytes: dict[str, int] = {}
    for item in metadata.storage_data.values():
        name = item.relative_path
        min_bytes[name] = max(min_bytes.get(name, 0), item.offset + item.length)
    return min_bytes


_RANK_FILE = re.compile(r"^__(\d+)_")  # DCP's file names start with the writing rank: __{rank}_{i}.distcp


def check_every_rank_wrote(tmp: Path, *, world_size: int) -> None:
    """Rank 0, before publishing a save in `tmp`: every rank's checksums and every file `.metadata` refers to are
    there, else a CheckpointError. A rank missing from them wrote into another folder (a relative or node-local
    path resolved differently on its node): publishing would make a checkpoint that never loads."""
    listed: set[str] = set()
    absent = set()
    for rank in range(world_size):
        sidecar = tmp / sidecar_name(rank)
        if sidecar.is_file():
            listed.update(read_sidecar(sidecar)["files"])
        else:
            absent.add(rank)
    unlisted = sorted(set(data_files(load_dcp_metadata(tmp / METADATA))) - listed)
    ranks = sorted(absent | {int(m.group(1)) for name in unlisted if (m := _RANK_FILE.match(name))})
    if not ranks and not unlisted:
        return
    who = (f"rank {ranks[0]} wrote its" if len(ranks) == 1 else
           f"ranks {', '.join(map(str, ranks))} wrote their" if ranks else "a rank wrote its")
    raise CheckpointError(
        f"{who} shards into another folder: "
        f"{', '.join(unlisted) or 'its checksums'} {'is' if len(unlisted) == 1 else 'are'} not in {tmp.absolute()}, where rank 0 "
        "publishes the checkpoint (job.dump_folder or checkpoint.folder names another folder on that rank's node: a "
        "relative path, or a node-local disk); give an absolute path on a filesystem every node shares")


def check_files(path: Path, info: dict[str, Any], names: dict[str, int]) -> list[str]:
    """Problems (one line each) with these files of a checkpoint: {name: least size}."""
    recorded = info.get("files")
    problems = []
    for name, min_bytes in names.items():
        if recorded is not None and name not in recorded:
            problems.append(f"{path / name} is not listed in {path / CHECKPOINT_JSON}")
        elif p := check_file(path / name, recorded.get(name) if recorded is not None else None, min_bytes=min_bytes):
            problems.append(p)
    return problems


def read_state_json(path: Path, info: dict[str, Any]) -> dict[str, Any]:
    """The non-tensor state of a training checkpoint (verified against checkpoint.json)."""
    file = path / STATE_JSON
    problems = check_files(path, info, {STATE_JSON: 1})
    if problems:
        raise CorruptCheckpointError(problems[0])
    if problem := special_file_problem(file, max_bytes=MAX_JSON_BYTES, what=STATE_JSON):
        raise CheckpointError(problem)
    state = read_json_object(file, what="a training state", error=CheckpointError, corrupt=CorruptCheckpointError)
    check_state_values(state, info, path=path)
    return state


def verify_on_every_rank(path: Path, *, model: nn.Module, run: RunInfo, group: dist.ProcessGroup | None,
                         allow_unverified: bool,
                         model_only: bool, raise_corrupt: bool) -> tuple[dict[str, Any], Metadata] | str:
    """(checkpoint.json, DCP metadata) once every check passed on every rank, or why it is corrupt.

    Collective on `group`: each rank checks a slice of the data files and all ranks see every
    rank's result, so all take the same branch. Incompatible or unsafe checkpoints (and corrupt
    ones with `raise_corrupt`) raise CheckpointError on every rank.
    """
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    result: tuple[str, str] = ("ok", "")
    info = metadata = None
    # Under pipeline parallelism each rank holds some stages: the checkpoint must match all ranks' keys.
    model_sd = model_state_dict(model)
    gathered: list[list[str]] = [[] for _ in range(world_size)]
    dist.all_gather_object(gathered, sorted(model_sd), group=group)
    all_keys = {k for keys in gathered for k in keys}
    try:
        info = read_checkpoint_json(path, allow_unverified=allow_unverified)
        check_model_matches(info, run, path=path)
        if not model_only and info.get("kind") != "training":
            raise CheckpointError(f"{path / CHECKPOINT_JSON}: a {info.get('kind')} checkpoint has no optimizer or "
                                  "step to resume; pass it as checkpoint.initial_load_path instead")
        metadata = read_dcp_metadata(path, info)
        check_index_entries(metadata, {k: tuple(v.shape) for k, v in model_sd.items()}, path=path,
                            all_keys=all_keys)
        names = data_files(metadata)
        if not model_only:
            names[STATE_JSON] = 1
        mine = sorted(names)[rank::world_size]
        problems = check_files(path, info, {n: names[n] for n in mine})
        if problems:
            result = ("corrupt", problems[0] + (f" (and {len(problems) - 1} more problems)"
                                                if len(problems) > 1 else ""))
    except CorruptCheckpointError as e:
        result = ("corrupt", str(e))
    except CheckpointError as e:
        result = ("error", str(e))
    results: list[tuple[str, str]] = [("ok", "")] * world_size
    dist.all_gather_object(results, result, group=group)
    for kind in ("error", "corrupt"):
        for k, message in results:
            if k == kind and (kind == "error" or raise_corrupt):
                raise on_every_rank((CheckpointError if kind == "error" else CorruptCheckpointError)(message))
            if k == kind:
                return message
    assert info is not None and metadata is not None
    return info, metadata
