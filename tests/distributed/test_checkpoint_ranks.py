"""What one rank does that the others cannot see, on 2 spawned gloo ranks (issue 39): a checkpoint folder that
resolves elsewhere on one rank, a rank stopped during a save, an error only one rank raises; and each rank writing its
shards with several threads."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from tests.distributed.spawn import run_distributed
from tests.helpers import FAST

ARGS = [*FAST, "--train.steps=2", "--train.seq_len=32", "--checkpoint.enable=true", "--checkpoint.interval=2"]


def _main(argv: list[str], cwd: dict[str, str], fail_on_rank1: bool = False) -> tuple[int | str, str]:
    """trainer.cli.main in this rank's working directory (cwd[RANK]): (exit code, or the exception's name; what
    it printed). With fail_on_rank1, rank 1 alone meets bad data right after the process group exists."""
    import contextlib
    import io

    import trainer.run.train
    from trainer.cli import main
    from trainer.data.shards import DataError

    rank = os.environ["RANK"]
    os.chdir(cwd[rank])
    if fail_on_rank1 and rank == "1":
        def bad_data(*args, **kwargs):
            raise DataError("shard data/train_01.bin holds token 70000, past the vocabulary (model.vocab_size=256)")

        trainer.run.train.build_data_loader = bad_data
    out = io.StringIO()
    with contextlib.redirect_stderr(out), contextlib.redirect_stdout(out):
        try:
            rc: int | str = main(argv)
        except BaseException as e:  # noqa: BLE001 - a peer that is gone fails the collectives of this rank
            rc = type(e).__name__
    return rc, out.getvalue()


def test_a_rank_that_writes_its_shards_elsewhere_fails_the_save_instead_of_publishing(tmp_path: Path) -> None:
    """A relative job.dump_folder from two working directories (two nodes' home folders, say): every rank's job is
    the same, but rank 1's shards land in its own folder. Rank 0 used to publish step-2 listing only its own shard,
    a checkpoint that never verifies on resume."""
    cwd = {"0": tmp_path / "node0", "1": tmp_path / "node1"}
    for folder in cwd.values():
        folder.mkdir()
    (rc0, out0), (rc1, out1) = run_distributed(
        _main, world_size=2, args=([*ARGS, "--job.dump_folder=run"], {r: str(p) for r, p in cwd.items()}),
        timeout=180)
    assert (rc0, rc1) == (2, 2), (out0[-3000:], out1[-3000:])
    tmp = cwd["0"] / "run" / "checkpoint" / "step-2.tmp"
    assert out0.splitlines()[-1] == (
        f"error (rank 0): checkpoint step-2 was not published: rank 1 wrote its shards into another folder: "
        f"__1_0.distcp is not in {tmp}, where rank 0 publishes the checkpoint (job.dump_folder or checkpoint.folder "
        "names another folder on that rank's node: a relative path, or a node-local disk); give an absolute path on "
        "a filesystem every node shares; removed the partial step-2.tmp; earlier checkpoints are untouched"), out0
    assert "error" not in out1  # the same line, once per node: local rank 0's
    assert sorted(p.name for p in (cwd["0"] / "run" / "checkpoint").iterdir()) == []


def test_an_error_on_one_rank_is_printed_by_that_rank(tmp_path: Path) -> None:
    """Bad data on rank 1 only used to show nothing but torchrun's `exitcode: 2`: only local rank 0 printed."""
    dump = str(tmp_path / "run")
    (rc0, out0), (rc1, out1) = run_distributed(
        _main, world_size=2, timeout=180,
        args=([*ARGS, f"--job.dump_folder={dump}", "--distributed.init_timeout_seconds=5"],
              {"0": str(tmp_path), "1": str(tmp_path)}, True))
    assert rc1 == 2 and out1.splitlines()[-1] == (
        "error (rank 1): shard data/train_01.bin holds token 70000, past the vocabulary (model.vocab_size=256)"), out1
    assert rc0 != 0 and "past the vocabulary" not in out0  # rank 0's own end: its peer is gone


def _save_alone(folder: str, timeout_seconds: int) -> float:
    """Rank 0 saves while rank 1 never joins the save: seconds until rank 0's save failed."""
    import torch
    import torch.distributed as dist

    from trainer.checkpoint import CheckpointManager, RunInfo
    from trainer.config import CheckpointSection
    from trainer.models.llama import FLAVORS
    from trainer.validate.options import checkpoint_options

    dist.init_process_group("gloo")

    class State:
        def state_dict(self):
            return {"model": {"w": torch.ones(64, 64)}, "train_state": {"step": 0}}

    manager = CheckpointManager(
        checkpoint_options(CheckpointSection(enable=True, interval=1), dump_folder=folder), state=State(),
        run=RunInfo(flavor="debug", model_args=FLAVORS["debug"], mixed_precision="fp32"),
        timeout_seconds=timeout_seconds)
    if dist.get_rank() == 1:
        time.sleep(4 * timeout_seconds)  # stopped (SIGSTOP, a hung filesystem) through rank 0's save
        return 0.0
    start = time.perf_counter()
    try:
        manager.save(1)
    except RuntimeError:  # gloo's timeout, or DCP's report of it
        return time.perf_counter() - start
    raise AssertionError("the save succeeded without rank 1")


def test_a_rank_stopped_during_a_save_fails_the_others_after_the_timeout(tmp_path: Path) -> None:
    """The checkpoint group used torch's 30-minute default, ignoring distributed.init_timeout_seconds."""
    waited, _ = run_distributed(_save_alone, world_size=2, args=(str(tmp_path), 3), timeout=120)
    assert 3 <= waited < 11, waited  # the timeout, and at most one more (the error's broadcast)


def _value_problems_on_two_ranks() -> list[str]:
    """value_problems of tensors shaped as a resume holds them: a DTensor sharded over the 2 ranks with bad values in
    both shards, one replicated over them and a plain tensor every rank holds whole (staged block scales, FP8
    histories, RNG states), each with one bad value."""
    import math

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from trainer.tensor_values import FINITE, TensorRule, value_problems

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,))
    whole = torch.zeros(4, 6)
    whole[1, 4], whole[2, 1], whole[3, 3] = math.inf, math.nan, math.nan  # rank 0 holds rows 0-1, rank 1 rows 2-3
    sharded = distribute_tensor(whole, mesh, [Shard(0)])
    replicated = distribute_tensor(torch.tensor([1.0, -2.0, 3.0]), mesh, [Replicate()])
    plain = torch.tensor([0.5, 0.0])
    return value_problems({"sharded": (sharded, FINITE), "replicated": (replicated, TensorRule(low=0)),
                           "plain": (plain, TensorRule(low=0, low_open=True))}, group=dist.group.WORLD)


