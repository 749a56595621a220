"""Every crafted value of a checkpoint or export folder is a one-line error, within seconds, before anything is
allocated (issue 25, items 1, 2, 3 and 5).

The attacker edits a genuine folder and rewrites checkpoint.json's checksums to match (`_rewrite_checksums`),
so every file verifies: only checking the values protects. Cases run in-process (`load_model`,
`load_full_model_weights` as export uses it, `read_state_json` as resume uses it, `read_hf_weights` as import
uses it), and through the command lines (exit 2, one line, no traceback) in one subprocess each.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import shutil
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.faults.test_hostile_checkpoint import ARGS, CONVERT, DEBUG, _rewrite_checksums
from tests.helpers import REPO, env, run_cli_cases
from trainer.checkpoint import (
    CheckpointError, RunInfo, load_dcp_metadata, load_full_model_weights, load_model, read_checkpoint_json,
    save_model_only,
)
from trainer.checkpoint.verify import read_state_json
from trainer.hf import ExportError, expected_shapes, read_hf_weights
from trainer.models.moe import MOE_FLAVORS

EDITED = "(not as this trainer writes it: an edited or foreign file)"


@pytest.fixture(scope="module")
def moe_ckpt(tmp_path_factory):
    """A model-only checkpoint of the debug MoE model."""
    args = MOE_FLAVORS["debug_moe"]
    torch.manual_seed(0)
    weights = {k: torch.randn(shape) for k, shape in expected_shapes(args).items()}
    return save_model_only(tmp_path_factory.mktemp("moe") / "moe_model", weights,
                           run=RunInfo(flavor="debug_moe", model_args=args, mixed_precision="fp32"), source="test")


@pytest.fixture(scope="module")
def hf_export(trained, tmp_path_factory):
    pytest.importorskip("safetensors")
    out = tmp_path_factory.mktemp("hf") / "export"
    proc = subprocess.run([sys.executable, CONVERT, "export", str(trained), str(out), "--dtype=float32"],
                          capture_output=True, text=True, env=env(), cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_json(folder: Path, name: str, edit) -> Path:
    data = json.loads((folder / name).read_text())
    edit(data)
    (folder / name).write_text(json.dumps(data))
    if (folder / "checkpoint.json").exists():
        _rewrite_checksums(folder)
    return folder


def _edit_index(folder: Path, edit) -> Path:
    md = pickle.loads((folder / ".metadata").read_bytes())  # our own file: trusted
    edit(md.state_dict_metadata)
    (folder / ".metadata").write_bytes(pickle.dumps(md))
    _rewrite_checksums(folder)
    return folder


def _resize(md, size: list[int]) -> None:
    md.size = torch.Size(size)
    md.chunks[0].sizes, md.chunks[0].offsets = torch.Size(size), torch.Size([0] * len(size))


def _set_property(name, value):
    def edit(entries):
        setattr(entries[name], "properties", value) if value is None else setattr(entries[name].properties, "dtype",
                                                                                 value)
    return edit


def _quick(fn, *args, **kwargs):
    """fn(*args) must raise within seconds (today some of these hang)."""
    start = time.perf_counter()
    try:
        fn(*args, **kwargs)
    finally:
        assert time.perf_counter() - start < 30, "took too long"


# -- item 1: crafted .metadata values, on load_model and export ---------------------------------------------


def _index_cases(src: Path, tmp: Path) -> dict[str, tuple[Path, str]]:
    meta = ".metadata: entry 'model.norm.weight' "
    return {
        "negative size": (_edit_index(_copy(src, tmp / "neg"), lambda e: _resize(e["model.norm.weight"], [-1])),
                          meta + "has size torch.Size([-1]), not a list of sizes >= 0"),
        "giant size": (_edit_index(_copy(src, tmp / "giant"),
                                   lambda e: _resize(e["model.norm.weight"], [10**7, 10**7])),
                       ".metadata: model.norm.weight has shape [10000000, 10000000] in the checkpoint but [128] in "
                       "this model"),
        "properties None": (_edit_index(_copy(src, tmp / "none"), _set_property("model.norm.weight", None)),
                            meta + "has properties None, not a tensor dtype"),
        "int64 dtype": (_edit_index(_copy(src, tmp / "int"), _set_property("model.norm.weight", torch.int64)),
                        ".metadata: model.norm.weight is stored as torch.int64, not one of torch.float32, "
                        "torch.bfloat16"),
        "chunk outside": (_edit_index(_copy(src, tmp / "chunk"),
                                      lambda e: setattr(e["model.norm.weight"].chunks[0], "offsets", torch.Size([64]))),
                          meta + "has a chunk outside its size [128]"),
        # issue 39 item 3: a gap loaded as torch.empty's memory (a norm weight of -8.9e-08, 0.0, ...), exit 0
        "no chunks": (_edit_index(_copy(src, tmp / "nochunk"), lambda e: setattr(e["model.norm.weight"], "chunks", [])),
                      meta + "has chunks that leave elements out (they cover 0 elements of its 128, size [128])"),
        "overlapping chunks": (_edit_index(_copy(src, tmp / "overlap"), _overlap("model.norm.weight")),
                               meta + "has chunks that leave elements out and overlap (they cover 128 elements of its "
                               "128, size [128])"),
    }


def _overlap(key: str):
    """The entry's one chunk cut in two halves that overlap by 8 elements and leave the last 8 out."""
    def edit(entries):
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        md = entries[key]
        md.chunks = [ChunkStorageMetadata(offsets=torch.Size([0]), sizes=torch.Size([64])),
                     ChunkStorageMetadata(offsets=torch.Size([56]), sizes=torch.Size([64]))]
    return edit


