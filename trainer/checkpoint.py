"""Checkpoints with torch.distributed.checkpoint (DCP): save, resume, verify, prune, export.

Layout under `{job.dump_folder}/{checkpoint.folder}/`:

    step-{N}/                 a complete checkpoint; only ever created by a rename
        .metadata             DCP's index of every tensor chunk
        __{rank}_{i}.distcp   each rank's shards
        checkpoint.json       step, model shape, vocab, mixed_precision, layout, size and crc32 of every file
    step-{N}.tmp/             a save in progress, or one a crash interrupted: ignored with a warning
    step-{N}-hf/              the final weights-only export (checkpoint.model_only), Hugging Face layout

Every rank writes its shards into `step-{N}.tmp/`. DCP gathers all ranks' write
results before rank 0 writes `.metadata`, so once rank 0's save returns, every
rank has finished; only then does rank 0 add `checkpoint.json` and rename the
folder. "Latest" is therefore always a checkpoint that every rank finished, and
a process killed mid-save leaves the previous one as latest.

Resuming is one `Stateful`, `CheckpointState`: model, optimizer, LR schedule,
data position, RNG, loss scale and the trainer's `TrainState`. The model is saved
as plain tensors (torchao's float8 all-gather wrapper is unwrapped, sharing
storage), so keys and dtypes are the same for bf16 and fp8 runs and a checkpoint
loads in a process that never imported torchao. DCP reshards on load: a
checkpoint saved at one parallel layout loads at any other.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import time
import warnings
import zlib
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from trainer.errors import UserError
from trainer.config import CheckpointSection
from trainer.models.llama import ModelArgs

logger = logging.getLogger(__name__)

CHECKPOINT_JSON = "checkpoint.json"
FORMAT = "trainer-dcp-1"
_METADATA = ".metadata"
_STEP_DIR = re.compile(r"^step-(\d+)(\.tmp)?$")
# Shape-determining model args: a mismatch in any of them is an error before loading.
_SHAPE_KEYS = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_dim",
               "n_experts", "moe_ffn_dim", "n_shared_experts", "n_dense_layers")  # the last four: MoE only
# Same shapes, different function: loaded, with a warning.
_FUNCTION_KEYS = ("norm_eps", "rope_theta", "rope_scaling")
_EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class CheckpointError(UserError, ValueError):
    """A user-facing checkpoint problem (missing, incomplete, corrupted, incompatible); one line."""


# ---------------------------------------------------------------------------
# What is saved


def plain_tensor(t: torch.Tensor) -> torch.Tensor:
    """`t` without torchao's float8 all-gather wrapper (`WeightWithDynamicFloat8CastTensor`), same storage.

    Checked by duck type (a tensor subclass holding `_tensor`), so this module
    never imports torchao.
    """
    if isinstance(t, DTensor):
        local = t._local_tensor
        inner = plain_tensor(local)
        if inner is local:
            return t
        return DTensor.from_local(inner, t.device_mesh, t.placements, run_check=False, shape=t.shape,
                                  stride=t.stride())
    if type(t) not in (torch.Tensor, torch.nn.Parameter) and isinstance(getattr(t, "_tensor", None), torch.Tensor):
        return t._tensor
    return t


def model_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Sharded model state by clean fqn (no `_orig_mod.`/`_checkpoint_wrapped_module.`), plain tensors.

    The values share storage with the parameters, so DCP loads into them in place.
    """
    return {k: plain_tensor(v) for k, v in get_model_state_dict(model).items()}


