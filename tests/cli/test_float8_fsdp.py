"""FP8 with FSDP2 through the trainer under torchrun: the console prints none of the libraries' noise. 2 gloo ranks
with fp8 all-gather against 1 rank (spawned functions): tests/distributed/test_float8_fsdp.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.test_float8_fsdp import ARGS
from tests.helpers import launch
from trainer.log import KNOWN_WARNINGS


# What torch and torchao print on every rank of such a run unless trainer.log filters it.
LIBRARY_NOISE = ("Detected that context_fn is passed", "checkpointed region does not contain in-place ops",
                 "KernelPreference", "No CUDA runtime is found", "Failed to load")


@pytest.mark.slow  # starts 2 processes
def test_selective_ac_compile_fp8_prints_no_library_noise(tmp_path: Path) -> None:
    # The console of a torchrun launch is what is tested (every rank's output, as a user sees it): the CLI stays.
    # fp32 master weights (bf16 ones: tests/cli/test_bf16_master.py).
    proc = launch([*ARGS, "--train.steps=2", "--train.seq_len=32", "--distributed.dp_shard=2",
                   "--train.activation_checkpointing=selective", "--train.compile_model=true",
                   "--distributed.master_dtype=fp32", "--float8.enable_fsdp_float8_all_gather=true",
                   f"--job.dump_folder={tmp_path}"], nproc=2)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert [line for line in out.splitlines() if any(noise in line for noise in LIBRARY_NOISE)] == []
    # Explained once, by rank 0, in our words.
    explanation = next(k.explanation for k in KNOWN_WARNINGS if k.logger == "torch._higher_order_ops.wrap")
    assert [line for line in out.splitlines() if explanation in line] == [
        line for line in out.splitlines() if line.startswith("[rank0 ") and explanation in line]
    assert out.count(explanation) == 1
    assert "step      2/2" in proc.stdout