def test_crafted_index_values_are_one_line(trained, tmp_path):
    for name, (folder, message) in _index_cases(trained, tmp_path).items():
        for load in (load_model, load_full_model_weights):
            with pytest.raises(CheckpointError) as e:
                _quick(load, folder)
            assert str(e.value).startswith(str(folder)) and message in str(e.value), (name, str(e.value))


def _narrow_embedding(good: Path, out: Path) -> Path:
    """A copy whose index AND shard both hold tok_embeddings as [512, 64] (the model wants [512, 128])."""
    md = load_dcp_metadata(good / ".metadata")
    flat = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype) for k, v in md.state_dict_metadata.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(flat, checkpoint_id=str(good), no_dist=True)
        flat["model.tok_embeddings.weight"] = flat["model.tok_embeddings.weight"][:, :64].clone()
        dcp.save(flat, checkpoint_id=str(out), no_dist=True)
    for name in ("checkpoint.json", "state.json"):
        shutil.copy(good / name, out / name)
    _rewrite_checksums(out)
    return out


def test_index_and_shard_of_another_shape_are_refused(trained, tmp_path):
    folder = _narrow_embedding(trained, tmp_path / "narrow")
    with pytest.raises(CheckpointError, match=r"\.metadata: model\.tok_embeddings\.weight has shape \[512, 64\] in "
                                              r"the checkpoint but \[512, 128\] in this model"):
        load_model(folder)
    with pytest.raises(CheckpointError, match=r"model\.tok_embeddings\.weight has shape \[512, 64\]"):
        load_full_model_weights(folder)  # what export reads: today it exits 0 writing a wrong file


def test_optimizer_and_moe_entries_are_checked(trained, moe_ckpt, tmp_path):
    opt = _edit_index(_copy(trained, tmp_path / "opt"),
                      lambda e: _resize(e["optimizer.state.norm.weight.exp_avg"], [64]))
    with pytest.raises(CheckpointError, match=r"\.metadata: optimizer\.state\.norm\.weight\.exp_avg has shape \[64\] "
                                              r"in the checkpoint but \[128\] in this model"):
        load_full_model_weights(opt)
    stray = _edit_index(_copy(trained, tmp_path / "stray"), lambda e: e.update(
        {"optimizer.state.nope.weight.exp_avg": e["optimizer.state.norm.weight.exp_avg"]}))
    with pytest.raises(CheckpointError, match=r"optimizer\.state\.nope\.weight\.exp_avg is the optimizer state of "
                                              r"'nope\.weight', which the model has not"):
        load_full_model_weights(stray)
    w1 = "model.layers.1.moe.experts.w1"
    moe = _edit_index(_copy(moe_ckpt, tmp_path / "moe"), lambda e: _resize(e[w1], [8, 64, 64]))
    with pytest.raises(CheckpointError, match=rf"{w1} has shape \[8, 64, 64\] in the checkpoint but \[8, 64, 128\]"):
        load_model(moe)


