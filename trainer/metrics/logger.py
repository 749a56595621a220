"""Throughput, MFU, memory and health metrics: console line, metrics.jsonl, TensorBoard, W&B (wandb_run.py)."""

from __future__ import annotations

import json
import logging
import math
import os
import resource
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from trainer.errors import UserError
from trainer.files.confine import special_file_problem
from trainer.files.json_object import json_lines
from trainer.metrics.wandb_run import MAX_RUN_FILE_BYTES, RUN_FILE, WandbOptions, WandbRun

logger = logging.getLogger(__name__)

ACC_NORM = "val/acc_norm/"
"""The prefix of each [[validation.tasks]] task's acc_norm in the metrics (trainer/run/tasks.py)."""

# Dense bf16 tensor-core peak in FLOP/s, from the vendors' datasheets (SXM parts
# unless named). MFU is model FLOPs / (time * this). FP8 runs are read against the
# same bf16 peak, so an FP8 speedup shows up as MFU above what bf16 can reach.
PEAK_BF16_FLOPS: list[tuple[str, float]] = [
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989.5e12),
    ("H200", 989.5e12),
    ("H800", 989.5e12),
    ("GH200", 989.5e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("L4", 121e12),
    ("A10", 125e12),
    ("MI300X", 1307e12),
]


def device_peak_flops(device: torch.device) -> float | None:
    """bf16 dense peak of this device, or None when unknown (CPU): MFU is then not reported."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, flops in PEAK_BF16_FLOPS:
        if key in name:
            return flops
    logger.warning("no bf16 peak known for %s: MFU will not be reported (add it to PEAK_BF16_FLOPS)", name)
    return None


def peak_memory_gib(device: torch.device) -> tuple[float, float]:
    """(peak allocated, peak reserved) in GiB since the last reset; CPU: peak RSS twice."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30, torch.cuda.max_memory_reserved(device) / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # kB on Linux
    return rss, rss


def _fmt_duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


@dataclass
class StepStats:
    step: int
    loss: float
    grad_norm: float
    lr: float
    tokens: int  # tokens processed by this device in the interval
    seconds: float  # wall time of the interval
    steps_in_interval: int
    extra: dict[str, float] | None = None
    """More scalars for metrics.jsonl and TensorBoard, from the step hooks (MoE: aux_loss, moe/*; validation:
    val_loss, val_ppl; fp8 health); aux_loss and the validation pair also go on the log line."""
    batch: tuple[int, int, bool] | None = None
    """(this step's global tokens, the run's so far, whether a batch-size warm-up step): metrics.jsonl's tokens and
    tokens_seen; a warm-up step's log line says its batch."""


