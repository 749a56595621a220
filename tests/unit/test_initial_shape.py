"""checkpoint.initial_load_path gives the model its shape (trainer/validate/initial.py), decided by the validation
pass from the checkpoint's checkpoint.json: an imported Hugging Face folder trains with a config that sets no shape
key; shape keys that contradict it are one error naming every one; a dry run plans the same model. The whole CLI
(import, train, export back): tests/cli/test_hf_import.py."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest

from tests.helpers import DEBUG_CONFIG
from trainer.checkpoint import RunInfo, save_model_only
from trainer.config import load_job_config
from trainer.errors import ConfigError
from trainer.hf import read_hf_config, read_hf_weights
from trainer.models import FLAVORS
from trainer.run.dry_run import dry_run
from trainer.validate import validate_job

pytest.importorskip("transformers")


def _import(folder: Path, out: Path) -> Path:
    """What `scripts/convert_checkpoint.py import FOLDER OUT` writes (no --flavor: the folder's own shape)."""
    args = read_hf_config(folder)
    return save_model_only(out, read_hf_weights(folder, args=args),
                           run=RunInfo(flavor="imported", model_args=args, mixed_precision="hf-import"),
                           source=str(folder))


@pytest.fixture(scope="module")
def imported(tmp_path_factory) -> tuple[Path, Path]:
    from tests.unit.test_hf_models import make_hf_folder

    root = tmp_path_factory.mktemp("initial_shape")
    folder = make_hf_folder("qwen3", root / "hf", vocab=512)  # tied, qk_norm, head_dim apart from dim / n_heads
    return folder, _import(folder, root / "imported")


def _job(out: Path, *argv: str, world_size: int = 1):
    return validate_job(load_job_config(["--config", DEBUG_CONFIG, f"--checkpoint.initial_load_path={out}", *argv]),
                        world_size=world_size)


def test_a_config_without_shape_keys_takes_the_checkpoints_whole_shape(imported, tmp_path: Path) -> None:
    folder, out = imported
    job = _job(out, f"--job.dump_folder={tmp_path}")
    want = read_hf_config(folder)
    assert job.model_args == want  # every argument: dim, layers, heads, head_dim, ffn, vocab, tied, qk_norm, RoPE
    assert (want.vocab_size, want.tie_word_embeddings, want.qk_norm, want.head_dim) == (512, True, True, 32)
    assert job.run.flavor == "imported"
    assert job.model_source.startswith(f"model shape: checkpoint.initial_load_path={out}'s, with its vocabulary "
                                       f"(imported from {folder}")
    resolved = tomllib.loads(dict(job.run_files)["resolved.toml"])
    assert (resolved["model"]["dim"], resolved["model"]["tie_word_embeddings"]) == (want.dim, True)
    assert "dim" not in tomllib.loads(dict(job.run_files)["config.toml"])["model"]  # the config as given
    # The dry run plans that model and says where its shape came from.
    text, fits = dry_run(load_job_config(["--config", DEBUG_CONFIG, f"--checkpoint.initial_load_path={out}"]),
                         world_size=1)
    assert fits and job.model_source in text.splitlines()
    assert f"dim={want.dim}, layers={want.n_layers}, heads={want.n_heads}/{want.n_kv_heads} kv x 32" in text


def test_shape_keys_that_contradict_the_checkpoint_are_one_error_naming_each(imported) -> None:
    folder, out = imported
    want = read_hf_config(folder)
    with pytest.raises(ConfigError) as e:
        _job(out, "--model.dim=128", "--model.n_layers=4", "--model.vocab_size=512", "--model.rope_theta=5e5")
    message = str(e.value)
    assert message.startswith(f"model.dim=128 (the checkpoint's: {want.dim}), model.n_layers=4 (the checkpoint's: "
                              f"{want.n_layers}): these keys differ from the model of "
                              f"checkpoint.initial_load_path={out}"), message
    assert "vocab_size" not in message and "rope_theta" not in message and "\n" not in message
    # Keys that agree are fine; what the model computes (not its shapes) stays the config's, and the line says so.
    job = _job(out, f"--model.vocab_size={want.vocab_size}", "--model.qk_norm=true", "--model.rope_theta=5e5")
    assert job.model_args.rope_theta == 5e5 and job.model_args.dim == want.dim
    assert job.model_source.endswith("; the config's model.rope_theta=500000.0 replaces the checkpoint's")
    # An MoE key on a dense checkpoint is one of the list too.
    with pytest.raises(ConfigError, match=r"^model.head_dim=64 \(the checkpoint's: 32\), moe.n_experts=4 \(the "
                                          r"checkpoint's model is dense\): these keys differ"):
        _job(out, "--model.head_dim=64", "--moe.n_experts=4")


def test_what_is_not_a_checkpoint_is_one_line_before_anything_starts(imported, tmp_path: Path) -> None:
    folder, out = imported
    with pytest.raises(ConfigError) as e:  # a Hugging Face folder: convert it, no --flavor asked for
        _job(folder)
    assert str(e.value) == (f"{folder / 'checkpoint.json'} is missing: {folder} looks like a Hugging Face model "
                            f"folder; convert it first: python scripts/convert_checkpoint.py import {folder} OUT, then "
                            "pass OUT as checkpoint.initial_load_path (the model's shape comes with it)")
    missing = tmp_path / "nowhere"
    with pytest.raises(ConfigError, match=f"^checkpoint {missing} does not exist$"):
        _job(missing)
    # A dry run planned elsewhere names it and plans the config's shape; a run that resumes its own checkpoint
    # does not need it (its checkpoint holds the shape).
    text, _ = dry_run(load_job_config(["--config", DEBUG_CONFIG, f"--checkpoint.initial_load_path={missing}"]),
                      world_size=1)
    assert f"checkpoint.initial_load_path={missing} is not on this machine" in text
    (tmp_path / "run" / "checkpoint" / "step-2").mkdir(parents=True)
    info = json.loads((out / "checkpoint.json").read_text())
    (tmp_path / "run" / "checkpoint" / "step-2" / "checkpoint.json").write_text(json.dumps(info | {"step": 2}))
    (tmp_path / "run" / "checkpoint" / "step-2" / ".metadata").write_bytes(b"")  # complete, as far as a listing says
    job = _job(missing, f"--job.dump_folder={tmp_path / 'run'}", "--checkpoint.enable=true")
    assert job.model_source is None


def test_an_moe_checkpoint_gives_a_dense_config_its_family_too(tmp_path: Path) -> None:
    """The whole shape includes the family: an MoE checkpoint under debug_model.toml (a dense flavor, no [moe] key)
    builds the checkpoint's MoE model, routing included; resolved.toml names a flavor of that family, in a
    precision phase's job as well."""
    import dataclasses

    from trainer.models import build_model
    from trainer.models.moe import MoEArgs
    from trainer.validate import with_config

    moe = dataclasses.replace(FLAVORS["debug_moe"], top_k=3, route_norm=True)
    model = build_model(moe)
    model.init_weights(seed=0)
    out = save_model_only(tmp_path / "moe", {k: v.detach() for k, v in model.state_dict().items()},
                          run=RunInfo(flavor="imported", model_args=moe, mixed_precision="hf-import"), source="")
    cfg = load_job_config(["--config", DEBUG_CONFIG, f"--checkpoint.initial_load_path={out}",
                           "--moe.aux_loss_coef=0.02"])
    job = validate_job(cfg, world_size=1)
    assert isinstance(job.model_args, MoEArgs)
    # The config's balancing is kept; head_dim comes as a value (32, what dim / n_heads gives).
    assert job.model_args == dataclasses.replace(moe, aux_loss_coef=0.02, explicit_head_dim=moe.head_dim)
    assert job.model_source.endswith("flavor 'imported'; resolved.toml has every value); model.flavor='debug' is "
                                     "not used; the config's moe.aux_loss_coef=0.02 replaces the checkpoint's")
    phase = with_config(job, dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, mixed_precision="bf16")),
                        run_cfg=cfg)
    for resolved in (job, phase):
        used = tomllib.loads(dict(resolved.run_files)["resolved.toml"])
        assert used["model"]["flavor"] == "debug_moe" and used["moe"]["top_k"] == 3 and used["moe"]["route_norm"]
        assert resolved.run.flavor == "imported"
