"""Every value of a Hugging Face config.json that this trainer reads, checked by type and range before any is used.

A config.json may be hand-edited or foreign, and JSON has no types a Python `bool()` or `float()` could not
misread: `"tie_word_embeddings": "false"` is a non-empty string, true to `bool`. So each key a family's mapping
reads has a rule: the model arguments' own (`trainer.model_values.RULES`, by the field it becomes: `CONFIG_KEYS`)
or, for the keys that only select or refuse a layout, one of `CONFIG_RULES` here (the MoE mapping adds its
routing keys). A value that breaks its rule is one ExportError line naming the file and the key.

RoPE comes in two spellings: transformers 4 reads `rope_scaling` and a top-level `rope_theta`; transformers 5
reads `rope_parameters` (holding `rope_theta`; a `rope_scaling` given too takes its place). A folder that spells
both must say the same in both: otherwise the model depends on the transformers version, and the one line names
the two values.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from trainer.hf.folder import ExportError
from trainer.model_values import Rule, YarnScaling, rule_problem, values_problem

# Our ModelArgs field -> its config.json key: checked by the rules of every model argument (trainer.model_values).
CONFIG_KEYS = {"dim": "hidden_size", "n_layers": "num_hidden_layers", "n_heads": "num_attention_heads",
               "n_kv_heads": "num_key_value_heads", "vocab_size": "vocab_size", "ffn_dim": "intermediate_size",
               "norm_eps": "rms_norm_eps", "rope_theta": "rope_theta", "max_seq_len": "max_position_embeddings",
               "tie_word_embeddings": "tie_word_embeddings"}
# config.json keys read by every family that are no model argument: what selects the layout or refuses it. A flag
# left null is off, as transformers reads it.
_FLAG = Rule("bool", optional=True)
CONFIG_RULES: dict[str, Rule] = {
    "model_type": Rule("str", high=100),
    "hidden_act": Rule("str", high=100),
    "attention_bias": _FLAG,
    "mlp_bias": _FLAG,
    "use_sliding_window": _FLAG,
    "layer_types": Rule("list", high=100_000, optional=True),
    "rope_scaling": Rule("dict", optional=True),
    "rope_parameters": Rule("dict", optional=True),
}
# Keys whose null transformers replaces with another value (num_key_value_heads: num_attention_heads).
NULL_IS_DEFAULT = ("num_key_value_heads",)
# The RoPE dicts' keys that are numbers; "rope_type" (or the old "type") names the kind.
_ROPE_KINDS = ("rope_type", "type")


def rope_fields(config: Mapping[str, Any], *, where: str = "config.json") -> tuple[dict, Any]:
    """(the RoPE dict or {}, rope_theta or None) of a config.json, in transformers 4's keys (rope_scaling, a
    top-level rope_theta) or 5's (rope_parameters with rope_theta); ExportError where a RoPE dict is no object or
    the two spellings disagree."""
    given: dict[str, dict] = {}
    for key in ("rope_scaling", "rope_parameters"):
        value = config.get(key)
        if value is None:
            continue
        if problem := rule_problem(CONFIG_RULES[key], value, key=key):
            raise ExportError(f"{where}: {problem}")
        if nested := next((k for k, v in value.items() if isinstance(v, Mapping)), None):
            raise ExportError(f"{where}: {key}.{nested} is an object: RoPE parameters per layer type have no "
                              "equivalent in this trainer (one RoPE for every layer)")
        given[key] = value
    if len(given) == 2:
        a, b = given["rope_scaling"], given["rope_parameters"]
        for k in sorted(a.keys() & b.keys()):
            if a[k] != b[k]:
                raise ExportError(f"{where}: rope_scaling.{k}={a[k]!r} but rope_parameters.{k}={b[k]!r} "
                                  "(transformers 4 reads the first, 5 the second): make them agree, or remove one")
    rope = {**given.get("rope_parameters", {}), **given.get("rope_scaling", {})}
    theta, inner = config.get("rope_theta"), rope.get("rope_theta")
    if theta is not None and inner is not None and theta != inner:
        source = "rope_parameters" if "rope_theta" in given.get("rope_parameters", {}) else "rope_scaling"
        raise ExportError(f"{where}: rope_theta={theta!r} but {source}.rope_theta={inner!r} (transformers 4 reads "
                          "the first, 5 the second): make them agree, or remove one")
    return rope, inner if inner is not None else theta


def rope_kind(rope: Mapping[str, Any]) -> Any:
    """The RoPE dict's type ("default" when it names none), in the 5.x key or the 4.x one."""
    return next((rope[k] for k in _ROPE_KINDS if k in rope), "default")


