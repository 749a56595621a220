"""CheckpointManager: resume (with fallback past a corrupt newest), save (sync or async), prune, export (exports.py).

Every rank writes its shards into `step-{N}.tmp/`. DCP gathers all ranks' write results before rank 0 writes
`.metadata`, so once rank 0's save returns, every rank has finished; only then does rank 0 add `checkpoint.json` and
rename the folder. "Latest" is therefore always a checkpoint that every rank finished, and a process killed mid-save
leaves the previous one as latest. Before publishing, rank 0 checks that every rank's shards and checksums are in the
folder it publishes (a relative or node-local path can send a rank's writes elsewhere). Pruning never removes the
checkpoint just written nor the one the run resumed from; a run pinned to an earlier `load_step` moves the later
trajectory's checkpoints aside (`step-N.abandoned`) at its first save, so they are never resumed by mistake and never
deleted; so is a `step-N` folder that the scan calls incomplete once a save takes its name (`step-N.incomplete`). Only
a folder holding the marker a save writes first (trainer/files/publish.py) is ever removed as partial. A save that
fails (disk full, a folder removed) leaves no partial folder and never touches the previous checkpoints; space.py says
how big a checkpoint is, warns before a save that will not fit, and words a full disk.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import set_model_state_dict

from trainer.checkpoint.format import (
    CHECKPOINT_JSON, DISK_ERRNOS, FORMAT, STATE_JSON, CheckpointError, CorruptCheckpointError,
    file_digest, first_line, root_cause, write_json,
)
from trainer.checkpoint.exports import HFExports
from trainer.checkpoint.options import CheckpointOptions
from trainer.checkpoint.parts import CheckpointState
from trainer.checkpoint.space import (
    checkpoint_bytes, describe_disk_error, move_aside, prune_checkpoints, save_error, warn_if_short,
)
from trainer.checkpoint.staging import RunStager
from trainer.checkpoint.state import RunInfo, describe_layout, merge_tensors, model_state_dict, split_tensors
from trainer.checkpoint.tokenizer import remember_tokenizer, write_tokenizer
from trainer.checkpoint.values import EDITED
from trainer.checkpoint.verify import (
    check_every_rank_wrote, incomplete_reason, read_state_json, safe_load, scan_checkpoints, verify_on_every_rank,
)
from trainer.checkpoint.writer import ChecksummedWriter, collect_checksums, describe_writes
from trainer.errors import on_every_rank
from trainer.files.publish import PARTIAL, clear_partial, publish, remove_partial, start_partial
from trainer.tensor_values import FINITE, dtype_problems, problems_line, value_problems

logger = logging.getLogger("trainer.checkpoint")


@dataclass
class _PendingSave:
    step: int
    tmp: Path
    future: Future
    start: float
    nbytes: int
    previous: int  # last_saved_step before this save, restored if it fails


class CheckpointManager:
    """Saves every `interval` steps (and at the last step and on a SIGTERM stop), resumes, prunes, exports.

    All ranks construct it and call every method in the same order (they are collective).
    Its gloo group `pg` is used by a background save's thread; the main thread uses it only
    when no save is in flight (after `wait()`), so collectives of the two never interleave.
    """

    def __init__(self, options: CheckpointOptions, *, state: CheckpointState, run: RunInfo,
                 timeout_seconds: int | None = None):
        """`timeout_seconds` bounds every collective of the checkpoint group (distributed.init_timeout_seconds;
        None: torch's default), so a rank stopped during a save fails the others instead of hanging them."""
        self.enable, self.folder, self.interval, self.keep_latest_k = (options.enable, options.path, options.interval,
                                                                       options.keep_latest_k)
        self.load_step, self.async_mode = options.load_step, options.async_mode
        self.initial_load_path, self.model_only = options.initial_load_path, options.model_only
        self.on_save_error, self.allow_unverified = options.on_save_error, options.allow_unverified
        self.state, self.run = state, run
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        # (event, step, path, seconds=, error=) at each save's start and end: metrics.event_log's EventLog.checkpoint
        self.save_events: Callable[..., Any] = lambda *args, **kwargs: None
        self.last_saved_step = -1
        self.resumed_step = -1  # the checkpoint this run resumed from: pruning never removes it
        self._abandoned: list[Path] = []  # rank 0: a later trajectory's checkpoints, moved aside at the first save
        self._nbytes: int | None = None  # the checkpoint's size, estimated at the first save
        self._pending: _PendingSave | None = None
        self._prestaged = False
        self._stager = None
        if self.rank == 0 and options.enable:  # every save copies the tokenizer.json the run started with
            remember_tokenizer(run.tokenizer, run.tokenizer_fingerprint)
        # Checkpoint traffic gets its own gloo group: an async save runs its collectives in a
        # background thread, which must never interleave with training's collectives on one group.
        self.pg = dist.new_group(backend="gloo", timeout=None if timeout_seconds is None
                                 else timedelta(seconds=timeout_seconds))
        self.exports = HFExports(state, options, run=run)  # checkpoint.export_interval's and the final one
        if self.enable and self.async_mode != "disabled":
            pinned = self.async_mode == "async_with_pinned_mem"
            if pinned and not torch.cuda.is_available():
                logger.warning("checkpoint.async_mode='async_with_pinned_mem' without CUDA: there is no pinned "
                               "memory, so checkpoints are staged in ordinary host memory (same as 'async')")
                pinned = False
            self._stager = RunStager(pinned=pinned)  # one for the run: its host buffers are reused by every save
        if self.enable:
            logger.info(
                "checkpointing: every %d steps into %s, keep_latest_k=%d, async_mode=%s%s",
                self.interval, self.folder, self.keep_latest_k, self.async_mode,
                f", weights-only {options.export_dtype} export at the end" if self.model_only else "",
            )

    # -- resume ----------------------------------------------------------------

    def resume(self) -> None:
        """Load the checkpoint to resume from, or the initial weights, or nothing; say which."""
        # Rank 0 decides and tells the others: ranks listing a shared filesystem each on their
        # own could see different folders (attribute caching) and load different checkpoints.
        candidates = self._on_rank0(self._checkpoints_to_try) if self.enable else []
        if candidates:
            path, verified = self._newest_that_verifies(candidates)
            if self.initial_load_path:
                logger.info("checkpoint.initial_load_path=%s is not used: resuming %s (it only seeds a new run)",
                            self.initial_load_path, path)
            self._load(path, verified, model_only=False)
        elif self.initial_load_path:
            path = Path(self.initial_load_path)
            self._load(path, self._verify(path, model_only=True, raise_corrupt=True), model_only=True)
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
            raise on_every_rank(CheckpointError(value))
        return value

    def _checkpoints_to_try(self) -> list[Path]:
        """The pinned checkpoint (load_step), or every complete one, newest first."""
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
            newer = sorted(s for s in complete if s > self.load_step)
            if newer:
                # A later trajectory: left as it is until this run writes a checkpoint of its own, then moved aside
                # (a relaunch without load_step must resume this run, not the trajectory it abandoned).
                self._abandoned = [complete[s] for s in newer]
                logger.warning("loading step-%d although newer checkpoints exist (%s): they are a later trajectory "
                               "this run abandons; its first save moves them aside as step-N.abandoned (kept, never "
                               "resumed; delete them when done)", self.load_step,
                               ", ".join(f"step-{s}" for s in newer))
            return [complete[self.load_step]]
        return [complete[s] for s in sorted(complete, reverse=True)]

    def _newest_that_verifies(self, candidates: list[Path]) -> tuple[Path, tuple]:
        """The first candidate that verifies; the corrupt ones before it are moved aside (never deleted).

        A pinned load_step, or no candidate verifying, is an error and moves nothing.
        """
        corrupt: list[tuple[Path, str]] = []
        for path in candidates:
            verified = self._verify(path, model_only=False, raise_corrupt=self.load_step >= 0)
            if isinstance(verified, str):
                corrupt.append((path, verified))
                if self.rank == 0:
                        logger.error("CHECKPOINT %s FAILED VERIFICATION: %s", path, verified)
                continue
            break
        else:
            more = f"; no older checkpoint verifies either ({len(corrupt) - 1} tried)" if len(corrupt) > 1 else ""
            raise on_every_rank(CorruptCheckpointError(corrupt[0][1] + more))
        for bad, _ in corrupt:
            aside = self._on_rank0(lambda: move_aside(bad, "corrupt", why="is corrupt"))
            if self.rank == 0:
                logger.error("moved the corrupt checkpoint %s aside to %s (kept for inspection; delete it when done)",
                             bad, aside)
        if corrupt and self.rank == 0:
            logger.error("FELL BACK to %s, the newest checkpoint that verifies, past %d corrupt newer one(s)",
                         path, len(corrupt))
        return path, verified

    def _verify(self, path: Path, *, model_only: bool, raise_corrupt: bool) -> tuple | str:
        return verify_on_every_rank(path, model=self.state.model, run=self.run, group=self.pg,
                                    allow_unverified=self.allow_unverified, model_only=model_only,
                                    raise_corrupt=raise_corrupt)

    def _check_values(self, rules: dict[str, Any], path: Path, *, hint: str, stored: dict | None = None) -> None:
        """Refuse, in one line naming the checkpoint and the keys, tensors whose values break their part's rule
        (trainer/tensor_values.py): with `stored` (the index's entries) their stored dtypes, before anything is read;
        else their loaded values on every rank (each checks its shards; one collective)."""
        if stored is not None and (problems := dtype_problems(rules, stored)):
            raise on_every_rank(CheckpointError(f"{path}: {problems_line(problems)} ({EDITED}); {hint}"))
        if stored is None and (problems := value_problems(rules, group=self.pg)):
            raise on_every_rank(CheckpointError(f"{path}: {problems_line(problems)} ({EDITED}, or a run that "
                                                f"diverged); {hint}"))

    def _load(self, path: Path, verified: tuple, *, model_only: bool) -> None:
        start = time.perf_counter()
        what = "checkpoint.initial_load_path" if model_only else "checkpoint"
        info, metadata = verified
        # Built after the checks: get_optimizer_state_dict initializes empty optimizer state.
        sd = {"model": model_state_dict(self.state.model)} if model_only else self.state.state_dict()
        if not model_only:  # each part asks for what it can take of this checkpoint (trainer/checkpoint/parts.py)
            for note in self.state.reconcile(sd, metadata.state_dict_metadata):
                logger.info("%s", note)
        tensors, _ = split_tensors(sd)
        # state.json's values and the stored dtypes are checked before any tensor is read, the values once loaded.
        rest = None if model_only else read_state_json(path, info)
        rules = self.state.tensor_rules(tensors, step=info.get("step", 0))
        hint = "start from other weights" if model_only else "resume an earlier checkpoint with checkpoint.load_step=N"
        self._check_values(rules, path, hint=hint, stored=metadata.state_dict_metadata)
        safe_load(tensors, path, what=what, process_group=self.pg)
        self._check_values(rules, path, hint=hint)
        if model_only:
            set_model_state_dict(self.state.model, tensors["model"])
            logger.info("loaded model weights from %s (step %s of its run, saved with mixed_precision=%s) in %.1f s; "
                        "optimizer, schedule and data start fresh at step 0", path, info.get("step"),
                        info.get("mixed_precision"), time.perf_counter() - start)
            return
        try:
            self.state.load_state_dict(merge_tensors(tensors, rest))
        except (KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{path / STATE_JSON} does not hold this trainer's state "
                                  f"({type(e).__name__}: {first_line(e)})") from None
        step = self.state.train_state.step
        self.last_saved_step = self.resumed_step = step
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

    # -- save ----------------------------------------------------------------

    def maybe_save(self, step: int, *, final: bool, stopping: bool, before_save: Callable[[], Any] | None = None
                   ) -> None:
        """After each step: save on the interval, at the last step and when stopping; export at the last step.

        `before_save` runs on every rank right before a save or export (the trainer's
        finiteness check, so a run that must stop stops before it is checkpointed).
        """
        self._poll()
        saving = self.enable and step != self.last_saved_step and (step % self.interval == 0 or final or stopping)
        exporting = self.exports.due(step, final_export=final and self.model_only)
        if self._stager is not None and not self._prestaged and not saving:
            # After the first step every state tensor exists (the moments too): their host buffers are allocated
            # in the background now, not by the first save.
            self._prestaged = True
            self._stager.prestage(split_tensors(self.state.state_dict())[0])
        if before_save is not None and (saving or exporting or (final and self.model_only)):
            before_save()
        if saving:
            self.save(step)
        if exporting:
            self.exports.export(step)
        if final and self.model_only:
            self.exports.final(step, p2p_group=self.pg, before_p2p=self.wait)

    def save(self, step: int) -> None:
        """Save step `step`; logs how long training was blocked ("checkpoint step-N: blocked training X s")."""
        blocked_since = time.perf_counter()
        self.wait()  # one save at a time; also frees the checkpoint group for this save's collectives
        start = time.perf_counter()
        self.save_events("checkpoint_begin", step, self.folder / f"step-{step}")
        tmp = self.folder / f"step-{step}.tmp"
        tensors, rest = split_tensors(self.state.state_dict())
        self._refuse_nonfinite_weights(step, tensors["model"])
        if self._nbytes is None:  # shapes do not change during a run: one collective, at the first save
            self._nbytes = checkpoint_bytes(tensors, group=self.pg)
        nbytes = self._nbytes
        error = None
        if self.rank == 0:
            warn_if_short(self.folder, step=step, nbytes=nbytes, keep_latest_k=self.keep_latest_k,
                          resumed=self.resumed_step)
            try:
                # An earlier, interrupted save of this step is removed; a folder of that name it cannot prove its own
                # (no marker: trainer/files/publish.py) is moved aside.
                if aside := clear_partial(tmp, tag="incomplete"):
                    logger.warning("moved %s aside to %s: named like an unfinished save, but without the %s marker "
                                   "every save writes first (kept; delete it when done)", tmp, aside.name, PARTIAL)
                start_partial(tmp)
                write_json(tmp / STATE_JSON, rest)  # non-tensor state: JSON, never pickled
            except OSError as e:
                error = e
        error = self._broadcast_error(error)
        if error is not None:
            self._save_failed(step, tmp, error, nbytes)
            return
        writer = ChecksummedWriter(tmp, step=step)
        previous, self.last_saved_step = self.last_saved_step, step
        if self._stager is None:
            error = None
            try:
                dcp.save(tensors, storage_writer=writer, process_group=self.pg)
                self._finalize(step, tmp, start)
            except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
                if isinstance(root_cause(e), KeyboardInterrupt):
                    raise KeyboardInterrupt from None  # a second Ctrl-C during the save (DCP wraps it): quit now
                error = save_error(e)
            # Nobody goes on until step-N is complete (or every rank knows it failed).
            error = self._broadcast_error(error)
            if error is not None:
                self.last_saved_step = previous
                self._save_failed(step, tmp, error, nbytes)
                return
            self.save_events("checkpoint_end", step, self.folder / f"step-{step}", seconds=time.perf_counter() - start)
            logger.info("checkpoint step-%d: blocked training %.2f s (synchronous save; checkpoint.async_mode "
                        "writes in the background)", step, time.perf_counter() - blocked_since)
            return
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        staging_since = time.perf_counter()
        future = dcp.async_save(tensors, storage_writer=writer, process_group=self.pg, async_stager=self._stager)
        self._pending = _PendingSave(step=step, tmp=tmp, future=future, start=start, nbytes=nbytes,
                                     previous=previous)
        now = time.perf_counter()
        # preparing: the state dict, the folder and the GPU finishing the steps queued before (busy, not stalled);
        # staging: the copy of this rank's shards to host memory, while the GPU has nothing to do.
        logger.info("checkpoint step-%d: blocked training %.2f s (previous save %.2f s, preparing %.2f s, staging "
                    "%.2f s); writing in the background", step, now - blocked_since, start - blocked_since,
                    staging_since - start, now - staging_since)

    def _refuse_nonfinite_weights(self, step: int, weights: dict[str, Any]) -> None:
        """Non-finite weights are never published (collective, before anything is written): one line; latest stays."""
        if problems := value_problems({f"model.{k}": (t, FINITE) for k, t in weights.items()}, group=self.pg):
            latest = (f"step-{self.last_saved_step} stays the latest checkpoint" if self.last_saved_step >= 0
                      else "there is no earlier checkpoint")
            raise on_every_rank(CheckpointError(
                f"checkpoint step-{step} was not saved: the weights are not finite: {problems_line(problems)}; "
                f"{latest} (the run diverged: resume it with a lower optimizer.lr or more scheduler.warmup_steps)"))

    def _broadcast_error(self, error: BaseException | None) -> BaseException | None:
        """Rank 0's error, or None, on every rank (collective on pg), so all ranks take the same branch."""
        box: list[Any] = [error and (type(error).__name__, first_line(error), getattr(error, "errno", None))]
        dist.broadcast_object_list(box, src=0, group=self.pg)
        if box[0] is None:
            return None
        if self.rank == 0:
            return error
        name, message, code = box[0]
        if code is not None:
            return OSError(code, message)
        return CheckpointError(message) if name == CheckpointError.__name__ else RuntimeError(f"{name}: {message}")

    def _save_failed(self, step: int, tmp: Path, error: BaseException, nbytes: int) -> None:
        """One line saying what failed and why; the partial folder removed; stop or continue as configured."""
        self.save_events("checkpoint_end", step, self.folder / f"step-{step}", error=first_line(error))
        removed = ""
        if self.rank == 0 and remove_partial(tmp):
            removed = f"; removed the partial {tmp.name}"
        # After the removal: the free space it reports is what a retry would find.
        why = f"{type(error).__name__}: {first_line(error)}"
        if isinstance(error, OSError) and error.errno in DISK_ERRNOS:
            why = describe_disk_error(error, folder=self.folder, step=step, nbytes=nbytes,
                                      keep_latest_k=self.keep_latest_k, resumed=self.resumed_step)
        elif isinstance(error, CheckpointError):  # a save that cannot succeed in this setup: no retry helps
            raise on_every_rank(CheckpointError(f"checkpoint step-{step} was not published: {first_line(error)}"
                                                f"{removed}; earlier checkpoints are untouched"))
        message = f"checkpoint step-{step} failed to save into {tmp}: {why}{removed}; earlier checkpoints are untouched"
        if self.on_save_error == "stop":
            raise CheckpointError(message + " (checkpoint.on_save_error=continue would keep training)")
        logger.error("%s; training continues without it (checkpoint.on_save_error=continue)", message)

    def require_saved(self, step: int) -> None:
        """At the end of a run (collective): the last step's checkpoint exists, or a one-line CheckpointError.

        With on_save_error="continue" a failed save lets training go on, but a run whose last
        checkpoint failed must not exit 0: a scheduler would call it done and its last steps lost.
        """
        if not self.enable:
            return
        self.wait()
        box = [self.last_saved_step]  # rank 0 finalizes every save: its word is the one
        dist.broadcast_object_list(box, src=0, group=self.pg)
        if box[0] == step:
            return
        latest = f"step-{box[0]}" if box[0] >= 0 else "step 0 (no checkpoint)"
        raise on_every_rank(CheckpointError(
            f"training reached its last step {step}, but checkpoint step-{step} failed to save (see above), so steps "
            f"after {latest} are in no checkpoint: make room in {self.folder} and relaunch the same command to redo "
            "them"))

    def _poll(self) -> None:
        """Make a background save that has finished complete: rank 0 publishes it (checkpoint.json, the rename,
        pruning), in the training loop, so that time blocks training too and is logged."""
        if self._pending is not None and self._pending.future.done():
            step, start = self._pending.step, time.perf_counter()
            self.wait()
            if self.rank == 0 and self.last_saved_step == step:  # published (a failed save said so instead)
                logger.info("checkpoint step-%d: publishing blocked training %.2f s (checkpoint.json, the rename, "
                            "pruning)", step, time.perf_counter() - start)

    def wait(self) -> None:
        """Block until the background save (if any) is written, then make it complete."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        try:
            pending.future.result()
            self._finalize(pending.step, pending.tmp, pending.start)
            self.save_events("checkpoint_end", pending.step, self.folder / f"step-{pending.step}",
                             seconds=time.perf_counter() - pending.start)
        except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
            # No collective here: ranks reach wait() at different times. DCP reports a failed
            # write to every rank; a failed finalize is rank 0's alone, and stopping ends the job.
            if self.last_saved_step == pending.step:
                self.last_saved_step = pending.previous
            self._save_failed(pending.step, pending.tmp, save_error(e), pending.nbytes)

    def _finalize(self, step: int, tmp: Path, start: float) -> None:
        """Rank 0, once every rank has written: checkpoint.json, rename to step-N, prune."""
        if self.rank != 0:
            return
        check_every_rank_wrote(tmp, world_size=self.world_size)
        files, writes = collect_checksums(tmp)
        files[STATE_JSON] = file_digest(tmp / STATE_JSON)
        files.update(write_tokenizer(self.run.tokenizer, self.run.tokenizer_fingerprint, tmp))
        info = {
            "format": FORMAT,
            "kind": "training",
            "step": step,
            "model": self.run.model_json(),
            "mixed_precision": self.run.mixed_precision,
            "layout": self.run.layout,
            "tokenizer": self.run.tokenizer_json(),
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "files": files,
        }
        write_json(tmp / CHECKPOINT_JSON, info)
        self._move_abandoned_aside()
        final = self.folder / f"step-{step}"
        why = incomplete_reason(final) if os.path.lexists(final) else None  # the scan's word for what holds the name
        if aside := publish(tmp, final, tag="incomplete" if why else "replaced"):
            logger.warning("moved %s aside to %s (%s): this run's save of step %d takes its name (kept, never resumed; "
                           "delete it when done)", final, aside.name, why or "a checkpoint that appeared during this "
                           "run", step)
        size = sum(f["bytes"] for f in files.values())
        logger.info("saved checkpoint %s (%.1f MiB, %.2f s); %s", final, size / 2**20, time.perf_counter() - start,
                    describe_writes(writes))
        self._prune(step)

    def _move_abandoned_aside(self) -> None:
        """Rank 0, at this run's first save after resuming an earlier load_step: the later trajectory's checkpoints
        become `step-N.abandoned` (kept; scans skip them), so "latest" is this run's."""
        for path in self._abandoned:  # a failure fails this save, which then publishes nothing
            aside = move_aside(path, "abandoned", why=f"is a later trajectory than step-{self.resumed_step}")
            logger.warning("moved %s aside to %s: a later trajectory than step-%d, which this run resumed (kept, never "
                           "resumed; delete it when done)", path, aside.name, self.resumed_step)
        self._abandoned = []

    def _prune(self, newest: int) -> None:
        for path in prune_checkpoints(self.folder, newest=newest, keep_latest_k=self.keep_latest_k,
                                      resumed=self.resumed_step):
            why = (f"an interrupted save, superseded by step-{newest}" if path.name.endswith(".tmp")
                   else f"keep_latest_k={self.keep_latest_k}")
            logger.info("removed %s (%s)", path, why)

    def close(self) -> None:
        """Finish a background save (it becomes complete) and release the stager."""
        try:
            self.wait()
            self.exports.wait()  # a background export is complete (or fails loudly) before exit
        finally:
            if self._stager is not None:
                self._stager.close()
                self._stager = None

