"""The CLI under torchrun: parallel degrees that do not multiply to the world size are one config error line, printed
once. The layouts against the 1-process run (spawned functions): tests/distributed/test_parallel.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import FAST, launch


@pytest.mark.slow  # starts 2 processes
def test_wrong_degree_product_is_one_line(tmp_path: Path) -> None:
    # What torchrun and the CLI print on a config error is what is tested: a whole-CLI launch.
    proc = launch([*FAST, "--train.steps=1", "--distributed.dp_shard=4", f"--job.dump_folder={tmp_path}"], nproc=2)
    assert proc.returncode != 0
    want = "dp_replicate*dp_shard*cp*tp*pp = 1*4*1*1*1 = 4, but WORLD_SIZE=2"
    # Found by the validation pass (before distributed init), printed once per node.
    assert proc.stderr.count(f"config error: parallel degrees do not multiply to the world size: {want}") == 1
    # torchrun reports the failed child with its own traceback; our ranks print none.
    assert "[rank0]: Traceback" not in proc.stderr and "[rank1]: Traceback" not in proc.stderr
