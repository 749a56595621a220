"""Checkpoints of the trainer run as a command, in one process: exact resume after SIGKILL, kill mid-save,
SIGTERM, precision switch, bad input, Hugging Face export/import against transformers.

The trainer runs in subprocesses (a 1-process gloo group each); the multi-process cases are in
tests/cli/test_checkpoint_distributed.py, the functions they rely on in tests/unit/test_checkpoint.py.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import (
    REPO, TRAIN, env, first_batch_loss, hooks_env, launch_ok, losses_by_step, read_metrics, run_cli_cases,
    run_until_paused,
)
from tests.unit.test_checkpoint import DEBUG, _hf_logits
from trainer.checkpoint import load_full_model_weights, load_model


CONVERT = str(REPO / "scripts" / "convert_checkpoint.py")
# Tiny and fast; fp32 + deterministic so a resumed run reproduces the uninterrupted one exactly.
ARGS = [
    "--config", str(REPO / "configs" / "train" / "debug_model.toml"),
    "--train.seq_len=32", "--train.batch_size=2", "--metrics.log_freq=1", "--metrics.enable_tensorboard=false",
]
EXACT = [*ARGS, "--train.mixed_precision=fp32", "--train.deterministic=true"]


def _run(args: list[str], dump: Path) -> subprocess.CompletedProcess:
    return launch_ok(args, dump, timeout=120)


def _run_until_paused(args: list[str], dump: Path, pause: str) -> str:
    return run_until_paused([sys.executable, TRAIN, *args, f"--job.dump_folder={dump}"], pause, timeout=120)


def _dirs(dump: Path) -> list[str]:
    return sorted(p.name for p in (dump / "checkpoint").iterdir())


# -- the trainer, relaunched ----------------------------------------------------


@pytest.mark.slow
def test_sigkill_at_step_12_resumes_from_step_10_exactly(tmp_path):
    """The issue's done-when: 20 steps, interval 5, SIGKILL after step 12, relaunch: steps 11-20 match."""
    args = [*EXACT, "--train.steps=20", "--train.grad_accum_steps=2", "--checkpoint.interval=5"]
    _run(args, tmp_path / "ref")
    ref = losses_by_step(tmp_path / "ref")
    dump = tmp_path / "run"
    ckpt = [*args, "--checkpoint.enable=true", "--checkpoint.keep_latest_k=2"]
    killed_log = _run_until_paused(ckpt, dump, pause="step:12")
    assert "step     12/20" in killed_log
    assert _dirs(dump) == ["step-10", "step-5"]
    relaunch = _run(ckpt, dump)  # the same command, no edits
    assert f"resumed from checkpoint {dump / 'checkpoint' / 'step-10'} at step 10" in relaunch.stdout
    resumed = losses_by_step(dump)
    assert sorted(resumed) == list(range(1, 21))
    for step in range(11, 21):
        assert abs(resumed[step] - ref[step]) <= 1e-6, (step, resumed[step], ref[step])
    assert _dirs(dump) == ["step-10", "step-15", "step-20"]  # keep_latest_k=2, and the one it resumed from


@pytest.mark.slow
def test_kill_mid_save_of_one_process_leaves_previous_checkpoint_latest(tmp_path):
    args = [*EXACT, "--train.steps=10", "--checkpoint.interval=5", "--checkpoint.enable=true",
            "--checkpoint.keep_latest_k=1"]
    dump = tmp_path / "run"
    # Pauses inside the save of step 10 after the shard file is written, before the save completes.
    _run_until_paused(args, dump, pause="save:10")
    assert _dirs(dump) == ["step-10.tmp", "step-5"]  # keep_latest_k=1 kept the only complete one
    assert (dump / "checkpoint" / "step-10.tmp" / "__0_0.distcp").exists()
    relaunch = _run(args, dump)
    assert "ignoring incomplete checkpoint" in relaunch.stdout and "step-10.tmp" in relaunch.stdout
    assert "at step 5 " in relaunch.stdout
    assert _dirs(dump) == ["step-10", "step-5"]  # keep_latest_k=1, and the one it resumed from
    assert json.loads((dump / "checkpoint" / "step-10" / "checkpoint.json").read_text())["step"] == 10


