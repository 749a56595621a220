"""scripts/generate.py's bad input is one line that says what is wrong (exit 2, no traceback), checked before anything
is read: a path that does not exist, a device this machine does not have; a checkpoint without a tokenizer says
why it has none (an import of a folder without one), and so does an export of it. Sampling itself:
tests/cli/test_hf_moe.py; hostile and crafted checkpoints: tests/faults/."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.faults.test_tokenizer_confinement import one_line_error, run_scripts
from trainer.checkpoint import RunInfo, save_model_only
from trainer.models import FLAVORS, build_model


def _import_without_tokenizer(tmp_path: Path) -> tuple[Path, Path]:
    """What `convert_checkpoint.py import` writes from a folder that holds no tokenizer.json: (checkpoint, folder)."""
    model = build_model(FLAVORS["debug"])
    model.init_weights(seed=0)
    source = tmp_path / "hf-without-tokenizer"
    out = save_model_only(tmp_path / "imported", {k: v.detach() for k, v in model.state_dict().items()},
                          run=RunInfo(flavor="imported", model_args=FLAVORS["debug"], mixed_precision="hf-import"),
                          source=str(source))
    return out, source


def test_bad_paths_and_devices_are_one_line(tmp_path: Path) -> None:
    imported, source = _import_without_tokenizer(tmp_path)
    missing = tmp_path / "no-such-run"
    cases = {
        "missing": ("generate", [str(missing), "--max-new-tokens=2"]),
        "bogus device": ("generate", [str(imported), "--tokenizer=byte", "--device=gpu0"]),
        "no tokenizer": ("generate", [str(imported), "--max-new-tokens=2"]),
        "export": ("convert_checkpoint", ["export", str(imported), str(tmp_path / "hf"), "--dtype=float32"]),
    }
    if not torch.cuda.is_available():
        cases["cuda"] = ("generate", [str(imported), "--tokenizer=byte", "--device=cuda"])
    results = run_scripts(cases)
    # Blamed on the path, not on a tokenizer it could not find there.
    one_line_error(results["missing"], f"{missing} does not exist: give a step-N checkpoint folder")
    assert "tokenizer" not in results["missing"]["stderr"]
    one_line_error(results["bogus device"], "--device='gpu0' is not a device: use cpu, cuda or cuda:N")
    if "cuda" in cases:
        one_line_error(results["cuda"], "--device=cuda but this machine has no CUDA GPU", "use --device=cpu")
    # An import of a folder without a tokenizer is not "a synthetic-data run": generation and export say why.
    why = f"imported from {source}, which holds no tokenizer.json"
    one_line_error(results["no tokenizer"], f"{imported} names no tokenizer ({why}); pass --tokenizer=PATH")
    export = results["export"]
    assert export["rc"] == 0, export
    assert f"records no tokenizer ({why}): the export has none; --tokenizer=PATH" in export["stderr"] + export["stdout"]
    assert "synthetic" not in export["stderr"] + export["stdout"]
