"""One validation pass: everything knowable from the config, the world size, the model's shapes and the data.

The config alone was checked when the JobConfig was built (trainer.config.checks, so a bad TOML
or override fails while parsing, without importing torch); this pass adds the rest:

    layout.py          degrees x world size x model shapes; the pipeline's stages and schedule
    memory.py          the sharded weights, gradients and optimizer state per rank against the device's memory
    resolve.py         model arguments, FP8 and build options, data sources (and the checks they need)

`validate_job` runs them in that order on every rank before `init_distributed` does any
work; each raises `ConfigError` (or `DataError` for data files) with one line naming the key,
and what it resolves goes to the trainer as a `ResolvedJob`, so nothing is worked out twice.
Lower layers assert these facts; they do not check them again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trainer.config import JobConfig
from trainer.models import ModelArgs
from trainer.parallel import BuildOptions, ParallelDims
from trainer.parallel.pipeline import PipelineOptions
from trainer.validate.layout import check_model_layout, resolve_parallel_dims, resolve_pipeline
from trainer.validate.memory import check_fits_device
from trainer.validate.resolve import resolve_build, resolve_data, resolve_float8, resolve_model_args


@dataclass(frozen=True)
class ResolvedJob:
    """What validation resolved, handed to the trainer so nothing is worked out twice."""

    parallel_dims: ParallelDims
    model_args: ModelArgs
    build: BuildOptions
    data_source: Any
    """The opened, checked sample source (trainer.data.sources)."""
    validation_source: Any = None
    """The held-out source when validation.enable (never overlaps data_source)."""
    pipeline: PipelineOptions | None = None
    """The stage layout and schedule when distributed.pp > 1."""
    float8_layers: dict[str, str] | None = None
    """fp8 runs: every Linear's fqn -> "converted" or why it is excluded, in model order."""


def validate_job(cfg: JobConfig, *, world_size: int) -> ResolvedJob:
    """Check everything that needs the world size, the model's shapes or the data; resolve what the build takes."""
    pd = resolve_parallel_dims(cfg, world_size=world_size)
    args = resolve_model_args(cfg)
    check_model_layout(cfg, args, pd)
    # Before anything walks the blocks (pipeline costs, the FP8 meta model): 10**8 of them take minutes.
    check_fits_device(cfg, args, pd)
    pipeline = resolve_pipeline(cfg, pp=pd.pp, args=args)
    float8, float8_layers = resolve_float8(cfg, args, pd) if cfg.train.is_fp8 else (None, None)
    build = resolve_build(cfg, pd, float8)
    source, validation = resolve_data(cfg, vocab_size=args.vocab_size, dp=pd.dp)
    return ResolvedJob(parallel_dims=pd, model_args=args, build=build, data_source=source,
                       validation_source=validation, pipeline=pipeline, float8_layers=float8_layers)


__all__ = ["ResolvedJob", "validate_job"]
