"""Run the real trainer in subprocesses (1 process or torchrun) and read what it wrote; the counts a flavor's
shapes imply (parameters, Linear layers), so that tests expect what the model is, not a number copied once."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TRAIN = str(REPO / "scripts" / "train.py")
DEBUG_CONFIG = str(REPO / "configs" / "train" / "debug_model.toml")

# Small, fp32 and deterministic: comparisons across layouts hold to fp32 rounding.
FAST = [
    "--config", DEBUG_CONFIG,
    "--train.seq_len=64",
    "--train.mixed_precision=fp32",
    "--metrics.log_freq=1",
    "--metrics.enable_tensorboard=false",
]


# Every process a test starts carries this variable, "<pytest pid>.<launch id>" (inherited by torchrun's workers,
# which run in sessions of their own and so escape a process-group kill): reap() finds them by it.
OWNER_VAR = "TRAINER_TEST_OWNER"


@contextlib.contextmanager
def under_triton_interpreter(module):
    """`module` reloaded with TRITON_INTERPRET=1 (its @triton.jit kernels, built at import, then run by Triton's CPU
    interpreter), then reloaded as it was."""
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield importlib.reload(module)
    finally:
        if before is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = before
        importlib.reload(module)


def load_script(name: str):
    """scripts/<name>.py imported as a module (the scripts are no package)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def env(tag: str | None = None) -> dict[str, str]:
    e = dict(os.environ)
    e[OWNER_VAR] = tag or new_tag()
    e["OMP_NUM_THREADS"] = "1"  # 2-4 processes on a 2-core machine
    # A process that dies of a signal (SIGABRT, SIGSEGV) prints every thread's Python stack to the stderr a failing
    # test shows: where it was, for an abort seen once in CI (test_precision_switch_by_relaunch, after "training
    # finished") and never again in 42 local reruns.
    e["PYTHONFAULTHANDLER"] = "1"
    e["PYTHONPATH"] = str(REPO) + os.pathsep + e.get("PYTHONPATH", "")
    e.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path("/tmp") / "trainer_inductor_cache"))
    return e


def launch(args: list[str], *, nproc: int = 1, timeout: int = 300) -> subprocess.CompletedProcess:
    if nproc == 1:
        cmd = [sys.executable, TRAIN, *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", TRAIN, *args]
    tag = new_tag()
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env(tag), cwd=REPO)
    finally:
        reap(tag)  # a timeout kills torchrun only; its workers would live on


def new_tag() -> str:
    return f"{os.getpid()}.{uuid.uuid4().hex[:12]}"


def owned_processes(tag: str | None = None) -> dict[int, str]:
    """Live processes started (directly or through torchrun) by this test process, or by one launch of it
    when tag is given: pid -> command line."""
    want = f"{OWNER_VAR}={tag}".encode() if tag else f"{OWNER_VAR}={os.getpid()}.".encode()
    found = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            entries = (d / "environ").read_bytes().split(b"\0")
            if not any(e == want if tag else e.startswith(want) for e in entries):
                continue
            if (d / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue  # a zombie is dead; its parent has yet to wait for it
            found[int(d.name)] = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # it exited while we looked, or is not ours to read
            continue
    return found


def reap(tag: str | None = None, timeout: float = 20) -> dict[int, str]:
    """SIGKILL every process this test process started (or one launch of it, by tag) and wait until they are
    gone; return what was alive."""
    alive = owned_processes(tag)
    for pid in alive:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout
    # A killed process drops its environment before it is gone, so owned_processes stops seeing it while the kernel
    # still tears it down: wait on the pids themselves too, until each has left /proc or is a zombie.
    while (left := {**owned_processes(tag), **{pid: alive[pid] for pid in alive if _running(pid)}}) \
            and time.monotonic() < deadline:
        for pid in left:  # our own children become zombies until waited for
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
        time.sleep(0.05)
    if left:
        raise RuntimeError(f"could not reap test processes: {left}")
    return alive


def _running(pid: int) -> bool:
    """Whether pid is in /proc and not yet a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def launch_ok(args: list[str], dump: Path, *, nproc: int = 1, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run training in `dump`; fails the test with the output on error."""
    proc = launch([*args, f"--job.dump_folder={dump}"], nproc=nproc, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"training failed (rc={proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc


def train(args: list[str], dump: Path, *, nproc: int = 1, timeout: int = 300) -> list[dict]:
    """Run training; return the metrics.jsonl records. Fails the test with the output on error."""
    launch_ok(args, dump, nproc=nproc, timeout=timeout)
    return read_metrics(dump)


def lines_before_step_1(output: str) -> list[str]:
    """The lines of a run's output before its first step line: the startup header a user reads."""
    lines = output.splitlines()
    return lines[:next(i for i, line in enumerate(lines) if "step      1/" in line)]


def read_metrics(dump: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(dump) / "metrics.jsonl").read_text().splitlines()]


def losses_by_step(dump: Path) -> dict[int, float]:
    """Each step's loss in metrics.jsonl: after a relaunch appended to it, the resumed run's."""
    return {r["step"]: r["loss"] for r in read_metrics(dump)}


def first_batch_loss(checkpoint: Path, *, vocab_size: int, seq_len: int = 32, batch_size: int = 2):
    """(inputs, loss): the first batch a one-process run of the default data trains on (byte tokens, data.seed 0,
    shuffled) and the loss on it of the model in `checkpoint`, which a run started from it logs at step 1."""
    import torch

    from trainer.checkpoint import load_model
    from trainer.data import build_data_loader, build_source

    source = build_source(source="default", path="", tokenizer="byte", seed=0, vocab_size=vocab_size, seq_len=seq_len)
    loader = build_data_loader(source, seed=0, shuffle=True, seq_len=seq_len, batch_size=batch_size,
                               grad_accum_steps=1, dp_rank=0, dp_degree=1)
    (inputs, labels), = loader.next_batch()
    with torch.no_grad():
        logits = load_model(checkpoint).logits(inputs)
        return inputs, torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()).item()


