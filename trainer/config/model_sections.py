"""[model], [moe], [deepseek_v3] and [gpt_oss], generated from the model's dataclasses (trainer.model_values:
`ModelArgs`, `MoEArgs`, `DeepseekV3Args`, `GptOssArgs`), so the model's shape is written once.

A key per field, of the field's type, None (left out) = the flavor's value; the field's docstring is the key's.
Two rules name the keys: an `explicit_X` field is the key `X` (0 there means "derived", as in the dataclass), and an
optional dataclass field (`rope_scaling`) is a choice key, "none" or its `kind`, with a key per field of its own
(`rope_scaling_factor`, ...). `overrides` turns a section into the fields it replaces on a flavor's args, and
`section_values` the args back into the section's keys (resolved.toml). Torch-free, like the rest of the config.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Literal

from trainer.config.docstrings import field_docs
from trainer.model_values import DeepseekV3Args, GptOssArgs, ModelArgs, MoEArgs

NONE = "none"
"""The choice key's value for no nested dataclass (rope_scaling = "none": plain RoPE)."""


def _nested(tp: Any) -> type | None:
    """The dataclass of an optional dataclass field's type (RopeScaling | None), else None."""
    inner = [a for a in typing.get_args(tp) if a is not type(None)]
    return inner[0] if len(inner) == 1 and dataclasses.is_dataclass(inner[0]) else None


def _keys(args_cls: type, fields: list[dataclasses.Field]) -> list[tuple[str, Any, dict[str, Any]]]:
    """(key, type, metadata) of the section's keys for these fields of `args_cls`. The metadata: the `field` a key
    sets, with `sub` the nested dataclass's field it sets, or `choice` that dataclass; the key's `doc`."""
    hints, docs = typing.get_type_hints(args_cls), field_docs(args_cls)
    keys = []
    for f in fields:
        nested = _nested(hints[f.name])
        if nested is None:
            tp = hints[f.name]
            if typing.get_origin(tp) is tuple:  # tuple[int, ...] (dense_layers) is a TOML list; the args make it a tuple
                tp = list[typing.get_args(tp)[0]]
            keys.append((f.name.removeprefix("explicit_"), tp, {"field": f.name, "doc": docs[f.name]}))
            continue
        keys.append((f.name, Literal[NONE, nested.kind], {"field": f.name, "choice": nested, "doc": docs[f.name]}))
        inner_hints, inner_docs = typing.get_type_hints(nested), field_docs(nested)
        keys += [(f"{f.name}_{g.name}", inner_hints[g.name], {"field": f.name, "sub": g.name, "doc": inner_docs[g.name]})
                 for g in dataclasses.fields(nested)]
    return keys


def shape_section(name: str, args_cls: type, fields: list[dataclasses.Field], *,
                  first: tuple[tuple[str, type, Any, str], ...] = (), doc: str = "") -> type:
    """A section dataclass with a key per field (`first`: the section's own keys before them, (key, type, default,
    docstring)), each `type | None = None`."""
    own = [(key, tp, dataclasses.field(default=default, metadata={"doc": text})) for key, tp, default, text in first]
    generated = [(key, tp | None, dataclasses.field(default=None, metadata=meta)) for key, tp, meta in
                 _keys(args_cls, fields)]
    cls = dataclasses.make_dataclass(name, own + generated, namespace={"__doc__": doc, "args_class": args_cls})
    cls.__module__ = __name__
    return cls


def key_fields(section: Any) -> dict[str, str]:
    """{args field: its key} of a section's keys that set a field of the args (not a nested dataclass's field)."""
    return {f.metadata["field"]: f.name for f in dataclasses.fields(section)
            if "field" in f.metadata and "sub" not in f.metadata}


def overrides(section: Any, base: ModelArgs) -> dict[str, Any]:
    """The fields of `base` (a flavor's args) that the section's set keys replace. A nested dataclass: "none" drops it;
    a key of its own sets that field of the base's (or of the dataclass's defaults, where the base has none)."""
    out: dict[str, Any] = {}
    nested: dict[str, tuple[type, dict[str, Any]]] = {}
    for f in dataclasses.fields(section):
        value, meta = getattr(section, f.name), f.metadata
        if "choice" in meta:
            nested.setdefault(meta["field"], (meta["choice"], {}))
        elif "sub" in meta and value is not None:
            nested[meta["field"]][1][meta["sub"]] = value
        elif "field" in meta and value is not None:
            out[meta["field"]] = value
    for name, (cls, values) in nested.items():
        choice, have = getattr(section, name), getattr(base, name)
        if choice == NONE:
            out[name] = None
        elif choice is not None or values:
            out[name] = dataclasses.replace(have or cls(), **values)
    return out


