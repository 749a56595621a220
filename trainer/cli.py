"""Command-line handling for scripts/train.py: help, config loading, one-line user errors.

Errors the user can fix (`trainer.errors.UserError`: a config, data, a checkpoint, a folder,
FP8 that cannot run) are printed as one line and exit 2, whether found by the validation pass
or after the process group exists: by the rank that found it, or once per node (local rank 0)
when every rank raises it alike (what each rank's validation found alone is compared once the
group exists, trainer.validate.ranks.agree_to_start: each distinct error once per node, with its
rank where the other ranks did not find it); anything else is a bug or an environment failure
and keeps its traceback (exit 1). A dry run whose plan does not fit the GPU exits 3 (trainer.run.dry_run). A stop
by SIGTERM or Ctrl-C exits 143 or 130 (trainer.run.train_state.STOP_SIGNALS): after the current step and its
checkpoint, or at once before this process's first step has ended (nothing to save yet); a second Ctrl-C quits at
once with 130.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
from pathlib import Path
from typing import NoReturn

from trainer.config import ConfigError, load_job_config, section_help, usage
from trainer.errors import UserError
from trainer.log import setup_logging
from trainer.run.train_state import EXIT_INTERRUPTED, EXIT_PREEMPTED, StoppedBeforeFirstStep

logger = logging.getLogger("trainer")

EXIT_USER_ERROR = 2
MAX_PLANNED = 2**20


def dry_run_flags(argv: list[str]) -> tuple[list[str], dict | None]:
    """(argv without them, dry_run's keywords or None) from --dry-run, --world-size N and --gpu-memory-gib G."""
    rest, plan, values = [], False, {}
    # (keyword, type, the largest value): 2**20 ranks and a 2**20 GiB GPU are beyond any machine a dry run plans for.
    names = {"--world-size": ("world_size", int, MAX_PLANNED), "--gpu-memory-gib": ("gpu_gib", float, MAX_PLANNED)}
    i = 0
    while i < len(argv):
        arg = argv[i]
        name, _, value = arg.partition("=")
        if arg == "--dry-run":
            plan = True
        elif name in names:
            if not value:
                if i + 1 >= len(argv):
                    raise ConfigError(f"{name} needs a value")
                i += 1
                value = argv[i]
            key, kind, most = names[name]
            try:
                values[key] = kind(value)
            except ValueError:
                raise ConfigError(f"{name}={value!r} is not a{'n integer' if kind is int else ' number'}") from None
            if not 0 < values[key] <= most:  # False for nan
                raise ConfigError(f"{name}={value} must be a positive number at most {most:,} (2**20)")
        else:
            rest.append(arg)
        i += 1
    if values and not plan:
        raise ConfigError(f"{' and '.join(sorted(n for n, (k, *_) in names.items() if k in values))} only go with "
                          "--dry-run (a real run takes its world size from torchrun and its memory from the GPU)")
    return rest, ({"world_size": 1} | values if plan else None)


def _quiet_disk_errors_in_threads() -> None:
    """A full disk in a writer's thread (TensorBoard's) prints nothing there: the main thread's next write raises
    it again, and main() says it in one line. Other thread errors keep their traceback."""
    from trainer.checkpoint.format import disk_error

    default = threading.excepthook
    if getattr(default, "quiets_disk_errors", False):  # main() ran before in this process
        return

    def hook(args: threading.ExceptHookArgs) -> None:
        if args.exc_value is None or disk_error(args.exc_value) is None:
            default(args)

    hook.quiets_disk_errors = True  # type: ignore[attr-defined]
    threading.excepthook = hook


def exit_process(code: int) -> NoReturn:
    """End scripts/train.py's process with `code`. A run stopped by a signal (143, 130) has saved, closed its writers
    and left the process group when main() returns: its process runs the atexit handlers (log handlers, the compile
    workers' shutdown, W&B) and then ends with os._exit, without the interpreter's own teardown. That teardown scans
    what an interrupted compile left behind for cycles (16-47 s from the signal to the exit on a loaded 2-core
    machine after a stop during fp8 + compile's step 1) and, where Triton's objects are still alive then, prints
    nanobind's report of them (~40 `nanobind: leaked ...` lines after a SIGTERM during a compiled step; Triton
    silences the same report in its own compile workers, triton/_compile_warmup_pool.py). Any other code exits
    normally."""
    if code not in (EXIT_PREEMPTED, EXIT_INTERRUPTED):
        sys.exit(code)
    atexit._run_exitfuncs()  # logging.shutdown among them: every line is written before the process ends
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _speaks(error: UserError, local_rank_0: bool) -> bool:
    """Whether this rank prints `error`: as the ranks agreed where they compared their errors
    (trainer.validate.ranks.agree_to_start), else local rank 0 for an error every rank raises alike and the rank
    that raised any other (an error of this rank alone is printed where it happened)."""
    return error.speaker if error.speaker is not None else local_rank_0 or not error.every_rank


def main(argv: list[str]) -> int:
    rank = int(os.environ.get("RANK", "0"))
    # One line per node, not one per rank: every rank hits the same user error.
    speaks = int(os.environ.get("LOCAL_RANK", "0")) == 0
    if not argv:
        if speaks:
            print(usage(), file=sys.stderr)
        return EXIT_USER_ERROR
    if "-h" in argv or "--help" in argv:
        sections = argv[argv.index("-h" if "-h" in argv else "--help") + 1:]
        sections = [s for s in sections if not s.startswith("-")]
        try:
            text = "\n\n".join(section_help(s) for s in sections) if sections else usage()
        except ConfigError as e:
            print(f"config error: {e}", file=sys.stderr)
            return EXIT_USER_ERROR
        print(text)
        return 0
    setup_logging(rank)  # first: its warning filters must be in place before anything imports torchao
    try:
        argv, plan = dry_run_flags(argv)
        cfg = load_job_config(argv)
    except ConfigError as e:
        if speaks:
            print(f"config error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    if plan is not None:
        from trainer.run.dry_run import EXIT_DOES_NOT_FIT, dry_run

        try:
            text, fits = dry_run(cfg, **plan)
        except UserError as e:
            print(f"config error: {e}", file=sys.stderr)
            return EXIT_USER_ERROR
        print(text)
        return 0 if fits else EXIT_DOES_NOT_FIT
    if not any(a == "--config" or a.startswith("--config=") for a in argv):
        logger.warning("no --config given: training the built-in defaults (model.flavor=%r, %d steps, data.source=%r) "
                       "into %s", cfg.model.flavor, cfg.train.steps, cfg.data.source, cfg.job.dump_folder)
    if cfg.job.description:
        logger.info("job: %s", cfg.job.description)

    from trainer.run.train import train

    _quiet_disk_errors_in_threads()
    try:
        state = train(cfg)
    except ConfigError as e:  # found by the validation pass (world size, model shapes, data)
        if _speaks(e, speaks):
            print(f"config error{'' if e.every_rank else f' (rank {rank})'}: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    except UserError as e:
        if _speaks(e, speaks):
            print(f"error (rank {rank}): {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    except StoppedBeforeFirstStep as e:  # its line is logged: no traceback; exit_process ends the process at once
        return e.exit_code
    except KeyboardInterrupt:
        print(f"interrupted (rank {rank})", file=sys.stderr)
        return 130
    except Exception as e:  # a full disk outside a save (a save's own is a CheckpointError line)
        from trainer.checkpoint.format import disk_error
        from trainer.checkpoint.space import disk_full_line

        if (error := disk_error(e)) is None:
            raise
        folder = Path(cfg.job.dump_folder) / cfg.checkpoint.folder if cfg.checkpoint.enable else None
        print(f"error (rank {rank}): {disk_full_line(error, checkpoint_folder=folder)}", file=sys.stderr)
        return EXIT_USER_ERROR
    return state.exit_code
