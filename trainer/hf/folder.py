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
GPT-OSS's MXFP4 experts (two uint8 tensors each) are read as one and dequantized to bfloat16 (trainer/hf/mxfp4.py),
and so are DeepSeek-V3's block-FP8 weights with their `_scale_inv` (trainer/hf/fp8.py).
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
import trainer.hf.fp8 as fp8
from trainer.hf.mxfp4 import BLOCKS, MXFP4, SCALES, dequantize, dequantized_shape, packed_problem
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


@dataclass(frozen=True)
class Header:
    """One tensor of a safetensors file, as its header gives it (no data read)."""

    dtype: str
    """safetensors' name of its dtype: F32, BF16, F16, F64, I64, BOOL, F8_E4M3, ..."""
    shape: tuple[int, ...]
    file: str
    """The safetensors file of the folder that holds it."""
    scales_file: str = ""
    """MXFP4 (`X_blocks` and `X_scales` read as one tensor `X`, trainer/hf/mxfp4.py) or FP8 (`X` and `X_scale_inv`,
    trainer/hf/fp8.py): the file of its scales."""
    block: tuple[int, ...] = ()
    """FP8: [rows, columns] of a block of one scale."""


# The dtypes a model's weights are read in, by safetensors' names: float16 and float64 are read as float32 (as
# transformers loads them unless told another dtype; float16 exactly), so what is read is what a checkpoint of this
# trainer holds. Integers, booleans and FP8 without its scales are no model's weights.
WEIGHT_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float32, "F64": torch.float32}
CAST_ON_READ = {"F16": "float16", "F64": "float64"}
_DTYPE_WORDS = {"BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "U16": "uint16", "I32": "int32",
                "U32": "uint32", "I64": "int64", "U64": "uint64", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}
# What comparing two tables reads at a time (a vocabulary of 256K x 8K in bfloat16 is 4 GiB).
_COMPARE_BYTES = 64 * 2**20


def read_headers(folder: Path, *, mxfp4: bool = False, fp8_block: tuple[int, int] | None = None
                 ) -> dict[str, Header]:
    """Every tensor of the folder's safetensors files (by its Hugging Face name) as its header gives it; a one-line
    ExportError for a tensor in two files or of a dtype no model's weights have. mxfp4 (a folder whose
    quantization_config says so): each `X_blocks` and `X_scales` pair is one tensor `X` of dtype MXFP4. fp8_block
    (its weight_block_size, where quant_method is "fp8"): each float8 `X` with its `X_scale_inv` one `X` of dtype
    FP8."""
    require_safetensors("reading a Hugging Face model")
    from safetensors import SafetensorError, safe_open

    headers: dict[str, Header] = {}
    for name in _safetensors_files(folder):
        path = _confined(folder / name, what="safetensors file")
        try:
            with safe_open(str(path), framework="pt") as f:  # reads the header only
                for key in f.keys():
                    if key.endswith("rotary_emb.inv_freq"):  # a buffer of some old exports; derived from the config
                        continue
                    if key in headers:
                        raise ExportError(f"{path}: {key} is also in {headers[key].file}: which one is the model's?")
                    part = f.get_slice(key)
                    headers[key] = Header(part.get_dtype(), tuple(part.get_shape()), name)
        except (SafetensorError, OSError) as e:
            raise ExportError(f"{path} is not a readable safetensors file: {str(e).splitlines()[0]}") from None
    if mxfp4:
        headers = _merge_mxfp4(headers, folder)
    if fp8_block is not None:
        headers = _merge_fp8(headers, folder, fp8_block)
    for key, header in headers.items():
        if header.dtype not in WEIGHT_DTYPES and header.dtype not in (MXFP4, fp8.FP8):
            word = _DTYPE_WORDS.get(header.dtype, header.dtype)
            raise ExportError(f"{folder / header.file}: {key} is stored as {word}, not a floating-point dtype of a "
                              f"model's weights ({', '.join(WEIGHT_DTYPES)}): not a model this trainer can load")
    return headers


def _merge_mxfp4(headers: dict[str, Header], folder: Path) -> dict[str, Header]:
    """The headers with each MXFP4 pair (`X_blocks`, `X_scales`) as one `X` of the shape it dequantizes to."""
    merged = dict(headers)
    for key, blocks in headers.items():
        if not key.endswith(BLOCKS):
            continue
        name = key.removesuffix(BLOCKS)
        if (scales := headers.get(name + SCALES)) is None or name in headers:
            what = f"has no {name + SCALES}" if scales is None else f"is there with {name} itself"
            raise ExportError(f"{folder / blocks.file}: {key} {what}: not an MXFP4 tensor as transformers reads it")
        if problem := packed_problem((blocks.dtype, blocks.shape), (scales.dtype, scales.shape)):
            raise ExportError(f"{folder / blocks.file}: {key}: {problem}")
        del merged[key], merged[name + SCALES]
        merged[name] = Header(MXFP4, dequantized_shape(blocks.shape), blocks.file, scales.file)
    if orphan := next((k for k in merged if k.endswith(SCALES) and merged[k].dtype == "U8"), None):
        raise ExportError(f"{folder / merged[orphan].file}: {orphan} has no {orphan.removesuffix(SCALES) + BLOCKS}: "
                          "not an MXFP4 tensor as transformers reads it")
    return merged


