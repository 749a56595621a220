"""trainer.cli.exit_process, the end of scripts/train.py's process: a run stopped by a signal (143, 130) runs the
atexit handlers and ends without the interpreter's teardown, which reports Triton's live nanobind objects
(`nanobind: leaked ...`, ~40 lines after a SIGTERM during a compiled step on a GPU); every other code exits
normally. Here Triton objects are kept alive to the exit as an interrupted compile leaves them (frozen out of the
collector's reach), in a child process. The whole stop under torchrun: tests/cli/test_signals.py."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers import REPO, env

pytest.importorskip("triton")

_CHILD = """
import atexit, gc, logging, sys
from triton._C.libtriton import ir
from trainer.cli import exit_process
from trainer.log import setup_logging

context = ir.context()
ir.load_dialects(context)
held = [context, ir.builder(context)]
held.append(held)  # a cycle: only the collector would free it, and it is frozen out of its reach
del held
gc.freeze()
setup_logging(0)
logging.getLogger("trainer").warning("the stop's last line")
atexit.register(lambda: print("atexit handlers ran", flush=True))
exit_process(int(sys.argv[1]))
"""


@pytest.mark.parametrize("code", [143, 130, 0])
def test_a_stopped_run_ends_without_the_interpreters_leak_report(code: int) -> None:
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(code)], capture_output=True, text=True, env=env(),
                          cwd=REPO, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == code, out[-3000:]
    assert "the stop's last line" in out and "atexit handlers ran" in out  # flushed, and the handlers ran
    leaked = [line for line in out.splitlines() if "nanobind" in line or "leaked" in line]
    if code:
        assert leaked == [], leaked
    else:  # a normal exit is the interpreter's: here it reports the frozen objects (the control of this test)
        assert any(line.startswith("nanobind: leaked") for line in leaked), out[-3000:]
