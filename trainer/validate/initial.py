"""checkpoint.initial_load_path gives the model its shape: read from the checkpoint's checkpoint.json alone (no
weight, no code), in the validation pass, before anything is built.

A run started from a checkpoint's weights (`scripts/convert_checkpoint.py import`'s output, or another run's
checkpoint) takes the model's whole shape and vocabulary from it: every [model] and [moe] key the config leaves at
its default gets the checkpoint's value, and the startup log says so in one line. A shape key the config sets (in
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

from trainer.config import JobConfig
from trainer.config.sections import ModelSection, MoESection
from trainer.errors import ConfigError
from trainer.models import ModelArgs, family_of

# [model] keys that size a weight (ffn_dim_multiplier and multiple_of through the ffn_dim they give).
_MODEL_SHAPE = ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "vocab_size", "tie_word_embeddings",
                "qk_norm")
_FFN_RULE = ("ffn_dim_multiplier", "multiple_of")
# [moe] keys that size a weight; the others (routing, balancing) are the run's own when set.
_MOE_SHAPE = ("n_experts", "moe_ffn_dim", "n_shared_experts", "n_dense_layers", "dense_ffn_dim")
_MOE_RUN = ("top_k", "score_func", "route_norm", "aux_loss_coef", "bias_update_rate")


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
    from trainer.checkpoint.state import args_from_json
    from trainer.checkpoint.verify import read_checkpoint_json
    from trainer.errors import UserError

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
    model, moe, kept = _sections(cfg, saved, where=f"checkpoint.initial_load_path={text}")
    family = family_of(saved)
    flavor = info["model"].get("flavor")
    flavor = flavor if isinstance(flavor, str) and flavor else "imported"
    base = flavor if flavor in family.flavors else next(iter(family.flavors))  # the defaults, all replaced
    shaped = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, flavor=base, **model),
                                 moe=dataclasses.replace(cfg.moe, **moe))
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
    from trainer.checkpoint.verify import scan_checkpoints

    c = cfg.checkpoint
    return c.enable and bool(scan_checkpoints(Path(cfg.job.dump_folder) / c.folder)[0])


def _sections(cfg: JobConfig, saved: ModelArgs, *, where: str) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """([model] values, [moe] values, the config's keys that replace the checkpoint's) of the checkpoint's model; a
    ConfigError naming every shape key the config sets to another value."""
    from trainer.run_files import model_section_values

    model = model_section_values(saved)
    moe_model = family_of(saved).has_router
    moe: dict[str, Any] = {k: getattr(saved, k) for k in (*_MOE_SHAPE, *_MOE_RUN)} if moe_model else {}
    differ, kept = [], []
    given = {k: getattr(cfg.model, k) for k in ModelSection.__dataclass_fields__
             if k != "flavor" and getattr(cfg.model, k) != _default(ModelSection, k)}
    for key, value in given.items():
        if key in _MODEL_SHAPE:  # an MoE model's ffn_dim is its dense blocks' width (moe.dense_ffn_dim)
            have = saved.ffn_dim if key == "ffn_dim" else model[key]
            if value != have:
                differ.append(f"model.{key}={_show(value)} (the checkpoint's: {_show(have)})")
        elif key not in _FFN_RULE:  # what the model computes, not the shapes of its weights: the run's choice
            model[key] = value
            kept.append(f"model.{key}={_show(value)}")
    rule = {k: v for k, v in given.items() if k in _FFN_RULE}
    if rule and "ffn_dim" not in given:  # Llama's rule for ffn_dim from dim, with the config's values
        ffn_dim = dataclasses.replace(saved, explicit_ffn_dim=0, **rule).ffn_dim
        if ffn_dim != saved.ffn_dim:
            differ.append(f"{', '.join(f'model.{k}={_show(v)}' for k, v in rule.items())} (ffn_dim={ffn_dim}; the "
                          f"checkpoint's: {saved.ffn_dim})")
    if model["rope_scaling"] == "none" and "rope_scaling" in given:  # the config turns the checkpoint's off
        model.update({k: 0 for k in model if k.startswith("rope_scaling_") and k not in given})
    elif model["rope_scaling"] == "none" and any(k.startswith("rope_scaling_") for k in given):
        model["rope_scaling"] = ""  # a scaling key turns Llama 3 scaling on, as it does on a flavor without it
    for key in MoESection.__dataclass_fields__:
        given = getattr(cfg.moe, key)
        if given == _default(MoESection, key) or key == "capacity_factor":
            continue
        if not moe_model:
            if key in _MOE_SHAPE or key in _MOE_RUN:
                differ.append(f"moe.{key}={_show(given)} (the checkpoint's model is dense)")
        elif key in _MOE_SHAPE and given != moe[key]:
            differ.append(f"moe.{key}={_show(given)} (the checkpoint's: {_show(moe[key])})")
        elif key in _MOE_RUN:
            moe[key] = given
            kept.append(f"moe.{key}={_show(given)}")
    if differ:
        raise ConfigError(f"{', '.join(differ)}: {'this key differs' if len(differ) == 1 else 'these keys differ'} "
                          f"from the model of {where}, whose shape the run takes; remove "
                          f"{'it' if len(differ) == 1 else 'them'} from the config and the command line (the "
                          "checkpoint gives every shape key), or start from other weights")
    return model, moe, kept


def _default(section: type, key: str) -> Any:
    return section.__dataclass_fields__[key].default


def _show(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else repr(value) if isinstance(value, str) else str(value)
