"""Checkpoint faults: an unverifiable description, a corrupt newest checkpoint, a save that fails (full disk).

- checkpoint.json without its "files" list is not verified-complete: refused unless
  --checkpoint.allow_unverified=true.
- A corrupt newest checkpoint: the run falls back to the newest one that verifies and
  moves the corrupt one aside (renamed, never deleted), loudly; a pinned load_step, or
  no checkpoint verifying, is an error that moves nothing.
- A run resumed at an earlier step (load_step) keeps the checkpoint it resumed from and the ones it
  writes whatever keep_latest_k says, and moves the later trajectory aside at its first save.
- A failed save (ENOSPC injected by tests/support/sitecustomize.py) is one line saying
  what and why, leaves no step-N.tmp and no touched checkpoint; on_save_error=continue
  keeps training.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, TRAIN, hooks_env, launch, read_metrics, run_cli_cases
from trainer.checkpoint import CorruptCheckpointError, load_full_model_weights, read_checkpoint_json

pytestmark = pytest.mark.slow

ARGS = [
    "--config", str(REPO / "configs" / "train" / "debug_model.toml"), "--train.seq_len=32", "--train.batch_size=2",
    "--metrics.log_freq=1", "--metrics.enable_tensorboard=false", "--train.mixed_precision=fp32",
    "--train.deterministic=true", "--checkpoint.enable=true", "--checkpoint.interval=2",
]

def _cli(cases: dict[str, list[str]]) -> dict[str, dict]:
    """trainer.cli.main once per case, in one process (cheaper than a process each)."""
    return run_cli_cases(cases, timeout=400)


def _corrupt(shard: Path) -> None:
    with open(shard, "r+b") as f:  # same size, different bytes in the middle of the tensor data
        f.seek(shard.stat().st_size // 2)
        f.write(b"\x7f" * 64)


@pytest.fixture(scope="module")
def steps_2_and_4(tmp_path_factory):
    """A 6-step run with checkpoints at steps 2, 4 and 6, and its losses."""
    dump = tmp_path_factory.mktemp("ref")
    proc = launch([*ARGS, "--train.steps=6", f"--job.dump_folder={dump}"], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dump / "checkpoint", {r["step"]: r["loss"] for r in read_metrics(dump)}


def _dump_with(tmp_path: Path, name: str, source: Path, steps: tuple[int, ...]) -> Path:
    dump = tmp_path / name
    for s in steps:
        shutil.copytree(source / f"step-{s}", dump / "checkpoint" / f"step-{s}")
    return dump


def _dirs(dump: Path) -> list[str]:
    return sorted(p.name for p in (dump / "checkpoint").iterdir())


def test_unverifiable_and_corrupt_checkpoints(steps_2_and_4, tmp_path):
    source, ref = steps_2_and_4
    # checkpoint.json without "files": refused (one line), or loaded with the explicit override.
    no_files = _dump_with(tmp_path, "no_files", source, (4,))
    info_file = no_files / "checkpoint" / "step-4" / "checkpoint.json"
    info = json.loads(info_file.read_text())
    del info["files"]
    info_file.write_text(json.dumps(info))
    allowed = _dump_with(tmp_path, "allowed", no_files / "checkpoint", (4,))
    # A corrupt step-4 shard, a good step-2.
    fallback = _dump_with(tmp_path, "fallback", source, (2, 4))
    _corrupt(fallback / "checkpoint" / "step-4" / "__0_0.distcp")
    pinned = _dump_with(tmp_path, "pinned", fallback / "checkpoint", (2, 4))
    all_bad = _dump_with(tmp_path, "all_bad", fallback / "checkpoint", (2, 4))
    _corrupt(all_bad / "checkpoint" / "step-2" / "__0_0.distcp")
    run = [*ARGS, "--train.steps=6"]
    results = _cli({
        "no files": [*run, f"--job.dump_folder={no_files}"],
        "allowed": [*run, "--checkpoint.allow_unverified=true", f"--job.dump_folder={allowed}"],
        "fallback": [*run, f"--job.dump_folder={fallback}"],
        "pinned": [*run, "--checkpoint.load_step=4", f"--job.dump_folder={pinned}"],
        "all bad": [*run, f"--job.dump_folder={all_bad}"],
    })

    def one_line_error(name: str) -> str:
        r = results[name]
        lines = r["stderr"].strip().splitlines()
        assert r["rc"] == 2 and len(lines) == 1, (name, r["stderr"][-2000:])
        assert "| loss" not in r["stdout"], name
        return lines[0]

    line = one_line_error("no files")
    assert f'{info_file} has no valid "files" list' in line and "--checkpoint.allow_unverified=true" in line
    assert _dirs(no_files) == ["step-4"]  # refused, not moved: nothing older verifies
    out = results["allowed"]["stdout"]
    assert results["allowed"]["rc"] == 0 and "UNVERIFIED" in out and "at step 4" in out
    # Fallback: step-4 is moved aside (not deleted), the run resumes step 2 and reproduces steps 3-6.
    out = results["fallback"]["stdout"]
    bad = fallback / "checkpoint" / "step-4"
    assert results["fallback"]["rc"] == 0, results["fallback"]["stderr"][-2000:]
    assert f"CHECKPOINT {bad} FAILED VERIFICATION: {bad / '__0_0.distcp'} is corrupted: crc32" in out
    assert f"moved the corrupt checkpoint {bad} aside to {bad}.corrupt" in out
    assert f"FELL BACK to {fallback / 'checkpoint' / 'step-2'}" in out
    assert f"resumed from checkpoint {fallback / 'checkpoint' / 'step-2'} at step 2" in out
    assert _dirs(fallback) == ["step-2", "step-4", "step-4.corrupt", "step-6"]
    resumed = {r["step"]: r["loss"] for r in read_metrics(fallback)}
    assert [resumed[s] for s in range(3, 7)] == [ref[s] for s in range(3, 7)]
    # Pinned to the corrupt one: an error naming the shard; nothing moved.
    line = one_line_error("pinned")
    assert f"{pinned / 'checkpoint' / 'step-4' / '__0_0.distcp'} is corrupted: crc32" in line
    assert _dirs(pinned) == ["step-2", "step-4"]
    line = one_line_error("all bad")
    assert f"{all_bad / 'checkpoint' / 'step-4' / '__0_0.distcp'} is corrupted" in line
    assert "no older checkpoint verifies either (1 tried)" in line
    assert _dirs(all_bad) == ["step-2", "step-4"]
    # The library refuses the same checkpoint.json without an override.
    with pytest.raises(CorruptCheckpointError, match='has no valid "files" list'):
        load_full_model_weights(no_files / "checkpoint" / "step-4")
    assert read_checkpoint_json(no_files / "checkpoint" / "step-4", allow_unverified=True)["files"] is None


def test_a_run_resumed_at_an_earlier_step_keeps_its_checkpoints(tmp_path):
    """Trained to step 15 (checkpoints 5, 10, 15), relaunched at load_step=5 for 13 steps with keep_latest_k=1 and
    interval 4: it used to remove step-5, step-8, step-10 and its own step-13, leaving only the abandoned step-15,
    which a relaunch then resumed silently."""
    dump, ckpt = tmp_path / "run", tmp_path / "run" / "checkpoint"
    run = [*ARGS, f"--job.dump_folder={dump}"]
    earlier = [*run, "--train.steps=13", "--checkpoint.interval=4", "--checkpoint.keep_latest_k=1",
               "--checkpoint.load_step=5"]
    results = _cli({
        "to 15": [*run, "--train.steps=15", "--checkpoint.interval=5"],
        "from 5": earlier,
        "latest": [*run, "--train.steps=13", "--checkpoint.keep_latest_k=1"],
        "from 5 again": earlier,
    })
    for name, r in results.items():
        assert r["rc"] == 0, (name, r["stderr"][-2000:])
    out = results["from 5"]["stdout"]
    assert "loading step-5 although newer checkpoints exist (step-10, step-15): they are a later trajectory" in out
    for step in (10, 15):
        assert f"moved {ckpt / f'step-{step}'} aside to step-{step}.abandoned" in out
    assert f"removed {ckpt / 'step-8'} (keep_latest_k=1)" in out and f"removed {ckpt / 'step-12'}" in out
    assert "removed" not in out.replace(f"removed {ckpt / 'step-8'}", "").replace(f"removed {ckpt / 'step-12'}", "")
    # What a relaunch without load_step resumes is this run's newest, not the abandoned step-15.
    assert f"resumed from checkpoint {ckpt / 'step-13'} at step 13" in results["latest"]["stdout"]
    # The checkpoint it resumed from is still there to resume again; its later trajectory is moved aside in turn.
    again = results["from 5 again"]["stdout"]
    assert f"resumed from checkpoint {ckpt / 'step-5'} at step 5" in again
    assert f"moved {ckpt / 'step-13'} aside to step-13.abandoned" in again
    assert _dirs(dump) == ["step-10.abandoned", "step-13", "step-13.abandoned", "step-15.abandoned", "step-5"]
    assert json.loads((ckpt / "step-15.abandoned" / "checkpoint.json").read_text())["step"] == 15


def _run_with_full_disk(args: list[str], dump: Path, step: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, TRAIN, *args, f"--job.dump_folder={dump}"], capture_output=True,
                          text=True, timeout=300, cwd=REPO, env=hooks_env(TRAINER_TEST_SAVE_ERROR=str(step)))


@pytest.mark.parametrize("async_mode", ["disabled", "async"])
def test_failed_save_is_one_line_and_leaves_nothing_behind(tmp_path, async_mode):
    args = [*ARGS, "--train.steps=6", f"--checkpoint.async_mode={async_mode}"]
    stop = _run_with_full_disk(args, tmp_path / "stop", 4)
    tmp = tmp_path / "stop" / "checkpoint" / "step-4.tmp"
    lines = stop.stderr.strip().splitlines()
    assert stop.returncode == 2 and len(lines) == 1, stop.stderr[-3000:]
    assert lines[0].startswith(f"error (rank 0): checkpoint step-4 failed to save into {tmp}: no space left on "
                               "device (this checkpoint needs about "), lines[0]
    assert "MiB free); removed the partial step-4.tmp; earlier checkpoints are untouched" in lines[0]
    assert "checkpoint.on_save_error=continue would keep training" in lines[0]
    assert _dirs(tmp_path / "stop") == ["step-2"]
    load_full_model_weights(tmp_path / "stop" / "checkpoint" / "step-2")  # still verifies
    cont = _run_with_full_disk([*args, "--checkpoint.on_save_error=continue"], tmp_path / "cont", 4)
    assert cont.returncode == 0, cont.stderr[-3000:]
    assert "ERROR: checkpoint step-4 failed to save into" in cont.stdout
    assert "training continues without it (checkpoint.on_save_error=continue)" in cont.stdout
    assert _dirs(tmp_path / "cont") == ["step-2", "step-6"]
    assert [r["step"] for r in read_metrics(tmp_path / "cont")] == list(range(1, 7))