def section_values(args: ModelArgs, section_cls: type) -> dict[str, Any]:
    """The section's keys for these args, each the value in effect (an `explicit_X` field's key is `X`, the width
    derived or not); fields without a value (None) have no key."""
    values: dict[str, Any] = {}
    for f in dataclasses.fields(section_cls):
        meta = f.metadata
        if "field" not in meta:
            continue
        have = getattr(args, meta["field"])
        if "choice" in meta:
            value = NONE if have is None else have.kind
        elif "sub" in meta:
            value = None if have is None else getattr(have, meta["sub"])
        else:
            value = getattr(args, f.name)
            value = list(value) if isinstance(value, tuple) else value  # a TOML list (dense_layers)
        if value is not None:
            values[f.name] = value
    return values


_FLAVOR_DOC = ("Size preset, which also picks the family: debug, 1b, 3b, 8b, 70b, 405b; MoE debug_moe, moe_small, "
               "moe_16b, qwen3_moe_debug, qwen3_30b_a3b; DeepSeek-V3 debug_deepseek_v3, deepseek_v3_16b; GPT-OSS "
               "debug_gpt_oss, gpt_oss_20b.")

ModelSection = shape_section(
    "ModelSection", ModelArgs, list(dataclasses.fields(ModelArgs)), first=(("flavor", str, "debug", _FLAVOR_DOC),),
    doc="The model's shapes: a flavor is a preset, and every key set here replaces its value.")
_DISPATCH_DOC = ('What token rows cross the expert-parallel dispatch all-to-all as (ep > 1): "bf16", or "fp8": e4m3 '
                 "with one fp32 scale per 1x128 block (DeepSeek-V3's dispatch; needs train.mixed_precision='fp8' and "
                 "a dim that is a multiple of 128); FP8 rowwise experts (float8.moe_experts) requantize the received "
                 "e4m3 rows rowwise without a bf16 copy; the combine stays bf16 (docs/moe.md).")

_DISPATCH_SIZES_DOC = ('How the expert-parallel all-to-alls learn their sizes (ep > 1): "sized" reads each rank\'s row counts '
                       'on the host (one host sync per MoE layer), "padded" sends every rank a slot of all its rows, '
                       'its own rows first and zeros after, so the host never waits: ep times the rows on the wire and '
                       'in the routed experts\' activations (the dry run counts them); with moe.dispatch_dtype=\'bf16\' '
                       'and without token dropping. "auto": padded at ep=2 on GPUs (where it was measured faster) when '
                       'the memory plan with it stays within 95% of the device, sized otherwise; the startup line says '
                       'which and why (docs/moe.md).')

_OVERLAP_DOC = ("Compiled MoE blocks under ep > 1: each all-to-all starts before, and is waited for after, the "
                "compute that does not need its rows (forward: the shared experts, beside the combine; backward: "
                "their backward beside the combine's gradient, the routed experts' weight gradients beside the "
                "dispatch's), so the GEMMs run while the rows cross (an inductor pass, trainer.parallel.comm_overlap); "
                "false: each wait right after its all-to-all, as dynamo traces it (docs/moe.md).")

MoESection = shape_section(
    "MoESection", MoEArgs, [f for f in dataclasses.fields(MoEArgs) if f.name not in ModelArgs.__dataclass_fields__],
    first=(("dispatch_dtype", Literal["bf16", "fp8"], "bf16", _DISPATCH_DOC),
           ("dispatch", Literal["sized", "padded", "auto"], "auto", _DISPATCH_SIZES_DOC),
           ("overlap_all_to_all", bool, True, _OVERLAP_DOC)),
    doc="Experts, routing and load balancing of MoE flavors (docs/moe.md); every key set replaces the flavor's value.")

DeepseekV3Section = shape_section(
    "DeepseekV3Section", DeepseekV3Args,
    [f for f in dataclasses.fields(DeepseekV3Args) if f.name not in MoEArgs.__dataclass_fields__],
    doc="Multi-head latent attention, group-limited routing and multi-token prediction of DeepSeek-V3 flavors "
        "(docs/models.md); every key set replaces the flavor's value.")

GptOssSection = shape_section(
    "GptOssSection", GptOssArgs,
    [f for f in dataclasses.fields(GptOssArgs) if f.name not in MoEArgs.__dataclass_fields__],
    doc="Attention windows, the experts' clamped SwiGLU and YaRN RoPE of GPT-OSS flavors (docs/models.md#gpt-oss); "
        "every key set replaces the flavor's value.")
