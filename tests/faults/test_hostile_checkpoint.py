"""A hostile checkpoint folder is refused in one line and runs no code, on every load path.

Each crafted file carries a pickle whose `__reduce__` would create a marker file when
unpickled (`_Payload`); the tests first show the payload is live (plain `pickle` /
torch's own DCP reader do create the marker), then that resume, `--checkpoint.initial_load_path`,
`scripts/convert_checkpoint.py export|import` and `load_model` refuse the folder, naming the
file, and the marker does not exist. The attacker also rewrites checkpoint.json's checksums,
so the files verify: only reading them safely protects.
"""

from __future__ import annotations

import json
import pickle
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from tests.helpers import REPO, env, run_cli_cases
from trainer.checkpoint import (
    CheckpointError, RunInfo, file_digest, load_dcp_metadata, load_full_model_weights, load_model, save_model_only,
)
from trainer.hf import ExportError, read_hf_weights
from trainer.models.llama import FLAVORS

CONVERT = str(REPO / "scripts" / "convert_checkpoint.py")
DEBUG = FLAVORS["debug"]
ARGS = [
    "--config", str(REPO / "configs" / "train" / "debug_model.toml"), "--train.seq_len=32", "--train.batch_size=2",
    "--metrics.log_freq=1", "--metrics.enable_tensorboard=false", "--train.mixed_precision=fp32",
]


class _Payload:
    """Unpickling this runs `open(marker, "w")`: the stand-in for an attacker's shell command."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _rewrite_checksums(folder: Path) -> None:
    """What an attacker does after editing files: make checkpoint.json's sizes and crc32 match again."""
    info = json.loads((folder / "checkpoint.json").read_text())
    info["files"] = {p.name: file_digest(p) for p in sorted(folder.iterdir()) if p.name != "checkpoint.json"}
    (folder / "checkpoint.json").write_text(json.dumps(info))


def _model_only(folder: Path) -> Path:
    """A genuine model-only checkpoint of the debug model (what convert_checkpoint.py import writes)."""
    torch.manual_seed(0)
    from trainer.hf import expected_shapes

    weights = {k: torch.randn(shape) for k, shape in expected_shapes(DEBUG).items()}
    run = RunInfo(flavor="debug", model_args=DEBUG, mixed_precision="fp32")
    return save_model_only(folder, weights, run=run, source="test")


def _with_hostile_metadata(good: Path, out: Path, marker: Path) -> Path:
    """A copy of `good` whose .metadata also pickles the payload (in a field DCP ignores), checksums fixed."""
    shutil.copytree(good, out)
    md = pickle.loads((good / ".metadata").read_bytes())  # our own file: trusted
    md.planner_data = {"model.norm.weight": _Payload(marker)}
    (out / ".metadata").write_bytes(pickle.dumps(md))
    _rewrite_checksums(out)
    return out


def _with_pickled_entry(good: Path, out: Path, marker: Path) -> Path:
    """A copy of `good` with every tensor re-saved plus one non-tensor DCP entry holding the payload."""
    md = load_dcp_metadata(good / ".metadata")
    flat = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype) for k, v in md.state_dict_metadata.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(flat, checkpoint_id=str(good), no_dist=True)
        # DCP stores a non-tensor value with torch.save and reads it back with torch.load(weights_only=False).
        dcp.save({**flat, "train_state.step": _Payload(marker)}, checkpoint_id=str(out), no_dist=True)
    for name in ("checkpoint.json", "state.json"):
        if (good / name).exists():
            shutil.copy(good / name, out / name)
    _rewrite_checksums(out)
    return out


def test_crafted_metadata_is_refused_and_runs_nothing(tmp_path):
    marker = tmp_path / "marker"
    hostile = _with_hostile_metadata(_model_only(tmp_path / "good"), tmp_path / "hostile", marker)
    # The payload is live: torch's own reader runs it.
    FileSystemReader(str(hostile)).read_metadata()
    assert marker.exists()
    marker.unlink()
    meta = str(hostile / ".metadata")
    with pytest.raises(CheckpointError, match=rf"{meta} is not a safe DCP index, refusing to load it \(it refers to "
                                              r"io.open"):
        load_full_model_weights(hostile)
    with pytest.raises(CheckpointError, match=f"{meta} is not a safe DCP index"):
        load_model(hostile)
    assert not marker.exists()


