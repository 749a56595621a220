"""Hugging Face import and export, one mapping per model family; the entry points pick the family from the args or
config.json.

    folder.py     the folder on disk: config.json, safetensors (sharded with an index above a size), 0644 files,
                  reading only safetensors and JSON; the tensors' headers (names, dtypes, shapes) before their data
    mxfp4.py      GPT-OSS's MXFP4 experts (quantization_config.quant_method "mxfp4"), dequantized on read
    fp8.py        DeepSeek-V3's block-FP8 weights (quant_method "fp8", `X_scale_inv` per 128 x 128), dequantized on read
    config_values.py  every config.json value read, checked by type and range; the two RoPE spellings agree
    llama.py      dense Llama <-> LlamaForCausalLM (Qwen3ForCausalLM with qk_norm), names one to one
    moe.py        MoE <-> Ernie4_5_MoeForCausalLM (softmax scores) or Glm4MoeForCausalLM (sigmoid scores), or
                  Qwen3MoeForCausalLM for a model with q/k norms (moe_qwen3.py: its config.json and what differs)
    deepseek_v3.py  DeepSeek-V3 (MLA, group-limited routing) <-> DeepseekV3ForCausalLM; MTP modules not exported
    tokenizer.py  the run's tokenizer (tokenizer.json, BOS/EOS ids) in the export
    output_folder.py  where an export or an import (trainer/checkpoint/offline.py) writes: a new, empty or earlier
                  output folder, published whole

A family's mapping is this package's module of the family's name (`trainer.models.family.ModelFamily.name`), found by
that name: the model families' registry (`trainer.models.FAMILIES`) is the one list, so a new family is its model file
and its mapping here, with no line added to this file. Each mapping names the config.json `MODEL_TYPES` it reads and
its `KIND` for messages; one that reads quantized folders, their `QUANT_METHODS` and `packed_params` (GPT-OSS: MXFP4;
DeepSeek-V3: block FP8).

A folder is read by one reader, `open_hf_folder` (import, `load_model`, generate.py): config.json into ModelArgs,
checked value by value, bound by the safetensors files' size, and every tensor's name, dtype and shape checked
against the args before any tensor is read.

An export loads with `transformers.AutoModelForCausalLM.from_pretrained(folder)` and with
`trainer.checkpoint.load_model(folder)`, and gives our model's logits (tests/unit/test_checkpoint.py,
tests/unit/test_hf_moe.py).
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

from trainer.hf import fp8, llama, mxfp4
from trainer.hf.folder import (
    CAST_ON_READ, DEFAULT_MAX_SHARD_BYTES, DTYPE_NAMES, SAFETENSORS_HINT, ExportError, Header, Spec, check_parts,
    join_tensors, max_difference, numel, plan_shards, read_config, read_headers, read_tensors, require_safetensors,
    safetensors_bytes, write_folder,
)
from trainer.hf.llama import LLAMA3_SCALED_CONTEXT, from_hf_name, to_hf_name
from trainer.hf.tokenizer import ExportTokenizer, resolve_tokenizer, write_tokenizer_files
from trainer.models.counts import files_fit_problem
from trainer.models import FAMILIES, ModelFamily, family_of
from trainer.models.llama import ModelArgs

logger = logging.getLogger("trainer.hf")


def mapping(model_family: ModelFamily) -> ModuleType:
    """The Hugging Face mapping of a model family: this package's module of the family's name."""
    return importlib.import_module(f"{__name__}.{model_family.name}")


def family(args: ModelArgs) -> ModuleType:
    """The module that maps this model's family: `trainer.hf.moe` or `trainer.hf.llama`."""
    return mapping(family_of(args))


def _family_of_config(config: dict, *, where: str) -> ModuleType:
    model_type = config.get("model_type", llama.MODEL_TYPE)
    mappings = [mapping(f) for f in FAMILIES.values()]
    for m in mappings:
        if model_type in m.MODEL_TYPES:
            return m
    raise ExportError(f"{where}: model_type={model_type!r} is not a layout this trainer reads "
                      f"({', '.join(repr(t) for m in mappings for t in m.MODEL_TYPES)})")


