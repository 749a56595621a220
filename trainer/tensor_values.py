"""What the values of a loaded checkpoint's tensors may be, and the one check that holds each tensor to its rule.

A checkpoint is a dict of parts (trainer/checkpoint/parts.py); a part may say, per tensor it loads, what its values
must be (`TensorRule`): finite (every floating tensor's rule unless its part says more), within a range, whole
numbers, stored in one of some dtypes, a random generator's state that torch takes. The checkpoint manager asks the
parts for their rules, checks the stored dtypes against the index before any tensor is read (`dtype_problems`) and
the values once DCP has loaded them, before any part takes them (`value_problems`): one reduction per tensor
(`aminmax`) on its device, one host sync for all of them, one collective of what was found. Only the error path counts
and locates the values that break a rule. The same check keeps a save from publishing weights that are not finite.

Each problem is one phrase naming the tensor's checkpoint key: `optimizer.state.{fqn}.exp_avg_sq holds 3 of 4,096
values outside the allowed [0, inf) (first at [0, 7]: -0.25; AdamW's second moment, a mean of squares)`; the caller
puts the checkpoint's path before them and what to do after, in one line of its own error type. A leaf: torch, and the plain
tensor under a DTensor (trainer.distributed).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from trainer.distributed import Layout, plain_tensor

# float8 e4m3fn (an fp8 AdamW first moment) has no Inf and its finite values lie in +-448: NaN is the one value it can
# hold wrongly, and torch has no min/max reduction of it. Other float8 dtypes are reduced in fp32.
_E4M3 = torch.float8_e4m3fn
SHOWN = 3  # problems a line names; the rest are counted


@dataclass(frozen=True)
class TensorRule:
    """What every value of one loaded tensor must be. A floating tensor's values are finite and in [low, high]
    ((low, high] with low_open), whole numbers with `integral`; `dtypes` are the dtypes its file may store it in (empty:
    what the index checks allow); `accepts` checks a small CPU tensor on the host (a random generator's state) and
    returns what is wrong or None. `why` says what a value outside the rule does, for the error line."""

    low: float = -math.inf
    high: float = math.inf
    low_open: bool = False
    integral: bool = False
    dtypes: tuple[torch.dtype, ...] = ()
    accepts: Callable[[torch.Tensor], str | None] | None = None
    why: str = ""

    def describe(self) -> str:
        """The values allowed: 'finite', '[0, inf)', '(0, 5.734e+16]', 'whole numbers in [0, 12]'."""
        if self.low == -math.inf and self.high == math.inf:
            return "finite whole numbers" if self.integral else "finite"
        interval = f"{'(' if self.low_open else '['}{self.low:g}, {self.high:g}{']' if self.high < math.inf else ')'}"
        return f"whole numbers in {interval}" if self.integral else interval

    def broken_by(self, low: float, high: float, fraction: float) -> str | None:
        """Which part of the rule a tensor of this min, max and largest fractional part breaks, if any."""
        if not (math.isfinite(low) and math.isfinite(high)):
            return "finite"
        if low < self.low or (self.low_open and low <= self.low) or high > self.high:
            return "range"
        return "integral" if self.integral and fraction > 0 else None


FINITE = TensorRule()


def dtype_problems(rules: dict[str, tuple[torch.Tensor, TensorRule]], stored: dict[str, Any]) -> list[str]:
    """The tensors whose checkpoint entry (`stored`: DCP's index entries by key) holds a dtype their rule does not
    allow. Host only, before anything is read: DCP would convert the entry silently into this run's tensor."""
    problems = []
    for key, (_, rule) in rules.items():
        md = stored.get(key)
        dtype = getattr(getattr(md, "properties", None), "dtype", None)
        if rule.dtypes and md is not None and dtype not in rule.dtypes:
            allowed = " or ".join(str(d).removeprefix("torch.") for d in rule.dtypes)
            problems.append(f"{key} is stored as {str(dtype).removeprefix('torch.')}, not {allowed}"
                            + (f" ({rule.why})" if rule.why else ""))
    return problems


def value_problems(rules: dict[str, tuple[torch.Tensor, TensorRule]], *,
                   group: dist.ProcessGroup | None = None) -> list[str]:
    """Every tensor whose values break its rule, one phrase each (module docstring), the same list on every rank of
    `group` (each checks its shards; one all_gather_object of what was found). note: a host sync per device."""
    found = [_locate(key, t, rule) for key, (t, rule) in _broken(rules).items()]
    for key, (t, rule) in rules.items():
        if rule.accepts is not None and (problem := rule.accepts(plain_tensor(t, local=True))):
            found.append({"key": key, "kind": "accepts", "offsets": (), "problem": problem, "why": rule.why})
    if group is not None and dist.get_world_size(group) > 1:
        every: list[list[dict[str, Any]]] = [[] for _ in range(dist.get_world_size(group))]
        dist.all_gather_object(every, found, group=group)
        found = [record for rank_found in every for record in rank_found]
    return [_phrase(records) for records in _by_key(found).values()]


def problems_line(problems: list[str]) -> str:
    """The first SHOWN problems, '; '-joined, and how many more."""
    more = f"; and {len(problems) - SHOWN} more" if len(problems) > SHOWN else ""
    return "; ".join(problems[:SHOWN]) + more


def _broken(rules: dict[str, tuple[torch.Tensor, TensorRule]]) -> dict[str, tuple[torch.Tensor, TensorRule]]:
    """The tensors (this rank's shards) that break their rule: one reduction each on its device, then one host read
    per device of every tensor's [min, max, largest fractional part]."""
    stats: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
    for key, (t, rule) in rules.items():
        local = plain_tensor(t, local=True)
        if local.is_floating_point() and local.numel():
            stats.setdefault(local.device, []).append((key, _stats(local.detach(), integral=rule.integral)))
    broken = {}
    for per_device in stats.values():
        values = torch.stack([s for _, s in per_device]).tolist()  # note: the host sync, once per device
        for (key, _), (low, high, fraction) in zip(per_device, values):
            if rules[key][1].broken_by(low, high, fraction):
                broken[key] = rules[key]
    return broken


def _stats(t: torch.Tensor, *, integral: bool) -> torch.Tensor:
    """float64 [min, max, largest fractional part] of a floating tensor; NaN propagates into min and max."""
    zero = torch.zeros((), dtype=torch.float64, device=t.device)
    if t.dtype == _E4M3:
        value = torch.where(t.isnan().any(), math.nan, zero)
        return torch.stack([value, value, zero])
    if t.dtype.itemsize == 1:  # another float8 dtype
        t = t.float()
    low, high = torch.aminmax(t)
    fraction = (t - t.trunc()).abs().amax().double().nan_to_num(0.0) if integral else zero
    return torch.stack([low.double(), high.double(), fraction])


def _locate(key: str, t: torch.Tensor, rule: TensorRule) -> dict[str, Any]:
    """The error path: how many of this rank's values break the rule, and the first of them by global index."""
    local, layout = plain_tensor(t, local=True), Layout.of(t)
    x = local.detach().float() if local.dtype.itemsize == 1 else local.detach()
    nan, inf = x.isnan(), x.isinf()
    record: dict[str, Any] = {"key": key, "offsets": layout.offsets, "numel": t.numel(), "nan": int(nan.sum()),
                              "inf": int(inf.sum()), "allowed": rule.describe(), "why": rule.why}
    if record["nan"] or record["inf"]:
        record["kind"], bad = "finite", nan | inf
    else:
        outside = (x < rule.low) | (x > rule.high)
        if rule.low_open:
            outside |= x <= rule.low
        record["kind"] = "range" if bool(outside.any()) else "integral"
        bad = outside if record["kind"] == "range" else (x != x.trunc())
    first = int(bad.flatten().int().argmax())  # the first True
    index = [int(i) for i in torch.unravel_index(torch.tensor(first), tuple(x.shape))] if x.dim() else []
    record["count"], record["value"] = int(bad.sum()), float(x.flatten()[first])
    record["first"] = tuple(o + i for o, i in zip(layout.offsets, index))
    return record


def _by_key(found: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Records by key, sorted (the same order on every rank), each shard once (replicas hold the same shard)."""
    out: dict[str, dict[tuple, dict[str, Any]]] = {}
    for record in found:
        out.setdefault(record["key"], {}).setdefault((record["kind"], tuple(record["offsets"])), record)
    return {key: list(records.values()) for key, records in sorted(out.items())}


def _phrase(records: list[dict[str, Any]]) -> str:
    """One phrase for one tensor, from its shards' records (the worst kind: a state torch refuses, non-finite values,
    values out of range, fractions)."""
    key = records[0]["key"]
    kind = next(k for k in ("accepts", "finite", "range", "integral") if any(r["kind"] == k for r in records))
    shards = [r for r in records if r["kind"] == kind]
    why = f"; {shards[0]['why']}" if shards[0]["why"] else ""
    if kind == "accepts":
        return f"{key} is not a state torch takes ({shards[0]['problem']}{why})"
    first = min(shards, key=lambda r: r["first"])
    if not first["first"]:  # a scalar
        return f"{key} is {first['value']:g} (allowed: {first['allowed']}{why})"
    at = list(first["first"])
    if kind == "finite":
        nan, inf = sum(r["nan"] for r in shards), sum(r["inf"] for r in shards)
        return (f"{key} holds {nan + inf:,} non-finite value{'s' if nan + inf > 1 else ''} ({nan:,} NaN, {inf:,} Inf "
                f"of {first['numel']:,}; first at {at}{why})")
    count = sum(r["count"] for r in shards)
    return (f"{key} holds {count:,} of {first['numel']:,} values outside the allowed {first['allowed']} (first at "
            f"{at}: {first['value']:g}{why})")
