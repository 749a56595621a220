"""scripts/multigpu_tables.py: the scaling, checkpoint-stall and loss tables of gpu_checks.sh's multi-GPU steps,
from the lines benchmark.py, the checkpoint manager and metrics.jsonl write."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO


@pytest.fixture(scope="module")
def tables():
    sys.path.insert(0, str(REPO / "scripts"))  # it imports fp8_parity's reader, as when run from scripts/
    try:
        spec = importlib.util.spec_from_file_location("multigpu_tables", REPO / "scripts" / "multigpu_tables.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(REPO / "scripts"))


def run(world: int, precision: str, tps: float, *, ag_off: bool = False) -> dict:
    overrides = ["--train.batch_size=4"] + (["--float8.enable_fsdp_float8_all_gather=false"] if ag_off else [])
    return {"world_size": world, "precision": precision, "tokens_per_s_per_gpu": tps, "overrides": overrides}


def test_scaling_efficiency_is_per_gpu_throughput_over_one_gpus(tables) -> None:
    runs = [run(1, "bf16", 4000.0), run(1, "fp8", 5000.0), run(4, "bf16", 3800.0), run(4, "fp8", 4600.0),
            run(4, "fp8", 4500.0, ag_off=True), run(2, "bf16", 3900.0)]
    lines = tables.scaling_table(runs).splitlines()
    assert lines[0] == ("| GPUs | bf16: tokens/s per GPU (efficiency) | fp8: tokens/s per GPU (efficiency) | fp8, "
                        "all-gather fp8: tokens/s per GPU (efficiency) | fp8, all-gather bf16: tokens/s per GPU "
                        "(efficiency) |")
    rows = {line.split(" | ")[0].strip("| "): line for line in lines[2:]}
    assert rows["1"] == "| 1 | 4,000 (100.0%) | 5,000 (100.0%) |  |  |"
    assert rows["2"] == "| 2 | 3,900 (97.5%) |  |  |  |"
    # Both all-gather columns are held against one GPU's fp8, which has no all-gather.
    assert rows["4"] == "| 4 | 3,800 (95.0%) |  | 4,600 (92.0%) | 4,500 (90.0%) |"


def test_scaling_without_a_one_gpu_run_gives_no_efficiency(tables) -> None:
    assert tables.scaling_table([run(4, "bf16", 3800.0)]).splitlines()[2] == "| 4 | 3,800 |"


def test_stall_table_reads_the_managers_lines(tables) -> None:
    # The lines trainer/checkpoint/manager.py logs for an async save and for a synchronous one.
    def line(rank: int, step: int, previous: float, preparing: float, staging: float) -> str:
        return (f"[rank{rank}    61.0s] checkpoint step-{step}: blocked training {previous + preparing + staging:.2f} s "
                f"(previous save {previous:.2f} s, preparing {preparing:.2f} s, staging {staging:.2f} s); writing in "
                "the background")

    log = "\n".join([
        line(0, 30, 0.0, 1.2, 9.8), line(1, 30, 0.0, 1.3, 9.7),
        line(0, 60, 0.25, 1.0, 1.25), line(1, 60, 0.3, 1.0, 1.3),
        line(0, 90, 0.0, 1.0, 2.5),
        "[rank0   140.0s] checkpoint step-100: blocked training 4.00 s (synchronous save; checkpoint.async_mode "
        "writes in the background)",
    ])
    table = tables.stall_table(log)  # each save's slowest rank: the next collective waits for it
    assert "| step-30 | 11.00 | 0.00 | 1.20 | 9.80 |" in table
    assert "| step-60 | 2.60 | 0.30 | 1.00 | 1.30 |" in table
    assert "| step-100 | 4.00 |  |  |  |" in table
    assert table.splitlines()[-1] == ("GPU idle (staging; a synchronous save: all of it): first save 9.80 s; the "
                                      "others median 2.50 s, max 4.00 s")
    assert tables.stall_table("no saves") == "no 'checkpoint step-N: blocked training' line in the log"


def test_losses_compare_two_runs_step_by_step(tables, tmp_path: Path) -> None:
    for name, losses in (("ref", [10.0, 8.0, 6.0]), ("other", [10.0, 8.04, 6.006])):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text(
            "".join(json.dumps({"step": i + 1, "loss": v}) + "\n" for i, v in enumerate(losses)))
    assert tables.loss_comparison(tmp_path / "ref", tmp_path / "other") == (
        "3 common steps; largest difference at step 2: 8.0000 vs 8.0400 (+0.500%); step 3: 6.0000 vs 6.0060 (+0.100%)")
