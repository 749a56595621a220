"""Every value a resume reads from a checkpoint's tensors is checked (issue 51, item 2): AdamW's moments, steps and
fp8 block scales, FP8 delayed scaling's amax histories and scales, the random generators' states, the weights.
Each bad value is one CheckpointError line naming the checkpoint and the key, before any part takes it (a NaN
exp_avg_sq once made the first resumed step NaN, and the run blamed optimizer.lr; an amax of 1e30 zeroed every FP8
matmul for amax_history_len steps without a word; an all-zero RNG state was a traceback). And a step whose weights
are not finite is never published as the latest checkpoint.

One in-process run of the debug model (fp8 with delayed scaling and an fp8 AdamW first moment, 2 steps) writes the
genuine checkpoint; each case loads its tensors, edits one and saves them again with checksums to match (what an
attacker, or a damaged run, leaves), and the same Trainer resumes it.
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from tests.faults.test_hostile_checkpoint import _rewrite_checksums
from tests.helpers import DEBUG_CONFIG
from trainer.checkpoint import CheckpointError, load_dcp_metadata
from trainer.checkpoint.verify import scan_checkpoints
from trainer.config import load_job_config
from trainer.distributed import destroy_distributed
from trainer.run.train import Trainer, build_trainer
from trainer.tensor_values import FINITE, TensorRule, value_problems

Q = "layers.0.attention.q_proj"
OPT = f"optimizer.state.{Q}.weight"  # its AdamW state: an fp8 exp_avg with block scales, a bf16 exp_avg_sq
AMAX = f"float8_scaling.{Q}"


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Trainer:
    """The Trainer of a finished 2-step run, its step-2 checkpoint in `run.checkpoint.folder`."""
    dump = tmp_path_factory.mktemp("values")
    cfg = load_job_config(["--config", DEBUG_CONFIG, "--train.steps=2", "--train.seq_len=32", "--train.batch_size=2",
                           "--train.mixed_precision=fp8", "--float8.scaling=delayed", "--optimizer.exp_avg_dtype=fp8",
                           "--checkpoint.enable=true", "--checkpoint.interval=2", f"--job.dump_folder={dump}",
                           "--metrics.enable_tensorboard=false"])
    trainer = build_trainer(cfg)
    try:
        trainer.run()
        trainer.genuine = trainer.checkpoint.folder / "step-2"
        entries = load_dcp_metadata(trainer.genuine / ".metadata").state_dict_metadata
        trainer.tensors = {k: torch.empty(md.size, dtype=md.properties.dtype) for k, md in entries.items()}
        dcp.load(trainer.tensors, storage_reader=FileSystemReader(str(trainer.genuine)))
        yield trainer
    finally:
        trainer.close()
        destroy_distributed()


def _crafted(run: Trainer, out: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    """A copy of the run's checkpoint whose tensors `edit` changed (the index and shards written anew, checksums
    rewritten to match): its checkpoint folder."""
    genuine = run.genuine
    shutil.copytree(genuine, out / genuine.name, ignore=shutil.ignore_patterns(".metadata", "*.distcp"))
    tensors = {k: t.clone() for k, t in run.tensors.items()}
    edit(tensors)
    dcp.save(tensors, storage_writer=FileSystemWriter(str(out / genuine.name)))
    _rewrite_checksums(out / genuine.name)
    return out


def _first(key: str, value: float):
    def edit(tensors):
        if tensors[key].dim():
            tensors[key].view(-1)[0] = value
        else:
            tensors[key] = torch.tensor(value, dtype=tensors[key].dtype)
    return edit


def _as(key: str, dtype: torch.dtype):
    def edit(tensors):
        tensors[key] = tensors[key].to(dtype)
    return edit


NAN, INF = math.nan, math.inf
NONFINITE = "holds 1 non-finite value"
# (edit, key, what the line says of it)
CASES = {
    "exp_avg_sq NaN": (_first(f"{OPT}.exp_avg_sq", NAN), f"{OPT}.exp_avg_sq", f"{NONFINITE} (1 NaN, 0 Inf of 16,384"),
    "exp_avg_sq Inf": (_first(f"{OPT}.exp_avg_sq", INF), f"{OPT}.exp_avg_sq", f"{NONFINITE} (0 NaN, 1 Inf of 16,384"),
    "exp_avg_sq negative": (_first(f"{OPT}.exp_avg_sq", -0.25), f"{OPT}.exp_avg_sq",
                            "holds 1 of 16,384 values outside the allowed [0, inf) (first at [0, 0]: -0.25; AdamW's "
                            "second moment, a mean of squares)"),
    "exp_avg NaN": (_first(f"{OPT}.exp_avg", NAN), f"{OPT}.exp_avg", f"{NONFINITE} (1 NaN, 0 Inf of 16,384"),
    "norm exp_avg Inf": (_first("optimizer.state.norm.weight.exp_avg", INF), "optimizer.state.norm.weight.exp_avg",
                         f"{NONFINITE} (0 NaN, 1 Inf of 128"),
    "step NaN": (_first(f"{OPT}.step", NAN), f"{OPT}.step", "is nan (allowed: whole numbers in [0, 2]"),
    "step negative": (_first(f"{OPT}.step", -1.0), f"{OPT}.step", "is -1 (allowed: whole numbers in [0, 2]"),
    "step past the checkpoint's": (_first(f"{OPT}.step", 1e9), f"{OPT}.step", "is 1e+09 (allowed: whole numbers"),
    "step fractional": (_first(f"{OPT}.step", 1.5), f"{OPT}.step", "is 1.5 (allowed: whole numbers in [0, 2]"),
    "exp_avg_scale NaN": (_first(f"{OPT}.exp_avg_scale", NAN), f"{OPT}.exp_avg_scale", NONFINITE),
    "exp_avg_scale 0": (_first(f"{OPT}.exp_avg_scale", 0.0), f"{OPT}.exp_avg_scale",
                        "holds 1 of 128 values outside the allowed (0, inf) (first at [0, 0]: 0"),
    "exp_avg_scale negative": (_first(f"{OPT}.exp_avg_scale", -1.0), f"{OPT}.exp_avg_scale", "outside the allowed (0"),
    "exp_avg_scale missing": (lambda t: t.pop(f"{OPT}.exp_avg_scale"), f"{OPT}.exp_avg",
                              f"without its block scales ({OPT}.exp_avg_scale is missing)"),
    "exp_avg_scale of a bf16 exp_avg": (_as(f"{OPT}.exp_avg", torch.bfloat16), f"{OPT}.exp_avg_scale",
                                        "holds block scales of"),
    "amax 1e30": (_first(f"{AMAX}.amax_history", 1e30), f"{AMAX}.amax_history",
                  "values outside the allowed [0, 1e+12] (first at [0, 0]: 1e+30; an amax above 1e+12 would flush"),
    "amax NaN": (_first(f"{AMAX}.amax_history", NAN), f"{AMAX}.amax_history", NONFINITE),
    "amax negative": (_first(f"{AMAX}.amax_history", -1.0), f"{AMAX}.amax_history", "outside the allowed [0, 1e+12]"),
    "amax float64": (_as(f"{AMAX}.amax_history", torch.float64), f"{AMAX}.amax_history",
                     "is stored as float64, not float32"),
    "fp8 scale NaN": (_first(f"{AMAX}.scale", NAN), f"{AMAX}.scale", NONFINITE),
    "fp8 scale 0": (_first(f"{AMAX}.scale", 0.0), f"{AMAX}.scale", "outside the allowed (4.48e-10, 5.7344e+16]"),
    "fp8 scale 1e30": (_first(f"{AMAX}.scale", 1e30), f"{AMAX}.scale", "(first at [0]: 1e+30"),
    "fp8 scale float16": (_as(f"{AMAX}.scale", torch.float16), f"{AMAX}.scale", "is stored as float16, not float32"),
    "rng all zero": (lambda t: t["rng.cpu"].zero_(), "rng.cpu", "is not a state torch takes (Invalid mt19937 state"),
    "rng float32": (_as("rng.cpu", torch.float32), "rng.cpu", "is stored as float32, not uint8"),
    "weight NaN": (_first(f"model.{Q}.weight", NAN), f"model.{Q}.weight", f"{NONFINITE} (1 NaN, 0 Inf of 16,384"),
}


@pytest.mark.parametrize("case", CASES)
def test_a_bad_loaded_value_is_one_line_naming_the_checkpoint_and_the_key(run: Trainer, case: str,
                                                                           tmp_path: Path) -> None:
    edit, key, says = CASES[case]
    run.checkpoint.folder = _crafted(run, tmp_path, edit)
    with pytest.raises(CheckpointError) as e:
        run.checkpoint.resume()
    line = str(e.value)
    assert "\n" not in line and line.startswith(str(tmp_path / "step-2")), line
    assert key in line and says in line, line
    assert "optimizer.lr" not in line  # not blamed on the learning rate, as the non-finite guard did
    assert (tmp_path / "step-2").is_dir()  # nothing moved aside: the folder is not corrupt, its values are


def test_a_genuine_checkpoint_rewritten_the_same_way_resumes(run: Trainer, tmp_path: Path) -> None:
    """The control: the crafting alone changes nothing a resume checks."""
    run.checkpoint.folder = _crafted(run, tmp_path, lambda tensors: None)
    run.checkpoint.resume()
    assert run.state.step == 2 and run.checkpoint.resumed_step == 2


def test_a_save_of_weights_that_are_not_finite_is_refused_and_the_previous_stays_latest(run: Trainer,
                                                                                        tmp_path: Path) -> None:
    folder = tmp_path / "checkpoint"
    shutil.copytree(run.genuine, folder / "step-2")
    run.checkpoint.folder = folder
    run.checkpoint.resume()
    weight = run.model.layers["0"].attention.q_proj.weight
    local = weight.to_local() if hasattr(weight, "to_local") else weight
    kept = local.detach().clone()
    try:
        with torch.no_grad():
            local[3, 5] = math.inf
        with pytest.raises(CheckpointError) as e:
            run.checkpoint.save(3)
    finally:
        with torch.no_grad():
            local.copy_(kept)
    assert str(e.value) == (
        f"checkpoint step-3 was not saved: the weights are not finite: model.{Q}.weight holds 1 non-finite value "
        "(0 NaN, 1 Inf of 16,384; first at [3, 5]); step-2 stays the latest checkpoint (the run diverged: resume it "
        "with a lower optimizer.lr or more scheduler.warmup_steps)")
    complete, incomplete = scan_checkpoints(folder)
    assert list(complete) == [2] and incomplete == []  # nothing written, not even step-3.tmp
    run.checkpoint.save(3)  # finite again: saved
    assert sorted(scan_checkpoints(folder)[0]) == [2, 3]


def test_value_problems_name_the_first_bad_value_of_each_tensor_that_breaks_its_rule() -> None:
    """`value_problems` in one process: the first bad value by index, one phrase per tensor that breaks its rule, none
    for one that keeps it (several ranks' shards: tests/distributed/test_checkpoint_ranks.py)."""
    x = torch.zeros(4, 6)
    x[2, 1], x[3, 0] = math.nan, math.inf
    step = torch.tensor(3.0)
    rules = {"a": (x, FINITE), "b": (torch.ones(3), TensorRule(low=0, low_open=True)),
             "c": (step, TensorRule(low=0, high=2, integral=True, why="at most the checkpoint's")),
             "d": (torch.tensor([0.5, -1.0]).to(torch.float8_e4m3fn), FINITE)}
    assert value_problems(rules) == [
        "a holds 2 non-finite values (1 NaN, 1 Inf of 24; first at [2, 1])",
        "c is 3 (allowed: whole numbers in [0, 2]; at most the checkpoint's)",
    ]
    nan_e4m3 = torch.tensor([0.5, math.nan]).to(torch.float8_e4m3fn)  # e4m3fn's one bad value
    assert value_problems({"d": (nan_e4m3, FINITE)}) == ["d holds 1 non-finite value (1 NaN, 0 Inf of 2; first at [1])"]
