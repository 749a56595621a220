"""Loading a JobConfig: defaults < TOML (--config) < --section.key=value overrides.

Every way a value can be wrong here (unknown section or key, wrong type, a value outside its
`Literal`, a non-finite number, unreadable TOML) is one `ConfigError` line naming the key,
with the nearest valid name suggested for a typo.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import sys
import typing
from pathlib import Path
from types import UnionType
from typing import Any, Literal

from trainer.config.job import JobConfig
from trainer.config.sections import _SECTIONS, field_types, toml_value
from trainer.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on Python 3.10
    import tomli as tomllib


def suggest(name: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(name, choices, n=1)
    return f" (did you mean {close[0]}?)" if close else f" (valid: {', '.join(choices)})"


def _coerce(key: str, value: Any, tp: Any, *, from_cli: bool) -> Any:
    """Check (TOML) or parse (command line) one value against its annotation."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, UnionType):  # `X | None`: None is only the default (a key left out)
        (tp,) = [a for a in typing.get_args(tp) if a is not type(None)]
        origin = typing.get_origin(tp)
    if origin is Literal:
        allowed = typing.get_args(tp)
        takes_bool = any(isinstance(a, bool) for a in allowed)
        if from_cli and isinstance(value, str) and takes_bool and value.lower() in ("true", "false"):
            value = value.lower() == "true"
        # Compare types too: 1 == True, but an integer is not a boolean setting.
        if not any(type(value) is type(a) and value == a for a in allowed):
            listed = ", ".join(toml_value(a) if isinstance(a, bool) else repr(a) for a in allowed)
            raise ConfigError(f"{key}={toml_value(value) if isinstance(value, bool) else repr(value)} "
                              f"is not one of {listed}")
        return value
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if from_cli and isinstance(value, str):
            value = [v for v in (s.strip() for s in value.split(",")) if v]
        if not isinstance(value, list):
            raise ConfigError(f"{key}={value!r} must be a list of {item_tp.__name__}")
        return [_coerce(f"{key}[{i}]", v, item_tp, from_cli=from_cli) for i, v in enumerate(value)]
    if dataclasses.is_dataclass(tp):  # a table of an array of tables ([[data.mix]])
        if from_cli and isinstance(value, str):
            value = dataclasses.asdict(tp.from_cli(value))
        if not isinstance(value, dict):
            raise ConfigError(f"{key}={value!r} must be a table ({', '.join(f.name for f in dataclasses.fields(tp))})")
        types = field_types(tp)
        for name in value:
            if name not in types:
                raise ConfigError(f"unknown key {key}.{name}{suggest(name, list(types))}")
        return tp(**{name: _coerce(f"{key}.{name}", v, types[name], from_cli=False) for name, v in value.items()})
    if tp is bool:
        if from_cli and isinstance(value, str):
            lowered = value.lower()
            if lowered in ("true", "1", "yes"):
                return True
            if lowered in ("false", "0", "no"):
                return False
        if not isinstance(value, bool):
            raise ConfigError(f"{key}={value!r} must be true or false")
        return value
    if tp is int:
        if from_cli and isinstance(value, str):
            try:
                value = int(value.replace("_", ""))
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}={value!r} must be an integer")
        return value
    if tp is float:
        if from_cli and isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}={value!r} must be a number")
        if not math.isfinite(value):
            # nan would silently disable comparisons (max_norm=nan turns clipping off).
            raise ConfigError(f"{key}={value!r} must be a finite number")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}={value!r} must be a string")
        return value
    raise AssertionError(f"unsupported config type {tp} for {key}")


def _apply(raw: dict[str, dict[str, Any]], section: str, key: str, value: Any, *, from_cli: bool) -> None:
    if section not in _SECTIONS:
        raise ConfigError(f"unknown section [{section}]{suggest(section, list(_SECTIONS))}")
    types = field_types(_SECTIONS[section])
    if key not in types:
        raise ConfigError(f"unknown key [{section}].{key}{suggest(key, list(types))}")
    raw.setdefault(section, {})[key] = _coerce(f"{section}.{key}", value, types[key], from_cli=from_cli)


