"""What a run writes beside its metrics so the console can stay short: the values it used.

    config.toml       the config as given (placeholders such as dp_shard = -1 kept): relaunchable as is
    resolved.toml     every value the run used: the placeholders replaced (vocab_size, n_layers, the MoE
                      routing, dp_shard, master weights, FP8 all-gather, resharding, pipeline stages) and
                      the model's whole shape ([model_args])
    fp8_layers.json   fp8 runs: the recipe, the FP8 format, and every Linear layer, converted or the reason it was
                      excluded ({"recipe", "format", "layers": {fqn: fate}}); with float8.scaling='delayed' also
                      "scaling", "amax_history_len", "amax_compute_algo", "margin"; "save_fp8_activations" when on;
                      "unavailable" (why) where this device has no FP8 matmul of the recipe and nothing converts

The startup log names these files instead of printing them.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch

from trainer.config import JobConfig
from trainer.config.load import tomllib
from trainer.config.model_sections import DeepseekV3Section, GptOssSection, ModelSection, MoESection, section_values
from trainer.config.sections import to_toml
from trainer.model_values import DeepseekV3Args, GptOssArgs
from trainer.models import FLAVORS, ModelArgs, family_of
from trainer.parallel import BuildOptions, ParallelDims
from trainer.parallel.float8 import fp8_layers_json
from trainer.parallel.pipeline_layout import PipelineOptions

RESOLVED = "resolved.toml"
FP8_LAYERS = "fp8_layers.json"


def resolved_config(cfg: JobConfig, *, args: ModelArgs, pd: ParallelDims, build: BuildOptions,
                    pipeline: PipelineOptions | None) -> dict[str, dict[str, Any]]:
    """cfg's sections with every placeholder replaced by what validation resolved."""
    d = cfg.to_dict()
    d["model"].update(model_section_values(args))
    family = family_of(args)
    if family is not family_of(FLAVORS[cfg.model.flavor]):  # the shape of checkpoint.initial_load_path's model
        d["model"]["flavor"] = next(iter(family.flavors))  # a flavor of its family, whose values all replace
    if family.has_router:  # the experts and routing values of [moe]
        d["moe"].update(section_values(args, MoESection))
    if isinstance(args, DeepseekV3Args):  # MLA, group routing, MTP
        d["deepseek_v3"].update(section_values(args, DeepseekV3Section))
    if isinstance(args, GptOssArgs):  # the windows, SwiGLU clamp and YaRN of [gpt_oss]
        d["gpt_oss"].update(section_values(args, GptOssSection))
    d["distributed"].update(
        dp_shard=pd.dp_shard, master_dtype="bf16" if build.fsdp.master_dtype == torch.bfloat16 else "fp32",
        reshard_after_forward="always" if build.fsdp.reshard_after_forward else "never",
    )
    if build.float8 is not None:
        d["float8"]["enable_fsdp_float8_all_gather"] = build.float8.enable_fsdp_float8_all_gather
    if pipeline is not None:
        p = pipeline
        d["distributed"].update(pp_stages_per_rank=p.stages_per_rank, pp_microbatch_size=p.microbatch_size)
        d["pipeline"] = {f"stage_{i}": list(fqns) for i, fqns in enumerate(p.stage_fqns)}
        d["pipeline"]["stage_costs"] = [round(c, 4) for c in p.stage_costs]
    d["model_args"] = {k: v for k, v in dataclasses.asdict(args).items() if v is not None}
    d["model_args"]["ffn_dim"] = args.ffn_dim
    return d


def model_section_values(args: ModelArgs) -> dict[str, Any]:
    """[model] as the run used it: every shape key set to the value in effect (a config that gives them builds this
    model from any flavor of its family)."""
    values = section_values(args, ModelSection)
    if family_of(args).has_router:
        del values["ffn_dim"]  # the dense blocks' width is [moe] dense_ffn_dim
    return values