# -- item 2: crafted model arguments in checkpoint.json and config.json -------------------------------------


def _with_model(src: Path, dst: Path, **changes) -> Path:
    return _edit_json(_copy(src, dst), "checkpoint.json", lambda info: info["model"].update(changes))


def test_crafted_model_arguments_are_one_line(trained, tmp_path):
    file = "checkpoint.json: "
    cases = {
        "layers int": ({"n_layers": 10**8}, "the model arguments (dim=128, n_layers=100000000, vocab_size=512) "
                                            "imply 19,686,400,131,200 parameters, at least 36,668.8 GiB, but its "
                                            "data files (__0_0.distcp) hold"),
        "layers float": ({"n_layers": 1e8}, "model.n_layers=100000000.0 must be an integer " + EDITED),
        "max_seq_len": ({"max_seq_len": 10**13}, "model.max_seq_len=10000000000000 must be an integer in "
                                                 "[1, 16777216] " + EDITED),
        "dim string": ({"dim": "128"}, "model.dim='128' must be an integer " + EDITED),
        "unknown": ({"n_loops": 3}, "model.n_loops is not an argument of ModelArgs " + EDITED),
        "heads": ({"n_kv_heads": 3}, "model.n_heads=4 must be a multiple of model.n_kv_heads=3 " + EDITED),
        "eps": ({"norm_eps": -1.0}, "model.norm_eps=-1.0 must be in (0, 1] " + EDITED),
        "ffn_dim": ({"ffn_dim": 999}, "model.ffn_dim=999 but the other arguments give 384 " + EDITED),
    }
    for name, (changes, message) in cases.items():
        folder = _with_model(trained, tmp_path / name.replace(" ", "_"), **changes)
        # read_checkpoint_json: every load path (resume and initial load too) checks types and ranges there.
        loads = (load_model, load_full_model_weights) + ((read_checkpoint_json,) if name != "layers int" else ())
        for load in loads:
            with pytest.raises(CheckpointError) as e:
                _quick(load, folder)
            assert str(e.value).startswith(str(folder / file)) and message in str(e.value), (name, str(e.value))


@pytest.mark.parametrize("flavor", ["debug", "8b", "405b", "debug_moe", "moe_16b"])
def test_sizes_in_closed_form_match_the_model(flavor):
    """param_count and num_tensors (what a crafted n_layers is checked with, before any model is built) count
    exactly what the meta-device model holds."""
    from trainer.checkpoint.values import model_shapes
    from trainer.models.counts import num_tensors, param_count
    from trainer.models import FLAVORS

    shapes = model_shapes(FLAVORS[flavor])
    assert param_count(FLAVORS[flavor]) == sum(math.prod(s) for s in shapes.values())
    assert num_tensors(FLAVORS[flavor]) == len(shapes)


def test_load_needing_more_memory_than_the_host_has_is_one_line(trained, tmp_path, monkeypatch):
    import trainer.checkpoint.values as values

    monkeypatch.setattr(values, "available_memory_bytes", lambda: 2**20)
    with pytest.raises(CheckpointError, match=rf"^{trained}: loading it needs about 9\.0 MiB of memory \(the "
                                              r"weights, a torch.float32 copy and the RoPE table of 8,192 positions\) "
                                              r"but 1\.0 MiB is available on this host"):
        load_model(trained)
    monkeypatch.setattr(values, "available_memory_bytes", lambda: 2**30)
    with pytest.raises(CheckpointError, match=r"needs about 2\.4 GiB of memory .* RoPE table of 10,000,000 "
                                              r"positions\) but 1\.0 GiB"):
        load_model(trained, max_seq_len=10**7)  # the caller's own RoPE length counts too


