"""The leak check: workers that escape a process-group kill (as torchrun's do) are found and reaped."""

import os
import signal
import subprocess
import sys
import time

from tests.helpers import env, owned_processes, reap

# A parent that starts a grandchild in a session of its own, like torchrun starting a rank, prints its pid, waits.
_PARENT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
print(child.pid, flush=True)
time.sleep(600)
"""


def test_reap_finds_workers_that_escape_the_process_group():
    parent = subprocess.Popen([sys.executable, "-c", _PARENT], stdout=subprocess.PIPE, text=True, env=env(),
                              start_new_session=True)
    grandchild = int(parent.stdout.readline())
    os.killpg(parent.pid, signal.SIGKILL)  # what a test helper killing "torchrun" does
    parent.wait()
    time.sleep(0.2)
    assert grandchild in owned_processes()  # it survived the group kill
    assert grandchild in reap()
    assert not owned_processes()
    assert not os.path.exists(f"/proc/{grandchild}") or open(f"/proc/{grandchild}/stat").read().split()[2] == "Z"