def column(records: list[dict], key: str) -> list[float]:
    return [r[key] for r in records]


def hooks_env(tag: str | None = None, **variables: str) -> dict[str, str]:
    """env(tag) plus the test-only hooks of tests/support/sitecustomize.py, e.g. TRAINER_TEST_PAUSE="save:10:1"."""
    e = env(tag)
    e["PYTHONPATH"] = str(REPO / "tests" / "support") + os.pathsep + e["PYTHONPATH"]
    e.update(variables)
    return e


def run_until_paused(cmd: list[str], pause: str, *, timeout: float = 150) -> str:
    """Start cmd with TRAINER_TEST_PAUSE=pause, wait until a rank reports the pause, then SIGKILL
    torchrun and every rank (each rank runs in a session of its own): no cleanup of any kind runs."""
    tag = new_tag()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                            env=hooks_env(tag, TRAINER_TEST_PAUSE=pause), start_new_session=True)
    out = []
    watchdog = threading.Timer(timeout, os.killpg, (proc.pid, signal.SIGKILL))  # a hang fails, not blocks
    watchdog.start()
    try:
        for line in proc.stdout:
            out.append(line)
            if line.startswith("TRAINER_TEST_PAUSE"):
                break
        else:
            raise AssertionError("the run ended without reaching the pause:\n" + "".join(out[-60:]))
    finally:
        watchdog.cancel()
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        reap(tag)
    return "".join(out)


# Runs many trainer command lines in one fresh Python (one torch import for all of them).
_CLI_CASES = """
import contextlib, io, json, sys
from trainer.cli import main
results = {}
for name, argv in json.loads(sys.argv[1]).items():
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        rc = main(argv)
    results[name] = {"rc": rc, "stderr": err.getvalue(), "stdout": out.getvalue()}
print(json.dumps(results))
"""


def run_cli_cases(cases: dict[str, list[str]], *, timeout: float = 300) -> dict[str, dict]:
    """{name: argv} -> {name: {"rc", "stdout", "stderr"}} of `trainer.cli.main(argv)`, all in one subprocess."""
    proc = subprocess.run([sys.executable, "-c", _CLI_CASES, json.dumps(cases)], capture_output=True, text=True,
                          env=env(), cwd=REPO, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


# -- what a flavor's shapes imply -------------------------------------------------------------------------------
# Counted here from ModelArgs, independently of the model code: a flavor change moves the expected values with it,
# a model that builds a layer too many or too few does not.


def dense_param_counts(args) -> tuple[int, int, int]:
    """(parameter tensors, parameters, non-embedding parameters) of a dense Llama flavor: per block the four
    attention projections (q, o: dim x dim; k, v: dim x kv_heads x head_dim), the three MLP projections
    (dim x ffn_dim) and two RMSNorm weights; then the final norm and the untied output head."""
    kv = args.n_kv_heads * args.head_dim
    block = 2 * args.dim * args.dim + 2 * args.dim * kv + 3 * args.dim * args.ffn_dim + 2 * args.dim
    non_embedding = args.n_layers * block + args.dim + args.dim * args.vocab_size
    tensors = 1 + args.n_layers * (4 + 3 + 2) + 2
    return tensors, args.vocab_size * args.dim + non_embedding, non_embedding


def fp8_linear_counts(args) -> tuple[int, int]:
    """(Linear layers FP8 converts by default, all Linear layers) of a flavor: attention's four projections, a
    dense MLP's three and the output head convert; an MoE block's router gate and shared-expert MLP (three
    Linears, when the flavor has shared experts) stay in high precision; routed experts are no Linears."""
    n_moe = getattr(args, "n_moe_layers", 0)
    n_dense = args.n_layers - n_moe
    shared = 3 if getattr(args, "n_shared_experts", 0) else 0
    converted = 4 * args.n_layers + 3 * n_dense + 1
    # torch._scaled_mm needs every GEMM dim divisible by 16: then no converted layer is left out for its shape.
    dims = [args.dim, args.n_kv_heads * args.head_dim, args.ffn_dim, args.vocab_size]
    assert all(d % 16 == 0 for d in dims), f"a dim of {dims} is not a multiple of 16: count the shape exclusions"
    return converted, converted + n_moe * (1 + shared)


def count_expert_weight_quantizations(monkeypatch) -> list[str]:
    """The FP8 experts' weight quantizations, recorded by orientation ("forward", "dgrad") as they run: the two
    quantize functions of trainer.models.moe_fp8 wrapped for the test (production code keeps no counter)."""
    import trainer.models.moe_fp8 as moe_fp8

    calls: list[str] = []
    for which in ("forward", "dgrad"):
        quantize = getattr(moe_fp8, f"quantize_{which}_weights")

        def counted(*weights, quantize=quantize, which=which):
            calls.append(which)
            return quantize(*weights)

        monkeypatch.setattr(moe_fp8, f"quantize_{which}_weights", counted)
    return calls