def model_keys(args: ModelArgs) -> list[str]:
    """The command-line keys that give a run these model arguments from any flavor of their family: [model]'s values
    in effect, and [moe]'s shapes and routing for an MoE model (resolved.toml's, as flags; the balancing is left to
    the run)."""
    values = {f"model.{k}": v for k, v in model_section_values(args).items()}
    if family_of(args).has_router:
        values |= {f"moe.{k}": v for k, v in section_values(args, MoESection).items()
                   if k not in ("aux_loss_coef", "bias_update_rate", "capacity_factor")}
    if isinstance(args, DeepseekV3Args):
        values |= {f"deepseek_v3.{k}": v for k, v in section_values(args, DeepseekV3Section).items()}
    if isinstance(args, GptOssArgs):
        values |= {f"gpt_oss.{k}": v for k, v in section_values(args, GptOssSection).items()}
    flavor = next(iter(family_of(args).flavors))
    return [f"--model.flavor={flavor}"] + [f"--{k}={_flag_value(v)}" for k, v in values.items()]


def _flag_value(value: Any) -> str:
    """A value as the command line reads it back: true/false, a list as 1,3 (trainer.config.load)."""
    if isinstance(value, bool):
        return str(value).lower()
    return ",".join(map(str, value)) if isinstance(value, list) else str(value)


def _roles_and_blocks(forward: str, backward: str, bf16_blocks: tuple[tuple[int, str], ...]) -> str:
    """What the precision line adds for float8.forward / backward and the bf16 blocks ('' for neither)."""
    text = "" if forward == backward else f", FP8 {'forward' if forward == 'fp8' else 'backward'} only"
    if bf16_blocks:
        text += f", blocks {', '.join(f'layers.{i}' for i, _ in bf16_blocks)} in bf16"
    return text


def describe_precision(*, mixed_precision: str, bf16_update: str | None, build: BuildOptions,
                       float8_layers: dict[str, str] | None) -> str:
    """The startup log's one line on precision: compute, FP8, master weights, gradient reduction.

    bf16_update: optimizer.bf16_update where the master weights are bf16 (else None)."""
    fsdp, f8 = build.fsdp, build.float8
    compute = str(fsdp.param_dtype or torch.float32).removeprefix("torch.")
    parts = [f"train.mixed_precision={mixed_precision!r}: {compute} compute"]
    if f8 is not None and f8.unavailable:  # what really runs: bf16 matmuls (apply_float8's banner says why)
        parts[0] += f", NO FP8: {f8.recipe} FP8 is unavailable on this device, every Linear layer runs in {compute}"
    elif f8 is not None:
        n = sum(1 for fate in (float8_layers or {}).values() if fate == "converted")
        parts[0] += (f", FP8 {f8.recipe} matmuls in {n} Linear layers ({'EMULATED, ' if f8.emulate else ''}"
                     f"{f8.format}: {'e5m2 gradients' if f8.format == 'hybrid' else 'e4m3 everywhere'}"
                     f"{', delayed scaling' if f8.delayed else ''}{', fp8 inputs saved' * f8.save_fp8_activations}"
                     f"{_roles_and_blocks(f8.forward, f8.backward, f8.bf16_blocks)})")
    if f8 is not None and f8.moe_experts != "off":
        parts[0] += (f"; routed experts in {compute} (FP8 grouped GEMMs unavailable on this device)"
                     if f8.experts_unavailable else f" and FP8 {f8.moe_experts} grouped GEMMs in the routed experts")
    master = "bf16 master weights" if fsdp.master_dtype == torch.bfloat16 else "fp32 master weights"
    if fsdp.master_dtype == torch.bfloat16:
        master += {"stochastic": " (stochastic rounding)", "kahan": " (Kahan-compensated updates)",
                   "nearest": " (round-to-nearest updates)"}[bf16_update]
    grads = str(fsdp.reduce_dtype).removeprefix('torch.')
    if fsdp.reduce_dtype.itemsize == 1:  # distributed.reduce_dtype='fp8' (trainer.parallel.fp8_reduce)
        grads = f"float8 ({grads.removeprefix('float8_').removesuffix('fn')}, one scale per unit from the amax over ranks)"
    parts += [master, f"gradients reduced in {grads}" if fsdp.reduces else f"gradients in {grads} (one rank, one "
              "microbatch: nothing to sum)"]
    return "precision: " + "; ".join(parts)


