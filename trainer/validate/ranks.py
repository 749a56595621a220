"""Every rank trains the same job: the one check of the validation pass that needs the process group.

Each rank resolved its job alone (`validate_job`, before the group existed) from its own command line, config file,
checkout and data. A rank whose job differs trains apart without a word (its own learning rate, sequence length or
dump folder) or leaves its peers waiting in a collective (its own number of steps). So, after the group exists and
before any model work, every rank's job is reduced to a digest of

    the values resolved.toml holds             every section's keys as resolved, the model's whole shape, the stages
    trainer.version, trainer.commit            the package version and the git commit of its checkout (if any)
    data_contents.train, .validation           what the data sources hold (`fingerprint`), not only where they are

and the digests are gathered to every rank: one small collective. Where they differ, the values themselves are
gathered and every rank stops with the same line, naming the first differing key in resolved.toml's order and the
ranks involved (exit 2, never a hang). No value may differ per rank: every rank's job is the whole job.
"""

from __future__ import annotations

import functools
import hashlib
import json
import subprocess
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from trainer.errors import ConfigError
from trainer.validate.run_files import RESOLVED

if TYPE_CHECKING:
    from trainer.validate import ResolvedJob

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    import tomli as tomllib

# What a difference in these keys means, where the key alone does not say it.
_WHY = {
    "trainer.version": "every rank must run the same trainer: install the same version on every node",
    "trainer.commit": "every rank must run the same checkout: check out the same commit on every node",
    "data_contents.train": "the data differs between the ranks' machines: every node must read the same files",
    "data_contents.validation": "the validation data differs between the ranks' machines: every node must read "
                                "the same files",
}


def job_values(job: ResolvedJob) -> dict[str, Any]:
    """{"section.key": value} of everything every rank must agree on, in resolved.toml's order."""
    resolved = tomllib.loads(dict(job.run_files)[RESOLVED])
    values = {f"{section}.{key}": value for section, table in resolved.items() for key, value in table.items()}
    values["trainer.version"], values["trainer.commit"] = code_version()
    values["data_contents.train"] = job.data_source.fingerprint()
    if job.validation_source is not None:
        values["data_contents.validation"] = job.validation_source.fingerprint()
    return values


@functools.cache
def code_version() -> tuple[str, str]:
    """(the installed package's version, the git commit of the checkout the trainer runs from, or "none")."""
    try:
        version = metadata.version("trainer")
    except metadata.PackageNotFoundError:  # run from a checkout on PYTHONPATH
        version = "not installed"
    try:
        proc = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parents[2],
                              capture_output=True, text=True, timeout=10)
        commit = proc.stdout.strip() if proc.returncode == 0 else "none"
    except (OSError, subprocess.TimeoutExpired):  # no git on this machine
        commit = "none"
    return version, commit


def _digest(values: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(values, sort_keys=True, default=str).encode()).hexdigest()


def check_ranks_agree(job: ResolvedJob) -> None:
    """Raise the same ConfigError on every rank when any rank's job differs from rank 0's. Call it on every rank
    of the default process group, right after it is created."""
    if dist.get_world_size() == 1:
        return
    values = job_values(job)
    digests: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(digests, _digest(values))
    if len(set(digests)) == 1:
        return
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, values)  # only on a mismatch: every rank then names the same difference
    raise ConfigError(first_difference(every))


_MISSING = object()


def first_difference(values: list[dict[str, Any]]) -> str:
    """The line naming the first key (rank 0's order, then keys rank 0 lacks) on which some rank differs from
    rank 0, with the ranks that differ; `values` holds every rank's `job_values`, in rank order."""
    ref = values[0]
    keys = list(ref) + [k for v in values[1:] for k in v if k not in ref]
    for key in dict.fromkeys(keys):
        want = ref.get(key, _MISSING)
        ranks = [r for r, v in enumerate(values) if r and v.get(key, _MISSING) != want]
        if not ranks:
            continue
        got = values[ranks[0]].get(key, _MISSING)
        also = f"; so do ranks {', '.join(map(str, ranks[1:]))}" if ranks[1:] else ""
        why = _WHY.get(key, "every rank must run the same job")
        return (f"rank {ranks[0]}'s {key} = {_show(got)} differs from rank 0's {_show(want)} ({why}{also})")
    raise AssertionError("the digests differ but no value does")  # json.dumps of equal dicts is equal


def _show(value: Any) -> str:
    if value is _MISSING:
        return "(unset)"
    text = json.dumps(value, default=str)
    return text if len(text) <= 80 else text[:77] + "..."