class MetricsLogger:
    """Rank 0 writes; every rank may call (others do nothing)."""

    def __init__(
        self,
        *,
        dump_folder: str,
        rank: int,
        total_steps: int,
        flops_per_token: float,
        peak_flops: float | None,
        device: torch.device,
        enable_tensorboard: bool,
        enable_jsonl: bool,
        loss_spike_factor: float,
        fp8_converted_fraction: float | None,
        resumed_step: int = 0,
        wandb: WandbOptions | None = None,
        run_config: dict | None = None,
    ):
        """resumed_step=0: a fresh run; older metrics.jsonl and tb/ are moved aside, not appended to.
        resumed_step=N: the run continues from checkpoint step N; rows after N (written by the run
        that crashed after its last checkpoint) are dropped so no step appears twice.
        wandb: also log to W&B (trainer/metrics/wandb_run.py), with run_config as the W&B run's config."""
        self.rank = rank
        self.total_steps = total_steps
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops
        self.device = device
        self.loss_spike_factor = loss_spike_factor
        self.fp8_converted_fraction = fp8_converted_fraction
        self.running_loss: float | None = None
        self.num_nonfinite = 0
        self.num_loss_spikes = 0
        self.start_time = self.after_first_step = time.perf_counter()
        self.jsonl = None
        self.tb = None
        self.wandb: WandbRun | None = None
        if rank != 0:
            return
        folder = Path(dump_folder)
        folder.mkdir(parents=True, exist_ok=True)
        jsonl, tb = folder / "metrics.jsonl", folder / "tb"
        if resumed_step == 0:
            set_aside([jsonl, tb])
        else:
            truncate_jsonl(jsonl, after_step=resumed_step)
        if enable_jsonl:
            self.jsonl = open(jsonl, "a")
        if enable_tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step hides events past the resumed step that an earlier writer left.
            self.tb = SummaryWriter(log_dir=str(tb), purge_step=resumed_step + 1 if resumed_step else None)
        if wandb is not None:
            self.wandb = WandbRun.start(wandb, dump_folder=dump_folder, config=run_config or {},
                                        resumed=resumed_step > 0)

    def record_nonfinite(self) -> None:
        self.num_nonfinite += 1

    def _loss_spike(self, loss: float) -> bool:
        """Is this loss a spike against the running (EMA) loss? Updates the EMA."""
        spike = False
        if math.isfinite(loss):
            if self.running_loss is not None and loss > self.loss_spike_factor * self.running_loss:
                spike = True
                self.num_loss_spikes += 1
            # EMA of logged losses; slow enough that a spike stands out against it.
            self.running_loss = loss if self.running_loss is None else 0.9 * self.running_loss + 0.1 * loss
        return spike

    def _eta(self, step: int, first_step: int, now: float) -> float:
        # The ETA counts steps after the first, which holds compile and warm-up (2-3x a step's time).
        if step == first_step:
            self.after_first_step = now
            return float("nan")
        return (now - self.after_first_step) / (step - first_step) * (self.total_steps - step)

    def _console_line(self, s: StepStats, *, tps: float, tflops: float, mfu: float | None,
                      memory: tuple[float, float], eta: float) -> str:
        extra = s.extra or {}
        aux_text = f" | aux_loss {extra['aux_loss']:.4f}" if "aux_loss" in extra else ""
        # On a CPU, model TFLOP/s and MFU say nothing (no peak to compare with): the line leaves them out.
        perf = "" if self.device.type == "cpu" else f" | tflops {tflops:6.1f} | " + (
            f"mfu {mfu:5.1f}%" if mfu is not None else "mfu n/a")
        line = (
            f"step {s.step:>6}/{self.total_steps} | loss {s.loss:7.4f}{aux_text} | grad_norm {s.grad_norm:7.3f} | "
            f"lr {s.lr:.2e} | tps {tps:,.0f}{perf} | "
            f"mem {memory[0]:5.2f}/{memory[1]:5.2f} GiB | eta {_fmt_duration(eta)}"
        )
        if s.batch is not None and s.batch[2]:  # train.batch_size_warmup_tokens: this step's batch is smaller
            line += f" | warm-up batch {s.batch[0]:,} tokens"
        if "val_loss" in extra:
            line += f" | val_loss {extra['val_loss']:7.4f} ppl {extra['val_ppl']:.2f}"
            line += f" ema {extra['val_loss_ema']:7.4f}" if "val_loss_ema" in extra else ""  # train.ema_decay
        # [[validation.tasks]]: each task's acc_norm (metrics.jsonl, TensorBoard and W&B have acc too)
        line += "".join(f" | {k[len(ACC_NORM):]} acc_norm {v:.3f}" for k, v in extra.items() if k.startswith(ACC_NORM))
        return line

    def log(self, s: StepStats, *, first_step: int) -> dict:
        """Compute derived values, print one line, append to jsonl and TensorBoard."""
        tps = s.tokens / s.seconds if s.seconds > 0 else 0.0
        tflops = tps * self.flops_per_token / 1e12
        mfu = 100 * tps * self.flops_per_token / self.peak_flops if self.peak_flops else None
        mem_alloc, mem_reserved = peak_memory_gib(self.device)
        if self.device.type == "cuda":
            # Peaks per logged interval, so growth (a leak, a longer sequence) shows up.
            torch.cuda.reset_peak_memory_stats(self.device)
        spike = self._loss_spike(s.loss)
        now = time.perf_counter()
        elapsed = now - self.start_time
        eta = self._eta(s.step, first_step, now)
        record = {
            "step": s.step,
            "loss": s.loss,
            "grad_norm": s.grad_norm,
            "lr": s.lr,
            "tps": tps,
            "tflops": tflops,
            "mfu": mfu,
            "step_time_s": s.seconds / max(1, s.steps_in_interval),
            "memory_peak_gib": mem_alloc,
            "memory_reserved_gib": mem_reserved,
            "loss_spike": spike,
            "nonfinite_count": self.num_nonfinite,
            "elapsed_s": elapsed,
        }
        if self.fp8_converted_fraction is not None:
            record["fp8_converted_fraction"] = self.fp8_converted_fraction
        if s.batch is not None:
            record["tokens"], record["tokens_seen"] = s.batch[:2]
        extra = s.extra or {}
        record.update(extra)
        if self.rank != 0:
            return record
        line = self._console_line(s, tps=tps, tflops=tflops, mfu=mfu, memory=(mem_alloc, mem_reserved), eta=eta)
        logger.info(line + ("  << LOSS SPIKE" if spike else ""))
        if self.jsonl is not None:
            self.jsonl.write(json.dumps(record) + "\n")
            self.jsonl.flush()
        if self.tb is not None or self.wandb is not None:
            scalars = {
                "train/loss": s.loss,
                "train/grad_norm": s.grad_norm,
                "train/lr": s.lr,
                "perf/tokens_per_second": tps,
                "perf/tflops": tflops,
                "perf/step_time_s": record["step_time_s"],
                "memory/peak_gib": mem_alloc,
                "memory/reserved_gib": mem_reserved,
                "health/nonfinite_count": self.num_nonfinite,
                "health/loss_spikes": self.num_loss_spikes,
            }
            if mfu is not None:
                scalars["perf/mfu"] = mfu
            if s.batch is not None:
                scalars["train/tokens"], scalars["train/tokens_seen"] = s.batch[:2]
            if self.fp8_converted_fraction is not None:
                scalars["fp8/converted_fraction"] = self.fp8_converted_fraction
            names = {"val_loss": "val/loss", "val_ppl": "val/ppl", "val_loss_ema": "val/loss_ema"}
            scalars.update({names.get(k, k if "/" in k else f"train/{k}"): v for k, v in extra.items()})
            self.add_scalars(scalars, s.step)
        return record

    def add_scalars(self, scalars: dict[str, float], step: int) -> None:
        """TensorBoard's and W&B's scalars at `step` (rank 0)."""
        if self.tb is not None:
            for key, value in scalars.items():
                self.tb.add_scalar(key, value, step)
        if self.wandb is not None and not self.wandb.log(scalars, step):
            self.wandb = None  # said once; the run goes on without W&B

    def close(self) -> None:
        if self.jsonl is not None:
            self.jsonl.close()
            self.jsonl = None
        if self.tb is not None:
            tb, self.tb = self.tb, None
            try:
                tb.flush()  # raises what its writer thread met (a full disk); close() alone would drop it
            finally:
                tb.close()
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None