@dataclass
class CheckpointState(Stateful):
    """The one object a resume loads: everything that makes step k+1 identical to an uninterrupted run."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    data_loader: Any  # TokenDataLoader
    train_state: Any  # trainer.train.TrainState
    loss_scaler: Any  # trainer.train.LossScaler

    def state_dict(self) -> dict[str, Any]:
        optimizer = get_optimizer_state_dict(self.model, self.optimizer)
        optimizer["state"] = {
            fqn: {k: plain_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in s.items()}
            for fqn, s in optimizer["state"].items()
        }
        # Every rank seeds the same and draws the same numbers, so one RNG state serves all layouts.
        rng = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state()
        return {
            "model": model_state_dict(self.model),
            "optimizer": optimizer,
            "lr_scheduler": self.scheduler.state_dict(),
            "dataloader": self.data_loader.state_dict(),
            "train_state": self.train_state.state_dict(),
            "loss_scaler": self.loss_scaler.state_dict(),
            "rng": rng,
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        # The model tensors were loaded in place by DCP; set_* also checks every key is there.
        set_model_state_dict(self.model, sd["model"])
        config_groups = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        set_optimizer_state_dict(self.model, self.optimizer, sd["optimizer"])
        self._keep_config_hyperparameters(config_groups)
        self._load_scheduler(sd["lr_scheduler"])
        self.data_loader.load_state_dict(sd["dataloader"])
        self.train_state.load_state_dict(sd["train_state"])
        if self.loss_scaler.enabled and sd["train_state"].get("mixed_precision") == "fp16":
            self.loss_scaler.load_state_dict(sd["loss_scaler"])  # otherwise the scaler keeps its initial scale
        torch.set_rng_state(sd["rng"]["cpu"])
        if "cuda" in sd["rng"] and torch.cuda.is_available():
            torch.cuda.set_rng_state(sd["rng"]["cuda"])

    def _keep_config_hyperparameters(self, config_groups: list[dict]) -> None:
        # The config is the source of truth for hyperparameters (a cooldown relaunch may
        # change them); the checkpoint only supplies the optimizer's moments and step counts.
        changed = set()
        for group, config in zip(self.optimizer.param_groups, config_groups):
            for key, value in config.items():
                if key != "lr" and group.get(key) != value:
                    changed.add(f"{key} {group.get(key)} -> {value}")
                group[key] = value
        if changed:
            logger.warning("optimizer settings differ from the checkpoint; using this run's: %s",
                           ", ".join(sorted(changed)))

    def _load_scheduler(self, saved: dict[str, Any]) -> None:
        s = self.scheduler
        config_base_lrs = list(s.base_lrs)
        saved_lr = saved.get("_last_lr")
        s.load_state_dict({**saved, "base_lrs": config_base_lrs})
        # The lr of the next step from this run's schedule at the saved position; the same
        # expression LambdaLR uses, so an unchanged config gives the bit-identical lr.
        lrs = [base * fn(s.last_epoch) for base, fn in zip(s.base_lrs, s.lr_lambdas)]
        for group, lr in zip(self.optimizer.param_groups, lrs):
            group["lr"] = lr
        s._last_lr = lrs
        if saved_lr is not None and list(saved_lr) != lrs:
            logger.warning("learning rate at step %d is %.3e from this run's schedule (the checkpoint's run had "
                           "%.3e): optimizer/scheduler settings changed", s.last_epoch, lrs[0], saved_lr[0])


# ---------------------------------------------------------------------------
# Files: what is complete, and is it intact


@dataclass(frozen=True)
class RunInfo:
    """What checkpoint.json records about a run, and what a load is checked against."""

    flavor: str
    model_args: ModelArgs
    mixed_precision: str
    layout: dict[str, int] = field(default_factory=dict)  # dp_replicate, dp_shard, tp, world_size

    def model_json(self) -> dict[str, Any]:
        args = asdict(self.model_args)
        args.pop("max_seq_len")  # derived from train.seq_len; not part of the weights
        name = "moe" if "n_experts" in args else "llama3"
        return {"name": name, "flavor": self.flavor, **args, "ffn_dim": self.model_args.ffn_dim}


def describe_layout(layout: dict[str, int]) -> str:
    return ", ".join(f"{k}={layout[k]}" for k in ("dp_replicate", "dp_shard", "tp") if k in layout) + (
        f" (world size {layout['world_size']})" if "world_size" in layout else ""
    )


def scan_checkpoints(folder: Path) -> tuple[dict[int, Path], list[tuple[Path, str]]]:
    """(complete {step: path}, incomplete [(path, why)]) in a checkpoint folder; cheap (no data read)."""
    complete: dict[int, Path] = {}
    incomplete: list[tuple[Path, str]] = []
    if not folder.is_dir():
        return complete, incomplete
    for path in sorted(folder.iterdir()):
        m = _STEP_DIR.match(path.name)
        if not m or not path.is_dir():
            continue
        if m.group(2):
            incomplete.append((path, "a save that never finished (killed or failed mid-save)"))
        elif not (path / _METADATA).exists():
            incomplete.append((path, f"no {_METADATA}"))
        elif not (path / CHECKPOINT_JSON).exists():
            incomplete.append((path, f"no {CHECKPOINT_JSON}"))
        else:
            complete[int(m.group(1))] = path
    return complete, incomplete


def file_digest(path: Path, chunk_bytes: int = 16 * 2**20) -> dict[str, Any]:
    """Size and crc32 of a file (read in chunks; zlib is ~1 GB/s)."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            crc = zlib.crc32(chunk, crc)
    return {"bytes": path.stat().st_size, "crc32": f"{crc:08x}"}


