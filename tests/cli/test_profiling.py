"""scripts/summarize_trace.py run as a command: the summary of a trace folder, and a missing folder is one line,
exit 2. The profiler window, the summaries and the script's main in-process: tests/unit/test_profiling.py."""

import os
import subprocess
import sys

from tests.helpers import REPO
from trainer.metrics.profiling import TRACE_SUFFIX

SCRIPT = REPO / "scripts" / "summarize_trace.py"


def _script(*args):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # it must find trainer itself
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


def test_script_prints_the_summary_of_a_trace_dir(fp32_trace_dir):
    result = _script(fp32_trace_dir, "--top", "3")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == f"== {fp32_trace_dir / f'rank0_step3-5{TRACE_SUFFIX}'}"
    assert lines[1].startswith("Kernel summary of steps 3-5 (3 steps)")
    assert lines[-1] == "FP8 GEMMs ran: no (only bf16/fp32 GEMMs)"
    # The offline summary is the one the run wrote.
    assert (fp32_trace_dir / "summary_step3-5.txt").read_text().splitlines()[:3] == lines[1:4]


def test_script_on_a_missing_dir_exits_2_with_one_line(tmp_path):
    result = _script(tmp_path / "missing")
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == f"summarize_trace.py: no such file or folder: {tmp_path / 'missing'}\n"
