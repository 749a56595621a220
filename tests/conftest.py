"""Checks that hold for every test, and one for the whole session: it leaves the checkout as it found it."""

import logging
import os
import subprocess
from pathlib import Path

import pytest

from tests.helpers import REPO, reap

# What running tests may add to the checkout: Python's and pytest's caches, an editable install's metadata.
_CACHES = ("__pycache__", ".pytest_cache")
_checkout_before: dict[str, tuple] | None = None


def checkout_state(repo: Path = REPO) -> dict[str, tuple] | None:
    """{path: (git status, size, mtime)} of every tracked-and-changed, untracked and ignored file under `repo`
    (ignored ones matter: outputs/ is git-ignored); None where `repo` is not a git checkout or git is missing."""
    try:
        proc = subprocess.run(["git", "-C", str(repo), "status", "--porcelain=v1", "-z", "--ignored",
                               "--untracked-files=all", "--", "."], capture_output=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if proc.returncode != 0:
        return None
    top = Path(subprocess.run(["git", "-C", str(repo), "rev-parse", "--show-toplevel"], capture_output=True,
                              text=True).stdout.strip())
    state, entries = {}, iter(proc.stdout.decode(errors="surrogateescape").split("\0"))
    for entry in entries:
        if not entry:
            continue
        code, path = entry[:2], entry[3:]
        if code[0] in "RC":  # a rename's source path follows as an entry of its own
            next(entries, None)
        parts = Path(path).parts
        if any(p in _CACHES or p.endswith(".egg-info") for p in parts):
            continue
        try:
            st = os.stat(top / path)
            state[path] = (code, st.st_size, st.st_mtime_ns)
        except FileNotFoundError:
            state[path] = (code, None, None)  # a tracked file deleted
    return state


def checkout_changes(before: dict[str, tuple], after: dict[str, tuple]) -> list[str]:
    return sorted([f"new: {p}" for p in after.keys() - before.keys()]
                  + [f"gone: {p}" for p in before.keys() - after.keys()]
                  + [f"changed: {p}" for p in before.keys() & after.keys() if before[p] != after[p]])


def pytest_sessionstart(session: pytest.Session) -> None:
    global _checkout_before
    if not hasattr(session.config, "workerinput"):  # under pytest-xdist, the controller alone checks
        _checkout_before = checkout_state()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Tests write only under tmp_path: anything new or changed in the checkout fails the session (exit 1)."""
    if _checkout_before is None or (after := checkout_state()) is None:
        return
    changes = checkout_changes(_checkout_before, after)
    if changes:
        shown = "\n  ".join(changes[:30]) + (f"\n  ... and {len(changes) - 30} more" if len(changes) > 30 else "")
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        message = f"tests changed the checkout {REPO} (they may write only under tmp_path):\n  {shown}"
        if reporter is not None:
            reporter.write_line("")  # the progress line of -q has no newline yet
            reporter.write_sep("=", "checkout changed", red=True)
            reporter.write_line(message)
        else:
            print(message)
        if session.exitstatus == pytest.ExitCode.OK or session.exitstatus == pytest.ExitCode.NO_TESTS_COLLECTED:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


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


@pytest.fixture(autouse=True)
def dynamo_config_restored():
    """A run that compiles an MoE model sets torch._dynamo's capture_scalar_outputs for its process
    (trainer.parallel.compile): a test run in-process gives the next test the dynamo config it found."""
    import torch._dynamo

    saved = torch._dynamo.config.save_config()
    yield
    torch._dynamo.config.load_config(saved)


@pytest.fixture
def on_h100(monkeypatch):
    """Validate as on 80 GB H100s (what the shipped GPU configs are written for), whatever this machine's memory:
    on a CPU the memory checks hold a model against the host's RAM, and refuse a memory plan over it. The target stays
    this machine's (no FP8 kernel is probed, 'auto' precisions resolve as here) with an H100's memory, over whose plan
    a run is warned, as on a GPU."""
    import dataclasses

    import trainer.validate
    from trainer.validate import memory

    monkeypatch.setattr(memory, "device_memory", lambda: (79 * memory.GIB, "GPU 0 (H100 80GB, faked by the test)"))
    machine = memory.this_machine
    monkeypatch.setattr(trainer.validate, "this_machine", lambda: dataclasses.replace(machine(), host_memory=False))


# -- runs that tests in several folders read (each made once per session) --------------------------------------


@pytest.fixture(scope="session")
def moe_ep_reference(tmp_path_factory) -> dict:
    """The 1-process MoE run every expert-parallel layout must reproduce (tests/distributed/test_moe_ep.py and its
    torchrun half tests/cli/test_moe_ep.py): batch 4, fp32, checkpoints at steps 2 and 4."""
    from tests.distributed.test_moe_ep import ARGS, CKPT, FP32, VAL
    from tests.helpers import train

    dump = tmp_path_factory.mktemp("ref")
    return {"metrics": train([*ARGS, *FP32, *CKPT, *VAL, "--train.batch_size=4"], dump), "dump": dump}


@pytest.fixture(scope="session")
def fp32_trace_dir(tmp_path_factory) -> Path:
    """A profiled fp32 run's trace folder (steps 3-5), read by tests/unit/test_profiling.py and by the run of
    scripts/summarize_trace.py in tests/cli/test_profiling.py."""
    from tests.unit.test_profiling import _train

    trace_dir = tmp_path_factory.mktemp("fp32_trace")
    _train(trace_dir)
    return trace_dir