def check_file(path: Path, expected: dict[str, Any] | None, *, min_bytes: int = 0) -> str | None:
    """None when the file is intact, else a one-line reason naming it."""
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


def read_checkpoint_json(path: Path) -> dict[str, Any]:
    """checkpoint.json of a checkpoint folder, or a one-line CheckpointError naming what is wrong."""
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} is not a folder")
    file = path / CHECKPOINT_JSON
    try:
        info = json.loads(file.read_text())
    except FileNotFoundError:
        if (path / "config.json").exists():
            raise CheckpointError(
                f"{file} is missing: {path} looks like a Hugging Face model folder; convert it first: "
                f"python scripts/convert_checkpoint.py import {path} OUT --flavor FLAVOR"
            ) from None
        raise CheckpointError(
            f"{file} is missing: {path} is not a complete checkpoint (an interrupted save, or not written by this "
            "trainer)"
        ) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file} is corrupted (not valid JSON: {e})") from None
    if not isinstance(info, dict) or info.get("format") != FORMAT:
        raise CheckpointError(f"{file} is not a {FORMAT} checkpoint description (format={info.get('format')!r})")
    return info


def check_model_matches(info: dict[str, Any], run: RunInfo, *, path: Path) -> None:
    """Vocab and shape of the checkpoint against this run's model, from checkpoint.json alone."""
    file = path / CHECKPOINT_JSON
    saved, ours = info["model"], run.model_json()
    if saved.get("vocab_size") != ours["vocab_size"]:
        raise CheckpointError(
            f"{file}: vocab mismatch: the checkpoint has vocab_size={saved.get('vocab_size')}, this run has "
            f"{ours['vocab_size']} (model.vocab_size / the tokenizer must match the checkpoint's)"
        )
    diffs = [f"{k}={saved.get(k)} (this run: {ours.get(k)})" for k in _SHAPE_KEYS if saved.get(k) != ours.get(k)]
    if diffs:
        raise CheckpointError(
            f"{file}: model shape mismatch: the checkpoint is {saved.get('name', 'llama3')} {saved.get('flavor')} with "
            f"{', '.join(diffs)}; use the model.flavor/n_layers it was trained with"
        )
    changed = [f"{k} {saved.get(k)} -> {ours[k]}" for k in _FUNCTION_KEYS if saved.get(k) != ours[k]]
    if changed:
        logger.warning("%s: same shapes but %s differs from the checkpoint's model", file, ", ".join(changed))


def read_dcp_metadata(path: Path, info: dict[str, Any]):
    file = path / _METADATA
    problem = check_file(file, info.get("files", {}).get(_METADATA))
    if problem:
        raise CheckpointError(problem)
    try:
        return FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # unpickling garbage raises anything
        raise CheckpointError(f"{file} is corrupted ({type(e).__name__}: {_first_line(e)})") from None


