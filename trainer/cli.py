"""Command-line handling for scripts/train.py: help, config loading, one-line user errors.

Errors the user can fix (`trainer.errors.UserError`: a config, data, a checkpoint, a folder,
FP8 that cannot run) are printed as one line and exit 2, whether found by the validation pass
or after the process group exists: by the rank that found it, or once per node (local rank 0)
when every rank raises it alike; anything else is a bug or an environment failure and keeps
its traceback (exit 1). A stop by SIGTERM or Ctrl-C exits 143 or 130 (trainer.train.STOP_SIGNALS):
after the current step and its checkpoint, or at once before this process's first step has ended
(nothing to save yet); a second Ctrl-C quits at once with 130.
"""

from __future__ import annotations

import gc
import logging
import os
import sys

from trainer.config import ConfigError, load_job_config, section_help, usage
from trainer.errors import UserError

logger = logging.getLogger("trainer")

EXIT_USER_ERROR = 2


def main(argv: list[str]) -> int:
    from trainer.log import setup_logging

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
        cfg = load_job_config(argv)
    except ConfigError as e:
        if speaks:
            print(f"config error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    if not any(a == "--config" or a.startswith("--config=") for a in argv):
        logger.warning("no --config given: training the built-in defaults (model.flavor=%r, %d steps, data.source=%r) "
                       "into %s", cfg.model.flavor, cfg.train.steps, cfg.data.source, cfg.job.dump_folder)
    if cfg.job.description:
        logger.info("job: %s", cfg.job.description)

    from trainer.train import StoppedBeforeFirstStep, train

    try:
        state = train(cfg)
    except ConfigError as e:  # found by the validation pass (world size, model shapes, data)
        if speaks or not e.every_rank:
            print(f"config error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    except UserError as e:
        if speaks or not e.every_rank:  # an error of this rank alone is printed where it happened
            print(f"error (rank {rank}): {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    except StoppedBeforeFirstStep as e:  # its line is logged: no traceback
        # What an interrupted compile left behind is garbage the interpreter's exit scans for cycles: 16-47 s from
        # the signal to the exit on a loaded 2-core machine after a stop during fp8 + compile's step 1, 2.7 s with
        # it frozen (never scanned).
        gc.freeze()
        return e.exit_code
    except KeyboardInterrupt:
        print(f"interrupted (rank {rank})", file=sys.stderr)
        return 130
    return state.exit_code
