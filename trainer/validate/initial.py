"""checkpoint.initial_load_path gives the model its shape: read from the checkpoint's checkpoint.json alone (no
weight, no code), in the validation pass, before anything is built.

A run started from a checkpoint's weights (`scripts/convert_checkpoint.py import`'s output, or another run's
checkpoint) takes the model's whole shape and vocabulary from it: every [model] and [moe] key the config leaves
out gets the checkpoint's value, and the startup log says so in one line. A shape key the config sets (in
the TOML or on the command line) that differs from the checkpoint's is an error, one line naming every such key.
model.flavor only names the defaults the checkpoint replaces. Keys that change what the model computes but not the
shapes of its weights (norm_eps, rope_theta, the RoPE scaling, max_seq_len; the MoE routing and balancing) stay the
config's where it sets them: a long-context stage sets them on purpose (the load warns that they differ).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.checkpoint.state import args_from_json
from trainer.checkpoint.verify import read_checkpoint_json, scan_checkpoints
from trainer.config import JobConfig
from trainer.config.model_sections import NONE, section_values
from trainer.errors import ConfigError, UserError
from trainer.models import ModelArgs, family_of
from trainer.validate.run_files import model_section_values

# Why a shape section's keys do not apply to a checkpoint's model that is not of its `args_class`.
_NOT_ITS = {"moe": "dense", "deepseek_v3": "not DeepSeek-V3", "gpt_oss": "not GPT-OSS"}

# [model] keys that size a weight through the ffn_dim Llama's rule derives from them.
_FFN_RULE = ("ffn_dim_multiplier", "multiple_of")


@dataclass(frozen=True)
class CheckpointShape:
    """The config with the checkpoint's shape in [model] and [moe], the flavor name the checkpoint records, and the
    startup line that says where the shape came from."""

    cfg: JobConfig
    flavor: str
    line: str


def checkpoint_shape(cfg: JobConfig, *, planning: bool) -> CheckpointShape | None:
    """The shape of checkpoint.initial_load_path's model, as a config (None without one, or where the run resumes a
    checkpoint of its own instead). planning: a dry run, where a checkpoint not on this machine is named, not
    refused. Every shape key the config sets that differs from the checkpoint's is one ConfigError."""
    text = cfg.checkpoint.initial_load_path
    if not text:
        return None
    path = Path(text)
    if not path.exists() and (planning or _resumes(cfg)):
        # A dry run on a laptop, or a relaunch that resumes its own checkpoint (which then holds the shape).
        return None if not planning else CheckpointShape(cfg, cfg.model.flavor, (
            f"model shape: the config's; checkpoint.initial_load_path={text} is not on this machine (the run takes "
            "the shape from it)"))
    try:  # checkpoint.json only: its size, its place, every model value checked (trainer.checkpoint.verify)
        info = read_checkpoint_json(path, allow_unverified=cfg.checkpoint.allow_unverified)
        saved = args_from_json(info["model"], where=str(path / "checkpoint.json"))
    except UserError as e:
        raise ConfigError(str(e)) from None
    values, kept = _sections(cfg, saved, where=f"checkpoint.initial_load_path={text}")
    family = family_of(saved)
    flavor = info["model"].get("flavor")
    flavor = flavor if isinstance(flavor, str) and flavor else "imported"
    base = flavor if flavor in family.flavors else next(iter(family.flavors))  # the defaults, all replaced
    sections = {name: dataclasses.replace(section, **values[name]) for name, section in cfg.shape_sections()}
    shaped = dataclasses.replace(cfg, **sections | {"model": dataclasses.replace(sections["model"], flavor=base)})
    source = info.get("source")
    origin = f"imported from {source}" if isinstance(source, str) and source else f"flavor {flavor!r}"
    line = (f"model shape: checkpoint.initial_load_path={text}'s, with its vocabulary ({origin}; resolved.toml has "
            "every value)"
            + (f"; model.flavor={cfg.model.flavor!r} is not used" if cfg.model.flavor not in (flavor, base) else "")
            + (f"; the config's {', '.join(kept)} {'replaces' if len(kept) == 1 else 'replace'} the checkpoint's"
               if kept else ""))
    return CheckpointShape(shaped, flavor, line)


def _resumes(cfg: JobConfig) -> bool:
    """Whether the run's own checkpoint folder holds a complete checkpoint, which it resumes instead."""
    c = cfg.checkpoint
    return c.enable and bool(scan_checkpoints(Path(cfg.job.dump_folder) / c.folder)[0])


def _sections(cfg: JobConfig, saved: ModelArgs, *, where: str) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """(the values of each shape section, [model], [moe], [deepseek_v3], [gpt_oss], for the checkpoint's model (a
    section of another family's empty), the config's keys that replace the checkpoint's); a ConfigError naming every
    key the config sets that sizes a weight (the model's `weight_fields`) to another value, or that a section of
    another family sets."""
    sections = {name: model_section_values(saved) if name == "model" else
                section_values(saved, type(section)) if isinstance(saved, section.args_class) else {}
                for name, section in cfg.shape_sections()}
    model = sections["model"]
    differ, kept = [], []
    given: dict[str, Any] = {}
    for name, section in cfg.shape_sections():
        values = sections[name]
        for f in dataclasses.fields(section):
            value = getattr(section, f.name)
            if value is None or "field" not in f.metadata:  # left out, or model.flavor
                continue
            if name == "model":
                given[f.name] = value
            if not isinstance(saved, section.args_class):  # [moe] on a dense model, a family's own on another's
                differ.append(f"{name}.{f.name}={_show(value)} (the checkpoint's model is {_NOT_ITS[name]})")
            elif f.metadata["field"] in saved.weight_fields:  # the value in effect (head_dim: derived or not)
                if value != getattr(saved, f.name):
                    differ.append(f"{name}.{f.name}={_show(value)} (the checkpoint's: {_show(getattr(saved, f.name))})")
            elif f.name not in _FFN_RULE:  # what the model computes, not the shapes of its weights: the run's choice
                values[f.name] = value
                kept.append(f"{name}.{f.name}={_show(value)}")
    rule = {k: v for k, v in given.items() if k in _FFN_RULE}
    if rule and "ffn_dim" not in given:  # Llama's rule for ffn_dim from dim, with the config's values
        ffn_dim = dataclasses.replace(saved, explicit_ffn_dim=0, **rule).ffn_dim
        if ffn_dim != saved.ffn_dim:
            differ.append(f"{', '.join(f'model.{k}={_show(v)}' for k, v in rule.items())} (ffn_dim={ffn_dim}; the "
                          f"checkpoint's: {saved.ffn_dim})")
    if model["rope_scaling"] == NONE and "rope_scaling" in given:  # the config turns the checkpoint's off
        model.update({k: None for k in model if k.startswith("rope_scaling_") and k not in given})
    elif model["rope_scaling"] == NONE and any(k.startswith("rope_scaling_") for k in given):
        model["rope_scaling"] = None  # a scaling key turns Llama 3 scaling on, as it does on a flavor without it
    if differ:
        raise ConfigError(f"{', '.join(differ)}: {'this key differs' if len(differ) == 1 else 'these keys differ'} "
                          f"from the model of {where}, whose shape the run takes; remove "
                          f"{'it' if len(differ) == 1 else 'them'} from the config and the command line (the "
                          "checkpoint gives every shape key), or start from other weights")
    return sections, kept


def _show(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else repr(value) if isinstance(value, str) else str(value)