@pytest.mark.slow
@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)], ids=["sigterm", "ctrl-c"])
def test_sigterm_and_ctrl_c_save_and_stop(tmp_path, sig, code):
    dump = tmp_path / "run"
    cmd = [sys.executable, TRAIN, *ARGS, "--train.mixed_precision=fp32", "--train.steps=1000",
           "--checkpoint.enable=true", "--checkpoint.interval=1000", f"--job.dump_folder={dump}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO, env=env())
    watchdog = threading.Timer(120, proc.kill)
    watchdog.start()
    out = []
    for line in proc.stdout:
        out.append(line)
        if "step      3/1000" in line:
            proc.send_signal(sig)
            break
    out.append(proc.stdout.read())
    watchdog.cancel()
    assert proc.wait(timeout=30) == code, "".join(out)[-3000:]  # see trainer.run.train.STOP_SIGNALS
    last = max(r["step"] for r in read_metrics(dump))
    assert f"received {sig.name}" in "".join(out) and f"stopped by {sig.name} at step {last}" in "".join(out)
    assert _dirs(dump) == [f"step-{last}"]
    assert json.loads((dump / "preempted.json").read_text()) == {
        "step": last, "of_steps": 1000, "checkpoint_saved": True, "signal": sig.name}


@pytest.mark.slow
def test_a_second_ctrl_c_during_a_save_quits_with_130(tmp_path):
    """The docs promise 130 for a second Ctrl-C; during a save DCP wrapped the KeyboardInterrupt and the run exited 2
    with "failed to save ... KeyboardInterrupt"."""
    dump = tmp_path / "run"
    cmd = [sys.executable, TRAIN, *ARGS, "--train.mixed_precision=fp32", "--train.steps=4", "--checkpoint.enable=true",
           "--checkpoint.interval=2", f"--job.dump_folder={dump}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                            env=hooks_env(TRAINER_TEST_PAUSE="save:4"))  # inside step 4's save
    watchdog = threading.Timer(120, proc.kill)
    watchdog.start()
    out = []
    for line in proc.stdout:
        out.append(line)
        if line.startswith("TRAINER_TEST_PAUSE"):
            proc.send_signal(signal.SIGINT)
            time.sleep(1)  # the first: stop after this step and its save
            proc.send_signal(signal.SIGINT)
            break
    out.append(proc.stdout.read())
    watchdog.cancel()
    text = "".join(out)
    assert proc.wait(timeout=30) == 130, text[-3000:]
    assert "interrupted (rank 0)" in text and "failed to save" not in text, text[-3000:]
    assert _dirs(dump) == ["step-2", "step-4.tmp"]  # quit at once: the previous checkpoint is the latest


def test_extending_a_run_names_the_schedule_key_that_moved_its_learning_rate(tmp_path):
    """A relaunch with only train.steps raised: the cosine decay stretches, and the warning says so by key."""
    base = [*ARGS, "--train.mixed_precision=fp32", "--scheduler.warmup_steps=1", "--scheduler.decay_type=cosine",
            "--checkpoint.enable=true", "--checkpoint.interval=100"]
    _run([*base, "--train.steps=2"], tmp_path)
    longer = _run([*base, "--train.steps=4"], tmp_path)
    warning = next(line for line in longer.stdout.splitlines() if "learning rate at step 2" in line)
    assert warning.endswith("(the checkpoint's run had 3.000e-04): train.steps 2 -> 4"), warning  # nothing else


@pytest.mark.slow
def test_precision_switch_by_relaunch(tmp_path):
    """bf16 warmup -> fp8 body -> bf16 cooldown as relaunches (docs/checkpointing.md, pattern 3).

    constant, constant, then wsd over the whole run: the learning rate of every
    step equals that of one uninterrupted wsd run.
    """
    schedule = ["--scheduler.warmup_steps=1", "--scheduler.wsd_decay_ratio=0.5"]
    _run([*ARGS, *schedule, "--train.steps=6", "--train.mixed_precision=fp32", "--scheduler.decay_type=wsd"],
         tmp_path / "single")
    dump = tmp_path / "run"
    base = [*ARGS, *schedule, "--checkpoint.enable=true", "--checkpoint.interval=100"]
    _run([*base, "--train.steps=1", "--train.mixed_precision=bf16", "--scheduler.decay_type=constant"], dump)
    fp8 = _run([*base, "--train.steps=3", "--train.mixed_precision=fp8", "--scheduler.decay_type=constant"], dump)
    assert "resumed bf16 checkpoint at step 1 with mixed_precision=fp8" in fp8.stdout
    assert "Applied Float8 training" in fp8.stdout
    bf16 = _run([*base, "--train.steps=6", "--train.mixed_precision=bf16", "--scheduler.decay_type=wsd"], dump)
    assert "resumed fp8 checkpoint at step 3 with mixed_precision=bf16" in bf16.stdout
    assert "learning rate at step" not in fp8.stdout + bf16.stdout  # no schedule change to warn about
    lrs = {r["step"]: r["lr"] for r in read_metrics(dump)}
    assert lrs == {r["step"]: r["lr"] for r in read_metrics(tmp_path / "single")}
    assert lrs[6] < lrs[3]  # the cooldown decayed

    from torch.distributed.checkpoint import FileSystemReader

    def layout(step):
        md = FileSystemReader(str(dump / "checkpoint" / f"step-{step}")).read_metadata().state_dict_metadata
        return {k: (tuple(v.size), v.properties.dtype) if hasattr(v, "size") else None for k, v in md.items()}

    # The same keys, shapes and dtypes whether written by a bf16 or an fp8 (float8 all-gather) run.
    assert layout(1) == layout(3)
    # An fp8 run's checkpoint loads whole (optimizer included) in a process that never imports torchao.
    check = textwrap.dedent(f"""
        import sys
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
        from trainer.checkpoint import load_full_model_weights
        info, weights = load_full_model_weights({str(dump / 'checkpoint' / 'step-3')!r})
        assert info["mixed_precision"] == "fp8" and len(weights) == 39
        dcp_to_torch_save({str(dump / 'checkpoint' / 'step-3')!r}, {str(tmp_path / 'full.pt')!r})
        assert "torchao" not in sys.modules, "torchao was imported"
    """)
    proc = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, env=env(), cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]


# -- a finished run: bad input, export, import ------------------------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """2 fp32 steps with a checkpoint at step 2 and the final bf16 Hugging Face export."""
    dump = tmp_path_factory.mktemp("trained")
    _run([*EXACT, "--train.steps=2", "--checkpoint.enable=true", "--checkpoint.interval=2",
          "--checkpoint.model_only=true"], dump)
    return dump / "checkpoint"


# Runs trainer.cli.main (what scripts/train.py runs) once per case in one process: each
# case's rc and stderr, as JSON. Cheaper than a process per case.
@pytest.mark.slow
def test_bad_input_is_one_line_before_training(trained, tmp_path):
    def copy(name: str) -> Path:
        dump = tmp_path / name
        shutil.copytree(trained / "step-2", dump / "checkpoint" / "step-2")
        return dump / "checkpoint" / "step-2"

    truncated = copy("truncated") / "__0_0.distcp"
    truncated.write_bytes(truncated.read_bytes()[: truncated.stat().st_size // 2])
    corrupted = copy("corrupted") / "__0_0.distcp"
    with open(corrupted, "r+b") as f:  # same size, different bytes in the middle of the tensor data
        f.seek(corrupted.stat().st_size // 2)
        f.write(b"\x7f" * 64)
    metadata = copy("metadata") / ".metadata"
    metadata.write_bytes(b"not a pickle")
    # Under tmp_path: a case that passes validation creates its dump folder and moves its metrics aside.
    fresh = [*EXACT, f"--job.dump_folder={tmp_path / 'fresh'}"]
    resume = [*EXACT, "--train.steps=3", "--checkpoint.enable=true"]
    cases = {
        "missing folder": ([*fresh, "--checkpoint.initial_load_path=/nonexistent/ckpt"],
                           "checkpoint /nonexistent/ckpt does not exist"),
        "missing step": ([*resume, "--checkpoint.load_step=7", f"--job.dump_folder={tmp_path / 'truncated'}"],
                         "checkpoint.load_step=7: " + str(tmp_path / "truncated" / "checkpoint" / "step-7")),
        "not a checkpoint": ([*fresh, f"--checkpoint.initial_load_path={trained / 'step-2-hf'}"],
                             str(trained / "step-2-hf" / "checkpoint.json") + " is missing"),
        "truncated shard": ([*resume, f"--job.dump_folder={tmp_path / 'truncated'}"],
                            f"{truncated} is truncated or corrupted"),
        "corrupted shard": ([*resume, f"--job.dump_folder={tmp_path / 'corrupted'}"],
                            f"{corrupted} is corrupted: crc32"),
        "corrupted metadata": ([*resume, f"--job.dump_folder={tmp_path / 'metadata'}"], f"{metadata} is"),
        # The initial weights' shape is the run's: a key that contradicts it is one line, with the others.
        "other shape": ([*fresh, "--model.n_layers=2", "--model.vocab_size=1024",
                         f"--checkpoint.initial_load_path={trained / 'step-2'}"],
                        "model.n_layers=2 (the checkpoint's: 4), model.vocab_size=1024 (the checkpoint's: 512): these "
                        f"keys differ from the model of checkpoint.initial_load_path={trained / 'step-2'}"),
    }
    # What the initial weights' checkpoint.json says is read by the validation pass, before the process group.
    validation = ("missing folder", "not a checkpoint", "other shape")
    results = run_cli_cases({k: v[0] for k, v in cases.items()})
    for name, (_, expected) in cases.items():
        r = results[name]
        lines = r["stderr"].strip().splitlines()
        assert r["rc"] == 2 and len(lines) == 1, (name, r["stderr"])
        prefix = "config error: " if name in validation else "error (rank 0): "
        assert lines[0].startswith(prefix) and expected in lines[0], (name, lines[0], expected)
        assert "step      1/" not in r["stdout"], name  # found before training started


@pytest.mark.slow
def test_export_loads_in_transformers_with_our_logits(trained, tmp_path):
    tokens = torch.randint(0, DEBUG.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    # The final export of the run: bf16 weights, one model.safetensors.
    assert sorted(p.name for p in (trained / "step-2-hf").iterdir()) == [
        "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]  # the byte tokenizer's
    checkpoint = load_model(trained / "step-2")
    exported = load_model(trained / "step-2-hf")
    assert exported.args.ffn_dim == DEBUG.ffn_dim and exported.args.n_layers == DEBUG.n_layers
    # The export holds the checkpoint's weights rounded to bf16.
    assert all(torch.equal(v, checkpoint.state_dict()[k].to(torch.bfloat16).float())
               for k, v in exported.state_dict().items())
    with torch.no_grad():
        ours_bf16 = exported.logits(tokens)
    torch.testing.assert_close(_hf_logits(trained / "step-2-hf", tokens), ours_bf16, atol=1e-4, rtol=0)
    # scripts/convert_checkpoint.py: fp32, sharded.
    out = tmp_path / "hf32"
    proc = subprocess.run([sys.executable, CONVERT, "export", str(trained), str(out), "--dtype=float32",
                           "--max-shard-size=1MB"], capture_output=True, text=True, env=env(), cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    with torch.no_grad():
        ours = checkpoint.logits(tokens)
    torch.testing.assert_close(_hf_logits(out, tokens), ours, atol=1e-4, rtol=0)


@pytest.mark.slow
def test_import_hf_weights_as_initial_load_path(trained, tmp_path):
    imported = tmp_path / "imported"
    proc = subprocess.run([sys.executable, CONVERT, "import", str(trained / "step-2-hf"), str(imported),
                           "--flavor=debug"], capture_output=True, text=True, env=env(), cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    _, weights = load_full_model_weights(trained / "step-2")
    info, back = load_full_model_weights(imported)
    assert info["kind"] == "model_only"
    assert all(torch.equal(back[k], weights[k].to(torch.bfloat16)) for k in weights)
    # Wrong flavor: one line naming config.json.
    bad = subprocess.run([sys.executable, CONVERT, "import", str(trained / "step-2-hf"), str(tmp_path / "x"),
                          "--flavor=debug", "--n-layers=2"], capture_output=True, text=True, env=env(), cwd=REPO)
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0
    assert "config.json: num_hidden_layers=4 but the trainer model has 2" in bad.stderr

    # A new run starts from the imported weights: its step-1 loss is this model's loss on the first batch.
    run = _run([*EXACT, "--train.steps=1", f"--checkpoint.initial_load_path={imported}"], tmp_path / "run")
    assert f"loaded model weights from {imported}" in run.stdout
    _, expected = first_batch_loss(imported, vocab_size=DEBUG.vocab_size)
    assert abs(losses_by_step(tmp_path / "run")[1] - expected) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("async_mode", ["disabled", "async"])
def test_each_save_logs_how_long_it_blocked_training(tmp_path: Path, async_mode: str):
    proc = _run([*ARGS, "--train.steps=4", "--checkpoint.enable=true", "--checkpoint.interval=2",
                 f"--checkpoint.async_mode={async_mode}"],
                tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    blocked = re.findall(r"checkpoint step-(\d+): blocked training (\d+\.\d+) s \((.*?)\)", proc.stdout)
    saved = {int(m[0]): float(m[1]) for m in re.findall(r"saved checkpoint \S+/step-(\d+) \([\d.,]+ MiB, (\d+\.\d+) s\)",
                                                       proc.stdout)}
    assert [int(b[0]) for b in blocked] == [2, 4] and sorted(saved) == [2, 4], proc.stdout[-3000:]
    for step, seconds, detail in blocked:
        if async_mode == "disabled":
            assert detail.startswith("synchronous save") and float(seconds) >= saved[int(step)]
        else:
            # Training waits for the previous save (if still writing), the state dict and the staging copy, not
            # the write.
            previous, preparing, staging = map(float, re.fullmatch(
                r"previous save (\d+\.\d+) s, preparing (\d+\.\d+) s, staging (\d+\.\d+) s", detail).groups())
            assert float(seconds) == pytest.approx(previous + preparing + staging, abs=0.016)
