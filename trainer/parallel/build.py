"""One builder for the whole model and for each pipeline stage: meta -> parallelized -> materialized -> initialized.

    build_model_part(args, parallel_dims, options=..., device=..., seed=..., fqns=None) -> (module, BuildResult)

At pp=1 the trainer builds the whole model with it; under pipeline parallelism
(trainer/parallel/pipeline.py) each stage is the same model with the other stages' modules
removed (`split_stage_module`), built by the same call. Either way no rank ever holds more
than its shards, and every weight gets the per-fqn seeded init, so the stages together start
from exactly the pp=1 weights.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from trainer.models import ModelArgs, build_model
from trainer.parallel.apply import BuildOptions, BuildResult, build_parallel_model
from trainer.parallel.float8 import matches_exclusion
from trainer.parallel.parallel_dims import ParallelDims
from trainer.parallel.pipeline_layout import EMBEDDING, HEAD


def build_model_part(args: ModelArgs, parallel_dims: ParallelDims, *, options: BuildOptions, device: torch.device,
                     seed: int, fqns: tuple[str, ...] | None = None) -> tuple[nn.Module, BuildResult]:
    """The model (or, with `fqns`, the pipeline stage holding those top-level modules), parallelized by
    build_parallel_model, materialized on `device` and initialized, in train mode."""
    with torch.device("meta"):
        model = build_model(args)
    if options.document_eos is not None:  # data.document_masking
        model.set_document_masking(options.document_eos)
    if fqns is not None:
        model = split_stage_module(model, fqns)
        if options.float8 is not None:
            options = dataclasses.replace(options, float8=dataclasses.replace(
                options.float8, exclude_fqns=_stage_float8_excludes(model, options.float8.exclude_fqns)))
    result = build_parallel_model(model, parallel_dims, options=options, device=device)
    # Materialize only this rank's shards, then fill them as if the model were whole: the per-fqn seeded init
    # (trainer.models.layers.Decoder.init_weights) gives a stage the pp=1 model's values.
    model.to_empty(device=device)
    model.init_weights(seed=seed)
    model.train()
    return model, result


def split_stage_module(model: nn.Module, fqns: tuple[str, ...]) -> nn.Module:
    """Keep only `fqns` of a (meta) model, in place: other blocks deleted, embedding/norm/head set to None."""
    keep = set(fqns)
    for name in list(model.layers.keys()):
        if f"layers.{name}" not in keep:
            del model.layers[name]
    for name in (EMBEDDING, *HEAD):
        if name not in keep:
            setattr(model, name, None)
    return model


def _stage_float8_excludes(part: nn.Module, exclude_fqns: tuple[str, ...]) -> tuple[str, ...]:
    """The float8.exclude_fqns entries that match a Linear of this stage (validate checked each matches one
    somewhere in the full model; an entry for another stage's layer is not an error here)."""
    linears = [fqn for fqn, m in part.named_modules() if isinstance(m, nn.Linear)]
    return tuple(e for e in exclude_fqns if any(matches_exclusion(fqn, e) for fqn in linears))


__all__ = ["build_model_part", "split_stage_module"]
