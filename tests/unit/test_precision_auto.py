"""train.mixed_precision='auto' (trainer/validate/precision.py): the choice per GPU generation, parallelism and
recipe, the startup line that says it, and the run files (config.toml as given, resolved.toml as chosen)."""

from __future__ import annotations

import logging
import tomllib

import pytest

from trainer.config import load_job_config
from trainer.validate import validate_job
from trainer.validate.memory import Target, planned_gpus
from trainer.validate.precision import choose_precision

H100 = Target(device_type="cuda", memory=None, capability=(9, 0), name="GPU 0 (NVIDIA H100 80GB HBM3)")


@pytest.mark.parametrize("capability, argv, chosen", [
    ((9, 0), [], "fp8"),
    ((8, 9), [], "fp8"),  # Ada: FP8 tensor cores
    ((8, 9), ["--float8.recipe=blockwise"], "bf16"),  # blockwise needs sm90
    ((8, 0), [], "bf16"),
    ((7, 5), [], "fp16"),
    ((9, 0), ["--distributed.tp=2"], "bf16"),  # FP8 + TP is not supported
])
def test_auto_picks_by_gpu_generation_recipe_and_layout(capability, argv, chosen) -> None:
    cfg = load_job_config(["--train.mixed_precision=auto", *argv])
    target = Target(device_type="cuda", memory=None, capability=capability, name="GPU 0 (test)")
    precision, why = choose_precision(cfg, target)
    assert precision == chosen and f"compute capability {capability[0]}.{capability[1]}" in why
    assert choose_precision(cfg, Target(device_type="cpu", memory=None))[0] == "fp32"
    assert choose_precision(load_job_config(["--train.mixed_precision=auto"]), planned_gpus(80))[0] == "fp8"


def test_auto_resolves_before_validation_and_says_so(caplog) -> None:
    argv = ["--config", "configs/train/debug_model.toml", "--train.mixed_precision=auto"]
    with caplog.at_level(logging.INFO, logger="trainer"):
        job = validate_job(load_job_config(argv), world_size=1, target=Target(device_type="cpu", memory=None))
    assert job.run.mixed_precision == "fp32" and job.build.float8 is None
    assert "train.mixed_precision='auto': fp32 (no GPU: on a CPU reduced precision is emulated" in caplog.text
    files = dict(job.run_files)
    assert tomllib.loads(files["config.toml"])["train"]["mixed_precision"] == "auto"  # as given: relaunchable
    assert tomllib.loads(files["resolved.toml"])["train"]["mixed_precision"] == "fp32"
    on_h100 = validate_job(load_job_config([*argv, "--float8.emulate=true"]), world_size=1,
                           target=Target(device_type="cpu", memory=None, capability=(9, 0)))
    assert on_h100.run.mixed_precision == "fp32"  # a CPU target decides, whatever a capability says
    planned = validate_job(load_job_config(argv), world_size=1, target=planned_gpus(80))
    assert planned.run.mixed_precision == "fp8" and planned.build.float8 is not None
    assert planned.build.fsdp.master_dtype.itemsize == 2  # master_dtype 'auto' follows the chosen precision
