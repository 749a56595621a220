"""Entry point: `python scripts/train.py --config configs/train/debug_model.toml [--section.key=value ...]`.

Works under `torchrun` (any number of processes and nodes) and as plain `python`.
"""

from __future__ import annotations

import sys
from pathlib import Path

# The checkout this script is in comes first, even when another copy of trainer is installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.cli import exit_process, main

if __name__ == "__main__":
    exit_process(main(sys.argv[1:]))
