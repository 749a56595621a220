"""Special files and pathological inputs are one line, within seconds (issue 36, items 3 and 4): a FIFO or a device
where a checkpoint, a Hugging Face folder or a corpus has a file (they hung the command, or ended in MemoryError),
values nested thousands deep (RecursionError), text with lone surrogates, vocabulary sizes no shard or tokenizer
can hold, a timeout beyond what a timedelta holds, a microbatch too large for memory, an oversized tokenizer."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from tests.faults.test_tokenizer_confinement import one_line_error, run_scripts
from tests.helpers import DEBUG_CONFIG, launch
from trainer.config import load_job_config
from trainer.errors import ConfigError

pytestmark = pytest.mark.slow

DEEP = "[" * 5000 + "]" * 5000


def test_a_fifo_checkpoint_json_is_one_line_on_resume_and_export(trained, tmp_path):
    from tests.faults.test_hostile_checkpoint import ARGS

    dump = tmp_path / "run"
    shutil.copytree(trained, dump / "checkpoint" / "step-2")
    (dump / "checkpoint" / "step-2" / "checkpoint.json").unlink()
    os.mkfifo(dump / "checkpoint" / "step-2" / "checkpoint.json")
    proc = launch([*ARGS, "--train.steps=4", "--checkpoint.enable=true", f"--job.dump_folder={dump}"], timeout=120)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error")]
    assert proc.returncode == 2 and len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "checkpoint.json is a named pipe (FIFO), not a regular file" in errors[0]
    result = run_scripts({"export": ("convert_checkpoint", ["export", str(dump / "checkpoint" / "step-2"),
                                                            str(tmp_path / "hf")])})["export"]
    one_line_error(result, "checkpoint.json is a named pipe (FIFO), not a regular file")


def test_special_and_deep_files_in_a_hugging_face_folder_are_one_line(trained, tmp_path):
    assert run_scripts({"export": ("convert_checkpoint", ["export", str(trained), str(tmp_path / "hf"),
                                                          "--dtype=float32"])})["export"]["rc"] == 0
    cases, expected = {}, {}
    for name, file, make, fragment in [
        ("fifo-config", "config.json", os.mkfifo, "config.json is a named pipe (FIFO), not a regular file"),
        ("fifo-weights", "model.safetensors", os.mkfifo, "model.safetensors is a named pipe (FIFO)"),
        ("devzero-weights", "model.safetensors", lambda p: p.symlink_to("/dev/zero"), "outside its folder"),
        ("deep-config", "config.json", lambda p: p.write_text('{"a": ' + DEEP + "}"),
         "config.json nests its values too deeply to be a model config"),
    ]:
        folder = tmp_path / name
        shutil.copytree(tmp_path / "hf", folder)
        (folder / file).unlink()
        make(folder / file)
        cases[f"{name}/import"] = ("convert_checkpoint", ["import", str(folder), str(tmp_path / f"imported-{name}")])
        cases[f"{name}/generate"] = ("generate", [str(folder), "--max-new-tokens=2"])
        expected[name] = fragment
    for case, result in run_scripts(cases).items():
        one_line_error(result, expected[case.split("/")[0]])


def test_corpus_inputs_that_never_end_or_cannot_be_text_are_one_line(tmp_path):
    (tmp_path / "fifo").mkdir()
    os.mkfifo(tmp_path / "fifo" / "a.jsonl")
    (tmp_path / "zero").mkdir()
    (tmp_path / "zero" / "z.txt").symlink_to("/dev/zero")
    (tmp_path / "deep.jsonl").write_text('{"text": "ok"}\n{"text": ' + DEEP + "}\n")
    (tmp_path / "surrogate.jsonl").write_text('{"text": "fine"}\n{"text": "lone \\ud800 half"}\n')
    (tmp_path / "src").mkdir()
    os.mkfifo(tmp_path / "src" / "mod.py")
    out = str(tmp_path / "out")
    cases, expected = {}, {}
    for name, pattern, fragment in [
        ("fifo", str(tmp_path / "fifo" / "*.jsonl"), "a.jsonl is a named pipe (FIFO), not a regular file"),
        ("devzero", str(tmp_path / "zero" / "*.txt"), "z.txt is a character device, not a regular file"),
        ("deep", str(tmp_path / "deep.jsonl"), "deep.jsonl:2: JSON nested too deeply"),
        ("surrogate", str(tmp_path / "surrogate.jsonl"), "surrogate.jsonl:2: the text holds a lone surrogate (U+D800"),
    ]:
        cases[f"{name}/prepare"] = ("prepare_data", ["--input", pattern, "--output", out])
        cases[f"{name}/tokenizer"] = ("build_tokenizer", ["--input", pattern, "--output", out, "--vocab-size=300"])
        expected[name] = fragment
    cases["src/tokenizer"] = ("build_tokenizer", ["--corpus", "default", "--add-source", str(tmp_path / "src"),
                                                  "--output", out])
    expected["src"] = "mod.py is a named pipe (FIFO), not a regular file"
    cases["vocab/prepare"] = ("prepare_data", ["--input", str(tmp_path / "deep.jsonl"), "--output", out,
                                               f"--vocab-size={2**64}"])
    cases["vocab/tokenizer"] = ("build_tokenizer", ["--corpus", "default", "--output", out,
                                                    f"--vocab-size={10**12}"])
    results = run_scripts(cases)
    for case, result in results.items():
        if case.startswith("vocab/"):  # argparse's own error line: usage, then the message; exit 2
            assert result["rc"] == 2 and ("--vocab-size must be in [1, 4,294,967,296]" in result["stderr"] or
                                          "--vocab-size must be at most 2,097,152" in result["stderr"]), result
            continue
        assert result["rc"] == 2 and "Traceback" not in result["stderr"], (case, result)
        assert expected[case.split("/")[0]] in result["stderr"], (case, result["stderr"])
    assert not Path(out).exists() or not any(Path(out).iterdir())


@pytest.mark.parametrize("args, message", [
    (["--distributed.init_timeout_seconds=99999999999999"], "distributed.init_timeout_seconds=99999999999999 must be"),
    ([f"--train.precision_schedule={DEEP}"], "train.precision_schedule="),
])
def test_pathological_command_line_values_are_one_short_line(args, message):
    with pytest.raises(ConfigError) as e:
        load_job_config(["--config", DEBUG_CONFIG, *args])
    assert message in str(e.value) and "\n" not in str(e.value) and len(str(e.value)) < 2000


def test_a_deeply_nested_config_file_is_one_line(tmp_path):
    (tmp_path / "deep.toml").write_text("[train]\nprecision_schedule = " + DEEP + "\n")
    with pytest.raises(ConfigError, match="deep.toml nests its values too deeply to be a config"):
        load_job_config(["--config", str(tmp_path / "deep.toml")])


@pytest.mark.parametrize("arg, biggest", [("--train.seq_len=100000000", "logits"),
                                          ("--train.batch_size=1000000", "logits")])
def test_a_microbatch_too_large_for_memory_is_refused_before_anything_is_built(arg, biggest):
    from trainer.validate import validate_job
    from trainer.validate.memory import Target

    cfg = load_job_config(["--config", DEBUG_CONFIG, "--data.source=synthetic", arg])
    with pytest.raises(ConfigError) as e:
        validate_job(cfg, world_size=1, target=Target(device_type="cpu", memory=(16 * 2**30, "host memory")))
    assert str(e.value).startswith(arg.removeprefix("--").split("=")[0]) or "train.batch_size=" in str(e.value)
    assert f"({biggest}: " in str(e.value) and "more than the 16.0 GiB of host memory" in str(e.value)
    validate_job(load_job_config(["--config", DEBUG_CONFIG, "--data.source=synthetic"]), world_size=1,
                 target=Target(device_type="cpu", memory=(16 * 2**30, "host memory")))


def test_an_oversized_tokenizer_file_is_one_line(tmp_path):
    big = tmp_path / "tokenizer.json"
    with open(big, "wb") as f:
        f.truncate(300 * 2**20)  # sparse: no disk used
    with pytest.raises(Exception) as e:
        load_job_config(["--config", DEBUG_CONFIG, "--data.source=shards", f"--data.path={tmp_path}",
                         f"--data.tokenizer={big}", "--data.eod_mask_loss=true"])
        from trainer.data.tokenizer import tokenizer_fingerprint
        tokenizer_fingerprint(str(big))
    assert "is 300 MiB, more than the 256 MiB a tokenizer.json may be" in str(e.value)
    assert json.dumps(str(e.value)).count("\\n") == 0