def parse_overrides(args: list[str]) -> tuple[str | None, list[tuple[str, str]]]:
    """Split argv into --config PATH and (section.key, value) overrides."""
    config_path: str | None = None
    overrides: list[tuple[str, str]] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}; use --config PATH and --section.key=value")
        name, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(args) or args[i + 1].startswith("--"):
                raise ConfigError(f"--{name} needs a value (--{name}=VALUE or --{name} VALUE)")
            value = args[i + 1]
            i += 1
        i += 1
        if name in ("config", "job.config_file"):
            if not value.strip():  # not the built-in defaults without the warning that no --config was given
                raise ConfigError(f"--{name} is empty: give a TOML file (--{name}=configs/train/debug_model.toml), "
                                  f"or leave --{name} out for the built-in defaults")
            config_path = value
            continue
        if "." not in name:
            raise ConfigError(f"--{name}: expected --section.key (e.g. --train.steps=10)")
        overrides.append((name, value))
    return config_path, overrides


def read_toml(config_path: str) -> dict[str, Any]:
    """The parsed TOML file; every way reading it can fail is one ConfigError line."""
    path = Path(config_path)
    if not path.exists():
        raise ConfigError(f"config file {config_path} does not exist")
    if not path.is_file():
        raise ConfigError(f"config file {config_path} is not a regular file (a directory, a FIFO, a device?); pass a "
                          ".toml file with --config")
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise ConfigError(f"config file {config_path} is {path.stat().st_size / 2**20:,.0f} MiB, more than the "
                          f"{MAX_CONFIG_BYTES / 2**20:,.0f} MiB a config may be; pass a .toml file with --config")
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as e:
        raise ConfigError(f"config file {config_path} cannot be read: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"config file {config_path} is not UTF-8 text (byte {e.start}); TOML files must be UTF-8"
        ) from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{config_path} is not valid TOML: {e}") from None
    except RecursionError:
        raise ConfigError(f"{config_path} nests its values too deeply to be a config") from None


def _imply_shards(layer: dict[str, Any]) -> None:
    """A layer (the TOML file, or the command line) that points data at shards means shards.

    Setting data.path or a tokenizer.json without data.source in the same layer selects
    data.source='shards': `--data.path=dir --data.tokenizer=tok.json` is enough on the
    command line even when the TOML file says source='default'.
    """
    if "source" not in layer and (layer.get("path") or layer.get("mix") or layer.get("tokenizer", "byte") != "byte"):
        layer["source"] = "shards"


# A config is kilobytes; reading a far larger file whole is not worth its memory.
MAX_CONFIG_BYTES = 16 * 2**20


def load_job_config(args: list[str] | None = None, *, toml_path: str | None = None) -> JobConfig:
    """Build a JobConfig from defaults < TOML (--config) < --section.key overrides."""
    try:
        return _load_job_config(args, toml_path=toml_path)
    except RecursionError:  # a value nested thousands deep, in the file or on the command line
        raise ConfigError("a config value nests too deeply (thousands of levels of arrays or tables); no key takes "
                          "one") from None


def _load_job_config(args: list[str] | None, *, toml_path: str | None) -> JobConfig:
    config_path, overrides = parse_overrides(list(args or []))
    config_path = config_path or toml_path
    raw: dict[str, dict[str, Any]] = {}
    if config_path is not None:
        toml_layer: dict[str, dict[str, Any]] = {}
        for section, values in read_toml(config_path).items():
            if not isinstance(values, dict):
                raise ConfigError(f"{config_path}: top-level key {section!r} must be a [section]")
            for key, value in values.items():
                _apply(toml_layer, section, key, value, from_cli=False)
        if "data" in toml_layer:
            _imply_shards(toml_layer["data"])
        raw = toml_layer
    cli_layer: dict[str, dict[str, Any]] = {}
    for name, value in overrides:
        section, _, key = name.partition(".")
        _apply(cli_layer, section, key, value, from_cli=True)
    if "data" in cli_layer:
        _imply_shards(cli_layer["data"])
    for section, values in cli_layer.items():
        raw.setdefault(section, {}).update(values)
    sections = {name: cls(**raw.get(name, {})) for name, cls in _SECTIONS.items()}
    return JobConfig(**sections)
