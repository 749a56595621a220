"""A disk that fills outside a save (issue 36, item 5): the run files at the start, metrics.jsonl or TensorBoard
while training. Each ended in an `OSError: [Errno 28]` traceback; now one line that says what filled and which
checkpoint the relaunch resumes, and that checkpoint is untouched (the relaunch resumes it and matches an
uninterrupted run)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.faults.test_hostile_checkpoint import ARGS
from tests.helpers import REPO, TRAIN, hooks_env, read_metrics

pytestmark = pytest.mark.slow

RUN = [*ARGS, "--train.steps=6", "--checkpoint.enable=true", "--checkpoint.interval=2", "--train.deterministic=true"]


@pytest.mark.parametrize("name, writes, resumes", [
    ("resolved.toml", 1, None),  # the disk is full at the start: no checkpoint yet
    ("metrics.jsonl", 4, "step-2"),  # fills after step 3's line: step 2 saved
    # TensorBoard's writer thread, a write per record (a header, then 12 scalars a logged step): step 3's first
    ("events.out.tfevents", 26, "step-2"),
])
def test_a_full_disk_outside_a_save_is_one_line_and_keeps_the_latest_checkpoint(tmp_path, name, writes, resumes):
    args = ["--metrics.enable_tensorboard=true"] if name.startswith("events") else []
    dump = tmp_path / "run"
    proc = subprocess.run([sys.executable, TRAIN, *RUN, *args, f"--job.dump_folder={dump}"], capture_output=True,
                          text=True, timeout=300, cwd=REPO,
                          env=hooks_env(TRAINER_TEST_WRITE_ERROR=f"{name}:{writes}"))
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error")]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and len(errors) == 1, proc.stderr[-3000:]
    assert f"no space left on device writing {dump}" in errors[0] and name in errors[0], errors[0]
    checkpoint = dump / "checkpoint"
    if resumes is None:
        assert errors[0].endswith("the run has no checkpoint yet and starts over"), errors[0]
        return
    assert errors[0].endswith(f"the run resumes from {checkpoint / resumes}, untouched"), errors[0]
    # The relaunch on a disk with room resumes that checkpoint and trains as an uninterrupted run does.
    relaunch = subprocess.run([sys.executable, TRAIN, *RUN, *args, f"--job.dump_folder={dump}"], capture_output=True,
                              text=True, timeout=300, cwd=REPO, env=hooks_env())
    assert relaunch.returncode == 0 and f"resumed from checkpoint {checkpoint / resumes}" in relaunch.stdout
    reference = subprocess.run([sys.executable, TRAIN, *RUN, *args, f"--job.dump_folder={tmp_path / 'ref'}"],
                               capture_output=True, text=True, timeout=300, cwd=REPO, env=hooks_env())
    assert reference.returncode == 0
    ref = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "ref")}
    got = {r["step"]: r["loss"] for r in read_metrics(dump)}
    assert all(got[s] == ref[s] for s in (3, 4, 5, 6))