def yarn_of(config: Mapping[str, Any], rope: Mapping[str, Any], *, where: str) -> YarnScaling:
    """The YarnScaling of a config.json whose RoPE dict (`rope_fields`) is "yarn", read as transformers'
    `standardize_rope_params` and `_compute_yarn_parameters` read it (GPT-OSS and DeepSeek-V3 alike): beta_fast and
    beta_slow null or 0 are 32 and 1, a missing truncate is true, a missing mscale or mscale_all_dim unset (0), the
    original context a top-level original_max_position_embeddings, else the dict's, else max_position_embeddings.
    A given attention_factor (ours is derived from factor and the mscales) is refused in one line."""
    if rope.get("attention_factor") is not None:
        raise ExportError(f"{where}: rope attention_factor={rope['attention_factor']!r} has no equivalent in this "
                          "trainer's YaRN (it derives it from factor, mscale and mscale_all_dim, as transformers does "
                          "when it is left out)")
    original = next((v for v in (config.get("original_max_position_embeddings"),
                                 rope.get("original_max_position_embeddings"), config.get("max_position_embeddings"))
                     if v is not None), None)
    values = {"factor": rope.get("factor"), "beta_fast": rope.get("beta_fast") or 32.0,
              "beta_slow": rope.get("beta_slow") or 1.0, "original_max_seq_len": original,
              "truncate": rope.get("truncate", True), "mscale": rope.get("mscale") or 0.0,
              "mscale_all_dim": rope.get("mscale_all_dim") or 0.0}
    if problem := values_problem({"rope_yarn": values}, keys={"rope_yarn": "rope_scaling"}):
        raise ExportError(f"{where}: {problem} (not a model this trainer can load)")
    return YarnScaling(factor=float(values["factor"]), beta_fast=float(values["beta_fast"]),
                       beta_slow=float(values["beta_slow"]), original_max_seq_len=int(values["original_max_seq_len"]),
                       truncate=bool(values["truncate"]), mscale=float(values["mscale"]),
                       mscale_all_dim=float(values["mscale_all_dim"]))


def yarn_config(yarn: YarnScaling) -> dict[str, Any]:
    """config.json's rope_scaling of a YarnScaling (the mscales only where set, as DeepSeek's configs give them)."""
    return {"rope_type": "yarn", "factor": yarn.factor, "beta_fast": yarn.beta_fast, "beta_slow": yarn.beta_slow,
            "original_max_position_embeddings": yarn.original_max_seq_len, "truncate": yarn.truncate,
            **({"mscale": yarn.mscale} if yarn.mscale else {}),
            **({"mscale_all_dim": yarn.mscale_all_dim} if yarn.mscale_all_dim else {})}


def check_config_values(config: Mapping[str, Any], keys: Mapping[str, str], *, where: str,
                        rules: Mapping[str, Rule] = CONFIG_RULES) -> None:
    """Every value of config.json that this trainer reads, by type and range, before any is converted: the model
    arguments' (`keys`: our field -> its config.json key) by trainer.model_values' rules, the rest by `rules`."""
    for key, rule in rules.items():
        if key in config and (problem := rule_problem(rule, config[key], key=key)):
            raise ExportError(f"{where}: {problem} (not a model this trainer can load)")
    values = {field: config[key] for field, key in keys.items()
              if key in config and not (config[key] is None and key in NULL_IS_DEFAULT)}
    rope, theta = rope_fields(config, where=where)
    if theta is not None:
        values["rope_theta"] = theta
    kind = rope_kind(rope)
    if not isinstance(kind, str):
        raise ExportError(f"{where}: rope_type={kind!r} must be a string (not a model this trainer can load)")
    if kind == "llama3":
        values["rope_scaling"] = {k: rope.get(k) for k in ("factor", "low_freq_factor", "high_freq_factor")}
        values["rope_scaling"]["original_max_seq_len"] = rope.get("original_max_position_embeddings")
    if problem := values_problem(values, keys={**keys, "rope_scaling": "rope_scaling"}):
        raise ExportError(f"{where}: {problem} (not a model this trainer can load)")