def expected_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Every tensor a model with these args exports, by our fqn."""
    return family(args).expected_shapes(args)


def check_exportable(args: ModelArgs) -> list[str]:
    """A one-line ExportError for options without an exact Hugging Face target; the warnings an export prints."""
    return family(args).check_exportable(args)


def hf_config(args: ModelArgs, *, dtype: torch.dtype, tokenizer: ExportTokenizer | None = None) -> dict:
    """config.json of the export: the family's architecture, and the tokenizer's BOS/EOS ids (null if unknown)."""
    return {
        **family(args).hf_config(args, dtype=dtype),
        "bos_token_id": tokenizer.bos_id if tokenizer else None,
        "eos_token_id": tokenizer.eos_id if tokenizer else None,
        "pad_token_id": None,
    }


def args_from_hf_config(config: dict, *, where: str) -> ModelArgs:
    """ModelArgs (MoEArgs for an MoE layout) of a Hugging Face config.json; a quantized folder its family does not
    read is refused first (`packed_method`)."""
    fam = _family_of_config(config, where=where)
    packed_method(config, fam, where=where)
    return fam.args_from_hf_config(config, where=where)


# The quantized formats a family may read (its QUANT_METHODS): each one's module, with the dtype name its merged
# headers get (DTYPE) and the bytes 32 of its parameters take on disk at the least (BYTES_PER_32).
PACKED_FORMATS: dict[str, ModuleType] = {"mxfp4": mxfp4, "fp8": fp8}


def packed_method(config: dict, fam: ModuleType, *, where: str) -> str | None:
    """The quantization_config.quant_method of a folder whose family reads it (GPT-OSS's "mxfp4" experts,
    trainer/hf/mxfp4.py; DeepSeek-V3's block "fp8", trainer/hf/fp8.py, whose other keys are checked here), None for
    an unquantized one; any other: one ExportError line naming the key."""
    if (quant := config.get("quantization_config")) is None:
        return None
    method = quant.get("quant_method") if isinstance(quant, dict) else quant
    read = getattr(fam, "QUANT_METHODS", ())
    if not isinstance(method, str) or method not in read:
        also = f" (or {', '.join(map(repr, read))})" if read else ""
        raise ExportError(f"{where}: quantization_config.quant_method={method!r}: a quantized folder; this trainer "
                          f"reads {fam.KIND} weights in bf16, fp16 or fp32{also}: load it in transformers "
                          "dequantized and save_pretrained it first")
    if method == "fp8" and (problem := fp8.config_problem(quant)):
        raise ExportError(f"{where}: {problem}")
    return method


def check_hf_config(config: dict, args: ModelArgs, *, where: str) -> None:
    """Raise ExportError naming the first field where config.json disagrees with args."""
    theirs = _family_of_config(config, where=where)
    if theirs is not family(args):
        raise ExportError(f"{where}: model_type={config.get('model_type', llama.MODEL_TYPE)!r} is a {theirs.KIND} "
                          f"layout, but the trainer model is {family(args).KIND}")
    theirs.check_hf_config(config, args, where=where)


HEAD, EMBEDDINGS = "lm_head.weight", "model.embed_tokens.weight"
HEAD_FQN = "output_head.proj.weight"  # ours: a tied model writes its one table once, as the embeddings


@dataclass(frozen=True)
class HFFolder:
    """A Hugging Face folder whose config.json and safetensors headers are checked against `args`; `read()` reads
    its weights (by our fqns)."""

    path: Path
    args: ModelArgs
    data_bytes: int
    """What its tensors take in memory once read, at the least: its safetensors files' size, and for MXFP4 and FP8
    tensors the bfloat16 they are dequantized to (2 bytes a value; 17/32 and 1 on disk)."""
    headers: dict[str, Header]
    sources: dict[str, str]
    """The Hugging Face name a tensor is read from where it is another (a tied head: the one table)."""

    def read(self) -> dict[str, torch.Tensor]:
        fam = family(self.args)
        shapes = fam.expected_shapes(self.args)
        specs = {fqn: fam.spec(fqn, self.args) for fqn in shapes}
        names = {self.sources.get(n, n) for fqn in shapes for n in specs[fqn].names}
        tensors = read_tensors(self.path, self.headers, names)
        return join_tensors(tensors, specs=specs, shapes=shapes, sources=self.sources)


def open_hf_folder(folder: str | os.PathLike, *, args: ModelArgs | None = None) -> HFFolder:
    """The one reader of a Hugging Face folder (import, load_model, generate): its config.json into ModelArgs, every
    value it reads checked by type and range (trainer/hf/config_values.py); the parameters those imply bound by the
    size of its safetensors files before anything is built; then every tensor's name, dtype and shape (from the
    headers) against the args. `args`: the trainer model the folder must hold (a flavor), else the folder's own.

    The head, where config.json says tie_word_embeddings: the embeddings (transformers' `tie_weights`); a folder
    that holds a head apart from them too is read as transformers 5 reads it: one table if the two are equal, else
    the head kept as its own weight, with a warning (a model of `args` that ties them refuses it in one line).
    """
    folder = Path(folder)
    where = str(folder / "config.json")
    config = read_config(folder)
    theirs = args_from_hf_config(config, where=where)
    method = packed_method(config, family(theirs), where=where)
    packed = PACKED_FORMATS.get(method)
    config_tied = bool(config.get("tie_word_embeddings", family(theirs).tied_by_default(config)))
    data_bytes, files = safetensors_bytes(folder)
    if problem := files_fit_problem(theirs, data_bytes=data_bytes, files=files, tied=config_tied,
                                    packed=family(theirs).packed_params(theirs) if packed else 0,
                                    packed_per_32=packed.BYTES_PER_32 if packed else 0):
        raise ExportError(f"{where}: {problem}")  # before anything of n_layers' size is built
    headers = read_headers(folder, mxfp4=method == "mxfp4",
                           fp8_block=fp8.block_size(config["quantization_config"]) if method == "fp8" else None)
    if skip := getattr(family(theirs), "skip_headers", None):  # tensors the family's model does not hold (MTP)
        headers = skip(headers, theirs, where=where)
    own_head = _own_head(folder, headers, where=where) if config_tied else ""
    one_table = config_tied and not own_head
    if args is None:
        args = dataclasses.replace(theirs, tie_word_embeddings=theirs.tie_word_embeddings and one_table)
    elif args.tie_word_embeddings and own_head:
        raise ExportError(f"{own_head}, but the trainer model ties them (one table, which cannot hold both): read the "
                          "folder with its own shape (no flavor), which keeps the head as transformers 5 does")
    else:
        check_hf_config({**config, "tie_word_embeddings": one_table}, args, where=where)
    if own_head:
        logger.warning("%s; read as its own output head, as transformers 5 loads it: set tie_word_embeddings to false "
                       "in config.json to say so", own_head)
    sources = {}
    if one_table:  # the head is the embeddings, or the embeddings the head where only the head is there
        sources = dict.fromkeys((EMBEDDINGS, HEAD), EMBEDDINGS if EMBEDDINGS in headers else HEAD)
    fam = family(args)
    shapes = fam.expected_shapes(args)
    check_parts(headers, specs={fqn: fam.spec(fqn, args) for fqn in shapes}, shapes=shapes, sources=sources,
                folder=folder)
    if cast := sorted({CAST_ON_READ[h.dtype] for h in headers.values() if h.dtype in CAST_ON_READ}):
        logger.info("%s: the tensors stored as %s are read as float32 (as transformers loads them by default)",
                    folder, " and ".join(cast))
    if packed and (n_packed := sum(h.dtype == packed.DTYPE for h in headers.values())):
        # Each value's bfloat16 once read, less what it takes on disk (counted in the files' size).
        data_bytes += sum(numel(h.shape) * (64 - packed.BYTES_PER_32) // 32 for h in headers.values()
                          if h.dtype == packed.DTYPE)
        logger.info("%s: %d %s tensors (%s) are dequantized to bfloat16 as they are read (%s; an export writes them "
                    "in its own dtype, unquantized)", folder, n_packed, packed.DTYPE, packed.WHICH, packed.ROUNDING)
    return HFFolder(folder, args, data_bytes, headers, sources)


def _own_head(folder: Path, headers: dict[str, Header], *, where: str) -> str:
    """Where a tied config.json's folder holds lm_head.weight apart from the embeddings, a line that says so; else
    "" (no head, or one equal to the embeddings: transformers ties them)."""
    if not (HEAD in headers and EMBEDDINGS in headers):
        return ""
    head, table = headers[HEAD], headers[EMBEDDINGS]
    if head.shape != table.shape:
        difference = f"of shape {list(head.shape)}, the embeddings {list(table.shape)}"
    elif (d := max_difference(folder, headers, HEAD, EMBEDDINGS)) == 0:
        return ""
    else:
        difference = f"max |difference| {d:.3g}"
    return (f"{where} says tie_word_embeddings=true, but {folder / head.file} holds an {HEAD} that differs from "
            f"{EMBEDDINGS} ({difference})")


def read_hf_config(folder: str | os.PathLike) -> ModelArgs:
    """ModelArgs of a Hugging Face folder (Llama, Qwen3, Ernie4_5_Moe, Glm4Moe or Qwen3Moe), checked against its
    weights."""
    return open_hf_folder(folder).args


def read_hf_weights(folder: str | os.PathLike, *, args: ModelArgs) -> dict[str, torch.Tensor]:
    """A Hugging Face folder's weights as our fqns, checked against `args` first (`open_hf_folder`); float32 or
    bfloat16. A tied model's head is the embeddings' table (a copy)."""
    return open_hf_folder(folder, args=args).read()


def _check_shapes(shapes: dict[str, tuple[int, ...]], args: ModelArgs) -> None:
    expected = expected_shapes(args)
    missing = [k for k in expected if k not in shapes]
    unexpected = [k for k in shapes if k not in expected]
    wrong = [k for k in expected if k in shapes and tuple(shapes[k]) != expected[k]]
    if missing or unexpected or wrong:
        first = (f"missing {missing[0]}" if missing else f"unexpected {unexpected[0]}" if unexpected
                 else f"{wrong[0]} has shape {list(shapes[wrong[0]])}, expected {list(expected[wrong[0]])}")
        raise ExportError(f"the weights do not match the model arguments ({first}; {len(missing)} missing, "
                          f"{len(unexpected)} unexpected, {len(wrong)} of another shape)")


def export_dtypes(args: ModelArgs, dtype: torch.dtype) -> dict[str, torch.dtype]:
    """Each exported tensor's dtype, by our fqn: `dtype`, or float32 where the family keeps it (MoE expert biases)."""
    fam = family(args)
    return {fqn: torch.float32 if fam.spec(fqn, args).keep_fp32 else dtype for fqn in fam.expected_shapes(args)
            if not (args.tie_word_embeddings and fqn == HEAD_FQN)}


def export_bytes(args: ModelArgs, dtype: torch.dtype) -> int:
    """What one export holds: what rank 0 keeps in host memory while it is written."""
    shapes = family(args).expected_shapes(args)
    return sum(numel(shapes[fqn]) * d.itemsize for fqn, d in export_dtypes(args, dtype).items())


def write_hf_export(
    out_dir: str | os.PathLike,
    *,
    args: ModelArgs,
    shapes: dict[str, tuple[int, ...]],
    fetch: Callable[[list[str]], dict[str, torch.Tensor]],
    dtype: torch.dtype,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    is_writer: bool = True,
    tokenizer: ExportTokenizer | None = None,
) -> Path:
    """Write config.json, the safetensors and the tokenizer for `shapes` (our fqns), one shard's tensors at a time.

    `fetch(fqns)` returns those tensors (any dtype/device; cast here). In a distributed
    export every rank calls this with the same arguments (fetch may be collective) and only
    the writer rank writes. The folder appears complete or not at all: it is written as
    `{out_dir}.tmp` and renamed. Options without an exact target are refused before anything
    is fetched or written.
    """
    out = Path(out_dir)
    fam = family(args)
    notes = fam.check_exportable(args)
    if skip := getattr(fam, "skip_weights", None):  # weights the export leaves out (DeepSeek-V3's MTP modules)
        shapes = skip(shapes, args)
    _check_shapes(shapes, args)
    if args.tie_word_embeddings:  # one table: written once, as embed_tokens (config.json says it is tied)
        shapes = {fqn: shape for fqn, shape in shapes.items() if fqn != HEAD_FQN}
    config = hf_config(args, dtype=dtype, tokenizer=tokenizer)
    if is_writer:
        for note in notes:
            logger.warning("%s", note)
    extra = None
    if tokenizer is not None:
        def extra(tmp: Path) -> None:
            write_tokenizer_files(tokenizer, folder=tmp, max_seq_len=config["max_position_embeddings"])
    names = write_folder(out, specs={fqn: fam.spec(fqn, args) for fqn in shapes}, shapes=shapes, fetch=fetch,
                         dtype=dtype, config=config, max_shard_bytes=max_shard_bytes, is_writer=is_writer,
                         extra_files=extra)
    if is_writer:
        mib = sum(numel(s) for s in shapes.values()) * torch.empty((), dtype=dtype).element_size() / 2**20
        logger.info("exported %d tensors (%s, %.1f MiB) as %s to %s (%s); %s", len(shapes), DTYPE_NAMES[dtype], mib,
                    fam.architecture(args), out, names[0] if len(names) == 1 else f"{len(names)} shards",
                    tokenizer.describe() if tokenizer else "no tokenizer")
    return out


__all__ = [
    "DEFAULT_MAX_SHARD_BYTES", "LLAMA3_SCALED_CONTEXT", "SAFETENSORS_HINT", "ExportError", "ExportTokenizer",
    "HFFolder", "Spec", "args_from_hf_config", "check_exportable", "check_hf_config", "expected_shapes", "export_bytes", "export_dtypes", "family",
    "from_hf_name", "hf_config", "mapping", "open_hf_folder", "plan_shards", "read_hf_config", "read_hf_weights",
    "require_safetensors", "resolve_tokenizer", "safetensors_bytes", "to_hf_name", "write_hf_export",
]
