"""A Hugging Face model folder on disk, whatever the family: config.json, safetensors, the tokenizer.

Export writes `config.json` and either `model.safetensors` or, above `max_shard_bytes`,
`model-0000i-of-0000n.safetensors` with `model.safetensors.index.json`: the two layouts
`from_pretrained` reads. Tensors are fetched one shard at a time, so the writer never
holds more than one shard in memory. Files are written 0644 (safetensors alone would
leave them 0600) into `{out}.tmp`, which is renamed when complete. The output folder must be new, empty
or an earlier export (moved aside to `{out}.old`, never deleted): a folder holding checkpoints or
anything else is refused before anything is written (trainer/hf/output_folder.py).

What each of our tensors is called there, and how it is cut or permuted, is the family's
(`trainer.hf.llama`, `trainer.hf.moe`): one `Spec` per tensor of ours.
Needs the `safetensors` package (the `hf` extra). Reading runs no code from the folder:
only safetensors and JSON are read, and only files that resolve inside the folder (trainer/files/confine.py).
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from trainer.errors import UserError
from trainer.files.confine import outside_problem, special_file_problem
from trainer.files.json_object import read_json_object
from trainer.hf.output_folder import EXPORT, prepare_output, publish_output

logger = logging.getLogger("trainer.hf")

# HF's own default shard size for save_pretrained in transformers 4.x.
DEFAULT_MAX_SHARD_BYTES = 5 * 2**30
SAFETENSORS_HINT = "pip install safetensors (or pip install -e '.[hf]')"
# What save_pretrained's files get under the usual umask; safetensors' writer makes its files 0600.
FILE_MODE = 0o644
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class ExportError(UserError, ValueError):
    """A user-facing problem with an export or import; its message is one line."""


@dataclass(frozen=True)
class Spec:
    """How one tensor of ours is stored: the HF tensors it becomes, and the two directions.

    `split(ours)` returns the tensors named `names`, in order; `join(theirs)` is its inverse.
    `keep_fp32`: written in float32 whatever the export dtype (the expert bias, whose rounding
    would change which experts are chosen; transformers keeps it fp32 too).
    """

    names: tuple[str, ...]
    split: Callable[[torch.Tensor], list[torch.Tensor]]
    join: Callable[[list[torch.Tensor]], torch.Tensor]
    keep_fp32: bool = False


def rename(name: str) -> Spec:
    """The tensor as it is, under another name."""
    return Spec((name,), lambda t: [t], lambda ts: ts[0])


def require_safetensors(what: str) -> None:
    try:
        import safetensors  # noqa: F401
    except ImportError:
        raise ExportError(f"{what} needs the safetensors package: {SAFETENSORS_HINT}") from None


def plan_shards(sizes: dict[str, int], *, max_shard_bytes: int) -> list[list[str]]:
    """Group names (in order) into shards of at most max_shard_bytes; a bigger tensor gets its own shard."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, nbytes in sizes.items():
        if shards[-1] and used + nbytes > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += nbytes
    return shards


