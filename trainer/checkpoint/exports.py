"""Hugging Face exports while training (checkpoint.export_interval): `step-N-hf/` every N steps, written in the
background, the older ones pruned to checkpoint.export_keep_latest_k.

Where: beside the checkpoints, `{job.dump_folder}/{checkpoint.folder}/step-N-hf/`, where checkpoint.model_only's final
export already goes (a run's weights in one folder; the scan of checkpoints ignores the name, and an export may never
be written inside a checkpoint: trainer/hf/output_folder.py). Which weights: the training weights, as the final export
and `convert_checkpoint.py export` write them (train.ema_decay's average: `convert_checkpoint.py export --weights=ema`
from a checkpoint).

One exporter, the final export's: `gathered_fetch` (trainer/checkpoint/gather.py) gathers every rank's shards and
every pipeline stage's tensors to rank 0, and `write_hf_export` (trainer/hf) writes config.json, the safetensors and
the run's tokenizer into `step-N-hf.tmp/`, renamed when complete (a crash never leaves a half folder named step-N-hf).

What training waits for, as an async checkpoint's staging: the gather, which copies the whole model in the export's
dtype into rank 0's host memory (the other ranks hold one full tensor at a time). The cost is that host memory on rank
0 (the startup line says how much: 16 GiB for an 8B model in bf16) for as long as the write takes; rank 0 then writes
it from a thread while training goes on. One export at a time: the next waits for the previous write (logged).
A failed write is reported at the next step: checkpoint.on_save_error says whether the run stops.
"""

from __future__ import annotations

import logging
import re
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from trainer.checkpoint.format import EXPORT_DTYPES, CheckpointError, first_line
from trainer.checkpoint.gather import export_gathered, gathered_fetch, prepare_export
from trainer.checkpoint.options import CheckpointOptions
from trainer.checkpoint.parts import CheckpointState
from trainer.checkpoint.state import RunInfo
from trainer.files.publish import is_partial, remove_partial
from trainer.hf import export_bytes, export_dtypes, write_hf_export
from trainer.hf.output_folder import EXPORT
from trainer.model_values import ModelArgs


logger = logging.getLogger("trainer.checkpoint")

EXPORT_DIR = re.compile(r"^step-(\d+)-hf$")
EXPORT_TMP = re.compile(r"^step-(\d+)-hf\.tmp$")


