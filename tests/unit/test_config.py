"""Config loading, overrides, validation errors, shipped configs and the generated reference (the command line's
one-line errors: tests/cli/test_config.py)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import REPO, env
from trainer.config import _SECTIONS, ConfigError, JobConfig, config_markdown, field_docs, load_job_config
from trainer.models import Llama
from trainer.parallel.float8 import select_float8_linears
from trainer.validate import validate_job

CONFIGS = sorted((REPO / "configs" / "train").glob("*.toml"))


def test_defaults_toml_and_cli_precedence(tmp_path: Path) -> None:
    toml = tmp_path / "c.toml"
    toml.write_text('[train]\nsteps = 7\nbatch_size = 3\n[float8]\nexclude_fqns = ["output_head.proj"]\n')
    cfg = load_job_config(["--config", str(toml), "--train.steps=9", "--optimizer.lr", "0.5"])
    assert cfg.train.steps == 9  # CLI beats TOML
    assert cfg.train.batch_size == 3  # TOML beats default
    assert cfg.train.seq_len == 256  # default
    assert cfg.optimizer.lr == 0.5  # space-separated form
    assert cfg.float8.exclude_fqns == ["output_head.proj"]
    cfg = load_job_config(["--float8.exclude_fqns=a.b,c", "--train.compile_model=true", "--train.max_norm=2"])
    assert cfg.float8.exclude_fqns == ["a.b", "c"]
    assert cfg.train.compile_model is True and cfg.train.max_norm == 2.0


@pytest.mark.parametrize(
    "args, message",
    [
        (["--train.mixed_precision=FP8"], "train.mixed_precision='FP8' is not one of 'auto', 'fp32', 'fp16', 'bf16', 'fp8'"),
        (["--train.mixed_precision=float8"], "train.mixed_precision='float8' is not one of"),
        (["--train.bach_size=2"], "unknown key [train].bach_size (did you mean batch_size?)"),
        (["--trian.steps=2"], "unknown section [trian] (did you mean train?)"),
        (["--train.steps=ten"], "train.steps='ten' must be an integer"),
        (["--train.compile_model=maybe"], "train.compile_model='maybe' must be true or false"),
        (["--train.batch_size=0"], "train.batch_size=0 must be >= 1"),
        (["--distributed.dp_shard=0"], "distributed.dp_shard=0 must be >= 1, or -1"),
        (["--data.source=shards"], "data.source='shards' needs data.path"),
        (["--float8.recipe=rowwise", "--float8.enable_fsdp_float8_all_gather=true"],
         "float8.enable_fsdp_float8_all_gather=true only works with float8.recipe='tensorwise'"),
        (["--float8.enable_fsdp_float8_all_gather=1"],
         "float8.enable_fsdp_float8_all_gather='1' is not one of 'auto', true, false"),
        (["--profiling.enable=true", "--profiling.start_step=5", "--profiling.end_step=3"], "the window must satisfy 1 <= start_step <= end_step"),
        (["--checkpoint.keep_latest_k=-1"], "checkpoint.keep_latest_k=-1 must be >= 0"),
        (["--checkpoint.export_interval=-2"], "checkpoint.export_interval=-2 must be >= 0 (0 = off)"),
        (["--checkpoint.export_keep_latest_k=-1"], "checkpoint.export_keep_latest_k=-1 must be >= 0 (0 keeps all)"),
        (["--metrics.kurtosis_warn=-1", "--metrics.fp8_stats_freq=10"],
         "metrics.kurtosis_warn=-1.0 must be >= 0 (0 = off)"),
        (["--metrics.kurtosis_warn=nan", "--metrics.fp8_stats_freq=10"], "metrics.kurtosis_warn=nan must be a finite"),
        (["--metrics.kurtosis_warn=100"], "metrics.kurtosis_warn=100.0 has no effect: the kurtosis is one of the FP8 "
                                          "health stats; set metrics.fp8_stats_freq=N (fp8 runs) or metrics.kurtosis_warn=0"),
        (["--train.loss_chunk_tokens=-4"], "train.loss_chunk_tokens=-4 must be >= 0 (0 = off)"),
        (["--train.loss_chunk_tokens=4096", "--distributed.tp=2"],
         "train.loss_chunk_tokens=4096 with distributed.tp=2: a chunked loss is not implemented under tensor parallel"),
        (["--checkpoint.load_step=-2"], "checkpoint.load_step=-2 must be >= 0, or -1"),
        (["--checkpoint.load_step=5"], "checkpoint.load_step=5 needs checkpoint.enable=true"),
        (["steps=3"], "unexpected argument 'steps=3'"),
        (["--train.steps"], "--train.steps needs a value"),
        (["--config", "/nonexistent.toml"], "config file /nonexistent.toml does not exist"),
        # issue 39 item 6: trained the built-in defaults, without the warning that no --config was given
        (["--config="], "--config is empty: give a TOML file"),
        (["--config", " "], "--config is empty: give a TOML file"),
    ],
)
def test_bad_values_name_the_key(args: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_job_config(args)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_toml_type_errors(tmp_path: Path) -> None:
    toml = tmp_path / "c.toml"
    toml.write_text('[train]\nsteps = "10"\n')
    with pytest.raises(ConfigError, match=r"train.steps='10' must be an integer"):
        load_job_config(["--config", str(toml)])
    toml.write_text("[train]\nlearning_rate = 1\n")
    with pytest.raises(ConfigError, match=r"unknown key \[train\].learning_rate"):
        load_job_config(["--config", str(toml)])
    toml.write_text("steps = 1\n")
    with pytest.raises(ConfigError, match="must be a \\[section\\]"):
        load_job_config(["--config", str(toml)])
    toml.write_text("[train\n")
    with pytest.raises(ConfigError, match="is not valid TOML"):
        load_job_config(["--config", str(toml)])


def test_fp8_with_tp_is_rejected_by_post_init() -> None:
    cfg = load_job_config(["--train.mixed_precision=bf16", "--distributed.tp=2"])
    assert not cfg.is_fp8 and not cfg.train.is_fp8
    with pytest.raises(ValueError) as e:
        JobConfig(train=dataclasses.replace(cfg.train, mixed_precision="fp8"), distributed=cfg.distributed)
    assert str(e.value).startswith("FP8 + Tensor Parallelism is not yet supported")
    assert "distributed.tp=1" in str(e.value)  # says what to do instead


# The world sizes each shipped config is written for (its header's torchrun command), and what the whole
# validation pass must resolve there: (dp_shard, tp, ep, pp).
SHIPPED = {
    "7b_16gpu_fp8.toml": [(16, (16, 1, 1, 1))],
    "debug_gpt_oss.toml": [(1, (1, 1, 1, 1)), (2, (2, 1, 1, 1))],
    "debug_model.toml": [(1, (1, 1, 1, 1))],
    "debug_moe.toml": [(1, (1, 1, 1, 1)), (4, (4, 1, 1, 1))],
    "debug_pp.toml": [(2, (1, 1, 1, 2)), (4, (2, 1, 1, 2))],
    "deepseek_v3_16b_16gpu_fp8.toml": [(16, (16, 1, 8, 1))],
    "llama3_1b.toml": [(8, (8, 1, 1, 1))],
    "llama3_8b.toml": [(8, (8, 1, 1, 1))],
    "llama3_8b_128k_cp8.toml": [(8, (1, 1, 1, 1)), (16, (2, 1, 1, 1))],  # cp=8 takes the rest of the shard group
    "moe_16b_4gpu_fp8.toml": [(4, (4, 1, 4, 1))],
    "qwen3_moe_debug.toml": [(1, (1, 1, 1, 1)), (2, (2, 1, 1, 1))],
}


def test_every_shipped_config_is_listed() -> None:
    assert sorted(SHIPPED) == [p.name for p in CONFIGS]


def test_no_shipped_description_names_a_precision() -> None:
    # The console's "job: <description>" line must not say bf16 when --train.mixed_precision=fp8 overrides it;
    # the "precision:" line of the header says the precision the run resolved.
    import re

    for path in CONFIGS:
        description = load_job_config(["--config", str(path)]).job.description
        assert not re.search(r"\b(fp|bf)(8|16|32)\b|float8|tensorwise|rowwise", description, re.I), (path.name,
                                                                                                 description)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_validates(path: Path, tmp_path: Path, on_h100) -> None:
    cfg = load_job_config(["--config", str(path)])
    # The resolved config (saved as TOML in the dump folder) loads back to the same config.
    (tmp_path / "again.toml").write_text(cfg.to_toml())
    assert load_job_config(["--config", str(tmp_path / "again.toml")]) == cfg
    # The whole validation pass at the world sizes the config is written for. A config that names the
    # user's shards (data/shards) is checked on synthetic tokens: its data check needs those files.
    data = ["--data.source=synthetic"] if cfg.data.source == "shards" else []
    for world_size, degrees in SHIPPED[path.name]:
        job = validate_job(load_job_config(["--config", str(path), *data]), world_size=world_size)
        pd = job.parallel_dims
        assert (pd.dp_shard, pd.tp, pd.ep, pd.pp) == degrees, (path.name, world_size)
        assert (job.pipeline is not None) == (pd.pp > 1)
        assert (job.build.float8 is not None) == cfg.train.is_fp8
        assert pd.cp == cfg.distributed.cp


def test_debug_pp_config_resolves_the_stages_its_header_describes() -> None:
    # "emb+layers.0 | layers.1 | layers.2 | layers.3+head: 23/23/23/30%", 8 microbatches.
    job = validate_job(load_job_config(["--config", str(REPO / "configs/train/debug_pp.toml")]), world_size=2)
    p = job.pipeline
    assert (p.schedule, p.num_microbatches, p.stages_per_rank) == ("Interleaved1F1B", 8, 2)
    assert p.stage_fqns == (("tok_embeddings", "layers.0"), ("layers.1",), ("layers.2",),
                            ("layers.3", "norm", "output_head"))
    assert [round(100 * x) for x in p.stage_costs] == [23, 23, 23, 30]


def test_fp8_reference_recipe(on_h100) -> None:
    """The recipe users copy must pass the whole validation pass at the world size it names,
    with FP8 on every attention/MLP projection and the output head of the 8B model."""
    # Its data.path names the user's shards; the data check is exercised elsewhere.
    cfg = load_job_config(["--config", str(REPO / "configs/train/7b_16gpu_fp8.toml"), "--data.source=synthetic"])
    job = validate_job(cfg, world_size=16)
    assert (job.parallel_dims.dp_shard, job.parallel_dims.tp) == (16, 1)
    assert job.model_args.dim == 4096 and job.model_args.n_layers == 32
    assert job.build.float8 is not None and job.build.float8.recipe == cfg.float8.recipe
    assert job.build.ac.mode == "full" and job.build.compile
    # Its weights kept gathered from forward to backward fit an H100 (15 GiB more: a 42.6 GiB plan): no second gather.
    assert job.build.fsdp.param_dtype == torch.bfloat16 and not job.build.fsdp.reshard_after_forward
    with torch.device("meta"):
        model = Llama(job.model_args)
    converted, excluded, num_linear = select_float8_linears(model, exclude_fqns=list(cfg.float8.exclude_fqns))
    assert num_linear == 32 * 7 + 1 and len(converted) == num_linear and not excluded


def test_every_field_has_a_docstring() -> None:
    for name, cls in _SECTIONS.items():
        docs = field_docs(cls)
        missing = [f.name for f in dataclasses.fields(cls) if not docs.get(f.name)]
        assert not missing, f"[{name}] fields without a docstring: {missing}"


def test_every_note_names_a_key() -> None:
    # docs/config.md's long texts (trainer/config/notes.py) are keyed "section.key": one for a key that was renamed
    # or removed would vanish from the docs silently.
    from trainer.config.notes import NOTES

    keys = {f"{name}.{f.name}" for name, cls in _SECTIONS.items() for f in dataclasses.fields(cls)}
    assert sorted(set(NOTES) - keys) == []


def test_config_reference_is_current() -> None:
    current = (REPO / "docs" / "config.md").read_text()
    assert current == config_markdown(), "docs/config.md is stale: run python -m trainer.config --markdown > docs/config.md"


# What `scripts/train.py` does before training: --help, a config error, a config that passes every check (a
# precision schedule with an fp8 phase and FP8 experts, so the schedule parser and each check run).
_CONFIG_ONLY = """
import json, sys
from trainer.cli import main
from trainer.config import load_job_config
assert main(["--help"]) == 0
assert main(["--train.steps=0"]) == 2
load_job_config(["--train.steps=4", "--train.precision_schedule=bf16:2,fp8", "--checkpoint.enable=true",
                 "--model.flavor=debug_moe", "--float8.moe_experts=rowwise"])
print(json.dumps(sorted({m.partition(".")[0] for m in sys.modules} & {"torch", "torchao", "numpy"})))
"""


def test_help_and_config_checks_do_not_import_torch(tmp_path: Path) -> None:
    # --help and config errors answer in a fraction of a second because loading and checking a config imports
    # neither torch nor numpy (seconds on a cold start): trainer.config and trainer.config.checks import only
    # torch-free leaves; trainer.validate, which needs the model and the meshes, is imported after the config.
    proc = subprocess.run([sys.executable, "-c", _CONFIG_ONLY], capture_output=True, text=True, env=env(),
                          cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "config error: train.steps=0 must be >= 1" in proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []
