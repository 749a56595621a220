"""Weights & Biases beside TensorBoard (metrics.wandb; the optional extra `pip install 'trainer[wandb]'`).

Rank 0 logs what TensorBoard gets, under the same names and steps, to one W&B run: project, entity, name,
group and tags from [metrics], the run's resolved config as the W&B config. The run id is kept in the dump
folder (wandb_run.json), so a resumed run, or the next phase of a precision schedule, continues the same W&B run
(steps W&B already holds past the checkpoint it resumed from are dropped by W&B, which takes steps in order).
WANDB_MODE=offline writes the run under {dump_folder}/wandb without a network (`wandb sync` uploads it later).

The tracker never stops training: a failed start (no login, no network) or a failed log is one warning line,
and the run goes on without W&B. That the package is installed is checked with the config (trainer.config.checks).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.files.confine import special_file_problem
from trainer.files.json_object import read_json_object

logger = logging.getLogger(__name__)

RUN_FILE = "wandb_run.json"
MAX_RUN_FILE_BYTES = 2**16  # {"id": "..."} is a few bytes


@dataclass(frozen=True)
class WandbOptions:
    project: str
    entity: str
    run_name: str
    """"" = the dump folder's name."""
    group: str
    tags: tuple[str, ...]


class WandbRun:
    """One W&B run of this job (rank 0 only); `log` and `finish` never raise."""

    def __init__(self, run: Any):
        self._run = run

    @classmethod
    def start(cls, options: WandbOptions, *, dump_folder: str, config: dict, resumed: bool) -> WandbRun | None:
        """The job's W&B run, continued when `resumed` and this folder has one; None (after one warning) when W&B
        cannot start."""
        folder = Path(dump_folder)
        run_file = folder / RUN_FILE
        try:
            import wandb

            run_id = _saved_id(run_file) if resumed else None
            run_id = run_id or secrets.token_hex(6)  # W&B ids: letters and digits
            run = wandb.init(project=options.project, entity=options.entity or None,
                             name=options.run_name or folder.resolve().name, group=options.group or None,
                             tags=list(options.tags) or None, config=config, id=run_id, resume="allow",
                             dir=str(folder), settings=wandb.Settings(init_timeout=60, console="off"))
        except Exception as e:  # any failure of the tracker: login, network, the service process
            logger.warning("metrics.wandb: W&B did not start (%s: %s); training goes on without it (metrics.jsonl "
                           "and TensorBoard still record the run)", type(e).__name__, str(e).splitlines()[0][:200])
            return None
        run_file.write_text(json.dumps({"id": run_id}))
        logger.info("metrics.wandb: W&B run %s (project %r%s)", run_id, options.project,
                    ", offline: `wandb sync` uploads it" if run.settings.mode == "offline" else "")
        return cls(run)

    def log(self, scalars: dict[str, float], step: int) -> bool:
        """Log at `step`; False (after one warning) when W&B failed, and the caller drops this run."""
        try:
            self._run.log(scalars, step=step)
            return True
        except Exception as e:
            logger.warning("metrics.wandb: logging step %d to W&B failed (%s: %s); training goes on without W&B",
                           step, type(e).__name__, str(e).splitlines()[0][:200] if str(e) else "")
            return False

    def finish(self) -> None:
        try:
            self._run.finish()
        except Exception as e:
            logger.warning("metrics.wandb: closing the W&B run failed (%s: %s)", type(e).__name__, e)


def _saved_id(path: Path) -> str | None:
    """The run id an earlier process of this job saved; None when there is none. A file that does not hold one (read
    as untrusted data: a regular file of at most MAX_RUN_FILE_BYTES, a JSON object whose "id" is letters and digits) is
    one warning line naming it, and a new W&B run starts."""
    if not os.path.lexists(path):
        return None
    try:
        if problem := special_file_problem(path, max_bytes=MAX_RUN_FILE_BYTES, what=RUN_FILE):
            raise ValueError(problem)
        run_id = read_json_object(path, what="a W&B run record", error=ValueError).get("id")
        if isinstance(run_id, str) and run_id.isalnum() and len(run_id) <= 64:
            return run_id
        raise ValueError(f'{path}: "id"={str(run_id)[:80]!r} is not a W&B run id (letters and digits)')
    except (OSError, ValueError) as e:
        logger.warning("metrics.wandb: %s; a new W&B run starts instead of continuing this job's", e)
    return None