def numel(shape: Iterable[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _write_text(path: Path, text: str) -> None:
    path.write_text(text)
    os.chmod(path, FILE_MODE)


def write_folder(
    out: Path, *, specs: dict[str, Spec], shapes: dict[str, tuple[int, ...]],
    fetch: Callable[[list[str]], dict[str, torch.Tensor]], dtype: torch.dtype, config: dict, max_shard_bytes: int,
    is_writer: bool, extra_files: Callable[[Path], None] | None = None,
) -> list[str]:
    """Write the folder at `out` (see the module docstring); returns the safetensors file names.

    `fetch(fqns)` returns those tensors (any dtype/device; cast here). In a distributed export
    every rank calls this with the same arguments (fetch may be collective) and only the writer
    writes. `extra_files(tmp)` adds files (the tokenizer) before the folder is published.
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    sizes = {fqn: (4 if specs[fqn].keep_fp32 else itemsize) * numel(shape) for fqn, shape in shapes.items()}
    shards = plan_shards(sizes, max_shard_bytes=max_shard_bytes)
    tmp = None
    if is_writer:
        require_safetensors("writing a Hugging Face export")
        tmp = prepare_output(out, kind=EXPORT)  # refuses a folder of checkpoints (or anything but an export)
    names = ["model.safetensors"] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))
    ]
    weight_map: dict[str, str] = {}
    for fqns, file_name in zip(shards, names):
        tensors = fetch(fqns)
        if is_writer:
            weight_map.update(_write_shard(tmp / file_name, fqns, tensors, specs=specs, shapes=shapes, dtype=dtype))
        del tensors
    if tmp is None:
        return names
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
        _write_text(tmp / "model.safetensors.index.json", json.dumps(index, indent=2) + "\n")
    _write_text(tmp / "config.json", json.dumps(config, indent=2) + "\n")
    if extra_files is not None:
        extra_files(tmp)
    publish_output(tmp, out, kind=EXPORT)
    return names


def _write_shard(path: Path, fqns: list[str], tensors: dict[str, torch.Tensor], *, specs: dict[str, Spec],
                 shapes: dict[str, tuple[int, ...]], dtype: torch.dtype) -> dict[str, str]:
    from safetensors.torch import save_file

    out: dict[str, torch.Tensor] = {}
    for fqn in fqns:
        spec = specs[fqn]
        t = tensors[fqn].detach().to("cpu", torch.float32 if spec.keep_fp32 else dtype)
        assert tuple(t.shape) == tuple(shapes[fqn]), (fqn, t.shape, shapes[fqn])
        for name, part in zip(spec.names, spec.split(t), strict=True):
            # clone: safetensors refuses tensors that share storage (a 1-process "gather" may alias a parameter).
            out[name] = part.contiguous().clone()
    save_file(out, str(path), metadata={"format": "pt"})
    os.chmod(path, FILE_MODE)
    return {name: path.name for name in out}


# -- reading -------------------------------------------------------------------


def read_config(folder: Path) -> dict:
    """config.json of a Hugging Face folder, as a dict; a one-line ExportError if it is not one."""
    if not folder.is_dir():
        raise ExportError(f"{folder} does not exist or is not a folder")
    config_path = _confined(folder / "config.json", max_bytes=MAX_JSON_BYTES, what="config.json")
    try:
        return read_json_object(config_path, what="a model config", error=ExportError)
    except FileNotFoundError:
        raise ExportError(f"{config_path} is missing: not a Hugging Face model folder") from None


# A model's config.json or safetensors index is kilobytes to a few MB; more is not one.
MAX_JSON_BYTES = 64 * 2**20


def _confined(path: Path, *, max_bytes: int | None = None, what: str = "file") -> Path:
    """`path`, a file of a Hugging Face folder, unless it resolves outside the folder or is no regular file of at
    most `max_bytes` (a FIFO would hang the read): ExportError."""
    if problem := outside_problem(path) or special_file_problem(path, max_bytes=max_bytes, what=what):
        raise ExportError(problem)
    return path


def safetensors_bytes(folder: Path) -> tuple[int, str]:
    """(total size, a description) of the folder's safetensors files: what a config's arguments must fit in."""
    require_safetensors("reading a Hugging Face model")
    from safetensors import SafetensorError, safe_open

    names = _safetensors_files(folder)
    total = 0
    for name in names:
        path = _confined(folder / name, what="safetensors file")
        try:
            with safe_open(str(path), framework="pt"):  # reads the header only
                pass
        except (SafetensorError, OSError) as e:
            raise ExportError(f"{path} is not a readable safetensors file: {str(e).splitlines()[0]}") from None
        total += path.stat().st_size
    return total, f"its safetensors files ({', '.join(names) if len(names) <= 3 else f'{len(names)} files'})"


def _safetensors_files(folder: Path) -> list[str]:
    # Only safetensors are read: pytorch_model.bin and *.pt files are pickles, and unpickling runs code.
    index_path = _confined(folder / "model.safetensors.index.json", max_bytes=MAX_JSON_BYTES, what="safetensors index")
    if index_path.exists():
        weight_map = read_json_object(index_path, what="a safetensors index", error=ExportError).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ExportError(f"{index_path} is not a safetensors index (its weight_map is a JSON "
                              f"{type(weight_map).__name__}, not an object)")
        for name in weight_map.values():
            if not (isinstance(name, str) and re.fullmatch(r"[\w.-]+\.safetensors", name)):
                raise ExportError(f"{index_path} names {name!r}, not a .safetensors file of this folder")
        return sorted(set(weight_map.values()))
    if (folder / "model.safetensors").exists():
        return ["model.safetensors"]
    pickles = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".pkl"))
    raise ExportError(
        f"{folder} has neither model.safetensors nor model.safetensors.index.json"
        + (f" ({', '.join(pickles)} not read: pickled weights can run code when loaded; only safetensors are "
           "read)" if pickles else "")
    )


def read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's safetensors files, by its Hugging Face name, in the folder's dtype."""
    require_safetensors("reading a Hugging Face model")
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for name in _safetensors_files(folder):
        path = _confined(folder / name, what="safetensors file")
        try:
            loaded = load_file(str(path))
        except (SafetensorError, OSError) as e:
            raise ExportError(f"{path} is not a readable safetensors file: {str(e).splitlines()[0]}") from None
        # rotary_emb.inv_freq: a buffer some old exports include; derived from the config.
        tensors.update({k: v for k, v in loaded.items() if not k.endswith("rotary_emb.inv_freq")})
    return tensors


def join_tensors(tensors: dict[str, torch.Tensor], *, specs: dict[str, Spec], shapes: dict[str, tuple[int, ...]],
                 folder: Path) -> dict[str, torch.Tensor]:
    """Our tensors (by fqn, in `shapes` order) from the folder's, checking names and every shape first."""
    wanted = [name for fqn in shapes for name in specs[fqn].names]
    missing = [n for n in wanted if n not in tensors]
    unexpected = sorted(set(tensors) - set(wanted))
    if missing or unexpected:
        raise ExportError(
            f"{folder}: {len(missing)} missing weights (first: {missing[0] if missing else '-'}), "
            f"{len(unexpected)} unexpected (first: {unexpected[0] if unexpected else '-'})"
        )
    out = {}
    for fqn, shape in shapes.items():
        spec = specs[fqn]
        # The shapes the parts must have: the split of a tensor of ours with the expected shape.
        part_shapes = [tuple(p.shape) for p in spec.split(torch.empty(shape, device="meta"))]
        for name, part_shape in zip(spec.names, part_shapes, strict=True):
            if tuple(tensors[name].shape) != part_shape:
                raise ExportError(f"{folder}: {name} has shape {list(tensors[name].shape)}, "
                                  f"expected {list(part_shape)}")
        out[fqn] = spec.join([tensors[name] for name in spec.names])
    return out
