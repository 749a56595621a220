"""The kernel summary of a profiler trace: time per category (FP8 GEMM, other GEMM, attention,
communication, the rest), the top ops, and whether FP8 GEMMs really ran.

Pure functions over Chrome-trace events, read from a file: the live profiler
(trainer/metrics/profiling.py) and scripts/summarize_trace.py summarize the same file the same way.
docs/debug.md says how to read the summary.
"""

from __future__ import annotations

import collections
import dataclasses
import gzip
import os
import re

from trainer.files.json_object import json_object

# Kernel/op names are classified by the first of these that matches (case-insensitive); the order
# matters: NCCL kernel names contain "Reduce", and fused attention kernels contain "cutlass"/"wgmma".
CATEGORY_PATTERNS: dict[str, re.Pattern[str]] = {
    "communication": re.compile(
        r"nccl|gloo|c10d::|record_param_comms|all_?gather|reduce_?scatter|all_?reduce|all_?to_?all"
        r"|broadcast(?!_tensors)",
        re.I,
    ),
    # cuDNN runs no convolutions in a transformer; here it is the cuDNN SDPA backend.
    "attention": re.compile(r"flash|fmha|attention|attn|sdpa|cudnn", re.I),
    # `mm` only as a word of its own (aten::mm, triton_tem_fused_mm_0), not inside words like
    # "comm" or "summary".
    "gemm": re.compile(
        r"gemm|gemv|matmul|addmm|bmm|scaled_(?:grouped_)?mm|(?<![a-z])mm(?=backward|[^a-z]|$)"
        r"|cutlass|xmma|nvjet|cublas|wgmma",
        re.I,
    ),
}
# The summary splits GEMMs into FP8 ones (is_fp8_gemm, or launched by aten::_scaled_mm) and the rest.
CATEGORY_LABELS = {"gemm_fp8": "GEMM fp8", "gemm": "GEMM bf16/other", "attention": "attention",
                   "communication": "communication", "other": "elementwise/other"}
GEMM_CATEGORIES = ("gemm_fp8", "gemm")

# An FP8 GEMM is any op/kernel named like `scaled_mm` (aten::_scaled_mm, aten::_scaled_grouped_mm,
# F.scaled_mm's aten::_scaled_mm_v2 and torchao::blockwise_scaled_mm of the blockwise recipe,
# inductor's triton_tem_fused__scaled_mm_0), or a GEMM whose name carries an FP8 dtype:
# cuBLASLt `sm90_xmma_gemm_e4m3bf16_e4m3f32_...`, cutlass `..._e4m3_e4m3_...`/`f8f8bf16`, and
# cuBLAS 13 nvjet kernels, whose first letters after `nvjet_[smXX_]` are the operand types:
# `nvjet_sm90_qqtst_...` has two e4m3 operands, `qrtst` one e5m2, while bf16 is
# `nvjet_sm90_tst_...` (all seen on an H100 with torch 2.11+cu130). The dtype marker alone is not enough: the eager
# cast kernel `float8_copy_kernel_cuda` runs even when the GEMM itself falls back to bf16.
FP8_OP_PATTERN = re.compile(r"scaled_(?:grouped_)?mm", re.I)
FP8_DTYPE_PATTERN = re.compile(r"e4m3|e5m2|fp8|float8|f8f8|_f8|qgmma|nvjet_(?:sm\d+_)?[qr]{2}", re.I)

# Inductor names a kernel after the aten ops fused into it: a pointwise (poi), reduction (red) or persistent
# reduction (per) kernel that holds the casts around a GEMM is called `triton_poi_fused__scaled_mm_...` (seen on an
# H100, 8B shapes fp8) but runs no GEMM; inductor's GEMM templates are `triton_tem_...`.
_INDUCTOR_ELEMENTWISE = re.compile(r"^triton_(?:poi|red|per)_")

_STEP_MARKER = re.compile(r"ProfilerStep#(\d+)$")
_TRACE_NAME = re.compile(r"rank\d+_step(\d+)-(\d+)\.")


# ---------------------------------------------------------------------------------------------
# Kernel summary: pure functions over Chrome-trace events, live or from a file.


# Autograd's own ops on CPU (`autograd::engine::evaluate_function: AddmmBackward0`, `MmBackward0`):
# their self time is bookkeeping; the GEMMs they run are aten ops of their own.
_AUTOGRAD_NODE = re.compile(r"^autograd::|Backward\d*$")


