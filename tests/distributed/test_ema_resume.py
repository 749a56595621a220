"""train.ema_decay and checkpoint.resume_check through the trainer's checkpoints (2 spawned gloo ranks, FSDP2, then
rank 0 alone as one process):

- the EMA of the dp_shard=2 run equals the one-process run's (the same global batches) to fp32 rounding;
- a resume continues the EMA exactly: the resumed run's step-4 EMA is the uninterrupted run's, bit for bit;
- `convert_checkpoint.py export --weights=ema` writes the EMA tensors; a checkpoint without one is refused in one line;
- the resume check: a plain resume is bit-equal; dp=2 -> dp=1 passes within the stated tolerance; a resume with another
  model.norm_eps (in the process) or model.rope_theta (the CLI: one line, exit non-zero, no traceback) is caught.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.distributed.spawn import run_distributed
from tests.helpers import FAST, REPO, TRAIN, env, load_script
from trainer.run.resume_check import layout_tolerance

ARGS = [*FAST, "--train.steps=4", "--train.seq_len=32", "--checkpoint.enable=true", "--checkpoint.interval=2",
        "--train.ema_decay=0.8", "--validation.enable=true", "--validation.freq=2", "--validation.steps=1"]


def _train(args: list[str], dump: Path) -> list[str]:
    """One training run in this rank's process; the lines it printed (a CheckpointError: its one line, last)."""
    import contextlib
    import io
    import os

    from trainer.checkpoint import CheckpointError
    from trainer.config import load_job_config
    from trainer.log import setup_logging
    from trainer.run.train import train

    out = io.StringIO()
    with contextlib.redirect_stderr(out), contextlib.redirect_stdout(out):
        setup_logging(int(os.environ["RANK"]))  # the CLI's log lines, into `out`
        try:
            train(load_job_config([*args, f"--job.dump_folder={dump}"]))
        except CheckpointError as e:
            return [*out.getvalue().splitlines(), f"CheckpointError: {e}"]
    return out.getvalue().splitlines()


def _one_process() -> None:
    import os

    for key in ("MASTER_ADDR", "MASTER_PORT"):  # no peers: trainer.distributed makes a 1-process group
        os.environ.pop(key)
    os.environ.update({"WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"})


def _runs(folder: str, resume: bool) -> dict:
    """2 ranks: steps 1-4 (saving 2 and 4), or (resume) resumed from step 2 (its first save moves the uninterrupted
    step-4 aside as step-4.abandoned); a process group is started once per spawn. Then with resume, rank 0 alone:
    the one-process run of the same global batches, a dp=2 -> dp=1 resume of the step-2 checkpoint (with the EMA
    off), and a resume with another model.norm_eps."""
    import os

    root = Path(folder)
    two = [*ARGS, "--distributed.dp_shard=2", "--train.batch_size=2", f"--checkpoint.folder={root / 'two'}"]
    if not resume:
        return {"full": _train(two, root / "full")}
    out = {"resumed": _train([*two, "--checkpoint.load_step=2"], root / "resumed")}
    if os.environ["RANK"] != "0":
        return out
    _one_process()
    one = [*ARGS, "--train.batch_size=4"]
    out["one"] = _train([*one, f"--checkpoint.folder={root / 'one'}"], root / "one_run")
    for name in ("reshard", "norm_eps"):
        source = root / ("two" if name == "reshard" else "one") / "step-2"
        shutil.copytree(source, root / name / "step-2")
    out["reshard"] = _train([*one, "--train.ema_decay=0", f"--checkpoint.folder={root / 'reshard'}"], root / "r_run")
    out["norm_eps"] = _train([*one, "--model.norm_eps=1e-3", f"--checkpoint.folder={root / 'norm_eps'}"],
                             root / "n_run")
    return out


def _ema(checkpoint: Path) -> dict[str, torch.Tensor]:
    from trainer.checkpoint import load_full_model_weights

    return load_full_model_weights(checkpoint, weights="ema")[1]


def _check_line(log: list[str]) -> str:
    lines = [line for line in log if "resume check: saved" in line]
    assert len(lines) == 1, log
    return lines[0]


def _convert():
    return load_script("convert_checkpoint")