def test_crafted_hf_config_values_are_one_line(hf_export, tmp_path):
    file = str(tmp_path / "{}" / "config.json")
    cases = {
        "layers": ({"num_hidden_layers": 10**8}, "the model arguments (dim=128, n_layers=100000000, vocab_size=512) "
                                                 "imply 19,686,400,131,200 parameters"),
        "positions": ({"max_position_embeddings": 10**13}, "max_position_embeddings=10000000000000 must be an "
                                                           "integer in [1, 16777216] (not a model this trainer can "
                                                           "load)"),
        "string": ({"hidden_size": "128"}, "hidden_size='128' must be an integer"),
        "theta": ({"rope_theta": float("inf")}, "rope_theta=inf must be in (1, 1e+30]"),
    }
    for name, (changes, message) in cases.items():
        folder = _edit_json(_copy(hf_export, tmp_path / name), "config.json", lambda c: c.update(changes))
        with pytest.raises(ExportError) as e:
            _quick(load_model, folder)
        assert str(e.value).startswith(file.format(name)) and message in str(e.value), (name, str(e.value))


# -- item 3: crafted state.json values, on resume --------------------------------------------------------------


STATE_CASES = {
    "step string": ("train_state", "step", "abc", "train_state.step='abc' must be an integer in [0, 2**63-1]"),
    "step huge": ("train_state", "step", 1e300, "train_state.step=1e+300 must be an integer in [0, 2**63-1]"),
    "step negative": ("train_state", "step", -5, "train_state.step=-5 must be an integer in [0, 2**63-1]"),
    "step other": ("train_state", "step", 7, "train_state.step=7 but "),
    "samples string": ("dataloader", "consumed_samples", "x", "dataloader.consumed_samples='x' must be an integer"),
    "samples huge": ("dataloader", "consumed_samples", 10**30, "dataloader.consumed_samples=10000000000000000000"
                                                                "00000000000 must be an integer in [0, 2**63-1]"),
    "samples negative": ("dataloader", "consumed_samples", -1000, "dataloader.consumed_samples=-1000 must be an "
                                                                   "integer in [0, 2**63-1]"),
    # issue 39 item 5: a resume state that contradicts itself (each trained on silently before)
    "samples zero": ("dataloader", "consumed_samples", 0, "dataloader.consumed_samples=0 at step 2: the run would "
                                                          "read its data again from the start"),
    "schedule ahead": ("lr_scheduler", "last_epoch", 10**18, "lr_scheduler.last_epoch=1000000000000000000 but the "
                                                             "checkpoint is at step 2"),
    "schedule restarted": ("lr_scheduler", "last_epoch", 0, "lr_scheduler.last_epoch=0 but the checkpoint is at "
                                                            "step 2: the learning rate would resume at another point"),
    "scale nan": ("loss_scaler", "scale", float("nan"), "loss_scaler.scale=nan must be a finite number > 0"),
    "scale zero": ("loss_scaler", "scale", 0.0, "loss_scaler.scale=0.0 must be a finite number > 0"),
    "scale inf": ("loss_scaler", "scale", float("inf"), "loss_scaler.scale=inf must be a finite number > 0"),
    "scale negative": ("loss_scaler", "scale", -8.0, "loss_scaler.scale=-8.0 must be a finite number > 0"),
}


def _with_state(src: Path, dst: Path, section: str, key: str, value) -> Path:
    return _edit_json(_copy(src, dst), "state.json", lambda s: s[section].update({key: value}))


def test_crafted_state_values_are_one_line(trained, tmp_path):
    for name, (section, key, value, message) in STATE_CASES.items():
        folder = _with_state(trained, tmp_path / name.replace(" ", "_"), section, key, value)
        with pytest.raises(CheckpointError) as e:
            read_state_json(folder, read_checkpoint_json(folder))
        assert str(e.value).startswith(f"{folder / 'state.json'}: {message}"), (name, str(e.value))