def describe_bytes(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def prune_exports(folder: Path, *, newest: int, keep_latest_k: int) -> list[Path]:
    """After step-{newest}-hf is published: remove the exports before it past the newest `keep_latest_k` (0 keeps all),
    and the interrupted ones before it (`step-M-hf.tmp` holding the `.partial` marker); returns what was removed.
    Only folders that hold nothing but an export's files: anything else named so is left alone, and so is a later
    trajectory's export (a step after `newest`)."""
    interrupted = [p for p in folder.iterdir() if (m := EXPORT_TMP.match(p.name)) and int(m.group(1)) < newest
                   and is_partial(p)]
    found = sorted((int(m.group(1)), p) for p in folder.iterdir() if (m := EXPORT_DIR.match(p.name))
                   and int(m.group(1)) <= newest and p.is_dir() and not p.is_symlink()
                   and all(f.is_file() and not f.is_symlink() and EXPORT.files.fullmatch(f.name) for f in p.iterdir()))
    removed = sorted(interrupted) + ([path for _, path in found[:-keep_latest_k]] if keep_latest_k else [])
    for path in removed:
        shutil.rmtree(path)
    return removed


class HFExports:
    """The run's Hugging Face exports: checkpoint.export_interval's, written in the background, and
    checkpoint.model_only's final one. Every rank constructs it and calls it at the same steps (collective)."""

    def __init__(self, state: CheckpointState, options: CheckpointOptions, *, run: RunInfo):
        """`state.model`: the model whose weights are exported, read at each export."""
        self.state, self.folder, self.interval = state, options.path, options.export_interval
        self.keep_latest_k, self.stop_on_error = options.export_keep_latest_k, options.on_save_error == "stop"
        self.args, self.dtype = run.model_args, EXPORT_DTYPES[options.export_dtype]
        # Before training: safetensors, a Hugging Face target, the run's tokenizer unchanged (a run that cannot export
        # stops before it trains).
        self.tokenizer = None
        if options.model_only or self.interval:
            key = "checkpoint.model_only=true" if options.model_only else f"checkpoint.export_interval={self.interval}"
            self.tokenizer = prepare_export(run, key=key)
        self.rank = dist.get_rank()
        self._thread: threading.Thread | None = None
        self._failed: tuple[int, BaseException] | None = None
        if not self.interval:
            return
        self._dtypes = export_dtypes(self.args, self.dtype)
        # Other pipeline stages' tensors travel over a gloo group of the exports' own: the checkpoint's may be busy
        # with a background save.
        self.pg = dist.new_group(backend="gloo")
        logger.info("Hugging Face exports: every %d steps into %s/step-N-hf (%s, the run's tokenizer), keep_latest_k="
                    "%d; each holds %s of rank 0's host memory while it is written in the background",
                    self.interval, self.folder, options.export_dtype, self.keep_latest_k,
                    describe_bytes(export_bytes(self.args, self.dtype)))

    def final(self, step: int, *, p2p_group: dist.ProcessGroup, before_p2p: Callable[[], None]) -> Path:
        """checkpoint.model_only's export at the end, written as it is gathered, one shard at a time (collective; rank
        0 writes): `export_gathered`."""
        self.wait()  # the last background export first: rank 0 holds one copy of the weights at a time
        return export_gathered(self.state.model, self.folder / f"step-{step}-hf", args=self.args, dtype=self.dtype,
                               p2p_group=p2p_group, before_p2p=before_p2p, tokenizer=self.tokenizer)

    def due(self, step: int, *, final_export: bool) -> bool:
        """After each step: whether it exports (not where the final export, checkpoint.model_only's, takes the
        name); a background write that has finished is reported now."""
        if self._thread is not None and not self._thread.is_alive():
            self.wait()
        return bool(self.interval) and step % self.interval == 0 and not final_export

    def export(self, step: int) -> None:
        """Gather the weights to rank 0's host (collective: training waits), then write them in the background."""
        blocked_since = time.perf_counter()
        self.wait()  # one export at a time: rank 0 holds one copy of the weights
        start = time.perf_counter()
        shapes, fetch = gathered_fetch(self.state.model, p2p_group=self.pg, before_p2p=lambda: None,
                                       dtype_of=self._dtypes.__getitem__)
        # Every rank, in the same order (the gathers are collective): what the writer asks for. A state dict that is
        # not the export's (write_hf_export says how) fails the write, reported at the next step.
        host = fetch([fqn for fqn in shapes if fqn in self._dtypes])
        if self.rank != 0:
            return
        now = time.perf_counter()
        logger.info("export step-%d-hf: blocked training %.2f s (previous export %.2f s, gathering %.2f s); writing in "
                    "the background", step, now - blocked_since, start - blocked_since, now - start)
        self._thread = threading.Thread(target=self._write, args=(step, shapes, host), name=f"export-step-{step}",
                                        daemon=True)
        self._thread.start()

    def _write(self, step: int, shapes: dict[str, tuple[int, ...]], host: dict[str, torch.Tensor]) -> None:
        out = self.folder / f"step-{step}-hf"
        try:
            write_hf_export(out, args=self.args, shapes=shapes, fetch=lambda fqns: {k: host[k] for k in fqns},
                            dtype=self.dtype, tokenizer=self.tokenizer)
            for path in prune_exports(self.folder, newest=step, keep_latest_k=self.keep_latest_k):
                why = (f"an interrupted export, superseded by step-{step}-hf" if path.name.endswith(".tmp")
                       else f"checkpoint.export_keep_latest_k={self.keep_latest_k}")
                logger.info("removed %s (%s)", path, why)
        except BaseException as e:  # reported in the training loop (due, wait)
            remove_partial(out.with_name(out.name + ".tmp"))
            self._failed = (step, e)

    def wait(self) -> None:
        """Block until the background write (if any) is done; its failure stops the run or is logged (as
        checkpoint.on_save_error says)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._failed is None:
            return
        (step, error), self._failed = self._failed, None
        message = (f"export step-{step}-hf failed to write into {self.folder}: {type(error).__name__}: "
                   f"{first_line(error)}; earlier exports and checkpoints are untouched")
        if self.stop_on_error:
            raise CheckpointError(message + " (checkpoint.on_save_error=continue would keep training)")
        logger.error("%s; training continues (checkpoint.on_save_error=continue)", message)