def test_crafted_non_tensor_entry_is_refused_and_runs_nothing(tmp_path):
    marker = tmp_path / "marker"
    hostile = _with_pickled_entry(_model_only(tmp_path / "good"), tmp_path / "hostile", marker)
    with warnings.catch_warnings():  # the payload is live: DCP's own load of the entry runs it
        warnings.simplefilter("ignore")
        dcp.load({"train_state.step": 0}, checkpoint_id=str(hostile), no_dist=True)
    assert marker.exists()
    marker.unlink()
    with pytest.raises(CheckpointError, match=rf"{hostile / '.metadata'}: entry 'train_state.step' is a pickled "
                                              r"Python object, not a tensor; refusing to load it"):
        load_full_model_weights(hostile)
    assert not marker.exists()


def _hostile_hf(folder: Path, marker: Path, good_hf: Path | None = None) -> dict[str, Path]:
    """Hugging Face folders whose weights are pickles: pytorch_model.bin, a pickle named model.safetensors,
    and an index pointing outside the folder."""
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": DEBUG.dim,
              "intermediate_size": DEBUG.ffn_dim, "num_hidden_layers": DEBUG.n_layers,
              "num_attention_heads": DEBUG.n_heads, "num_key_value_heads": DEBUG.n_kv_heads,
              "vocab_size": DEBUG.vocab_size, "rms_norm_eps": DEBUG.norm_eps, "rope_theta": DEBUG.rope_theta,
              "max_position_embeddings": 128}
    payload = pickle.dumps({"model.embed_tokens.weight": _Payload(marker)})
    cases = {}
    for name, files in {
        "bin": {"pytorch_model.bin": payload},
        "fake_safetensors": {"model.safetensors": payload},
        "index_escape": {"model.safetensors.index.json": json.dumps(
            {"weight_map": {"model.embed_tokens.weight": "../bin/pytorch_model.bin"}}).encode()},
    }.items():
        path = folder / name
        path.mkdir(parents=True)
        (path / "config.json").write_text(json.dumps(config))
        for file, data in files.items():
            (path / file).write_bytes(data)
        cases[name] = path
    return cases


def test_crafted_hf_folders_are_refused_and_run_nothing(tmp_path):
    pytest.importorskip("safetensors")
    marker = tmp_path / "marker"
    cases = _hostile_hf(tmp_path, marker)
    pickle.loads((cases["bin"] / "pytorch_model.bin").read_bytes())
    assert marker.exists()
    marker.unlink()
    expected = {
        "bin": "has neither model.safetensors nor model.safetensors.index.json (pytorch_model.bin not read: "
               "pickled weights can run code",
        "fake_safetensors": "model.safetensors is not a readable safetensors file",
        "index_escape": "names '../bin/pytorch_model.bin', not a .safetensors file of this folder",
    }
    for name, path in cases.items():
        with pytest.raises(ExportError, match=expected[name].replace("(", r"\(").replace(")", r"\)")):
            load_model(path)
        with pytest.raises(ExportError, match=expected[name].replace("(", r"\(").replace(")", r"\)")):
            read_hf_weights(path, args=DEBUG)
    assert not marker.exists()


# -- the same files through the command lines: resume, initial load, export, import ------------------


