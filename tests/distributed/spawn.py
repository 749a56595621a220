"""Run a test function on N CPU processes with a gloo process group (OLMo-core's run_distributed_test).

    results = run_distributed(fn, world_size=2, args=(...))   # [fn(*args) of rank 0, of rank 1, ...]

`fn` must be importable (a module-level function of a test module): each rank is a new process
forked by multiprocessing's fork server, with the torchrun environment variables set (RANK,
LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT), so `trainer.distributed.init_distributed` and the
`Trainer` join the group as under torchrun; `fn` may also create the group itself. Seconds
instead of a whole CLI launch per case; the few whole-CLI torchrun runs, tests of the entry
point, are in tests/cli.

The fork server is one single-threaded Python per test session that has imported torch and the
trainer once (`_PRELOAD`); every rank is a fork of it, so a rank starts in milliseconds where a
fresh interpreter spends ~3 s of CPU importing torch (2-4 of them per test on a 2-core machine:
minutes of CI). A fork shares nothing with earlier ranks: each test's ranks start from the
server's state, never from another test's (patches, default dtype, compiled code).

A rank's environment is the caller's at the call (set in the rank, so the programs it starts
inherit it, TRAINER_TEST_OWNER included: the leak check in tests/conftest.py finds those);
the ranks themselves are the call's children to kill, since a fork's /proc environ is the
server's. A rank that fails makes the call fail with its traceback.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import socket
import tempfile
import traceback
from pathlib import Path
from typing import Any, Callable

from tests.helpers import OWNER_VAR, REPO, new_tag, reap


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Imported once by the fork server (what every test's ranks import anyway), so no rank imports them again.
_PRELOAD = ["torch", "torch.distributed", "torch.distributed.checkpoint", "torchao.float8", "trainer.run.train",
            "trainer.config", "tests.helpers"]
_context: Any = None


def _fork_server() -> Any:
    """multiprocessing's forkserver context, its server started once with torch and the trainer imported. It is
    started without the caller's TRAINER_TEST_OWNER (it lives for the whole session: the leak check after each
    test must not kill it) and with one intra-op thread, which torch reads when the server imports it."""
    global _context
    if _context is None:
        from multiprocessing import forkserver

        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(_PRELOAD)
        saved = {k: os.environ.get(k) for k in (OWNER_VAR, "OMP_NUM_THREADS", "PYTHONPATH")}
        os.environ.pop(OWNER_VAR, None)
        os.environ["OMP_NUM_THREADS"] = "1"
        os.environ["PYTHONPATH"] = str(REPO) + os.pathsep + (saved["PYTHONPATH"] or "")
        try:
            forkserver.ensure_running()
        finally:
            _restore(saved)
        _context = ctx
    return _context


def _restore(saved: dict[str, str | None]) -> None:
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _rank_main(fn: Callable, args: tuple, rank: int, world_size: int, port: int, out: str,
               environ: dict[str, str]) -> None:
    os.environ.clear()  # the caller's environment, as a spawned interpreter would have inherited it
    os.environ.update(environ)
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
                       "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    try:
        result: Any = ("ok", fn(*args))
    except BaseException as e:  # noqa: BLE001 - the parent reports it
        result = ("error", f"rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc()}")
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    with open(Path(out) / f"rank{rank}.pkl", "wb") as f:
        pickle.dump(result, f)


def run_distributed(fn: Callable, *, world_size: int, args: tuple = (), timeout: float = 300) -> list[Any]:
    """fn(*args) on world_size spawned processes; returns every rank's result, in rank order. A launch that failed
    because its rendezvous port was taken between `_free_port` and a bind (another test's processes, under
    pytest-xdist) is launched again on a new port, twice at most (fn runs again from the start: every test's fn
    writes under its own tmp folder, and a run started again moves its earlier files aside)."""
    for attempt in range(3):
        try:
            return _run_distributed_once(fn, world_size=world_size, args=args, timeout=timeout)
        except AssertionError as e:
            if "EADDRINUSE" not in str(e) or attempt == 2:
                raise
    raise AssertionError("unreachable")


def _run_distributed_once(fn: Callable, *, world_size: int, args: tuple, timeout: float) -> list[Any]:
    # multiprocessing's resource tracker and fork server (one each per test session) start before the tag is set:
    # they are no ranks.
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()
    ctx = _fork_server()
    tag = new_tag()
    environ = {**os.environ, OWNER_VAR: tag, "OMP_NUM_THREADS": "1",  # 2-4 processes on a 2-core machine
               "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(tempfile.gettempdir()) / "trainer_inductor_cache"))
    procs: list = []
    try:
        port = _free_port()
        with tempfile.TemporaryDirectory() as out:
            procs = [ctx.Process(target=_rank_main, args=(fn, args, r, world_size, port, out, environ))
                     for r in range(world_size)]
            for p in procs:
                p.start()
            for p in procs:
                p.join(timeout)
            results = []
            for r, p in enumerate(procs):
                path = Path(out) / f"rank{r}.pkl"
                if not path.exists():
                    raise AssertionError(f"rank {r} wrote no result (exit code {p.exitcode}; timed out after "
                                         f"{timeout} s?)" if p.exitcode is None else
                                         f"rank {r} died with exit code {p.exitcode}")
                status, value = pickle.loads(path.read_bytes())
                if status == "error":
                    raise AssertionError(value)
                results.append(value)
            return results
    finally:
        for p in procs:  # forks of the server: its environment, not the tag, so killed here by pid
            if p.pid is not None:
                p.kill()  # no-op on a rank that has exited
                p.join()
        reap(tag)  # what the ranks started (compile workers, subprocesses) carries the tag


def train_and_read_metrics(args: list[str], dump: str) -> list[dict]:
    """A whole training run in this process (trainer.run.train.train: validate, build, train, tear down), as each
    rank of a torchrun launch runs it; rank 0 returns the metrics.jsonl rows, the others []."""
    from tests.helpers import read_metrics
    from trainer.config import load_job_config
    from trainer.run.train import train

    train(load_job_config([*args, f"--job.dump_folder={dump}"]))
    return read_metrics(Path(dump)) if os.environ["RANK"] == "0" else []


def train_then_one_process(args: list[str], ref_args: list[str], dump: str, layout: str = "layout",
                           one_process: str = "one_process") -> tuple[list[dict], list[dict]]:
    """train_and_read_metrics(args) on every rank into dump/layout, then on rank 0 alone the 1-process run of
    ref_args into dump/one_process, as a plain `python scripts/train.py` runs it (world size 1 on an in-memory
    store). Rank 0 returns (the layout's metrics, the reference's), the others ([], []). The two folders may be
    one: the 1-process run then resumes from the layout's checkpoint.

    The reference costs no second spawn: no interpreter start and torch import (~5 of a debug run's ~8 s on 2
    cores). It runs after the layout, so every rank of the layout under test starts from a fresh interpreter."""
    got = train_and_read_metrics(args, str(Path(dump) / layout))
    if os.environ["RANK"] != "0":
        return [], []
    for key in ("MASTER_ADDR", "MASTER_PORT"):  # no peers: trainer.distributed makes a 1-process group
        os.environ.pop(key)
    os.environ.update({"WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"})
    return got, train_and_read_metrics(ref_args, str(Path(dump) / one_process))


def train_then_one_process_in_float64(args: list[str], ref_args: list[str],
                                      dump: str) -> tuple[list[dict], list[dict]]:
    """train_then_one_process with every weight, activation, gradient reduction and optimizer state in float64.

    A layout check that rounding cannot blur: in fp32 rounding flips some near-tied top-k choice of an MoE
    router in one run and not the other, and the runs then drift apart (docs/moe.md). In float64 a layout
    that computes the same sums agrees with one process to ~1e-12 over many steps.
    Test-only patches of this spawned process, never undone (it ends with the test; the trainer has no
    float64 mode): the model is built with float64 as the default dtype; `.float()` (routing, RMSNorm,
    the loss, the experts' weighted sum) leaves float64 as it is; FSDP2 reduces gradients in float64; the
    clipping norm is accumulated in float64. Pass `--optimizer.implementation=foreach`: the fused CPU
    AdamW kernel stops on float64 weights ("expected scalar type Float but found Double"). The logged
    loss stays an fp32 number (the step sums it in a default-dtype tensor).
    """
    import torch
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    import trainer.parallel.apply
    import trainer.parallel.build

    build_model, built = trainer.parallel.build.build_model, []

    def build_model_in_float64(model_args):
        torch.set_default_dtype(torch.float64)
        try:
            built.append(model_args)
            return build_model(model_args)
        finally:
            torch.set_default_dtype(torch.float32)

    to_float = torch.Tensor.float
    apply_fsdp = trainer.parallel.apply.apply_fsdp
    divide_factors = _fsdp_collectives._get_gradient_divide_factors
    foreach_norm = torch._foreach_norm
    trainer.parallel.build.build_model = build_model_in_float64
    torch.Tensor.float = lambda t, *a, **k: t if t.dtype == torch.float64 else to_float(t, *a, **k)
    trainer.parallel.apply.apply_fsdp = lambda *a, **k: apply_fsdp(*a, **{**k, "reduce_dtype": torch.float64})
    # FSDP2 (torch 2.13) pre-divides gradients it may overflow (any dtype but fp32/bf16), and with a
    # one-rank shard group and a divide factor (the experts' expert_fsdp mesh here) divides again
    # while copying: float64 cannot overflow, so it takes fp32's path.
    _fsdp_collectives._get_gradient_divide_factors = lambda group, ar_group, dtype, *a, **k: divide_factors(
        group, ar_group, torch.float32 if dtype == torch.float64 else dtype, *a, **k)
    torch._foreach_norm = lambda ts, ord=2.0, dtype=None: foreach_norm(
        ts, ord, dtype=None if ts and ts[0].dtype == torch.float64 else dtype)
    result = train_then_one_process(args, ref_args, dump)
    assert built, ("the Trainer no longer builds its model through trainer.parallel.build.build_model: "
                   "nothing ran in float64")
    return result


def gradients_of_one_step(args: list[str], dump: str) -> dict:
    """The trainer's first step in this rank's layout, forward and backward only (no optimizer step): its
    gradients, gathered to rank 0 (gathered_gradients)."""
    from trainer.config import load_job_config
    from trainer.distributed import destroy_distributed
    from trainer.run.train import build_trainer

    trainer = build_trainer(load_job_config([*args, f"--job.dump_folder={dump}"]))
    try:
        trainer.step_fn.forward_backward(trainer.data_loader.next_batch())
        return gathered_gradients(trainer.model)
    finally:
        trainer.close()
        destroy_distributed()


def gathered_gradients(model) -> dict:
    """Every parameter's full gradient by fqn, gathered from every rank (pipeline ranks hold different stages) to
    rank 0, which returns them ({} on the other ranks)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from trainer.models.layers import clean_fqn

    grads = {clean_fqn(n): (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
             for n, p in model.named_parameters()}
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, grads)
    return {k: v for part in gathered for k, v in part.items()} if dist.get_rank() == 0 else {}


def saved_bytes_of_one_forward(args: list[str], dump: str) -> int:
    """Bytes this rank's first training forward (loss included) saves for backward: every tensor autograd keeps,
    counted once per storage (`torch.autograd.graph.saved_tensors_hooks`); rank 0's value is returned."""
    import torch
    import torch.distributed as dist

    from trainer.config import load_job_config
    from trainer.distributed import destroy_distributed
    from trainer.run.train import build_trainer

    trainer = build_trainer(load_job_config([*args, f"--job.dump_folder={dump}"]))
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return t

    try:
        (inputs, labels), = trainer.data_loader.next_batch()
        if trainer.step_fn.cp is not None:
            inputs, labels = trainer.step_fn.cp.shard(inputs), trainer.step_fn.cp.shard(labels)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = trainer.loss_fn(trainer.model(inputs), labels)
        loss.backward()
        total = torch.tensor(sum(storages.values()), dtype=torch.int64)
        dist.all_reduce(total, op=dist.ReduceOp.MAX)
        return int(total.item())
    finally:
        trainer.close()
        destroy_distributed()
