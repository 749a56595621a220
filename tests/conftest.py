"""Checks that hold for every test."""

import pytest

from tests.helpers import reap


@pytest.fixture(autouse=True)
def no_leaked_processes():
    """Every process a test starts (torchrun workers included) must be gone when the test ends."""
    yield
    leaked = reap()
    if leaked:
        pytest.fail("processes outlived the test (now killed): "
                    + "; ".join(f"pid {pid}: {cmd[:200]}" for pid, cmd in leaked.items()), pytrace=False)