def check_model_keys(metadata, model_sd: dict[str, torch.Tensor], *, path: Path) -> None:
    """Every model tensor is in the checkpoint with the same shape, and it has no other model tensors."""
    saved = {k[len("model."):]: v for k, v in metadata.state_dict_metadata.items() if k.startswith("model.")}
    file = path / _METADATA
    missing = [k for k in model_sd if k not in saved]
    unexpected = [k for k in saved if k not in model_sd]
    if missing or unexpected:
        raise CheckpointError(
            f"{file}: model keys do not match: {len(missing)} missing (first: {missing[0] if missing else '-'}), "
            f"{len(unexpected)} unexpected (first: {unexpected[0] if unexpected else '-'})"
        )
    for k, t in model_sd.items():
        if tuple(saved[k].size) != tuple(t.shape):
            raise CheckpointError(f"{file}: model.{k} has shape {list(saved[k].size)} in the checkpoint but "
                                  f"{list(t.shape)} in this model")


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


@contextlib.contextmanager
def _single_process():
    # no_dist=True says it: DCP still warns that no process group exists.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _test_pause(where: str, step: int) -> None:
    """Test hook: TRAINER_TEST_PAUSE=where:step[:rank] blocks here, so a test can SIGKILL at a known point.

    where = "step" (after step `step` and its save) or "save" (inside the save of
    `step`, after this rank wrote its shard files and before the save completes).
    """
    spec = os.environ.get("TRAINER_TEST_PAUSE", "")
    if not spec:
        return
    parts = spec.split(":")
    rank = dist.get_rank() if dist.is_initialized() else 0
    if parts[0] != where or int(parts[1]) != step or (len(parts) > 2 and int(parts[2]) != rank):
        return
    print(f"TRAINER_TEST_PAUSE: paused at {where}:{step} on rank {rank}", flush=True)
    time.sleep(3600)


class _ChecksummedWriter(FileSystemWriter):
    """DCP's FileSystemWriter that also records size and crc32 of the files this rank wrote.

    They go to `__{rank}_checksums.json` (read back from the page cache right
    after the write), which rank 0 merges into checkpoint.json.
    """

    def __init__(self, path: Path, *, step: int):
        super().__init__(str(path), single_file_per_rank=True, sync_files=True)
        self.step = step

    def write_data(self, plan, planner):
        future = super().write_data(plan, planner)
        results = future.value()  # FileSystemWriter writes synchronously; the future is already done
        _test_pause("save", self.step)
        root = Path(self.path)
        files = sorted({r.storage_data.relative_path for r in results})
        digests = {name: file_digest(root / name) for name in files}
        sidecar = root / f"{plan.storage_data.prefix}checksums.json"
        with open(sidecar, "w") as f:
            json.dump(digests, f)
            f.flush()
            os.fsync(f.fileno())
        return future


# ---------------------------------------------------------------------------
# The manager


@dataclass
class _PendingSave:
    step: int
    tmp: Path
    future: Future
    start: float


