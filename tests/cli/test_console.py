"""The console of multi-process runs: a short header from rank 0, each warning once, the per-layer detail in files.

The quick, one-process counterpart is tests/cli/test_train.py::test_console_is_a_short_header_and_the_values_used_go_to_files.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import REPO, fp8_linear_counts, launch, lines_before_step_1
from trainer.models import FLAVORS

MOE = str(REPO / "configs" / "train" / "debug_moe.toml")
PP = str(REPO / "configs" / "train" / "debug_pp.toml")


def _header(proc) -> list[str]:
    """What a user sees before step 1: stdout up to the step line, and stderr (torchrun's banner, warnings)."""
    return lines_before_step_1(proc.stdout) + proc.stderr.splitlines()


@pytest.mark.slow  # starts 2-4 processes
@pytest.mark.parametrize("layout, nproc, args, converted", [
    ("moe-pp2-ep2", 4, ["--config", MOE, "--distributed.pp=2", "--distributed.ep=2"],
     fp8_linear_counts(FLAVORS["debug_moe"])),
    ("pp2-interleaved", 2, ["--config", PP], fp8_linear_counts(FLAVORS["debug"])),
])
def test_header_is_short_from_rank_0_and_warns_once(tmp_path: Path, layout: str, nproc: int, args: list[str],
                                                   converted: tuple[int, int]) -> None:
    # loss_chunk_tokens above the tokens of a microbatch: a job warning (one chunk saves nothing) every rank meets.
    proc = launch([*args, "--train.steps=1", "--train.seq_len=32", "--train.mixed_precision=fp8",
                   "--train.loss_chunk_tokens=100000", "--metrics.enable_tensorboard=false",
                   f"--job.dump_folder={tmp_path}"], nproc=nproc)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    header = _header(proc)
    text = "\n".join(header)
    assert len(header) <= 30, text
    ours = [line for line in header if line.startswith("[rank")]
    assert ours and all(line.startswith("[rank0 ") for line in ours), text  # rank 0 only
    # Every rank meets the same warning; the job prints it once. No advice to compile fp8 on a CPU (docs/fp8.md).
    assert text.count("train.loss_chunk_tokens=100000 >= the") == 1, text
    assert "compile_model" not in text, text
    # FSDP2's "returned a view tensor" warning (seen under PP once) does not come back.
    assert "view tensor" not in proc.stdout + proc.stderr
    # One line for the whole model's FP8 decisions and one for the split, not one per stage.
    done, total = converted
    assert "FP8 over all " in text and f"converted {done}/{total} Linear layers" in text
    assert text.count("pipeline split") == 1 and "FP8 on pipeline stage" not in text
    fates = json.loads((tmp_path / "fp8_layers.json").read_text())["layers"]  # the per-layer detail, every stage
    assert len(fates) == total and sum(fate == "converted" for fate in fates.values()) == done
    assert "fp8_layers.json" in text