@pytest.mark.slow
def test_crafted_values_and_symlinks_refused_on_resume(trained, tmp_path):
    cases = {}
    for name, (section, key, value, message) in STATE_CASES.items():
        dump = tmp_path / name.replace(" ", "_")
        _with_state(trained, dump / "checkpoint" / "step-2", section, key, value)
        cases[name] = ([*ARGS, "--train.steps=3", "--checkpoint.enable=true", f"--job.dump_folder={dump}"],
                       f"error (rank 0): {dump / 'checkpoint' / 'step-2' / 'state.json'}: {message}")
    dump = tmp_path / "optimizer"
    _edit_index(_copy(trained, dump / "checkpoint" / "step-2"),
                lambda e: _resize(e["optimizer.state.norm.weight.exp_avg"], [64]))
    cases["optimizer shape"] = ([*ARGS, "--train.steps=3", "--checkpoint.enable=true", f"--job.dump_folder={dump}"],
                                "optimizer.state.norm.weight.exp_avg has shape [64] in the checkpoint but [128]")
    dump = tmp_path / "gap"  # issue 39 item 3: resumed, the gap kept its fresh initial values
    _edit_index(_copy(trained, dump / "checkpoint" / "step-2"), lambda e: setattr(e["model.norm.weight"], "chunks", []))
    cases["chunk gap"] = ([*ARGS, "--train.steps=3", "--checkpoint.enable=true", f"--job.dump_folder={dump}"],
                          "entry 'model.norm.weight' has chunks that leave elements out (they cover 0 elements")
    dump = tmp_path / "symlink"
    _link_outside(_copy(trained, dump / "checkpoint" / "step-2"), "__0_0.distcp", tmp_path / "elsewhere")
    cases["symlink"] = ([*ARGS, "--train.steps=3", "--checkpoint.enable=true", f"--job.dump_folder={dump}"],
                        f"{dump / 'checkpoint' / 'step-2' / '__0_0.distcp'} is a symlink to {tmp_path / 'elsewhere'}")
    # The common setup stays fine: checkpoint/ itself a symlink to scratch storage.
    scratch = _copy(trained.parent, tmp_path / "scratch" / "checkpoint")
    (tmp_path / "linked").mkdir()
    os.symlink(scratch, tmp_path / "linked" / "checkpoint")
    results = run_cli_cases({"linked": [*ARGS, "--train.steps=3", "--checkpoint.enable=true",
                                        f"--job.dump_folder={tmp_path / 'linked'}"],
                             **{k: v[0] for k, v in cases.items()}})
    assert results["linked"]["rc"] == 0 and "resumed from checkpoint" in results["linked"]["stdout"], results["linked"]
    assert (scratch / "step-3" / "checkpoint.json").exists()
    for name, (_, message) in cases.items():
        r = results[name]
        lines = r["stderr"].strip().splitlines()
        assert r["rc"] == 2 and len(lines) == 1 and message in lines[0], (name, r["stderr"][-2000:])
        assert "Traceback" not in r["stderr"] and '"step": -4' not in r["stdout"], name


# -- item 5: reads confined to the folder ------------------------------------------------------------------


def _link_outside(folder: Path, name: str, outside: Path) -> Path:
    """Move `name` out of the folder and leave a symlink to it (same bytes: the checksums still match)."""
    outside.mkdir(parents=True, exist_ok=True)
    target = outside / name.lstrip(".")
    shutil.move(folder / name, target)
    os.symlink(target, folder / name)
    return target


@pytest.mark.parametrize("name", ["__0_0.distcp", ".metadata", "state.json", "checkpoint.json"])
def test_symlink_out_of_a_checkpoint_is_refused(trained, tmp_path, name):
    folder = _copy(trained, tmp_path / "step-2")
    target = _link_outside(folder, name, tmp_path / "elsewhere")
    message = f"{folder / name} is a symlink to {target}, outside its folder {folder}; refusing to read it"
    for load in (load_model, load_full_model_weights):
        with pytest.raises(CheckpointError, match="^" + message.replace(".", r"\.")):
            load(folder)


def test_a_symlinked_checkpoint_folder_is_fine(trained, tmp_path):
    scratch = _copy(trained.parent, tmp_path / "scratch" / "checkpoint")
    (tmp_path / "run").mkdir()
    os.symlink(scratch, tmp_path / "run" / "checkpoint")  # the common setup: checkpoint/ on scratch storage
    os.symlink(scratch / "step-2", tmp_path / "step-link")  # and a step folder that is itself a link
    assert load_model(tmp_path / "run" / "checkpoint").args.n_layers == DEBUG.n_layers
    assert load_model(tmp_path / "step-link").args.n_layers == DEBUG.n_layers