class CheckpointManager:
    """Saves every `interval` steps (and at the last step and on a SIGTERM stop), resumes, prunes, exports.

    All ranks construct it and call every method in the same order (they are collective).
    Its gloo group `pg` is used by a background save's thread; the main thread uses it only
    when no save is in flight (after `wait()`), so collectives of the two never interleave.
    """

    def __init__(self, section: CheckpointSection, *, dump_folder: str, state: CheckpointState, run: RunInfo):
        self.enable = section.enable
        self.folder = Path(dump_folder) / section.folder
        self.interval = section.interval
        self.keep_latest_k = section.keep_latest_k
        self.load_step = section.load_step
        self.async_mode = section.async_mode
        self.initial_load_path = section.initial_load_path
        self.model_only = section.model_only
        self.export_dtype = _EXPORT_DTYPES[section.export_dtype]
        self.state = state
        self.run = run
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.last_saved_step = -1
        self._pending: _PendingSave | None = None
        self._stager = None
        if self.model_only:
            from trainer.export import require_safetensors

            require_safetensors("checkpoint.model_only=true (a safetensors export)")
        # Checkpoint traffic gets its own gloo group: an async save runs its collectives in a
        # background thread, which must never interleave with training's collectives on one group.
        self.pg = dist.new_group(backend="gloo")
        if self.enable and self.async_mode != "disabled":
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            pinned = self.async_mode == "async_with_pinned_mem"
            if pinned and not torch.cuda.is_available():
                logger.warning("checkpoint.async_mode='async_with_pinned_mem' without CUDA: there is no pinned "
                               "memory, so checkpoints are staged in ordinary host memory (same as 'async')")
                pinned = False
            # One stager for the run: its host buffers are reused by every save.
            self._stager = DefaultStager(StagingOptions(use_pinned_memory=pinned, use_shared_memory=False,
                                                        use_async_staging=False, use_non_blocking_copy=False))
        if self.enable:
            logger.info(
                "checkpointing: every %d steps into %s, keep_latest_k=%d, async_mode=%s%s",
                self.interval, self.folder, self.keep_latest_k, self.async_mode,
                f", weights-only {section.export_dtype} export at the end" if self.model_only else "",
            )

    # -- resume ----------------------------------------------------------------

    def resume(self) -> None:
        """Load the checkpoint to resume from, or the initial weights, or nothing; say which."""
        # Rank 0 decides and tells the others: ranks listing a shared filesystem each on their
        # own could see different folders (attribute caching) and load different checkpoints.
        path = self._on_rank0(self._checkpoint_to_resume) if self.enable else None
        if path is not None:
            if self.initial_load_path:
                logger.info("checkpoint.initial_load_path=%s is not used: resuming %s (it only seeds a new run)",
                            self.initial_load_path, path)
            self._load(path, model_only=False)
        elif self.initial_load_path:
            self._load(Path(self.initial_load_path), model_only=True)
        elif self.enable:
            logger.info("no checkpoint in %s: starting from step 0", self.folder)

    def _on_rank0(self, fn):
        """fn() on rank 0, its result on every rank; its CheckpointError is raised on every rank."""
        result: list[Any] = [None]
        if self.rank == 0:
            try:
                result = [("ok", fn())]
            except CheckpointError as e:
                result = [("error", str(e))]
        dist.broadcast_object_list(result, src=0, group=self.pg)
        kind, value = result[0]
        if kind == "error":
            raise CheckpointError(value)
        return value

    def _checkpoint_to_resume(self) -> Path | None:
        complete, incomplete = scan_checkpoints(self.folder)
        for path, why in incomplete:
            logger.warning("ignoring incomplete checkpoint %s: %s", path, why)
        if self.load_step >= 0:
            if not self.folder.is_dir():
                raise CheckpointError(f"checkpoint.load_step={self.load_step}: checkpoint folder {self.folder} "
                                      "does not exist")
            if self.load_step not in complete:
                available = ", ".join(f"step-{s}" for s in sorted(complete)) or "none"
                raise CheckpointError(f"checkpoint.load_step={self.load_step}: {self.folder / f'step-{self.load_step}'}"
                                      f" is not a complete checkpoint (complete ones: {available})")
            newer = [s for s in complete if s > self.load_step]
            if newer:
                logger.warning("loading step-%d although newer checkpoints exist (%s); this run's saves replace "
                               "them as it reaches their steps", self.load_step,
                               ", ".join(f"step-{s}" for s in sorted(newer)))
            return complete[self.load_step]
        return complete[max(complete)] if complete else None

    def _load(self, path: Path, *, model_only: bool) -> None:
        start = time.perf_counter()
        what = "checkpoint.initial_load_path" if model_only else "checkpoint"
        info = read_checkpoint_json(path)
        check_model_matches(info, self.run, path=path)
        if not model_only and info.get("kind") != "training":
            raise CheckpointError(f"{path / CHECKPOINT_JSON}: a {info.get('kind')} checkpoint has no optimizer or "
                                  "step to resume; pass it as checkpoint.initial_load_path instead")
        metadata = read_dcp_metadata(path, info)
        model_sd = model_state_dict(self.state.model)
        check_model_keys(metadata, model_sd, path=path)
        self._verify_files(path, info, metadata)
        # Built after the checks: get_optimizer_state_dict initializes empty optimizer state.
        sd = {"model": model_sd} if model_only else self.state.state_dict()
        if not model_only and "rng.cuda" not in metadata.state_dict_metadata:
            sd["rng"].pop("cuda", None)  # saved on a machine without CUDA
        try:
            dcp.load(sd, storage_reader=FileSystemReader(str(path)), process_group=self.pg)
        except Exception as e:
            raise CheckpointError(f"failed to read {what} {path}: {_first_line(e)}") from e
        if model_only:
            set_model_state_dict(self.state.model, sd["model"])
            logger.info("loaded model weights from %s (step %s of its run, saved with mixed_precision=%s) in %.1f s; "
                        "optimizer, schedule and data start fresh at step 0", path, info.get("step"),
                        info.get("mixed_precision"), time.perf_counter() - start)
            return
        self.state.load_state_dict(sd)
        step = self.state.train_state.step
        self.last_saved_step = step
        saved_mp = self.state.train_state.resumed_mixed_precision or info.get("mixed_precision")
        if saved_mp != self.run.mixed_precision:
            logger.info("resumed %s checkpoint at step %d with mixed_precision=%s", saved_mp, step,
                        self.run.mixed_precision)
        saved_layout = info.get("layout", {})
        relayout = "" if saved_layout == self.run.layout else (
            f"; resharded from {describe_layout(saved_layout)} to {describe_layout(self.run.layout)}"
        )
        logger.info("resumed from checkpoint %s at step %d (saved with mixed_precision=%s)%s in %.1f s",
                    path, step, saved_mp, relayout, time.perf_counter() - start)

    def _verify_files(self, path: Path, info: dict[str, Any], metadata) -> None:
        """Size and crc32 of every data file, each rank checking a slice; all ranks raise the same error."""
        recorded = info.get("files", {})
        min_bytes: dict[str, int] = {}
        for item in metadata.storage_data.values():
            name = item.relative_path
            min_bytes[name] = max(min_bytes.get(name, 0), item.offset + item.length)
        names = sorted(min_bytes)
        problems = [p for name in names[self.rank::self.world_size]
                    if (p := check_file(path / name, recorded.get(name), min_bytes=min_bytes[name]))]
        gathered: list[list[str]] = [[] for _ in range(self.world_size)]
        dist.all_gather_object(gathered, problems, group=self.pg)
        problems = sorted(p for ps in gathered for p in ps)
        if problems:
            more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
            raise CheckpointError(problems[0] + more)

    # -- save ----------------------------------------------------------------

    def maybe_save(self, step: int, *, final: bool, stopping: bool, before_save: Callable[[], Any] | None = None
                   ) -> None:
        """After each step: save on the interval, at the last step and when stopping; export at the last step.

        `before_save` runs on every rank right before a save or export (the trainer's
        finiteness check, so a run that must stop stops before it is checkpointed).
        """
        self._poll()
        saving = self.enable and step != self.last_saved_step and (step % self.interval == 0 or final or stopping)
        if before_save is not None and (saving or (final and self.model_only)):
            before_save()
        if saving:
            self.save(step)
        if final and self.model_only:
            self.export(step)
        _test_pause("step", step)

    def save(self, step: int) -> None:
        self.wait()  # one save at a time; also frees the checkpoint group for this save's collectives
        start = time.perf_counter()
        tmp = self.folder / f"step-{step}.tmp"
        if self.rank == 0:
            if tmp.exists():
                shutil.rmtree(tmp)  # left by an earlier, interrupted save of this step
            tmp.mkdir(parents=True)
        dist.barrier(group=self.pg)
        sd = self.state.state_dict()
        writer = _ChecksummedWriter(tmp, step=step)
        self.last_saved_step = step
        if self._stager is None:
            dcp.save(sd, storage_writer=writer, process_group=self.pg)
            self._finalize(step, tmp, start)
            dist.barrier(group=self.pg)  # nobody goes on until step-N is visible as complete
            return
        future = dcp.async_save(sd, storage_writer=writer, process_group=self.pg, async_stager=self._stager)
        self._pending = _PendingSave(step=step, tmp=tmp, future=future, start=start)
        logger.info("checkpoint step-%d: staged in %.2f s, writing in the background", step,
                    time.perf_counter() - start)

    def _poll(self) -> None:
        if self._pending is not None and self._pending.future.done():
            self.wait()

    def wait(self) -> None:
        """Block until the background save (if any) is written, then make it complete."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        try:
            pending.future.result()
        except Exception as e:
            raise CheckpointError(f"checkpoint step-{pending.step} failed to save into {pending.tmp}: "
                                  f"{_first_line(e)}") from e
        self._finalize(pending.step, pending.tmp, pending.start)

    def _finalize(self, step: int, tmp: Path, start: float) -> None:
        """Rank 0, once every rank has written: checkpoint.json, rename to step-N, prune."""
        if self.rank != 0:
            return
        files = {}
        for sidecar in sorted(tmp.glob("__*_checksums.json")):
            files.update(json.loads(sidecar.read_text()))
        files[_METADATA] = file_digest(tmp / _METADATA)
        info = {
            "format": FORMAT,
            "kind": "training",
            "step": step,
            "model": self.run.model_json(),
            "mixed_precision": self.run.mixed_precision,
            "layout": self.run.layout,
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "files": files,
        }
        write_json(tmp / CHECKPOINT_JSON, info)
        for sidecar in tmp.glob("__*_checksums.json"):
            sidecar.unlink()
        final = self.folder / f"step-{step}"
        publish(tmp, final)
        size = sum(f["bytes"] for f in files.values())
        logger.info("saved checkpoint %s (%.1f MiB, %.2f s)", final, size / 2**20, time.perf_counter() - start)
        self._prune(step)

    def _prune(self, newest: int) -> None:
        for path in prune_checkpoints(self.folder, newest=newest, keep_latest_k=self.keep_latest_k):
            why = (f"an interrupted save, superseded by step-{newest}" if path.name.endswith(".tmp")
                   else f"keep_latest_k={self.keep_latest_k}")
            logger.info("removed %s (%s)", path, why)

    # -- export --------------------------------------------------------------

    def export(self, step: int) -> Path:
        """The model weights, gathered whole, in Hugging Face Llama layout (collective; rank 0 writes)."""
        from trainer.export import write_hf_export

        sd = model_state_dict(self.state.model)

        def fetch(fqns: list[str]) -> dict[str, torch.Tensor]:
            out = {}
            for fqn in fqns:
                t = sd[fqn]
                # note: an all-gather per tensor; ranks other than 0 hold one full tensor at a time.
                full = t.full_tensor() if isinstance(t, DTensor) else t
                if self.rank == 0:
                    out[fqn] = full.detach().to("cpu", self.export_dtype)
            return out

        out = write_hf_export(self.folder / f"step-{step}-hf", args=self.run.model_args,
                              shapes={k: tuple(v.shape) for k, v in sd.items()}, fetch=fetch,
                              dtype=self.export_dtype, is_writer=self.rank == 0)
        # Not self.pg: a background save of this step may be using it from its thread right now.
        dist.barrier()
        return out

    def close(self) -> None:
        """Finish a background save (it becomes complete) and release the stager."""
        try:
            self.wait()
        finally:
            if self._stager is not None:
                self._stager.close()
                self._stager = None


def prune_checkpoints(folder: Path, *, newest: int, keep_latest_k: int) -> list[Path]:
    """Remove interrupted saves older than step-{newest} and, with keep_latest_k > 0, all but the newest k.

    Called right after step-{newest} became complete, so with k >= 1 the only
    complete checkpoint always survives. Returns what was removed.
    """
    complete, incomplete = scan_checkpoints(folder)
    removed = []
    for path, _ in incomplete:
        m = _STEP_DIR.match(path.name)
        if m and m.group(2) and int(m.group(1)) < newest:
            removed.append(path)
    if keep_latest_k > 0:
        removed += [complete[step] for step in sorted(complete)[:-keep_latest_k]]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


def write_json(path: Path, data: dict[str, Any]) -> None:
    with open(path, "w") as f:
        f.write(json.dumps(data, indent=2) + "\n")
        f.flush()
        os.fsync(f.fileno())


def publish(tmp: Path, final: Path) -> None:
    """Atomically make `tmp` visible as `final` (replacing an older `final` of the same name)."""
    _fsync_dir(tmp)
    if final.exists():
        # Resumed from an older load_step: this run's save replaces the old trajectory's.
        old = final.with_name(final.name + ".replaced")
        if old.exists():
            shutil.rmtree(old)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    _fsync_dir(final.parent)


def save_model_only(
    path: Path, weights: dict[str, torch.Tensor], *, run: RunInfo, source: str, step: int = 0
) -> Path:
    """A model-only DCP checkpoint (for checkpoint.initial_load_path) from full tensors, in one process."""
    tmp = path.with_name(path.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    with _single_process():
        dcp.save({"model": weights}, storage_writer=_ChecksummedWriter(tmp, step=step), no_dist=True)
    files = {}
    for sidecar in sorted(tmp.glob("__*_checksums.json")):
        files.update(json.loads(sidecar.read_text()))
        sidecar.unlink()
    files[_METADATA] = file_digest(tmp / _METADATA)
    write_json(tmp / CHECKPOINT_JSON, {
        "format": FORMAT, "kind": "model_only", "step": step, "model": run.model_json(),
        "mixed_precision": run.mixed_precision, "layout": run.layout, "source": source,
        "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "files": files,
    })
    publish(tmp, path)
    return path


def load_full_model_weights(
    path: str | os.PathLike, *, dtype: torch.dtype | None = None
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(checkpoint.json, {fqn: full tensor}) of a checkpoint's model, in one process without a process group.

    Verifies every file first. For conversion scripts and tests; a training run
    loads sharded instead. Needs no torchao, even for a checkpoint of an fp8 run.
    """
    path = Path(path)
    info = read_checkpoint_json(path)
    metadata = read_dcp_metadata(path, info)
    recorded = info.get("files", {})
    for name in sorted({item.relative_path for item in metadata.storage_data.values()}):
        problem = check_file(path / name, recorded.get(name))
        if problem:
            raise CheckpointError(problem)
    sd = {}
    for key, md in metadata.state_dict_metadata.items():
        if key.startswith("model."):
            sd[key[len("model."):]] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
    try:
        with _single_process():
            dcp.load({"model": sd}, storage_reader=FileSystemReader(str(path)), no_dist=True)
    except Exception as e:
        raise CheckpointError(f"failed to read checkpoint {path}: {_first_line(e)}") from e
    if dtype is not None:
        sd = {k: v.to(dtype) for k, v in sd.items()}
    return info, sd


def args_from_json(model: dict[str, Any]) -> ModelArgs:
    """The ModelArgs recorded in checkpoint.json (for tools that have no job config)."""
    from trainer.models.llama import RopeScaling

    fields = {k: v for k, v in model.items() if k in ModelArgs.__dataclass_fields__}
    if fields.get("rope_scaling") is not None:
        fields["rope_scaling"] = RopeScaling(**fields["rope_scaling"])
    args = ModelArgs(**fields)
    assert args.ffn_dim == model["ffn_dim"], (args.ffn_dim, model["ffn_dim"])
    return args
