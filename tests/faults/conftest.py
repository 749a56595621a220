"""Fixtures of the fault tests."""

import pytest

from tests.faults.test_hostile_checkpoint import ARGS
from tests.helpers import launch


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 2-step training checkpoint of the debug model (model, optimizer, state.json): the genuine article an
    attacker edits."""
    dump = tmp_path_factory.mktemp("trained")
    proc = launch([*ARGS, "--train.steps=2", "--checkpoint.enable=true", "--checkpoint.interval=2",
                   f"--job.dump_folder={dump}"], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dump / "checkpoint" / "step-2"
