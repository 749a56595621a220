"""scripts/multigpu_tables.py: the scaling, checkpoint-stall and loss tables of gpu_checks.sh's multi-GPU steps,
from the lines benchmark.py, the checkpoint manager and metrics.jsonl write."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, load_script


@pytest.fixture(scope="module")
def tables():
    sys.path.insert(0, str(REPO / "scripts"))  # it imports fp8_parity's reader, as when run from scripts/
    try:
        yield load_script("multigpu_tables")
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


def test_speed_table_reads_the_managers_and_dds_lines(tables) -> None:
    # The lines trainer/checkpoint/manager.py, staging.py and the metrics logger print, and dd's last line per rank.
    def step(t: float, n: int, tps: int) -> str:
        return f"[rank0   {t:6.1f}s] step {n:6d}/30 | loss  7.0000 | grad_norm   1.000 | lr 3.00e-04 | tps {tps:,} | mem"

    def blocked(rank: int, n: int, staging: float) -> str:
        return (f"[rank{rank}   70.0s] checkpoint step-{n}: blocked training {staging + 0.05:.2f} s (previous save 0.00 "
                f"s, preparing 0.05 s, staging {staging:.2f} s); writing in the background")

    def saved(n: int, gb: float, seconds: float) -> str:
        return (f"[rank0   80.0s] saved checkpoint /tmp/ckpt_speed/checkpoint/step-{n} (45000.0 MiB, 11.00 s); written "
                f"at {gb / seconds:.2f} GB/s per rank (the slowest: {gb:.2f} GB in {seconds:.2f} s, 8 threads)")

    log = "\n".join([
        step(40.0, 1, 900), step(42.0, 2, 7000), step(44.0, 3, 7100),
        "[rank0    45.0s] checkpoint: host buffers for 22.4 GiB allocated in the background after the first step in "
        "6.1 s (pages touched in 4.0 s, pinned in 2.1 s; every save copies into them)",
        step(46.0, 4, 8000), step(48.0, 5, 8100), step(50.0, 6, 8200), blocked(0, 6, 0.55), blocked(1, 6, 0.61),
        step(52.0, 7, 6000), step(54.0, 8, 8150), saved(6, 24.08, 9.8),
        "[rank0    55.0s] checkpoint step-6: publishing blocked training 0.12 s (checkpoint.json, the rename, pruning)",
        step(56.0, 9, 8050), blocked(0, 9, 0.5), saved(9, 24.08, 10.4),
    ])
    dd = ("25769803776 bytes (26 GB, 24 GiB) copied, 8.6 s, 3.0 GB/s\n"
          "25769803776 bytes (26 GB, 24 GiB) copied, 10.31 s, 2.5 GB/s\n")
    table = tables.speed_table(log, dd).splitlines()
    assert "| step-6 | 24.08 | 9.80 | 2.46 | 8 | 0.66 | 0.61 | 0.12 |" in table  # the slowest rank's stall
    assert "| step-9 | 24.08 | 10.40 | 2.32 | 8 | 0.55 | 0.50 |  |" in table  # the last: published at the exit
    assert "dd of 25.77 GB per rank, 2 at once into the same folder (conv=fdatasync): 2.50 GB/s each (the slowest)" \
        in table
    # Steps 2 and 3 ran beside the allocation; the saves' steps and the step after each are left out.
    assert table[-1] == ("host buffers: 22.4 GiB allocated in the background in 6.1 s (pages touched in 4.0 s, pinned "
                         "in 2.1 s); tokens/s of the steps beside it 7,050 (median of 2), of the others 8,100 (median of "
                         "3)")
    assert tables.rank_bytes(log) == 24_080_000_000
    assert tables.speed_table("no saves", "") == "no 'saved checkpoint' line in the log"


def test_speed_table_reads_a_checkout_from_before_the_writer_as_a_baseline(tables) -> None:
    """Lines of a run before trainer/checkpoint/writer.py (no write speed, no allocation parts): the checkpoint's bytes
    over the ranks that logged, in the whole save's seconds, marked as such."""
    log = "\n".join([
        "[rank0    20.0s] step      2/30 | loss  7.0000 | grad_norm   1.000 | lr 3.00e-04 | tps 3,000 | mem",
        "[rank1    20.0s] step      2/30 | loss  7.0000 | grad_norm   1.000 | lr 3.00e-04 | tps 3,000 | mem",
        "[rank0    30.0s] checkpoint: host buffers for 22.4 GiB allocated in the background in 8.8 s (every save "
        "copies into them)",
        "[rank0    40.0s] step      3/30 | loss  7.0000 | grad_norm   1.000 | lr 3.00e-04 | tps 8,000 | mem",
        "[rank0    50.0s] checkpoint step-5: blocked training 0.60 s (previous save 0.00 s, preparing 0.05 s, staging "
        "0.55 s); writing in the background",
        "[rank0    90.0s] saved checkpoint /tmp/ckpt_speed/checkpoint/step-5 (45929.6 MiB, 40.00 s)",
    ])
    table = tables.speed_table(log, "").splitlines()
    assert "| step-5 | 24.08 | 40.00* | 0.60 |  | 0.60 | 0.55 |  |" in table  # 45,929.6 MiB over 2 ranks in 40 s
    assert "\\* the whole save, from its start to its publishing (this checkout logs no write time)" in table
    assert table[-1] == ("host buffers: 22.4 GiB allocated in the background in 8.8 s; tokens/s of the steps beside "
                         "it 3,000 (median of 1), of the others 8,000 (median of 1)")
    assert tables.rank_bytes(log) == int(45929.6 * 2**20 / 2)


def test_cold_table_keeps_each_run_and_names_those_that_never_reached_step_1(tables) -> None:
    log = "\n".join([
        "[coldpeer fp8 1 ours] launch to step 1: 41.8 s; own: step 1 done 22.5 s",
        "[coldpeer fp8 2 peer] launch to step 1: 36.3 s; own: step 1 after 17.8 s",
        "[coldpeer fp8 3 peer] launch to step 1: not reached; own: step 1 not reached",
        "[coldpeer fp8 4 ours] launch to step 1: 30.4 s; own: step 1 done 15.9 s",
        "[coldpeer bf16 1 ours] launch to step 1: no line; own: none",
        "[coldpeer bf16 2 peer] launch to step 1: 23.4 s; own: step 1 after 10.6 s",
    ])
    table, missing = tables.cold_table(log)
    rows = table.splitlines()[2:]
    assert rows[0] == "| fp8 | ours | 1: 41.8, 4: 30.4 | 36.1 | 1: 22.5, 4: 15.9 | 19.2 |"
    assert rows[1] == "| fp8 | torchtitan 0.2.2 | 2: 36.3, 3: - | 36.3 | 2: 17.8, 3: - | 17.8 |"
    assert rows[2] == "| bf16 | ours | 1: - | - | 1: - | - |"
    assert rows[3] == "| bf16 | torchtitan 0.2.2 | 2: 23.4 | 23.4 | 2: 10.6 | 10.6 |"
    assert missing == ["fp8 run 3 (peer)", "bf16 run 1 (ours)"]