def test_ema_sharded_resumed_exported_and_the_resume_check(tmp_path: Path, capsys) -> None:
    logs = run_distributed(_runs, world_size=2, args=(str(tmp_path), False), timeout=120)[0]
    logs |= run_distributed(_runs, world_size=2, args=(str(tmp_path), True), timeout=240)[0]
    two, one = tmp_path / "two", tmp_path / "one"
    # The sharded run's average is the one process's (the same global batches; FSDP2 sums in another order).
    sharded, single = _ema(two / "step-4.abandoned"), _ema(one / "step-4")
    assert set(sharded) == set(single) and len(single) > 10
    for k in single:
        torch.testing.assert_close(sharded[k], single[k], rtol=1e-4, atol=1e-5)
    # The resumed run continues the average exactly, and the weights it averages.
    resumed = _ema(two / "step-4")
    assert all(torch.equal(resumed[k], sharded[k]) for k in sharded)
    assert not all(torch.equal(resumed[k], single[k]) for k in single)  # not vacuous: another layout differs
    assert any("val_loss_ema" in line or " ema " in line for line in logs["full"] if "step      4/4" in line)
    # The resume check: a plain resume is bit-equal; dp=2 -> dp=1 is within the tolerance.
    line = _check_line(logs["resumed"])
    saved, now = line.split("saved ")[1].split(", now ")
    assert saved == now.split(",")[0] and line.endswith("difference 0"), line
    _check_line(logs["reshard"])
    within = (f"another layout or kernels (dp_shard 2 -> 1, world_size 2 -> 1), within its tolerance of "
              f"{layout_tolerance('fp32', n_layers=4):.2g} relative")
    assert any(within in x for x in logs["reshard"]), [x for x in logs["reshard"] if "resume check" in x]
    assert any("the checkpoint's EMA weights are not used" in x for x in logs["reshard"])
    refused = logs["norm_eps"][-1]
    assert refused.startswith("CheckpointError: resume check failed: checkpoint step-2's probe loss was"), refused
    assert "model.norm_eps=0.001 (saved: 1e-05)" in refused and "bit-equal expected" in refused
    # export --weights=ema writes the average; a checkpoint without one is refused in one line.
    pytest.importorskip("safetensors")
    from safetensors.torch import load_file

    convert = _convert()
    assert convert.main(["export", str(one / "step-4"), str(tmp_path / "hf"), "--weights=ema", "--dtype=float32",
                         "--no-tokenizer"]) == 0
    exported = load_file(str(tmp_path / "hf" / "model.safetensors"))
    emb = single["tok_embeddings.weight"]
    assert any(torch.equal(t, emb) for t in exported.values())
    assert convert.main(["export", str(tmp_path / "reshard" / "step-4"), str(tmp_path / "hf2"), "--weights=ema"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and "holds no EMA weights (its run had train.ema_decay=0)" in err[-1], err


def test_resume_with_another_rope_theta_stops_in_one_line(tmp_path: Path) -> None:
    """The CLI: a resume whose model.rope_theta differs from the saved run's exits non-zero with one line;
    checkpoint.resume_check=false lets it go on."""
    base = [sys.executable, TRAIN, *FAST, "--train.steps=2", "--train.seq_len=32", "--train.batch_size=2",
            "--checkpoint.enable=true", "--checkpoint.interval=2", f"--job.dump_folder={tmp_path}"]
    first = subprocess.run(base, capture_output=True, text=True, timeout=300, env=env(), cwd=REPO)
    assert first.returncode == 0, first.stderr[-3000:]
    again = subprocess.run([*base, "--train.steps=3", "--model.rope_theta=500000"], capture_output=True, text=True,
                           timeout=300, env=env(), cwd=REPO)
    assert again.returncode != 0
    output = again.stdout + again.stderr
    assert "Traceback" not in output, output[-3000:]
    errors = [line for line in output.splitlines() if "resume check failed" in line]
    assert len(errors) == 1 and "model.rope_theta=500000.0 (saved: 10000.0)" in errors[0], output[-3000:]
    # checkpoint.resume_check=false: the run goes on (with the resume's own warning of the changed argument).
    off = subprocess.run([*base, "--train.steps=3", "--model.rope_theta=500000", "--checkpoint.resume_check=false"],
                         capture_output=True, text=True, timeout=300, env=env(), cwd=REPO)
    assert off.returncode == 0 and "resume check" not in off.stdout + off.stderr, (off.stdout + off.stderr)[-3000:]