def set_aside(paths: list[Path]) -> None:
    """Rename existing outputs of an earlier run to `NAME.prev-N` (N = 1, 2, ...); nothing is deleted."""
    existing = [p for p in paths if p.exists()]
    if not existing:
        return
    n = 1
    while any(p.with_name(f"{p.name}.prev-{n}").exists() for p in paths):
        n += 1
    for p in existing:
        p.rename(p.with_name(f"{p.name}.prev-{n}"))
    logger.info("fresh run: earlier %s moved aside as *.prev-%d", ", ".join(p.name for p in existing), n)


def truncate_jsonl(path: Path, *, after_step: int) -> None:
    """Drop the rows of steps after `after_step`, and a last line a crash cut short (this trainer's own partial row),
    atomically. The file is read as data, a line at a time (trainer/files/json_object.py): a line that is no row with a
    numeric step is kept as it is, and said in one warning line naming the file and the line (a user's file is never
    cut)."""
    if not os.path.lexists(path):
        return
    if problem := special_file_problem(path, what="metrics file"):  # a FIFO would hang the read, /dev/zero not end
        raise RunFileError(_run_file_line(problem, path))
    cut, kept_bad, last = [], [], None
    for line in json_lines(path, what="a metrics row"):
        last, problem = line, line.problem
        if problem is None:
            step = line.value.get("step")
            if isinstance(step, (int, float)) and not isinstance(step, bool) and not math.isnan(step):
                if step > after_step:
                    cut.append((line.start, line.end))
                continue
            problem = f"{path} line {line.number} has step={repr(step)[:40]}, not a step number"
        if not line.ended:  # the last line, without its newline: a write that a crash cut short
            cut.append((line.start, line.end))
        else:
            kept_bad.append(problem)
    for problem in kept_bad[:5]:
        logger.warning("%s: kept as it is (a resume drops only rows of steps after %d)", problem, after_step)
    if len(kept_bad) > 5:
        logger.warning("%d more lines of %s are not metrics rows: kept as they are", len(kept_bad) - 5, path)
    # A kept last line without its newline would run into the first row this run appends.
    open_end = last is not None and not last.ended and (last.start, last.end) not in cut[-1:]
    if cut or open_end:
        _rewrite_without(path, cut, size=last.end, newline=open_end)
    if cut:
        logger.info("resumed at step %d: dropped %d metrics.jsonl rows written after it", after_step, len(cut))


