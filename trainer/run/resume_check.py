"""checkpoint.resume_check: a resume that proves itself.

Each checkpoint records, in its part `resume_check` (state.json), the loss of a fixed probe batch under the weights
it saves: one microbatch (train.batch_size sequences of train.seq_len tokens) of token ids drawn from the run's
vocabulary by a generator of fixed seed, every label valid, computed right before the save in eval mode without
gradients, in the training layout (trainer/run/evaluate.py's Evaluator over one batch: every data-parallel rank
computes the whole batch, so the loss is the same on every rank and takes no all-reduce over dp; cp ranks sum their
chunks). A resume recomputes it before step 1 and logs `resume check: saved X, now Y, difference D`:

- same layout, precision and kernels: bit-equal, or the run stops with one line naming what differs from the saved
  run (a model argument such as model.rope_theta or model.norm_eps, which a resume otherwise lets change with a
  warning; else the torch version, the device or a kernel);
- another layout (dp, tp, ...) or kernel choice (train.compile_model, attention backend, loss chunks, the GPU model,
  torch's version): the same values summed in another order, within `layout_tolerance` (relative), derived from the
  compute dtype's rounding;
- another precision (`precision_settings`: mixed_precision, the master and compute dtypes, the FP8 recipe; a
  precision schedule's next phase): logged, not checked (the numbers are expected to move).

A checkpoint without a record (checkpoint.resume_check=false, an older trainer) says so in one line.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from trainer.checkpoint import CheckpointError, RunInfo
from trainer.errors import on_every_rank
from trainer.run.evaluate import Evaluator
from trainer.run.step import TrainStep
from trainer.validate import ResolvedJob

logger = logging.getLogger(__name__)

PROBE_SEED = 0x5EED_C4EC
"""The probe's token ids: a generator of this seed, whatever the run's seeds."""
UNIT_ROUNDOFF = {"fp32": 2.0**-24, "fp16": 2.0**-11, "bf16": 2.0**-8, "fp8": 2.0**-8}
"""The unit roundoff of each mixed_precision's activations (fp8 runs keep bf16 activations; its GEMMs' inputs are cast
with scales every layout computes alike)."""


def layout_tolerance(mixed_precision: str, *, n_layers: int) -> float:
    """The relative difference a resume at another layout may show in the probe loss.

    Another layout reorders sums (tp splits a matmul's reduction, FSDP gathers the same weights) but computes the same
    values: each block's outputs differ by about one rounding of the compute dtype (unit roundoff u) where the order
    differs, and those differences add over the blocks like a random walk. 8 u sqrt(n_layers) keeps a factor of 8 over
    that estimate; the mean over the probe's tokens only shrinks it. fp32 with 2 blocks: 6.7e-7; bf16 with 32: 0.18.
    """
    return 8 * UNIT_ROUNDOFF.get(mixed_precision, UNIT_ROUNDOFF["bf16"]) * math.sqrt(max(1, n_layers))


class ProbeSource:
    """`rows` sequences of `seq_len + 1` token ids in [0, vocab_size), the held-out source protocol of the Evaluator."""

    def __init__(self, *, vocab_size: int, rows: int, seq_len: int):
        generator = torch.Generator().manual_seed(PROBE_SEED)
        self.rows = rows
        self.tokens = torch.randint(0, vocab_size, (rows, seq_len + 1), generator=generator).numpy()

    def num_samples(self, seq_len: int) -> int:
        return self.rows

    def get_sample(self, i: int, seq_len: int) -> np.ndarray:
        return self.tokens[i, :seq_len + 1]

    def __repr__(self) -> str:
        return f"the resume check's probe ({self.rows} sequences)"


def precision_settings(job: ResolvedJob) -> dict[str, str]:
    """What sets the probe's numbers apart: a change of any is another precision (logged, not checked)."""
    b = job.build
    return {"mixed_precision": job.run.mixed_precision, "master_dtype": str(b.fsdp.master_dtype),
            "param_dtype": str(b.fsdp.param_dtype), "float8": repr(b.float8),
            "moe_dispatch_dtype": b.moe_dispatch_dtype}


def kernel_settings(job: ResolvedJob, device: torch.device) -> dict[str, str]:
    """What computes the same values in another order: a change of any is checked within the tolerance. The GPU model
    and torch's version are among them: another GPU (an H100's checkpoint resumed on an H200) or torch picks its own
    GEMM and attention kernels for the same shapes."""
    b = job.build
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return {"compile": str(b.compile), "compile_loss": str(b.compile_loss), "attention": str(b.attention_backends),
            "loss_chunk_tokens": str(b.loss_chunk_tokens), "loss_parallel": str(b.loss_parallel), "device": gpu,
            "torch": torch.__version__}


class ResumeCheck:
    """The probe's loss recorded before each save (`record`, the part `resume_check`) and checked after a resume."""

    def __init__(self, job: ResolvedJob, *, step_fn: TrainStep, run: RunInfo, cp_group: dist.ProcessGroup | None):
        """The probe runs through `step_fn.eval_loss` (the training layout, as validation does): one microbatch of
        `job`'s; `cp_group`: the context-parallel ranks that hold the other chunks of a sequence (None without cp)."""
        self.enable, self.step_fn, self.model, self.run = job.checkpoint.resume_check, step_fn, step_fn.model, run
        self.rows, self.seq_len, self.cp_group = job.run.batch_size, job.run.seq_len, cp_group
        self.precision, self.kernels = precision_settings(job), kernel_settings(job, step_fn.device)
        # A V schedule's forward-only pass fails: each rank's two stages hand tensors over locally through the
        # backward's buffers (torch.distributed.pipelining: "can't steal_bwd_input if this stage doesn't have
        # backward"). Such a run records no probe and checks none.
        self.unchecked = (f"distributed.pipeline_schedule={job.pipeline.schedule} cannot run forward-only"
                          if job.pipeline is not None and job.pipeline.v_style else "")
        self.pipeline = job.pipeline is not None
        self.recorded: dict[str, Any] = {}
        self.saved: dict[str, Any] | None = None

    def probe_loss(self, *, rows: int, seq_len: int) -> float:
        """The probe's mean token loss under the current weights (collective over the model's groups)."""
        source = ProbeSource(vocab_size=self.run.model_args.vocab_size, rows=rows, seq_len=seq_len)
        step_fn = self.step_fn
        evaluator = Evaluator(source, model=self.model, batch_loss=step_fn.eval_loss, seq_len=seq_len, batch_size=rows,
                              steps=1, freq=2**62, last_step=-1, dp_rank=0, dp_degree=1, device=step_fn.device,
                              dp_group=self.cp_group, loss_context=step_fn.loss_context)
        return evaluator.evaluate(self.model)["loss"]

    def record(self) -> None:
        """Before a save (every rank): the probe's loss under the weights about to be saved."""
        if self.enable and not self.unchecked:
            self.recorded = {
                "loss": self.probe_loss(rows=self.rows, seq_len=self.seq_len), "rows": self.rows,
                "seq_len": self.seq_len, "precision": self.precision, "kernels": self.kernels,
                "layout": dict(self.run.layout), "model": {k: str(v) for k, v in self.run.model_json().items()},
            }

    # -- the checkpoint part (trainer/checkpoint/parts.py): JSON values only, into state.json --

    def state_dict(self) -> dict[str, Any]:
        return dict(self.recorded)

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.saved = sd

    # -- after a resume --

    def check(self, *, resumed_step: int) -> None:
        """After a resume (every rank, before step 1): recompute the probe and compare; one line either way."""
        if not self.enable or resumed_step < 0:
            return
        saved = self.saved
        if not saved or any(k not in saved for k in ("loss", "rows", "seq_len", "precision", "kernels", "layout")):
            logger.info("resume check: checkpoint step-%d records no probe loss (saved with "
                        "checkpoint.resume_check=false or by an older trainer): not checked", resumed_step)
            return
        if self.unchecked:
            logger.info("resume check: not checked: %s", self.unchecked)
            return
        fixed = "pipeline parallel," if self.pipeline else "context parallel," if self.cp_group is not None else ""
        if saved["seq_len"] > self.seq_len or (fixed and (saved["rows"], saved["seq_len"]) != (self.rows, self.seq_len)):
            # A pipeline's stages pass tensors of the training microbatch's shape only; context parallelism's chunks,
            # RoPE rows and masks are those of the training sequence length.
            logger.info("resume check: not checked: the probe is %d sequences of %d tokens, which this run (%s "
                        "train.batch_size=%d, train.seq_len=%d) cannot evaluate", saved["rows"], saved["seq_len"],
                        fixed, self.rows, self.seq_len)
            return
        now = self.probe_loss(rows=saved["rows"], seq_len=saved["seq_len"])
        diff = now - saved["loss"]
        logger.info("resume check: saved %r, now %r, difference %.3g", saved["loss"], now, diff)
        if changed := _changes(saved["precision"], self.precision):
            logger.info("resume check: another precision (%s): the difference is not checked", changed)
            return
        same_layout = saved["layout"] == self.run.layout and saved["kernels"] == self.kernels
        tolerance = 0.0 if same_layout else layout_tolerance(self.run.mixed_precision,
                                                             n_layers=self.run.model_args.n_layers)
        if abs(diff) <= tolerance * abs(saved["loss"]) and math.isfinite(now):
            if not same_layout:
                logger.info("resume check: another layout or kernels (%s), within its tolerance of %.2g relative "
                            "(docs/checkpointing.md)", _changes({**saved["layout"], **saved["kernels"]},
                                                                 {**self.run.layout, **self.kernels}), tolerance)
            return
        raise on_every_rank(CheckpointError(
            f"resume check failed: checkpoint step-{resumed_step}'s probe loss was {saved['loss']!r}, these weights "
            f"give {now!r} (difference {diff:.3g}, "
            + ("bit-equal expected at the same layout and precision" if same_layout
               else f"more than {tolerance:.2g} relative at another layout or kernels")
            + f"); {self._what_differs(saved)}; "
            "resume with the saved run's settings (its resolved.toml), or set checkpoint.resume_check=false to go on"))

    def _what_differs(self, saved: dict[str, Any]) -> str:
        """The model arguments that differ from the saved run's, else what else it could be."""
        ours = {k: str(v) for k, v in self.run.model_json().items()}
        theirs = saved.get("model", {})
        diffs = [f"model.{k}={ours.get(k)} (saved: {theirs.get(k)})" for k in sorted(set(ours) | set(theirs))
                 if k != "flavor" and ours.get(k) != theirs.get(k)]
        if diffs:
            return "what differs from the saved run: " + ", ".join(diffs)
        return ("the model arguments, precision, layout, GPU model and torch version are the saved run's: weights that "
                "did not load as saved, or a kernel that is not deterministic")


def _changes(saved: dict[str, Any], ours: dict[str, Any]) -> str:
    """"key saved -> ours" of each setting that differs, comma-separated ("" when none)."""
    return ", ".join(f"{k} {saved.get(k)} -> {ours.get(k)}" for k in sorted(set(saved) | set(ours))
                     if str(saved.get(k)) != str(ours.get(k)))