def classify(name: str) -> str:
    """"gemm", "attention", "communication" or "other" for a kernel or op name."""
    if _AUTOGRAD_NODE.search(name) or _INDUCTOR_ELEMENTWISE.search(name):
        return "other"
    for category, pattern in CATEGORY_PATTERNS.items():
        if pattern.search(name):
            return category
    return "other"


def is_fp8_gemm(name: str) -> bool:
    # Every FP8 op name (scaled_mm) is a GEMM name too, so classify's exclusions (autograd nodes, inductor's
    # elementwise kernels) hold for both.
    return classify(name) == "gemm" and bool(FP8_OP_PATTERN.search(name) or FP8_DTYPE_PATTERN.search(name))


def load_trace_events(path: str) -> list[dict]:
    """The complete ("X") events of a Chrome trace (.json or .json.gz) as dicts with name, cat,
    ts and dur (microseconds), pid, tid, external_id (which links a kernel to its CPU op) and
    input_types (an op's input dtypes as the profiler writes them, when it recorded shapes)."""
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            text = f.read()
    except (OSError, EOFError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not a readable Chrome trace: {e}") from e
    trace = json_object(text, source=path, what="a Chrome trace", error=ValueError)
    if "traceEvents" not in trace:
        raise ValueError(f"{path} is not a Chrome trace: it has no traceEvents")
    return [
        {"name": e["name"], "cat": e.get("cat", ""), "ts": float(e["ts"]), "dur": float(e["dur"]),
         "pid": e.get("pid"), "tid": e.get("tid"),
         "external_id": (e.get("args") or {}).get("External id"),
         "input_types": (e.get("args") or {}).get("Input type")}
        for e in trace["traceEvents"]
        if e.get("ph") == "X" and "dur" in e
    ]


def profiler_steps(events: list[dict]) -> list[int]:
    """The step numbers of the ProfilerStep#N markers in a trace, sorted."""
    return sorted({int(m.group(1)) for e in events if e["cat"] == "user_annotation"
                   and (m := _STEP_MARKER.match(e["name"]))})


def trace_steps(path: str, events: list[dict]) -> tuple[int, int] | None:
    """First and last train step of a trace: from a rank{r}_step{a}-{b} file name, which
    maybe_enable_profiling gives its traces (when a run ends inside the window, the trace also holds
    a ProfilerStep#N marker for the step that never ran), else from its ProfilerStep#N markers."""
    if m := _TRACE_NAME.match(os.path.basename(path)):
        return int(m.group(1)), int(m.group(2))
    marked = profiler_steps(events)
    return (marked[0], marked[-1]) if marked else None


@dataclasses.dataclass(frozen=True)
class OpStat:
    name: str
    category: str
    calls: int
    total_us: float


@dataclasses.dataclass(frozen=True)
class TraceSummary:
    device: str
    """"cuda": GPU kernel time; "cpu": self time of aten ops (a CPU trace has no kernels)."""
    num_steps: int
    steps: tuple[int, int] | None
    """First and last train step in the trace; None when unknown."""
    total_us: float
    """Summed device time; on GPU, kernels on overlapping streams all count."""
    wall_us: float
    """First to last moment of the trace's steps and device events."""
    busy_us: float
    """Time during which at least one kernel (op) ran; wall - busy is launch gaps, syncs, input waits."""
    category_us: dict[str, float]
    ops: list[OpStat]
    """Every kernel (op), by total time, largest first."""
    num_gemm_calls: int
    fp8_gemm_calls: int
    fp8_gemm_names: list[str]
    gemm_dtypes: dict[str, int]
    """Calls of the non-FP8 GEMMs by input dtype ("fp32", "bf16", ...); empty when the trace has no
    input types (recorded only with record_shapes)."""
    comm_us: float = 0.0
    """Time during which at least one communication kernel ran (GPU traces; 0 on CPU)."""
    exposed_comm_us: float = 0.0
    """Of comm_us, the time no other kernel ran beside it: communication the step waits for, not hidden behind
    compute. comm_us - exposed_comm_us is hidden, but the kernels beside it share the SMs with it."""
    host_waits: tuple[OpStat, ...] = ()
    """The host's blocking waits for the device (cudaStreamSynchronize, cudaDeviceSynchronize,
    cudaEventSynchronize) by where they were called from (`host_wait_site`), longest first: `.item()`, `.tolist()`
    or a D2H copy inside the step stalls the host there, and the device runs dry while the host catches up."""

    @property
    def host_wait_us(self) -> float:
        return sum(s.total_us for s in self.host_waits)

    @property
    def fp8_gemm_ran(self) -> bool:
        return self.fp8_gemm_calls > 0

    @property
    def gemm_us(self) -> float:
        return sum(self.category_us[c] for c in GEMM_CATEGORIES)

    @property
    def other_gemm_names(self) -> list[str]:
        """The non-FP8 GEMM kernels (ops), most calls first."""
        return [s.name for s in sorted(self.ops, key=lambda s: (-s.calls, s.name)) if s.category == "gemm"]

    @property
    def step_range(self) -> str:
        return f"steps {self.steps[0]}-{self.steps[1]}" if self.steps else "the recorded steps"


# On CPU, the layers around a GEMM op that are no GEMM of their own: a GEMM-named op with a GEMM
# inside (aten::matmul -> aten::mm; aten::mm on torchao's Float8 tensor, which dispatches to
# aten::_scaled_mm), the tensor subclass's __torch_dispatch__ (`PythonSubclass`), and an autograd
# Function named for FP8 (torchao's `matmul_with_hp_or_float8_args` and its `...Backward`, our
# `_Fp8SwiGLU`). Their self time (Python and dispatch around the GEMM) is filed with the GEMM inside,
# never as a call of its own; autograd's C++ nodes (`AddmmBackward0`) stay bookkeeping.
_SUBCLASS_DISPATCH = "PythonSubclass"


def _is_gemm_layer_name(name: str) -> bool:
    return name == _SUBCLASS_DISPATCH or classify(name) == "gemm" or bool(FP8_DTYPE_PATTERN.search(name))


def _self_times(ops: list[dict]) -> tuple[list[float], list[bool], list[str | None]]:
    """Each op's time minus that of the ops nested in it on its thread, so a microsecond counts
    once, for the op doing the work (aten::addmm, not the aten::linear around it); which ops
    lie inside an FP8 GEMM op; and which ops are layers around a GEMM (their category, else None).

    Ops inside an FP8 GEMM op are folded into it (their time stays its time): on CPU,
    aten::_scaled_mm may do its work through a nested aten::mm, which is still the FP8 GEMM.
    A layer around a GEMM (`_is_gemm_layer_name`, with a GEMM op inside) is "gemm_fp8" when an
    FP8 GEMM op is among the ops inside it, else "gemm"."""
    self_us = [e["dur"] for e in ops]
    folded = [False] * len(ops)
    inner: list[str | None] = [None] * len(ops)  # the GEMM category found inside each op
    by_thread: dict[tuple, list[int]] = collections.defaultdict(list)
    for i, e in enumerate(ops):
        by_thread[(e["pid"], e["tid"])].append(i)
    for indices in by_thread.values():
        indices.sort(key=lambda i: (ops[i]["ts"], -ops[i]["dur"]))
        stack: list[int] = []
        for i in indices:
            while stack and ops[stack[-1]]["ts"] + ops[stack[-1]]["dur"] <= ops[i]["ts"]:
                stack.pop()
            if stack:
                parent = stack[-1]
                if folded[parent] or FP8_OP_PATTERN.search(ops[parent]["name"]):
                    folded[i] = True
                else:
                    self_us[parent] -= ops[i]["dur"]
            fp8 = bool(FP8_OP_PATTERN.search(ops[i]["name"]))
            if not folded[i] and (fp8 or classify(ops[i]["name"]) == "gemm"):
                for a in stack:  # an FP8 GEMM anywhere inside makes the layer an FP8 GEMM's
                    inner[a] = "gemm_fp8" if fp8 or inner[a] == "gemm_fp8" else "gemm"
            stack.append(i)
    layers = [c if c and _is_gemm_layer_name(e["name"]) else None for e, c in zip(ops, inner)]
    return [max(t, 0.0) for t in self_us], folded, layers


def union_us(intervals: list[tuple[float, float]]) -> float:
    return sum(stop - start for start, stop in merged_intervals(intervals))


def merged_intervals(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of intervals as disjoint ones, in order."""
    merged: list[tuple[float, float]] = []
    for start, stop in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], stop))
        elif stop > start:
            merged.append((start, stop))
    return merged


def _overlap_us(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """The time two unions of intervals (each disjoint and in order, as merged_intervals returns them) share."""
    shared, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        shared += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return shared


def summarize_events(events: list[dict], *, num_steps: int,
                     steps: tuple[int, int] | None = None) -> TraceSummary:
    """Kernel summary of a trace's events (see load_trace_events for their keys); `steps` (first,
    last) defaults to the trace's ProfilerStep#N markers."""
    if num_steps < 1:
        raise ValueError(f"num_steps={num_steps} must be >= 1")
    kernels = [e for e in events if e["cat"] == "kernel"]
    cpu_ops = [e for e in events if e["cat"] == "cpu_op"]
    fp8_ids: set = set()
    layer_of: dict[int, str] = {}  # CPU: id(op) -> the GEMM category of the GEMM it is a layer around
    # The op that launched a kernel knows its input dtypes (when shapes were recorded).
    op_types = {e["external_id"]: e.get("input_types") for e in cpu_ops if e["external_id"] is not None}
    if kernels:
        device, timed = "cuda", kernels
        times = [e["dur"] for e in kernels]
        # A kernel launched by aten::_scaled_mm is an FP8 GEMM whatever its name (a cuBLAS naming scheme these
        # patterns do not know yet still counts); not one of inductor's casts (`triton_poi_fused__scaled_mm_...`).
        fp8_ids = {e["external_id"] for e in cpu_ops if e["external_id"] is not None
                   and FP8_OP_PATTERN.search(e["name"]) and classify(e["name"]) == "gemm"}
    else:
        self_us, folded, layers = _self_times(cpu_ops)
        device = "cpu"
        timed = [e for e, f in zip(cpu_ops, folded) if not f]
        times = [t for t, f in zip(self_us, folded) if not f]
        layer_of = {id(e): c for e, c in zip(cpu_ops, layers) if c}

    # Keyed by (name, category): a kernel name is an FP8 GEMM for the calls _scaled_mm launched.
    totals: dict[tuple[str, str], float] = collections.defaultdict(float)
    calls: collections.Counter[tuple[str, str]] = collections.Counter()
    fp8_calls: collections.Counter[str] = collections.Counter()
    gemm_dtypes: collections.Counter[str] = collections.Counter()
    layer_calls = 0  # calls of layers around a GEMM: their time is GEMM time, their calls are not GEMMs
    for e, t in zip(timed, times):
        if layer := layer_of.get(id(e)):
            totals[e["name"], layer] += t
            calls[e["name"], layer] += 1
            layer_calls += 1
            continue
        if device == "cpu":
            # A CPU op is an FP8 GEMM by being one (aten::_scaled_mm, ...), not by a dtype in its name: an
            # FP8-named wrapper with only a bf16 GEMM inside ran no FP8 GEMM.
            fp8 = bool(FP8_OP_PATTERN.search(e["name"]))
        else:
            fp8 = is_fp8_gemm(e["name"]) or (bool(fp8_ids) and e["external_id"] in fp8_ids)
        category = "gemm_fp8" if fp8 else classify(e["name"])
        totals[e["name"], category] += t
        calls[e["name"], category] += 1
        if fp8:
            fp8_calls[e["name"]] += 1
        elif category == "gemm":
            types = e.get("input_types") if device == "cpu" else op_types.get(e["external_id"])
            if dtype := _first_dtype(types):
                gemm_dtypes[dtype] += 1
    ops = sorted((OpStat(n, c, calls[n, c], t) for (n, c), t in totals.items()), key=lambda s: -s.total_us)
    category_us = dict.fromkeys(CATEGORY_LABELS, 0.0)
    for s in ops:
        category_us[s.category] += s.total_us

    if steps is None and (marked := profiler_steps(events)):
        steps = (marked[0], marked[-1])
    markers = [e for e in events if e["cat"] == "user_annotation" and _STEP_MARKER.match(e["name"])]
    spans = [(e["ts"], e["ts"] + e["dur"]) for e in timed + markers]
    # Nested CPU ops lie inside their parents, so the union over all of them is the top-level time.
    busy = union_us([(e["ts"], e["ts"] + e["dur"]) for e in timed])
    comm_us, exposed_us = _communication_us(timed) if device == "cuda" else (0.0, 0.0)
    host_waits = _host_waits(events, cpu_ops) if device == "cuda" else ()
    return TraceSummary(
        device=device, num_steps=num_steps, steps=steps, total_us=sum(times),
        wall_us=(max(s for _, s in spans) - min(s for s, _ in spans)) if spans else 0.0,
        busy_us=busy,
        category_us=category_us,
        ops=ops,
        num_gemm_calls=sum(s.calls for s in ops if s.category in GEMM_CATEGORIES) - layer_calls,
        fp8_gemm_calls=sum(fp8_calls.values()),
        fp8_gemm_names=[n for n, _ in fp8_calls.most_common()],
        gemm_dtypes=dict(gemm_dtypes.most_common()),
        comm_us=comm_us,
        exposed_comm_us=exposed_us,
        host_waits=host_waits,
    )


# The CUDA runtime calls that block the host until the device has caught up (a pageable D2H copy, `.item()`,
# `.tolist()` end in cudaStreamSynchronize).
HOST_WAIT_CALLS = frozenset({"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize"})


def _host_waits(events: list[dict], cpu_ops: list[dict]) -> tuple[OpStat, ...]:
    """The host's blocking syncs, summed by `host_wait_site`, longest first (category "host wait")."""
    waits = [e for e in events if e["cat"] == "cuda_runtime" and e["name"] in HOST_WAIT_CALLS]
    totals: dict[str, float] = collections.defaultdict(float)
    calls: collections.Counter[str] = collections.Counter()
    for w in waits:
        site = host_wait_site(w, cpu_ops)
        totals[site] += w["dur"]
        calls[site] += 1
    return tuple(sorted((OpStat(site, "host wait", calls[site], t) for site, t in totals.items()),
                        key=lambda s: -s.total_us))


def host_wait_site(wait: dict, cpu_ops: list[dict], *, depth: int = 3) -> str:
    """Where a runtime call was made: the innermost `depth` CPU ops around it on its thread, outermost first
    (`aten::to > aten::_to_copy > aten::copy_` for a `.tolist()`, `aten::item > aten::_local_scalar_dense` for an
    `.item()`), or "(no op: the script's own sync)" outside every op."""
    around = sorted((op for op in cpu_ops if op["tid"] == wait["tid"] and op["pid"] == wait["pid"]
                     and op["ts"] <= wait["ts"] and wait["ts"] + wait["dur"] <= op["ts"] + op["dur"]),
                    key=lambda op: (op["ts"], -op["dur"]))
    return " > ".join(op["name"] for op in around[-depth:]) or "(no op: the script's own sync)"


def _communication_us(kernels: list[dict]) -> tuple[float, float]:
    """(time some communication kernel ran, of it the time no other kernel ran beside it)."""
    comm, compute = [], []
    for e in kernels:
        (comm if classify(e["name"]) == "communication" else compute).append((e["ts"], e["ts"] + e["dur"]))
    comm, compute = merged_intervals(comm), merged_intervals(compute)
    comm_us = sum(stop - start for start, stop in comm)
    return comm_us, comm_us - _overlap_us(comm, compute)


# The profiler's names for tensor dtypes ("Input type" with record_shapes) -> ours.
_DTYPE_NAMES = {"float": "fp32", "double": "fp64", "c10::BFloat16": "bf16", "c10::Half": "fp16",
                "c10::Float8_e4m3fn": "fp8_e4m3", "c10::Float8_e5m2": "fp8_e5m2"}


def _first_dtype(types: list[str] | None) -> str | None:
    """The dtype of an op's first tensor input (a GEMM's operands share it)."""
    for t in types or ():
        if t:
            return _DTYPE_NAMES.get(t, t)
    return None


def _short(name: str, width: int) -> str:
    name = name.removeprefix("void ")
    return name if len(name) <= width else name[: width - 3] + "..."


def fp8_verdict(summary: TraceSummary) -> str:
    if summary.fp8_gemm_ran:
        names = ", ".join(_short(n, 70) for n in summary.fp8_gemm_names[:3])
        more = ", ..." if len(summary.fp8_gemm_names) > 3 else ""
        share = summary.category_us["gemm_fp8"] / summary.gemm_us if summary.gemm_us else 0.0
        return (f"FP8 GEMMs ran: yes ({summary.fp8_gemm_calls} calls, {share:.1%} of GEMM time: "
                f"{names}{more})")
    if summary.num_gemm_calls == 0:
        return "FP8 GEMMs ran: no (no GEMM ran at all)"
    return f"FP8 GEMMs ran: no (only {_gemm_dtypes(summary, unknown='bf16/fp32')} GEMMs)"


def _gemm_dtypes(summary: TraceSummary, *, unknown: str) -> str:
    """"fp32", "bf16 and fp32", or `unknown` when the trace holds no input types."""
    dtypes = list(summary.gemm_dtypes)
    return " and ".join(dtypes) if dtypes else unknown


def format_summary(summary: TraceSummary, *, top: int = 15) -> str:
    """A compact table; the last line is the FP8 verdict."""
    n = summary.num_steps
    what = "GPU kernels" if summary.device == "cuda" else "aten ops' self time (no GPU kernels in this trace)"
    total = summary.total_us or 1.0
    idle = 1.0 - summary.busy_us / summary.wall_us if summary.wall_us else 0.0
    lines = [
        f"Kernel summary of {summary.step_range} ({n} step{'s' * (n != 1)}), timing {what}",
        f"  device time {summary.total_us / n / 1e3:.2f} ms/step, wall {summary.wall_us / n / 1e3:.2f}"
        f" ms/step, device idle {idle:.1%} of wall (launch gaps, host syncs, input waits)",
        "  " + " | ".join(f"{CATEGORY_LABELS[c]} {t / total:.1%}" for c, t in summary.category_us.items()),
        f"  GEMM time {summary.gemm_us / n / 1e3:.2f} ms/step ({summary.gemm_us / total:.1%} of device time), "
        f"{summary.category_us['gemm_fp8'] / (summary.gemm_us or 1.0):.1%} of it in FP8 GEMMs",
        *([f"  communication {summary.comm_us / n / 1e3:.2f} ms/step, of it exposed (no other kernel running) "
           f"{summary.exposed_comm_us / n / 1e3:.2f} ms/step ({summary.exposed_comm_us / summary.wall_us:.1%} of wall)"]
          if summary.comm_us and summary.wall_us else []),
        *([f"  host blocked on the device {summary.host_wait_us / n / 1e3:.2f} ms/step in "
           f"{sum(w.calls for w in summary.host_waits) / n:.1f} syncs/step: "
           + "; ".join(f"{w.total_us / n / 1e3:.2f} ms {w.name} ({w.calls / n:.1f}/step)"
                       for w in summary.host_waits[:3])
           + ("; ..." if len(summary.host_waits) > 3 else "")] if summary.host_waits else []),
        f"  {'ms/step':>9} {'calls/step':>10} {'share':>6}  {'category':<17}  name",
    ]
    for s in summary.ops[:top]:
        lines.append(f"  {s.total_us / n / 1e3:9.3f} {s.calls / n:10.1f} {s.total_us / total:6.1%}"
                     f"  {CATEGORY_LABELS[s.category]:<17}  {_short(s.name, 90)}")
    lines.append(fp8_verdict(summary))
    return "\n".join(lines)


def fp8_warning(summary: TraceSummary, *, compute_dtype: str | None = None) -> str | None:
    """The warning for a trace that was meant to run FP8 GEMMs but ran none; None when FP8 GEMMs ran.

    It says what ran instead: the GEMMs found and their dtype, from the input types in the trace
    (recorded only with record_shapes), else from `compute_dtype`, the dtype the caller knows the
    run computed in (the trainer's fp8 runs compute in bf16 around the FP8 GEMMs)."""
    if summary.fp8_gemm_ran:
        return None
    where = f"no FP8 GEMM ran in {summary.step_range}"
    if compute_dtype is not None:
        where = f"mixed_precision='fp8' but {where}"
    if summary.num_gemm_calls == 0:
        return f"{where}: no GEMM ran at all. See docs/fp8.md#troubleshooting"
    names = summary.other_gemm_names
    found = ", ".join(_short(n, 60) for n in names[:3]) + (", ..." if len(names) > 3 else "")
    dtype = _gemm_dtypes(summary, unknown="") or compute_dtype
    ran = (f"its {summary.num_gemm_calls} GEMM calls ({found}) ran in {dtype}" if dtype else
           f"its {summary.num_gemm_calls} GEMM calls were {found}, none of them FP8 (their dtype is not in "
           "the trace: profile with profiling.record_shapes=true to see it)")
    return f"{where}: {ran}. See docs/fp8.md#troubleshooting"
