"""The Trainer built in-process: a compiled CPU run compiles the model; the optimizer runs eagerly there. The end-to-end runs of
the debug config (the trainer as a command): tests/cli/test_train.py."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.helpers import DEBUG_CONFIG
from trainer.config import load_job_config
from trainer.distributed import destroy_distributed
from trainer.run.train import build_trainer


def test_a_compiled_cpu_run_updates_bf16_master_weights_eagerly(tmp_path: Path) -> None:
    """On a GPU the update of bf16 master weights is the Triton kernel (trainer/optim/kernel.py); a CPU has no Triton, and
    train.compile_model compiles the model there, never the optimizer (inductor's CPU codegen of the update had not
    finished the debug model's first step in 15 minutes)."""
    from trainer.optim.adamw import AdamW

    cfg = load_job_config(["--config", DEBUG_CONFIG, "--train.steps=1", "--train.mixed_precision=fp8",
                           "--train.compile_model=true", f"--job.dump_folder={tmp_path}",
                           "--metrics.enable_tensorboard=false"])
    trainer = build_trainer(cfg)
    try:
        assert isinstance(trainer.optimizer, AdamW) and trainer.optimizer.implementation == "eager"
        assert isinstance(trainer.model.layers["0"], torch._dynamo.eval_frame.OptimizedModule)  # the blocks compile
    finally:
        trainer.close()
        destroy_distributed()
