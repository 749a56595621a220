"""Command-line handling shared by the scripts: config errors are one line, never a traceback."""

from __future__ import annotations

import logging
import os
import sys

from trainer.config import ConfigError, load_job_config

logger = logging.getLogger("trainer")


def main(argv: list[str]) -> int:
    from trainer.log import setup_logging

    rank = int(os.environ.get("RANK", "0"))
    # One line per node, not one per rank: every rank hits the same user error.
    speaks = int(os.environ.get("LOCAL_RANK", "0")) == 0
    setup_logging(rank)
    try:
        cfg = load_job_config(argv)
    except ConfigError as e:
        if speaks:
            print(f"config error: {e}", file=sys.stderr)
        return 2
    if cfg.job.description:
        logger.info("job: %s", cfg.job.description)
    logger.info("resolved config:\n%s", cfg.to_toml())

    from trainer.train import NonFiniteError, train

    try:
        train(cfg)
    except (ValueError, NonFiniteError) as e:
        # User-facing errors (bad data, bad parallel degrees, FP8 unavailable with
        # float8.require, non-finite loss) are raised with one-line messages.
        if type(e).__module__.startswith(("trainer", "builtins")):
            if speaks:
                print(f"error (rank {rank}): {e}", file=sys.stderr)
            return 1
        raise
    except KeyboardInterrupt:
        print(f"interrupted (rank {rank})", file=sys.stderr)
        return 130
    return 0
