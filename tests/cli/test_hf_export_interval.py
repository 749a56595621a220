"""checkpoint.export_interval (Hugging Face exports while training), one process: `step-N-hf/` every N steps, each the
weights of its step, which transformers loads with our model's logits (the tolerance of tests/cli/test_hf_import.py);
export_keep_latest_k prunes the older ones. Two ranks under FSDP: tests/distributed/test_hf_export_interval.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers import FAST, launch_ok

pytestmark = pytest.mark.slow

ARGS = [*FAST, "--train.seq_len=32", "--train.steps=4", "--checkpoint.export_interval=2"]


def test_exports_every_interval_are_their_steps_weights_in_transformers(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from tests.unit.test_hf_models import hf_model
    from trainer.checkpoint import load_model

    dump = tmp_path / "run"
    run = launch_ok([*ARGS, "--checkpoint.enable=true", "--checkpoint.interval=2", "--checkpoint.export_dtype=float32"],
                    dump, timeout=180)
    folder = dump / "checkpoint"
    assert sorted(p.name for p in folder.iterdir()) == ["step-2", "step-2-hf", "step-4", "step-4-hf"]
    assert "Hugging Face exports: every 2 steps into" in run.stdout
    assert "export step-2-hf: blocked training" in run.stdout and "writing in the background" in run.stdout
    tokens = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    for step in (2, 4):
        export = folder / f"step-{step}-hf"
        assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in export.iterdir()}
        assert json.loads((export / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
        with torch.no_grad():
            ours = load_model(folder / f"step-{step}").logits(tokens)  # the checkpoint of the same step
            theirs = hf_model(export)(tokens).logits
        torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-5)
    # Not vacuous: the two exports hold different weights (step 2's are not step 4's).
    with torch.no_grad():
        assert not torch.allclose(hf_model(folder / "step-2-hf")(tokens).logits, ours, rtol=1e-4, atol=1e-5)


def test_export_keep_latest_k_keeps_the_newest(tmp_path: Path) -> None:
    dump = tmp_path / "run"
    run = launch_ok([*ARGS, "--checkpoint.export_keep_latest_k=1"], dump, timeout=180)
    folder = dump / "checkpoint"
    assert sorted(p.name for p in folder.iterdir()) == ["step-4-hf"]  # no checkpoint, no leftover .tmp
    assert f"removed {folder / 'step-2-hf'} (checkpoint.export_keep_latest_k=1)" in run.stdout


@pytest.mark.parametrize("on_error", ["stop", "continue"])
def test_a_failed_export_stops_the_run_or_is_logged_as_on_save_error_says(tmp_path: Path, on_error: str) -> None:
    from tests.helpers import launch

    dump = tmp_path / "run"
    (dump / "checkpoint").mkdir(parents=True)
    (dump / "checkpoint" / "step-2-hf").write_text("a file where step 2's export goes\n")  # the write refuses it
    proc = launch([*ARGS, f"--checkpoint.on_save_error={on_error}", f"--job.dump_folder={dump}"], timeout=180)
    said = proc.stdout + proc.stderr
    failed = (f"export step-2-hf failed to write into {dump / 'checkpoint'}: OutputFolderError: refusing to export "
              f"into {dump / 'checkpoint' / 'step-2-hf'}: it is a file, not a folder")
    assert failed in said and "Traceback" not in said
    assert (dump / "checkpoint" / "step-2-hf").read_text() == "a file where step 2's export goes\n"  # untouched
    if on_error == "stop":  # at the next step, before it exports again
        assert proc.returncode != 0 and "(checkpoint.on_save_error=continue would keep training)" in said
        assert sorted(p.name for p in (dump / "checkpoint").iterdir()) == ["step-2-hf"]
    else:
        assert proc.returncode == 0, said[-3000:]
        assert "training continues (checkpoint.on_save_error=continue)" in said
        assert sorted(p.name for p in (dump / "checkpoint").iterdir()) == ["step-2-hf", "step-4-hf"]