@pytest.mark.slow
def test_hostile_checkpoints_refused_on_resume_initial_load_and_export(trained, tmp_path):
    marker = tmp_path / "marker"
    hostile = {
        "metadata": _with_hostile_metadata(trained, tmp_path / "src" / "metadata", marker),
        "entry": _with_pickled_entry(trained, tmp_path / "src" / "entry", marker),
    }
    hf = _hostile_hf(tmp_path / "hf", marker)
    expected = {
        "metadata": "is not a safe DCP index, refusing to load it (it refers to io.open",
        "entry": "entry 'train_state.step' is a pickled Python object, not a tensor; refusing to load it",
    }
    cases = {}
    for kind, folder in hostile.items():
        dump = tmp_path / f"resume-{kind}"
        shutil.copytree(folder, dump / "checkpoint" / "step-2")
        cases[f"resume {kind}"] = ([*ARGS, "--train.steps=3", "--checkpoint.enable=true",
                                    f"--job.dump_folder={dump}"], str(dump / "checkpoint" / "step-2" / ".metadata"),
                                   expected[kind])
        cases[f"initial load {kind}"] = ([*ARGS, "--train.steps=1", f"--checkpoint.initial_load_path={folder}",
                                          f"--job.dump_folder={tmp_path / f'init-{kind}'}"],
                                         str(folder / ".metadata"), expected[kind])
    cases["initial load hf"] = ([*ARGS, "--train.steps=1", f"--checkpoint.initial_load_path={hf['bin']}",
                                 f"--job.dump_folder={tmp_path / 'init-hf'}"], str(hf["bin"] / "checkpoint.json"),
                                "looks like a Hugging Face model folder; convert it first")
    results = run_cli_cases({k: v[0] for k, v in cases.items()})
    for name, (_, file, message) in cases.items():
        r = results[name]
        lines = r["stderr"].strip().splitlines()
        assert r["rc"] == 2 and len(lines) == 1, (name, r["stderr"][-2000:])
        assert file in lines[0] and message in lines[0], (name, lines[0])
        assert "| loss" not in r["stdout"], name
    # scripts/convert_checkpoint.py export (DCP -> HF) and import (HF -> DCP).
    for kind, folder in hostile.items():
        out = subprocess.run([sys.executable, CONVERT, "export", str(folder), str(tmp_path / f"out-{kind}")],
                             capture_output=True, text=True, env=env(), cwd=REPO, timeout=120)
        assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr[-2000:]
        assert str(folder / ".metadata") in out.stderr and expected[kind] in out.stderr
        assert not (tmp_path / f"out-{kind}").exists()
    for name, folder in hf.items():
        out = subprocess.run([sys.executable, CONVERT, "import", str(folder), str(tmp_path / f"imp-{name}"),
                              "--flavor=debug"], capture_output=True, text=True, env=env(), cwd=REPO, timeout=120)
        assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr[-2000:]
        assert str(folder) in out.stderr
    assert not marker.exists(), "a hostile file ran code"
    # The untouched original still loads everywhere: the checks refuse only what is unsafe.
    assert load_model(trained).args.n_layers == DEBUG.n_layers


def test_index_entries_must_be_tensors_in_this_folder(tmp_path):
    good = _model_only(tmp_path / "good")
    md = pickle.loads((good / ".metadata").read_bytes())  # our own file: trusted
    key = next(iter(md.storage_data))
    md.storage_data[key].relative_path = "../../etc/passwd"
    (tmp_path / "escape.metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(CheckpointError, match=r"a storage entry names '../../etc/passwd', not a __R_I.distcp file"):
        load_dcp_metadata(tmp_path / "escape.metadata")
    # Defense in depth: even handed a plan with a non-tensor read, the reader refuses before unpickling.
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

    from trainer.checkpoint import SafeReader

    item = ReadItem(type=LoadItemType.BYTE_IO, dest_index=MetadataIndex("train_state.step"), dest_offsets=torch.Size(),
                    storage_index=MetadataIndex("train_state.step"), storage_offsets=torch.Size(),
                    lengths=torch.Size())
    with pytest.raises(CheckpointError, match="entry 'train_state.step' is not a tensor; refusing to unpickle it"):
        SafeReader(str(good)).read_data(LoadPlan([item]), planner=None)


def test_checkpoints_of_the_pickling_format_are_refused(tmp_path):
    good = _model_only(tmp_path / "good")
    info = json.loads((good / "checkpoint.json").read_text())
    (good / "checkpoint.json").write_text(json.dumps({**info, "format": "trainer-dcp-1"}))
    with pytest.raises(CheckpointError, match="format trainer-dcp-1 stored pickled Python objects, which this "
                                              "trainer no longer loads"):
        load_model(good)