def _rewrite_without(path: Path, cut: list[tuple[int, int]], *, size: int, newline: bool) -> None:
    """`path` without the byte ranges `cut` (in order), and a newline at its end if `newline`, replaced atomically;
    copied a piece at a time."""
    tmp = path.with_name(path.name + ".tmp")
    with open(path, "rb") as src, open(tmp, "wb") as dst:
        for start, end in [*cut, (size, size)]:
            while src.tell() < start:
                dst.write(src.read(min(start - src.tell(), 2**24)))
            src.seek(end)
        dst.write(b"\n" if newline else b"")
        dst.flush()
        os.fsync(dst.fileno())
    os.replace(tmp, path)


class RunFileError(UserError):
    """A file of the run's folder that the run reads back or writes over is not a regular file (or too large)."""


# The files of a run's folder that a relaunch reads back and writes again, with the most bytes each may be (W&B's
# only with metrics.wandb).
READ_BACK = {"metrics.jsonl": None, RUN_FILE: MAX_RUN_FILE_BYTES}


def _run_file_line(problem: str, path: Path) -> str:
    return (f"{problem} (a relaunch reads {path.name} back and writes it again): move it away, or use another "
            "job.dump_folder")


def check_run_files(dump_folder: str | Path, *, wandb: bool, markers: tuple[str, ...] = ()) -> None:
    """Before anything is built: each file of READ_BACK in the run's folder, and each of `markers` (small files a
    relaunch removes and writes again: preempted.json), is absent or a regular file of a bounded size, else one
    RunFileError line (a FIFO would hang a resume, a directory stop it with a traceback, /dev/zero fill the memory)."""
    for name, max_bytes in {**READ_BACK, **dict.fromkeys(markers, MAX_RUN_FILE_BYTES)}.items():
        if name == RUN_FILE and not wandb:
            continue
        path = Path(dump_folder) / name
        if problem := special_file_problem(path, max_bytes=max_bytes, what=name):
            raise RunFileError(_run_file_line(problem, path))