@pytest.mark.parametrize("name", ["model.safetensors", "config.json"])
def test_symlink_out_of_an_hf_folder_is_refused(hf_export, tmp_path, name):
    folder = _copy(hf_export, tmp_path / "export")
    target = _link_outside(folder, name, tmp_path / "elsewhere")
    message = f"{folder / name} is a symlink to {target}, outside its folder {folder}; refusing to read it"
    with pytest.raises(ExportError, match="^" + message.replace(".", r"\.")):
        load_model(folder)
    with pytest.raises(ExportError, match="^" + message.replace(".", r"\.")):
        read_hf_weights(folder, args=DEBUG)  # what import reads


# -- the command lines: exit 2, one line, no traceback -----------------------------------------------------

_CONVERT_CASES = """
import contextlib, io, json, runpy, sys, traceback
main = runpy.run_path(sys.argv[2])["main"]
results = {}
for name, argv in json.loads(sys.argv[1]).items():
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            rc = main(argv)
        except BaseException:
            rc, _ = 1, traceback.print_exc()
    results[name] = {"rc": rc, "stderr": err.getvalue()}
print(json.dumps(results))
"""


def test_convert_checkpoint_refuses_crafted_folders_in_one_line(trained, hf_export, tmp_path):
    src = tmp_path / "src"
    cases = {
        "negative size": (_index_cases(trained, src)["negative size"][0], "has size torch.Size([-1])"),
        "other shape": (_narrow_embedding(trained, src / "narrow"), "model.tok_embeddings.weight has shape [512, 64]"),
        "n_layers": (_with_model(trained, src / "layers", n_layers=10**8), "imply 19,686,400,131,200 parameters"),
        "dim string": (_with_model(trained, src / "dim", dim="128"), "model.dim='128' must be an integer"),
    }
    link = _copy(trained, src / "link")
    _link_outside(link, "__0_0.distcp", tmp_path / "elsewhere")
    cases["symlink"] = (link, "is a symlink to")
    argv = {name: ["export", str(folder), str(tmp_path / "out" / name)] for name, (folder, _) in cases.items()}
    hf_link = _copy(hf_export, src / "hf_link")
    _link_outside(hf_link, "model.safetensors", tmp_path / "elsewhere_hf")
    cases["import symlink"] = (hf_link, "model.safetensors is a symlink to")
    argv["import symlink"] = ["import", str(hf_link), str(tmp_path / "out" / "imported"), "--flavor=debug"]
    proc = subprocess.run([sys.executable, "-c", _CONVERT_CASES, json.dumps(argv), CONVERT], capture_output=True,
                          text=True, env=env(), cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.splitlines()[-1])
    for name, (folder, message) in cases.items():
        r = results[name]
        lines = r["stderr"].strip().splitlines()
        assert r["rc"] == 2 and len(lines) == 1, (name, r["stderr"][-2000:])
        assert lines[0].startswith(f"error: {folder}") and message in lines[0], (name, lines[0])
    assert not (tmp_path / "out").exists()


# -- issue 36, item 2: every field that is read, by one rule table; bounded work ----------------------------------


def _edit_storage(folder: Path, edit) -> Path:
    """`edit(storage items)` on the index's storage entries (offset, length of each tensor's bytes)."""
    md = pickle.loads((folder / ".metadata").read_bytes())  # our own file: trusted
    edit(list(md.storage_data.values()))
    (folder / ".metadata").write_bytes(pickle.dumps(md))
    _rewrite_checksums(folder)
    return folder