def test_value_problems_count_each_shard_once_and_name_the_global_index() -> None:
    """A bad value is located by its index in the whole tensor and counted once however many ranks hold it; every
    rank gets the same list (the one line each raises is the same)."""
    rank0, rank1 = run_distributed(_value_problems_on_two_ranks, world_size=2, timeout=120)
    assert rank0 == rank1 == [
        "plain holds 1 of 2 values outside the allowed (0, inf) (first at [1]: 0)",
        "replicated holds 1 of 3 values outside the allowed [0, inf) (first at [1]: -2)",
        "sharded holds 3 non-finite values (2 NaN, 1 Inf of 24; first at [1, 4])",
    ]


def _train_writing_with_4_threads(argv: list[str]) -> int:
    """trainer.cli.main with each rank writing its shards with 4 threads (one per 4 KiB: the debug model's shards are
    far below one thread's share)."""
    from trainer.checkpoint import writer
    from trainer.cli import main

    writer.BYTES_PER_WRITE_THREAD = 4096
    writer.rank_cores = lambda: 4
    return main(argv)


def _every_tensor(path: Path) -> dict:
    import warnings

    import torch

    from trainer.checkpoint import load_dcp_metadata
    from trainer.checkpoint.verify import safe_load

    metadata = load_dcp_metadata(path / ".metadata")
    state = {k: torch.empty(tuple(md.size), dtype=md.properties.dtype) for k, md in metadata.state_dict_metadata.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        safe_load(state, path, no_dist=True)  # every rank's shards, whole
    return state


def test_two_ranks_writing_with_4_threads_each_resume_bit_for_bit(tmp_path: Path) -> None:
    """2 FSDP ranks, each writing its shards into 4 files: rank 0 finds every rank's 4 files listed before it publishes,
    and a copy of step-2 resumed by 2 ranks trains to the same step-4 checkpoint, every tensor bit for bit."""
    import shutil

    import torch

    args = [*FAST, "--train.steps=4", "--train.seq_len=32", "--checkpoint.enable=true", "--checkpoint.interval=2"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert run_distributed(_train_writing_with_4_threads, world_size=2, timeout=300,
                           args=([*args, f"--job.dump_folder={straight}"],)) == [0, 0]
    step2 = straight / "checkpoint" / "step-2"
    assert sorted(p.name for p in step2.glob("*.distcp")) == [f"__{r}_{i}.distcp" for r in (0, 1) for i in range(4)]
    shutil.copytree(step2, resumed / "checkpoint" / "step-2")
    assert run_distributed(_train_writing_with_4_threads, world_size=2, timeout=300,
                           args=([*args, f"--job.dump_folder={resumed}"],)) == [0, 0]
    metrics = (resumed / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in metrics] == [3, 4]  # it resumed step-2: it did not start over
    a, b = (_every_tensor(run / "checkpoint" / "step-4") for run in (straight, resumed))
    assert a.keys() == b.keys() and any(k.startswith("optimizer.") for k in a)
    assert all(torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8)) for k in a)