def describe_documents(*, document_eos: int | None, eod_mask_id: int | None) -> str | None:
    """The startup log's line on how packed documents are treated, when data.document_masking or data.eod_mask_loss
    is on (None when both are off: attention crosses documents and every token is trained on, the default)."""
    parts = []
    if document_eos is not None:
        parts.append(f"attention stays inside each document of a packed row and RoPE positions restart at each "
                     f"(data.document_masking; a document ends at EOS id {document_eos})")
    if eod_mask_id is not None:
        parts.append(f"the token after each EOS (id {eod_mask_id}) is not trained on, in training and validation "
                     "(data.eod_mask_loss)")
    return "documents: " + "; ".join(parts) if parts else None


def cpu_precision_hint(mixed_precision: str, device_type: str, *, fp8_unavailable: bool = False) -> str | None:
    """One line for a CPU run in a reduced precision, which is much slower there than fp32 (None otherwise).

    The default (bf16) suits GPUs; on CPU a user otherwise only sees a slow run with no reason given.
    Measured on the debug model (one thread per process, an AMD EPYC without AVX512-BF16 or AMX):
    fp32 2,015-2,036 tokens/s, bf16 239-272 (about 8x slower), fp8 335-433 (about 3.5x slower).
    """
    if device_type != "cpu" or mixed_precision == "fp32":
        return None
    if fp8_unavailable:  # what runs is bf16 (the precision line says so)
        return ("on CPU, bf16 (what train.mixed_precision='fp8' runs here, FP8 being unavailable) runs several times "
                "slower than 'fp32' (the debug model: about 8x, on a CPU without bf16 matmul instructions); "
                "--train.mixed_precision=fp32 is the fast path on CPU")
    return (f"on CPU, train.mixed_precision={mixed_precision!r} runs several times slower than 'fp32' "
            "(the debug model: bf16 about 8x, fp8 about 3.5x, on a CPU without bf16 matmul instructions); "
            "--train.mixed_precision=fp32 is the fast path on CPU")


def run_file_texts(cfg: JobConfig, *, run_cfg: JobConfig, args: ModelArgs, pd: ParallelDims, build: BuildOptions,
                   pipeline: PipelineOptions | None,
                   float8_layers: dict[str, str] | None) -> tuple[tuple[str, str], ...]:
    """(name, text) of config.toml (`run_cfg`, the run's config as given), resolved.toml (`cfg` resolved) and, for
    fp8 runs, fp8_layers.json: made by the validation pass, written by the trainer (`write_run_files`)."""
    header = ("Every value this run used (config.toml is the config as given, relaunchable as is).\n"
              "[model_args] is the model's whole shape; [pipeline] the stages (pp > 1).")
    files = [("config.toml", run_cfg.to_toml()),
             (RESOLVED, to_toml(resolved_config(cfg, args=args, pd=pd, build=build, pipeline=pipeline), header=header))]
    if float8_layers:
        f8 = build.float8
        fp8 = fp8_layers_json(f8, float8_layers) if f8 else {"layers": float8_layers}
        files.append((FP8_LAYERS, json.dumps(fp8, indent=1) + "\n"))
    return tuple(files)


def run_config(files: tuple[tuple[str, str], ...]) -> dict:
    """The resolved config (resolved.toml of `files`, run_file_texts' result) as a dict: what a tracker records."""
    text = dict(files).get("resolved.toml", "")
    return tomllib.loads(text) if text else {}


def write_run_files(folder: str | Path, files: tuple[tuple[str, str], ...]) -> list[str]:
    """The run files (`run_file_texts`) in `folder`; returns the names written."""
    for name, text in files:
        (Path(folder) / name).write_text(text)
    return [name for name, _ in files]
