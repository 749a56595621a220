"""Checks that hold for every test."""

import logging

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


@pytest.fixture(autouse=True)
def trainer_logger_restored():
    """A CLI entry point run in-process (scripts/convert_checkpoint.py's main) calls setup_logging, which stops the
    trainer's loggers from reaching caplog: every test starts from the logger as it was."""
    log = logging.getLogger("trainer")
    saved = list(log.handlers), list(log.filters), log.level, log.propagate
    yield
    log.handlers[:], log.filters[:] = saved[0], saved[1]
    log.setLevel(saved[2])
    log.propagate = saved[3]


@pytest.fixture
def on_h100(monkeypatch):
    """Validate as on 80 GB H100s (what the shipped GPU configs are written for), whatever this machine's memory:
    on a CPU the memory check holds a model against the host's RAM."""
    from trainer.validate import memory

    monkeypatch.setattr(memory, "device_memory", lambda: (79 * memory.GIB, "GPU 0 (H100 80GB, faked by the test)"))