def test_crafted_state_and_checkpoint_fields_are_one_line(trained, tmp_path):
    state_cases = {
        "scheduler optimizer": (("lr_scheduler", "optimizer", 5), "lr_scheduler.optimizer is not a field this trainer "
                                                                  "writes"),
        "base_lrs strings": (("lr_scheduler", "base_lrs", ["x"]), "lr_scheduler.base_lrs[0]='x' must be a number"),
        "step_count string": (("lr_scheduler", "_step_count", "3"), "lr_scheduler._step_count='3' must be an integer"),
        "schedule key": (("lr_scheduler", "schedule", {"warmup_steps": 5, "evil": 1}),
                         "lr_scheduler.schedule.evil is not a field this trainer writes"),
    }
    for name, ((section, key, value), message) in state_cases.items():
        folder = _edit_json(_copy(trained, tmp_path / name.replace(" ", "_")), "state.json",
                            lambda s: s[section].__setitem__(key, value))
        with pytest.raises(CheckpointError) as e:
            read_state_json(folder, read_checkpoint_json(folder))
        assert str(e.value).startswith(f"{folder / 'state.json'}: {message}"), (name, str(e.value))
    folder = _edit_json(_copy(trained, tmp_path / "betas"), "state.json",
                        lambda s: s["optimizer"]["param_groups"][0].__setitem__("betas", [0.9, "x"]))
    with pytest.raises(CheckpointError, match=r"optimizer.param_groups\[0\].betas\[1\]='x' must be a number"):
        read_state_json(folder, read_checkpoint_json(folder))
    for name, value, message in [("layout string", "dp_shard=2", "layout='dp_shard=2' must be an object"),
                                 ("layout float", {"dp_shard": 2.5}, "layout.dp_shard=2.5 must be an integer")]:
        folder = _edit_json(_copy(trained, tmp_path / name.replace(" ", "_")), "checkpoint.json",
                            lambda i: i.__setitem__("layout", value))
        with pytest.raises(CheckpointError) as e:
            read_checkpoint_json(folder)
        assert str(e.value).startswith(f"{folder / 'checkpoint.json'}: {message}"), (name, str(e.value))
    # generate.py on a truncated checkpoint.json: the line resume and export give.
    truncated = _copy(trained, tmp_path / "truncated")
    (truncated / "checkpoint.json").write_text((truncated / "checkpoint.json").read_text()[:50])
    from tests.faults.test_tokenizer_confinement import one_line_error, run_scripts

    one_line_error(run_scripts({"g": ("generate", [str(truncated), "--max-new-tokens=2"])})["g"],
                   "checkpoint.json is corrupted (not valid JSON")


def test_crafted_storage_extents_and_chunk_counts_are_one_line(trained, tmp_path, monkeypatch):
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    from trainer.checkpoint import verify

    cases = {
        "offset string": (lambda items: setattr(items[0], "offset", "0"), "has offset '0', not an integer >= 0"),
        "offset missing": (lambda items: setattr(items[0], "offset", None), "has offset None, not an integer >= 0"),
        "length float": (lambda items: setattr(items[0], "length", 12.5), "has length 12.5, not an integer >= 1"),
        "length negative": (lambda items: setattr(items[0], "length", -4), "has length -4, not an integer >= 1"),
        "length zero": (lambda items: setattr(items[0], "length", 0), "has length 0, not an integer >= 1"),
    }
    folders = {name: (_edit_storage(_copy(trained, tmp_path / name.replace(" ", "_")), edit), message)
               for name, (edit, message) in cases.items()}

    monkeypatch.setattr(verify, "MAX_CHUNKS", 10_000)  # the bound's logic, at a size a test can write

    def many_chunks(entries):  # 10,001 chunks in all: one entry's 1-element chunks, over and over
        md = entries["model.norm.weight"]
        md.chunks = [ChunkStorageMetadata(offsets=torch.Size([i % 128]), sizes=torch.Size([1])) for i in range(10_001)]

    def few_chunks_many_pieces(entries):  # 64 1x1 chunks on the diagonal cut a 128 x 128 weight into 65 x 65 pieces
        md = entries["model.layers.0.attention.q_proj.weight"]
        md.chunks = [ChunkStorageMetadata(offsets=torch.Size([2 * i, 2 * i]), sizes=torch.Size([1, 1]))
                     for i in range(64)]

    folders["many chunks"] = (_edit_index(_copy(trained, tmp_path / "many"), many_chunks),
                              "chunks, more than the 10,000 a DCP index of this trainer holds")
    folders["many pieces"] = (_edit_index(_copy(trained, tmp_path / "pieces"), few_chunks_many_pieces),
                              "chunks that cut it into more pieces than a DCP index of this trainer has")
    for name, (folder, message) in folders.items():
        start = time.perf_counter()
        with pytest.raises(CheckpointError) as e:
            load_full_model_weights(folder)
        assert message in str(e.value) and "\n" not in str(e.value), (name, str(e.value))
        assert time.perf_counter() - start < 60, name