def _merge_fp8(headers: dict[str, Header], folder: Path, block: tuple[int, int]) -> dict[str, Header]:
    """The headers with each block-FP8 weight and its `_scale_inv` as one tensor of dtype FP8."""
    merged = dict(headers)
    for key, scales in headers.items():
        if not key.endswith(fp8.SCALE_INV):
            continue
        name = key.removesuffix(fp8.SCALE_INV)
        if (weight := headers.get(name)) is None:
            raise ExportError(f"{folder / scales.file}: {key} has no {name}: not a block-FP8 weight as transformers "
                              "reads it")
        if problem := fp8.pair_problem((weight.dtype, weight.shape), (scales.dtype, scales.shape), block):
            raise ExportError(f"{folder / weight.file}: {name}: {problem}")
        del merged[key]
        merged[name] = Header(fp8.FP8, weight.shape, weight.file, scales.file, block)
    if orphan := next((k for k, h in merged.items() if h.dtype == fp8.WEIGHT_DTYPE), None):
        raise ExportError(f"{folder / merged[orphan].file}: {orphan} is float8_e4m3fn with no {orphan}{fp8.SCALE_INV}: "
                          "a block-FP8 weight is read with its scales")
    return merged


def max_difference(folder: Path, headers: dict[str, Header], a: str, b: str) -> float:
    """The largest |a - b| of two tensors of the same shape (0.0: equal; nan where either holds one), compared a
    slice of rows at a time."""
    from safetensors import safe_open

    ha, hb = headers[a], headers[b]
    rows = ha.shape[0] if ha.shape else 1
    step = max(1, _COMPARE_BYTES // (4 * max(1, numel(ha.shape[1:]))))
    worst = 0.0
    with safe_open(str(folder / ha.file), framework="pt") as fa, safe_open(str(folder / hb.file), framework="pt") as fb:
        sa, sb = fa.get_slice(a), fb.get_slice(b)
        for start in range(0, rows, step):
            x, y = (s[start:start + step] if ha.shape else s[:] for s in (sa, sb))
            if not torch.equal(x.float(), y.float()):
                d = (x.float() - y.float()).abs().max().item()
                worst = d if d != d or d > worst else worst  # a NaN stays
    return worst


def check_parts(headers: dict[str, Header], *, specs: dict[str, Spec], shapes: dict[str, tuple[int, ...]],
                sources: dict[str, str], folder: Path) -> None:
    """Every tensor the model needs is in the folder with the shape it must have, and the folder holds no other
    (but the keys of `sources`); before any tensor is read.

    sources: the Hugging Face name a needed name is read from, where it is another (a tied head's table: the
    embeddings, or a head alone where the embeddings are missing, as transformers ties them).
    """
    wanted = [name for fqn in shapes for name in specs[fqn].names]
    read = {sources.get(n, n) for n in wanted}
    missing = [n for n in wanted if sources.get(n, n) not in headers]
    unexpected = sorted(set(headers) - read - set(sources))
    if missing or unexpected:
        raise ExportError(
            f"{folder}: {len(missing)} missing weights (first: {missing[0] if missing else '-'}), "
            f"{len(unexpected)} unexpected (first: {unexpected[0] if unexpected else '-'})"
        )
    for fqn, shape in shapes.items():
        spec = specs[fqn]
        # The shapes the parts must have: the split of a tensor of ours with the expected shape.
        part_shapes = [tuple(p.shape) for p in spec.split(torch.empty(shape, device="meta"))]
        for name, part_shape in zip(spec.names, part_shapes, strict=True):
            have = headers[sources.get(name, name)].shape
            if have != part_shape:
                raise ExportError(f"{folder}: {sources.get(name, name)} has shape {list(have)}, "
                                  f"expected {list(part_shape)}")


def read_tensors(folder: Path, headers: dict[str, Header], names: set[str]) -> dict[str, torch.Tensor]:
    """The named tensors of the folder (checked by `read_headers`), by their Hugging Face names, in the dtypes of
    WEIGHT_DTYPES (MXFP4: dequantized to bfloat16, exactly; FP8: the float32 product, cast to bfloat16), one at a
    time: what is held is the tensors read, plus one tensor's packed form."""
    from safetensors import SafetensorError, safe_open

    tensors: dict[str, torch.Tensor] = {}
    for file in sorted({headers[n].file for n in names}):
        path = _confined(folder / file, what="safetensors file")
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in sorted(n for n in names if headers[n].file == file):
                    h = headers[name]
                    if h.dtype == MXFP4:  # its scales may be in another file
                        tensors[name] = dequantize(f.get_tensor(name + BLOCKS), _read_one(folder, h.scales_file,
                                                                                            name + SCALES))
                    elif h.dtype == fp8.FP8:  # its scales are in this file, as DeepSeek's are, or another one
                        scale = name + fp8.SCALE_INV
                        scales = f.get_tensor(scale) if h.scales_file == file else _read_one(folder, h.scales_file,
                                                                                               scale)
                        tensors[name] = fp8.dequantize(f.get_tensor(name), scales, h.block)
                    else:
                        tensors[name] = f.get_tensor(name).to(WEIGHT_DTYPES[h.dtype])
        except (SafetensorError, OSError) as e:
            raise ExportError(f"{path} is not a readable safetensors file: {str(e).splitlines()[0]}") from None
    return tensors


def _read_one(folder: Path, file: str, name: str) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(str(_confined(folder / file, what="safetensors file")), framework="pt") as f:
        return f.get_tensor(name)


def join_tensors(tensors: dict[str, torch.Tensor], *, specs: dict[str, Spec], shapes: dict[str, tuple[int, ...]],
                 sources: dict[str, str]) -> dict[str, torch.Tensor]:
    """Our tensors (by fqn, in `shapes` order) from the folder's, checked by `check_parts`; a table read twice (a
    tied head) is a copy the second time, as two entries of a checkpoint must not share storage."""
    used: set[str] = set()

    def take(name: str) -> torch.Tensor:
        source = sources.get(name, name)
        tensor = tensors[source].clone() if source in used else tensors[source]
        used.add(source)
        return tensor

    return {fqn: specs[fqn].join([take(name) for name in specs[fqn].names]) for fqn in shapes}
