"""Every rank trains the same job: the one check of the validation pass that needs the process group.

Each rank resolved its job alone (`validate_job`, before the group existed) from its own command line, config file,
checkout and data. A rank whose job differs trains apart without a word (its own learning rate, sequence length or
dump folder) or leaves its peers waiting in a collective (its own number of steps). So, after the group exists and
before any model work, every rank's job is reduced to a digest of

    the values resolved.toml holds             every section's keys as resolved, the model's whole shape, the stages
    trainer.version                            the installed package's version
    trainer.source.<file>                      a digest of each of the trainer package's source files: what runs, an
                                               uncommitted edit included (~120 files, ~1 MB: a few ms)
    data_contents.train, .validation           what the data sources hold (`fingerprint`: a shard's header, a
                                               checksum of every byte and 65 windows over its whole length), not
                                               only where they are

and the digests are gathered to every rank: one small collective. Where they differ, the values themselves are
gathered and every rank stops with the same line, naming the first differing key in resolved.toml's order and the
ranks involved (exit 2, never a hang). No value may differ per rank: every rank's job is the whole job.

Before that, `agree_to_start` joins the group whatever the validation found and gathers each rank's user error (or
none): a rank whose own GPU, files or config refused the job stops every rank, and its line reaches the user from
that rank (trainer.errors: `speaker`), where before it stopped alone, unprinted, and left the others waiting.
"""

from __future__ import annotations

import functools
import hashlib
import json
import socket
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from trainer.distributed import init_distributed, world_size_from_env
from trainer.errors import ConfigError, UserError
from trainer.validate.run_files import RESOLVED

if TYPE_CHECKING:
    from trainer.validate import ResolvedJob

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    import tomli as tomllib

SOURCE = "trainer.source."
"""The prefix of each source file's key: trainer.source.run/train.py."""
TASKS = "data_contents.tasks."
"""The prefix of each [[validation.tasks]] file's key: data_contents.tasks.NAME."""

# What a difference in these keys means, where the key alone does not say it.
_WHY = {
    "trainer.version": "every rank must run the same trainer: install the same version on every node",
    SOURCE: "every rank must run the same code: this file differs between the ranks' checkouts (an uncommitted "
            "edit, another commit); check out the same tree on every node",
    "data_contents.train": "the data differs between the ranks' machines: every node must read the same files",
    "data_contents.validation": "the validation data differs between the ranks' machines: every node must read "
                                "the same files",
    TASKS: "a [[validation.tasks]] file differs between the ranks' machines: every node must read "
                            "the same files",
}


def job_values(job: ResolvedJob) -> dict[str, Any]:
    """{"section.key": value} of everything every rank must agree on, in resolved.toml's order."""
    resolved = tomllib.loads(dict(job.run_files)[RESOLVED])
    values = {f"{section}.{key}": value for section, table in resolved.items() for key, value in table.items()}
    version, source = code_version()
    values["trainer.version"] = version
    values.update((f"{SOURCE}{name}", digest) for name, digest in source.items())
    values["data_contents.train"] = job.data_source.fingerprint()
    if job.validation_source is not None:
        values["data_contents.validation"] = job.validation_source.fingerprint()
    values.update((f"{TASKS}{task.name}", task.fingerprint()) for task in job.tasks)
    return values


@functools.cache
def code_version() -> tuple[str, dict[str, str]]:
    """(the installed package's version, {file: digest} of every source file of the trainer package this process
    runs, by its path inside the package). Hashes the files themselves, not a git commit: an uncommitted edit, a
    checkout without git and an installed copy count as what they hold."""
    try:
        version = metadata.version("trainer")
    except metadata.PackageNotFoundError:  # run from a checkout on PYTHONPATH
        version = "not installed"
    package = Path(__file__).resolve().parents[1]
    return version, {path.relative_to(package).as_posix(): hashlib.sha256(path.read_bytes()).hexdigest()[:16]
                     for path in sorted(package.rglob("*.py"))}


def _digest(values: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(values, sort_keys=True, default=str).encode()).hexdigest()


def agree_to_start(error: UserError | None, *, timeout_seconds: int) -> None:
    """Every rank starts, or none. `error`: the user error this rank's validation found, or None. With more than one
    rank: join the process group (init_distributed) and gather what each found; where any found an error, every rank
    stops. A rank with an error raises it, printed (`UserError.speaker`) by the lowest rank of its host that holds
    the same line, with its rank unless every rank holds it; a rank without one raises a line naming the first rank
    that has one, printed by the first rank of a host where no rank has an error of its own."""
    if world_size_from_env() == 1:
        if error is not None:
            raise error
        return
    init_distributed(timeout_seconds=timeout_seconds)
    mine = (socket.gethostname(), None if error is None else str(error))
    found: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(found, mine)
    failed = [r for r, (_, line) in enumerate(found) if line is not None]
    if not failed:
        return
    rank = dist.get_rank()
    host = [r for r, (name, _) in enumerate(found) if name == mine[0]]
    if error is not None:
        error.every_rank = len({line for _, line in found}) == 1
        error.speaker = min(r for r in host if found[r][1] == mine[1]) == rank
        raise error
    first = failed[0]
    stop = UserError(f"rank {first} (on {found[first][0]}) refused the job, so no rank starts: {found[first][1]}")
    stop.speaker = rank == host[0] and not any(found[r][1] for r in host)
    raise stop


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
        why = _WHY.get(next((p for p in (SOURCE, TASKS) if key.startswith(p)), key), "every rank must run the same job")
        return (f"rank {ranks[0]}'s {key} = {_show(got)} differs from rank 0's {_show(want)} ({why}{also})")
    raise AssertionError("the digests differ but no value does")  # json.dumps of equal dicts is equal


def _show(value: Any) -> str:
    if value is _MISSING:
        return "(unset)"
    text = json.dumps(value, default=str)
    return text if len(text) <= 80 else text[:77] + "..."
