"""Low-precision optimizer states through the trainer's checkpoints (2 spawned gloo ranks, FSDP2): a run resumed
from its step-2 checkpoint repeats the uninterrupted run's losses exactly; the same checkpoint resumed on 1 process
(resharded 2 -> 1) with another exp_avg dtype is converted in one log line and trains on within fp32 noise."""

from __future__ import annotations

from pathlib import Path

from tests.distributed.spawn import run_distributed
from tests.helpers import FAST, losses_by_step

ARGS = [*FAST, "--train.steps=4", "--train.seq_len=32", "--checkpoint.enable=true", "--checkpoint.interval=2",
        "--optimizer.exp_avg_dtype=fp8", "--optimizer.exp_avg_sq_dtype=bf16"]


def _train(args: list[str], dump: Path) -> list[str]:
    """One training run in this rank's process; the lines it printed."""
    import contextlib
    import io
    import os

    from trainer.config import load_job_config
    from trainer.log import setup_logging
    from trainer.run.train import train

    out = io.StringIO()
    with contextlib.redirect_stderr(out), contextlib.redirect_stdout(out):
        setup_logging(int(os.environ["RANK"]))  # the CLI's log lines, into `out`
        train(load_job_config([*args, f"--job.dump_folder={dump}"]))
    return out.getvalue().splitlines()


def _runs(folder: str, resume: bool) -> dict:
    """The 2-rank run (resume=False: steps 1-4, saving at 2 and 4; True: resumed from step 2), then with resume on
    rank 0 alone the 1-process runs resumed from the same checkpoint, with the fp8 exp_avg and converted to bf16."""
    import os

    root, ckpt = Path(folder), f"--checkpoint.folder={Path(folder) / 'ckpt'}"
    resumed = ["--checkpoint.load_step=2"] if resume else []
    out = {"log": _train([*ARGS, "--distributed.dp_shard=2", ckpt, *resumed], root / ("resumed" if resume else "full"))}
    if not resume or os.environ["RANK"] != "0":
        return out
    for key in ("MASTER_ADDR", "MASTER_PORT"):  # no peers: trainer.distributed makes a 1-process group
        os.environ.pop(key)
    os.environ.update({"WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"})
    for name, dtype in (("one_fp8", "fp8"), ("one_bf16", "bf16")):
        out[name] = _train([*ARGS, ckpt, *resumed, f"--optimizer.exp_avg_dtype={dtype}"], root / name)
    return out


def test_resume_is_bit_exact_and_a_reshard_converts_the_dtype(tmp_path: Path) -> None:
    first = run_distributed(_runs, world_size=2, args=(str(tmp_path), False), timeout=120)[0]
    state = [line for line in first["log"] if "] Optimizer state:" in line]
    assert len(state) == 1 and "exp_avg fp8 e4m3" in state[0] and "update: eager torch per tensor" in state[0]
    assert "master 4 + exp_avg 1.03 + exp_avg_sq 2 = 7.03 B/param" in state[0], state[0]
    rank0 = run_distributed(_runs, world_size=2, args=(str(tmp_path), True), timeout=120)[0]
    full, resumed, fp8, bf16 = (losses_by_step(tmp_path / name) for name in ("full", "resumed", "one_fp8", "one_bf16"))
    assert [resumed[s] for s in (3, 4)] == [full[s] for s in (3, 4)]  # bit-exact
    assert any("resharded" in line for line in rank0["one_fp8"])
    assert not any("converted the checkpoint" in line for line in rank0["one_fp8"])
    converted = [line for line in rank0["one_bf16"] if "converted the checkpoint's AdamW moments" in line]
    assert len(converted) == 1 and "exp_avg fp8 -> bf16 (30 tensors)" in converted[0], rank0["one_bf16"]
    # 1 process reads other samples than 2 ranks (as any layout change): compare the two 1-process resumes.
    assert bf16[3] == fp8[3]  # the same weights and data before the first update
    assert abs(bf16[4] - fp8[4]) < 1e-3 * fp8[4], (bf16[4], fp8[4])


def test_pipeline_and_expert_parallel_runs_match_one_process(tmp_path: Path) -> None:
    """pp = 2 (each stage holds whole tensors) and MoE with ep = 2 (each rank whole experts): every fp8 block is the
    one process's, so the losses are the 1-process run's up to the order of fp32 sums (they differ by an fp32 ulp of
    the loss, 5e-7, on this CPU)."""
    from tests.distributed.spawn import train_then_one_process

    base = [*ARGS, "--train.steps=3", "--checkpoint.enable=false"]
    moe = ["--model.flavor=debug_moe", "--train.batch_size=8"]
    for layout, extra, one in (  # 2 data-parallel ranks read half the batch each: the same samples as one process
            ("pp", ["--distributed.pp=2"], []),
            ("ep", [*moe, "--distributed.ep=2", "--distributed.dp_shard=2", "--train.batch_size=4"], moe)):
        got, ref = run_distributed(train_then_one_process, world_size=2, timeout=120,
                                   args=([*base, *extra], [*base, *one], str(tmp_path / layout)))[0]
        assert [r["step"] for r in got] == [r["step"] for r in ref] == [1, 2, 3]
        for a, b in zip(got, ref):
            assert abs(a["loss"] - b["loss"]) < 1e-5 * b["loss"], (layout, a["step"], a["loss"], b["loss"])
