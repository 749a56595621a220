"""metrics.wandb (trainer/metrics/wandb_run.py): an offline W&B run records what TensorBoard gets, with the resolved
config; a resumed run continues the same W&B run; a missing package is a config error; a failed login or a failed
log is one warning and training goes on. The offline run's records are read back from its .wandb file."""

from __future__ import annotations

import json
import logging
import struct
from pathlib import Path

import pytest

from tests.helpers import DEBUG_CONFIG
from trainer.config import ConfigError, load_job_config

wandb = pytest.importorskip("wandb")


def read_wandb_records(path: Path) -> list:
    """The protobuf Records of an offline run's .wandb file: a 7-byte header, then LevelDB-log blocks of 32 KiB whose
    chunks are (crc32 4, length 2, type 1: full, first, middle, last) + data."""
    from wandb.proto import wandb_internal_pb2

    data, records, pending, pos = path.read_bytes(), [], b"", 7
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # full or last: one record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def history(records: list) -> dict[int, dict[str, float]]:
    steps = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            steps[int(items.pop("_step"))] = items
    return steps


def config_of(records: list) -> dict:
    """The W&B config: the run record's, then any config record's updates."""
    updates = [i for r in records if r.WhichOneof("record_type") == "run" for i in r.run.config.update]
    updates += [i for r in records if r.WhichOneof("record_type") == "config" for i in r.config.update]
    return {i.key: json.loads(i.value_json) for i in updates}


def train(dump: Path, steps: int) -> list[dict]:
    from trainer.distributed import destroy_distributed
    from trainer.run.train import build_trainer

    cfg = load_job_config(["--config", DEBUG_CONFIG, f"--train.steps={steps}", "--metrics.log_freq=1",
                           "--metrics.wandb=true", "--metrics.wandb_project=tests", "--metrics.wandb_tags=a,b",
                           "--checkpoint.enable=true", "--checkpoint.interval=4", f"--job.dump_folder={dump}"])
    trainer = build_trainer(cfg)
    try:
        trainer.run()
    finally:
        trainer.close()
        destroy_distributed()
    return [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]


def test_an_offline_run_records_the_metrics_and_a_resume_continues_it(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    dump = tmp_path / "my-run"
    try:
        train(dump, steps=4)
        resumed = train(dump, steps=6)  # resumes the step-4 checkpoint
    finally:
        wandb.teardown()
    run_id = json.loads((dump / "wandb_run.json").read_text())["id"]
    first, second = sorted((dump / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))  # one W&B run
    records = read_wandb_records(first)
    logged = history(records)
    assert sorted(logged) == [1, 2, 3, 4]
    jsonl = {r["step"]: r for r in json.loads("[" + ",".join(
        (dump / "metrics.jsonl").read_text().splitlines()) + "]")}
    for step, scalars in logged.items():  # what TensorBoard gets, under its names
        assert scalars["train/loss"] == pytest.approx(jsonl[step]["loss"], rel=1e-6)
        assert {"train/grad_norm", "train/lr", "perf/tokens_per_second", "memory/peak_gib"} <= scalars.keys()
    config = config_of(records)
    assert config["model"]["flavor"] == "debug" and config["train"]["steps"] == 4  # the resolved config
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert (run.project, run.display_name, list(run.tags)) == ("tests", "my-run", ["a", "b"])
    assert sorted(history(read_wandb_records(second))) == [5, 6]
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5, 6]


def test_a_failed_login_or_log_is_one_warning_and_training_goes_on(tmp_path: Path, monkeypatch, caplog) -> None:
    from trainer.metrics.logger import MetricsLogger, StepStats
    from trainer.metrics.wandb_run import WandbOptions, WandbRun

    import torch

    options = WandbOptions(project="tests", entity="", run_name="", group="", tags=())
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "config"))  # no saved login
    monkeypatch.setenv("WANDB_SILENT", "true")
    with caplog.at_level(logging.WARNING, logger="trainer"):
        assert WandbRun.start(options, dump_folder=str(tmp_path), config={}, resumed=False) is None
    assert [r.message.split(" (")[0] for r in caplog.records] == ["metrics.wandb: W&B did not start"]

    class Broken:
        def log(self, *args, **kwargs):
            raise ConnectionError("the service went away")

    logger = MetricsLogger(dump_folder=str(tmp_path / "run"), rank=0, total_steps=3, flops_per_token=1.0,
                           peak_flops=None, device=torch.device("cpu"), enable_tensorboard=False, enable_jsonl=True,
                           loss_spike_factor=3.0, fp8_converted_fraction=None)
    logger.wandb = WandbRun(Broken())
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="trainer"):
        for step in (1, 2, 3):
            logger.log(StepStats(step=step, loss=2.0, grad_norm=1.0, lr=1e-3, tokens=10, seconds=1.0,
                                 steps_in_interval=1), first_step=1)
    logger.close()
    warnings = [r.message for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "logging step 1 to W&B failed (ConnectionError" in warnings[0]
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 3  # the rest of the run logged


def test_wandb_without_the_package_is_a_config_error(monkeypatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"^metrics.wandb=true needs the wandb package: "
                                          r"pip install 'trainer\[wandb\]'"):
        load_job_config(["--metrics.wandb=true"])
