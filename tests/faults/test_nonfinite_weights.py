"""Weights holding NaN or Inf (issue 36, item 6): loading them for generation or a run is one line naming the
tensors; export and import carry them and warn the same line (they were accepted silently, and generation failed
with `RuntimeError: probability tensor contains either inf, nan ...`)."""

from __future__ import annotations

import pytest
import torch

from tests.faults.test_hostile_checkpoint import ARGS, DEBUG
from tests.faults.test_tokenizer_confinement import one_line_error, run_scripts
from tests.helpers import launch
from trainer.checkpoint import CheckpointError, RunInfo, load_model, save_model_only

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def diverged(tmp_path_factory):
    """A model-only checkpoint of the debug model whose q_proj of block 1 holds 2 NaN and 1 Inf."""
    from trainer.hf import expected_shapes

    torch.manual_seed(0)
    weights = {k: torch.randn(shape) * 0.02 for k, shape in expected_shapes(DEBUG).items()}
    q = weights["layers.1.attention.q_proj.weight"]
    q[0, 0] = q[3, 5] = float("nan")
    q[7, 1] = float("inf")
    run = RunInfo(flavor="debug", model_args=DEBUG, mixed_precision="fp32", tokenizer="byte",
                  tokenizer_fingerprint="byte-v1")
    return save_model_only(tmp_path_factory.mktemp("nan") / "ckpt", weights, run=run, source="test")


LINE = "the weights are not finite: 1 of"
TENSOR = "layers.1.attention.q_proj.weight (2 NaN, 1 Inf of"


def test_load_model_refuses_non_finite_weights_in_one_line(diverged):
    with pytest.raises(CheckpointError) as e:
        load_model(diverged)
    assert LINE in str(e.value) and TENSOR in str(e.value) and "\n" not in str(e.value)


def test_generate_refuses_and_export_and_import_warn(diverged, tmp_path):
    results = run_scripts({
        "generate": ("generate", [str(diverged), "--max-new-tokens=2"]),
        "export": ("convert_checkpoint", ["export", str(diverged), str(tmp_path / "hf"), "--dtype=float32"]),
        "import": ("convert_checkpoint", ["import", str(tmp_path / "hf"), str(tmp_path / "imported")]),
        "generate_hf": ("generate", [str(tmp_path / "hf"), "--max-new-tokens=2"]),
    })
    one_line_error(results["generate"], LINE, TENSOR)
    one_line_error(results["generate_hf"], LINE, TENSOR)
    for name in ("export", "import"):
        assert results[name]["rc"] == 0, results[name]
        logged = results[name]["stdout"] + results[name]["stderr"]  # convert_checkpoint logs to stdout
        warnings = [line for line in logged.splitlines() if LINE in line]
        assert len(warnings) == 1 and TENSOR in warnings[0] and "WARNING" in warnings[0], logged


def test_a_run_refuses_non_finite_initial_weights_in_one_line(diverged, tmp_path):
    proc = launch([*ARGS, "--train.steps=1", f"--checkpoint.initial_load_path={diverged}",
                   f"--job.dump_folder={tmp_path}"], timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error")]
    # The run checks every loaded tensor by its part's rule (trainer/tensor_values.py), the weights too.
    named = (f"{diverged}: model.{TENSOR.split(' (')[0]} holds 3 non-finite values (2 NaN, 1 Inf of 16,384; first at "
             "[0, 0])")
    assert len(errors) == 1 and named in errors[0] and "start from other weights" in errors[0], errors
