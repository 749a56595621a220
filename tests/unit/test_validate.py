"""The one validation pass: every user error is found before distributed init, as one line naming the key (the
command line's answers, --help among them: tests/cli/test_validate.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import trainer.run.train
from tests.helpers import DEBUG_CONFIG
from trainer.config import load_job_config
from trainer.data import DataError, write_shard
from trainer.data.tokenizer import ByteTokenizer
from trainer.errors import ConfigError, UserError
from trainer.validate import validate_job


def _cfg(*args: str):
    return load_job_config(["--config", DEBUG_CONFIG, *args])


@pytest.mark.parametrize(
    "world_size, args, message",
    [
        (3, ["--distributed.dp_replicate=2"], "world size 3 is not divisible by dp_replicate*cp*tp*pp = 2*1*1*1 = 2"),
        (4, ["--distributed.dp_shard=3"], "dp_replicate*dp_shard*cp*tp*pp = 1*3*1*1*1 = 3, but WORLD_SIZE=4"),
        (2, ["--model.flavor=7b"], "model.flavor='7b' is not one of"),
        (8, ["--distributed.tp=8"], "distributed.tp=8 must divide the model's n_heads=4 and n_kv_heads=2"),
        (2, ["--distributed.ep=2"], "distributed.ep=2 needs an MoE model, but model.flavor='debug' is dense"),
        (4, ["--distributed.ep=2", "--distributed.tp=2"], "expert parallel together with tensor parallel"),
        (6, ["--distributed.ep=4"], "distributed.ep=4 must divide distributed.dp_shard x distributed.cp = 6 x 1"),
        (4, ["--distributed.cp=4", "--train.seq_len=100"],
         "train.seq_len=100 with distributed.cp=4: each sequence is cut into 2 x cp = 8 chunks"),
        (4, ["--distributed.cp=2", "--distributed.tp=2"], "distributed.cp=2 with distributed.tp=2: context parallel "
                                                        "together with tensor parallel is not supported"),
        (2, ["--model.flavor=debug_moe", "--distributed.cp=2", "--moe.capacity_factor=1.0"],
         "moe.capacity_factor=1.0 with distributed.cp=2: capacity keeps the earliest positions"),
        (3, ["--distributed.pp=2"], "distributed.pp=2 does not divide the world size 3"),
        (2, ["--distributed.pp=2", "--distributed.pipeline_schedule=ZBVZeroBubble", "--validation.enable=true"],
         "validation.enable=true with distributed.pipeline_schedule='ZBVZeroBubble'"),
        (1, ["--train.mixed_precision=fp8", "--float8.exclude_fqns=layers.9.attention.q_proj"],
         "layers.9.attention.q_proj"),
        (1, ["--data.source=shards", "--data.path=/nonexistent/dir"], "no shard files found at data.path='/nonexistent/dir'"),
        # Batch 1 under full AC: the memory plan fits the host, the default text is too short.
        (1, ["--train.seq_len=600000", "--train.batch_size=1", "--train.activation_checkpointing=full"],
         "lower --train.seq_len"),
    ],
)
def test_validate_job_names_the_key(world_size: int, args: list[str], message: str) -> None:
    with pytest.raises(UserError) as e:
        validate_job(_cfg(*args), world_size=world_size)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_errors_come_before_distributed_init(monkeypatch) -> None:
    """train() validates first: a bad degree or shard is found before the process group exists, and only then handed
    to agree_to_start (which joins the group to tell the other ranks, trainer.validate.ranks); no Trainer is built."""
    found = []

    def agree(error, *, timeout_seconds: int) -> None:
        found.append(error)
        if error is not None:
            raise error

    def must_not_run(**kwargs):
        raise AssertionError("init_distributed ran before validation finished")

    monkeypatch.setattr(trainer.run.train, "agree_to_start", agree)
    monkeypatch.setattr(trainer.run.train, "init_distributed", must_not_run)
    monkeypatch.setenv("WORLD_SIZE", "8")
    with pytest.raises(ConfigError, match="distributed.tp=8 must divide"):
        trainer.run.train.train(_cfg("--distributed.tp=8"))
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(DataError, match="no shard files"):
        trainer.run.train.train(_cfg("--data.path=/nonexistent/dir"))
    assert [type(e) for e in found] == [ConfigError, DataError]


def test_validate_job_resolves_degrees_and_options() -> None:
    job = validate_job(_cfg("--distributed.dp_replicate=2", "--train.mixed_precision=bf16"), world_size=8)
    pd = job.parallel_dims
    assert (pd.dp_replicate, pd.dp_shard, pd.tp, pd.dp) == (2, 4, 1, 8)
    assert not job.build.fsdp.reshard_after_forward  # dp_shard > 1, but the gathered weights fit: kept (ZeRO-2)
    assert validate_job(_cfg("--distributed.dp_replicate=2", "--distributed.reshard_after_forward=always"),
                        world_size=8).build.fsdp.reshard_after_forward
    one = validate_job(_cfg("--train.mixed_precision=bf16"), world_size=1)
    assert not one.build.fsdp.reshard_after_forward  # nothing to free on a 1-rank shard group
    assert job.build.float8 is None


def test_profiling_window_is_checked_only_when_profiling() -> None:
    _cfg("--profiling.start_step=8")  # profiling off: the window is irrelevant and accepted
    with pytest.raises(ConfigError, match="profiling.start_step=8, profiling.end_step=5"):
        _cfg("--profiling.enable=true", "--profiling.start_step=8")
    with pytest.raises(ConfigError, match="profiling.start_step=0, profiling.end_step=5"):
        _cfg("--profiling.enable=true", "--profiling.start_step=0")


@pytest.mark.parametrize("key", ["train.max_norm", "optimizer.lr", "scheduler.min_lr_ratio"])
@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_non_finite_floats_are_rejected(key: str, value: str) -> None:
    with pytest.raises(ConfigError, match=f"{key}={value!r} must be a finite number|{key}=.* must be a finite"):
        _cfg(f"--{key}={value}")


def test_dead_keys_are_gone() -> None:
    for key in ("model.name=mistral", "optimizer.name=adamw", "distributed.sp=2"):
        with pytest.raises(ConfigError, match="unknown key"):
            _cfg(f"--{key}")


def test_data_path_implies_shards(tmp_path: Path) -> None:
    write_shard(tmp_path / "a.bin", np.arange(2000) % 258, vocab_size=258, tokenizer_fingerprint=ByteTokenizer.fingerprint)
    # The debug TOML says source='default'; a path on the command line means shards.
    cfg = _cfg(f"--data.path={tmp_path}")
    assert cfg.data.source == "shards"
    assert f"ShardSource(1 shards in {tmp_path}" in repr(validate_job(cfg, world_size=1).data_source)
    # An explicit source on the same layer wins (and is then checked).
    assert _cfg(f"--data.path={tmp_path}", "--data.source=synthetic").data.source == "synthetic"
    toml = tmp_path / "c.toml"
    toml.write_text(f'[data]\npath = "{tmp_path}"\n')
    assert load_job_config(["--config", str(toml)]).data.source == "shards"


def test_runtime_errors_that_are_not_user_errors_keep_their_traceback(monkeypatch, capsys) -> None:
    """A ValueError from inside torch is a bug or an environment failure: not a one-line 'config error'."""
    from trainer import cli

    def broken(cfg):
        raise ValueError("something inside torch")

    monkeypatch.setattr(trainer.run.train, "train", broken)
    with pytest.raises(ValueError, match="something inside torch"):
        cli.main(["--config", DEBUG_CONFIG])


def test_seq_len_beyond_the_flavor_is_a_logged_choice(caplog, monkeypatch) -> None:
    import logging

    monkeypatch.setattr(logging.getLogger("trainer"), "propagate", True)  # setup_logging may have run
    job = validate_job(_cfg("--train.seq_len=9000", "--data.source=synthetic"), world_size=1)
    assert job.model_args.max_seq_len == 9000
    assert "train.seq_len=9000 is longer than the model's max_seq_len=8192 (model.flavor='debug')" in caplog.text


def test_loss_chunk_tokens_reaches_the_build_and_one_chunk_is_a_logged_waste(caplog, monkeypatch) -> None:
    import logging

    monkeypatch.setattr(logging.getLogger("trainer"), "propagate", True)  # setup_logging may have run
    job = validate_job(_cfg("--train.loss_chunk_tokens=100", "--train.batch_size=2", "--train.seq_len=64"),
                       world_size=1)
    assert job.build.loss_chunk_tokens == 100 and "loss_chunk_tokens" not in caplog.text
    assert validate_job(_cfg("--train.batch_size=2", "--train.seq_len=64"), world_size=1).build.loss_chunk_tokens == 0
    validate_job(_cfg("--train.loss_chunk_tokens=128", "--train.batch_size=2", "--train.seq_len=64"), world_size=1)
    assert "train.loss_chunk_tokens=128 >= the 128 tokens of a microbatch" in caplog.text
