"""Config and command-line values that had no bound (issue 51, item 5), each now one `ConfigError` line naming the
key before anything is built: a control character in any string key (config.toml and resolved.toml became invalid
TOML, every 2-rank run crashed in the rank check, W&B at startup), FP8 delayed-scaling values past what the scale can
hold, a RoPE base at or below 1, and the dry run's --world-size and --gpu-memory-gib. The writer side: any string
round-trips through `to_toml`. (The mixture's bounds: tests/unit/test_mix.py; the CPU memory plan:
tests/unit/test_memory_plan.py.)"""

from __future__ import annotations

import contextlib
import io
import random

import pytest

from tests.helpers import DEBUG_CONFIG
from trainer.config import load_job_config
from trainer.config.sections import to_toml
from trainer.errors import ConfigError
from trainer.model_values import values_problem
from trainer.validate import validate_job

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    import tomli as tomllib


def _refused(*args: str) -> str:
    with pytest.raises(ConfigError) as e:
        load_job_config(["--config", DEBUG_CONFIG, *args])
    assert "\n" not in str(e.value), str(e.value)
    return str(e.value)


@pytest.mark.parametrize("arg, line", [
    ("--job.description=first\nsecond", "job.description='first\\nsecond' holds the control character '\\n' (a config "
                                        "value is one line of text); remove it"),
    ("--metrics.wandb_project=a\rb", "metrics.wandb_project='a\\rb' holds the control character '\\r'"),
    ("--checkpoint.folder=ck\tpt", "checkpoint.folder='ck\\tpt' holds the control character '\\t'"),
    ("--float8.exclude_fqns=output_head,layers.0\x1b[31m", "float8.exclude_fqns[1]='layers.0\\x1b[31m' holds the "
                                                           "control character '\\x1b'"),
    ("--data.mix=web\x85=a:1", "data.mix[0].name='web\\x85' holds the control character '\\x85'"),
    ("--job.description=line\u2028separator", "job.description='line\\u2028separator' holds the control character"),
    ("--job.description=\udcff", "job.description='\\udcff' holds '\\udcff', a byte the command line's encoding could "
                                 "not decode (config values are UTF-8 text); remove it"),
    ("--data.path=shards\x00", "data.path='shards\\x00' holds a NUL byte (\\x00), which no path or name can contain"),
], ids=["newline", "carriage-return", "tab", "escape-in-a-list", "c1-in-a-mix-table", "line-separator",
        "undecodable-byte", "nul"])
def test_a_control_character_in_any_string_key_is_one_line(arg: str, line: str) -> None:
    """One check over every string of every section, list items and [[data.mix]] tables included."""
    assert _refused(arg).startswith(line)


def test_printable_text_in_any_language_is_kept_and_written_back() -> None:
    cfg = load_job_config(["--config", DEBUG_CONFIG, '--job.description=été, 学习, 😀 "quoted" \\back'])
    assert tomllib.loads(cfg.to_toml())["job"]["description"] == 'été, 学习, 😀 "quoted" \\back'


def test_any_string_round_trips_through_to_toml() -> None:
    """The writer escapes what a TOML string may not hold (every control character but tab, the quote, the backslash)
    and quotes a key that is not bare: whatever reaches it reads back as itself."""
    rng = random.Random(0)
    alphabet = [chr(c) for c in range(0x250)] + ["\u2028", "\ufeff", "😀", '"""', "'''", "\\u0041", "\\"]
    for _ in range(2000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 24)))
        read = tomllib.loads(to_toml({"job": {"description": text, "tags": [text, "x"]}, "a key": {text: 1}}))
        assert read == {"job": {"description": text, "tags": [text, "x"]}, "a key": {text: 1}}, repr(text)


def test_a_project_name_w_and_b_refuses_is_one_line() -> None:
    pytest.importorskip("wandb")
    assert _refused("--metrics.wandb=true", "--metrics.wandb_project=team/run").startswith(
        "metrics.wandb_project='team/run' holds '/': a W&B project name has at most 128 characters and none of")
    assert "has 129 characters" in _refused("--metrics.wandb=true", f"--metrics.wandb_project={'p' * 129}")


@pytest.mark.parametrize("arg, line", [
    ("--float8.margin=2000", "float8.margin=2000 must be in [0, 16]"),  # OverflowError in 2.0 ** margin
    ("--float8.margin=200", "float8.margin=200 must be in [0, 16]"),  # scale 0: NaN blamed on the lr
    ("--float8.amax_history_len=1000000000", "float8.amax_history_len=1000000000 must be in [1, 16,384]"),  # 348 GB
    ("--model.rope_theta=1e-300", "model.rope_theta=1e-300 must be in (1, 1e+30]"),  # inf frequencies
    ("--model.rope_theta=1", "model.rope_theta=1.0 must be in (1, 1e+30]"),  # every pair the same frequency
])
def test_numbers_past_what_the_model_can_compute_are_one_line(arg: str, line: str) -> None:
    assert _refused("--train.mixed_precision=fp8", "--float8.scaling=delayed", arg).startswith(line)


def test_a_checkpoint_or_config_json_rope_theta_has_the_same_rule() -> None:
    assert values_problem({"rope_theta": 1e-300}) == "rope_theta=1e-300 must be in (1, 1e+30]"


@pytest.mark.parametrize("flags, line", [
    (["--gpu-memory-gib", "nan"], "--gpu-memory-gib=nan must be a positive number at most 1,048,576 (2**20)"),
    (["--gpu-memory-gib=inf"], "--gpu-memory-gib=inf must be a positive number at most 1,048,576 (2**20)"),
    (["--world-size", str(10**30)], f"--world-size={10**30} must be a positive number at most 1,048,576 (2**20)"),
    (["--world-size=0"], "--world-size=0 must be a positive number at most 1,048,576 (2**20)"),
])
def test_the_dry_runs_flags_are_bounded(flags: list[str], line: str) -> None:
    """`--dry-run --gpu-memory-gib nan|inf` and `--world-size 10**30` printed a plan and OK."""
    from trainer.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(err):
        rc = main(["--config", DEBUG_CONFIG, "--dry-run", *flags])
    assert (rc, err.getvalue()) == (2, f"config error: {line}\n")


def test_a_description_with_a_newline_no_longer_breaks_the_rank_check() -> None:
    """The rank check reads resolved.toml back (trainer.validate.ranks.job_values): a newline in a string key made
    every 2-rank run crash there. Refused at load now; and what the writer writes reads back whatever it holds."""
    _refused("--job.description=a\nb")
    from trainer.validate.ranks import job_values

    values = job_values(validate_job(load_job_config(["--config", DEBUG_CONFIG, '--job.description=say "hi" \\o/']),
                                     world_size=2))
    assert values["job.description"] == 'say "hi" \\o/'
