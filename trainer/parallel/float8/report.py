"""What the FP8 conversion did: `Float8Report`, a list of converters (torchtitan's model converters), each the same
small interface (`Float8Converter`) over one kind of module: the Linears (trainer.parallel.float8.linear: torchao's
tensorwise and rowwise; blockwise.py: blockwise), the routed experts (experts.py). MX or NVFP4 would be one more
converter. One report for logs, metrics, step hooks (hooks.py), evaluation (evaluation.py) and tests, merged over
pipeline stages here.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Self

import torch
import torch.distributed as dist
from torch import nn

from trainer.hooks import StepHook
from trainer.models.layers import clean_fqn


class Float8Converter:
    """One kind of FP8 conversion and, once it ran, what it converted: plain data (the pipeline gathers reports
    from other ranks), built from the resolved `Float8Options` by `trainer.parallel.float8.apply.float8_converters`.

    role: what of the model it converts, "linears" or "experts" (a run has at most one converter of each)."""

    role: ClassVar[str]

    def convert(self, model: nn.Module, *, device: torch.device) -> None:
        """Convert its modules of `model` in place (or say loudly why not, or stop under float8.require), record
        what converted, and log what it did."""
        raise NotImplementedError

    @classmethod
    def owns(cls, module: nn.Module) -> bool:
        """Whether `module` is one this kind of converter made."""
        raise NotImplementedError

    def modules(self, model: nn.Module) -> dict[str, nn.Module]:
        """fqn -> every module of `model` (this rank's) that this kind of converter made."""
        return {clean_fqn(fqn): m for fqn, m in model.named_modules() if self.owns(m)}

    def in_bf16(self, module: nn.Module) -> Callable[[], None]:
        """Make one of its modules compute in bf16 with the same parameters (evaluation.py); returns the undo."""
        raise NotImplementedError

    def lines(self) -> list[str]:
        """What it converted, in the words of the startup log."""
        raise NotImplementedError

    def fp8_layers_fields(self) -> dict:
        """Its part of fp8_layers.json (trainer.validate.run_files), from its options alone."""
        return {}

    @classmethod
    def merged(cls, stages: list[Self]) -> Self:
        """The whole model's converter from its pipeline stages' (in stage order)."""
        raise NotImplementedError

    def stages_lines(self, stages: list[Self]) -> list[str]:
        """The lines that say, once for the whole model, what this (merged) converter did over `stages`."""
        return [f"FP8 over all {len(stages)} pipeline stages: {line}" for line in self.lines()]

    def step_hooks(self, model: nn.Module, *, amax_group: dist.ProcessGroup | None) -> list[StepHook]:
        """The per-step hooks (trainer/hooks.py) its conversion needs, in the order they run."""
        return []


@dataclass
class Float8Report:
    """What apply_float8 did: its converters, in the order they ran, each holding what it converted."""

    converters: list[Float8Converter]

    def role(self, role: str) -> Float8Converter | None:
        return next((c for c in self.converters if c.role == role), None)

    @property
    def linears(self):
        """The Linears' converter (every fp8 run has one): `converted`, `excluded`, `num_linear`, `options`."""
        return self.role("linears")

    @property
    def experts(self):
        """The routed experts' converter (float8.moe_experts != 'off'): `num_layers` converted; else None."""
        return self.role("experts")

    @property
    def enabled(self) -> bool:
        """Some Linear layer runs in FP8."""
        return bool(self.linears is not None and self.linears.converted)

    @property
    def converted_fraction(self) -> float:
        linears = self.linears
        return len(linears.converted) / linears.num_linear if linears and linears.num_linear else 0.0

    def lines(self) -> list[str]:
        """Every converter's lines: the Linears' two, then the routed experts' where they run in FP8."""
        return [line for c in self.converters for line in c.lines()]

    @classmethod
    def of_stages(cls, stages: list[Float8Report]) -> Float8Report:
        """The whole model's report from its pipeline stages' (in stage order; each stage ran the same converters)."""
        kinds = [type(c) for c in stages[0].converters]
        assert all([type(c) for c in s.converters] == kinds for s in stages), "stages ran different converters"
        return cls([kind.merged([s.converters[i] for s in stages]) for i, kind in enumerate(kinds)])

    def stages_lines(self, stages: list[Float8Report]) -> list[str]:
        """(the merged report) The lines that say what converted over all `stages`, logged once by the pipeline."""
        return [line for i, c in enumerate(self.converters) for line in c.stages_lines([s.converters[i] for s in stages])]


_FIRST_INDEX = re.compile(r"^(.*?)\.(\d+)(?:\.(.*))?$")


def group_fqns(fqns: list[str]) -> list[str]:
    """Every fqn of `fqns`, written compactly and exactly, in model order.

    Fqns are split at their first numeric part (the layer index); the names under one index
    are braced, and indices holding the same names share one entry:
    ["layers.0.mlp.up_proj", "layers.0.mlp.down_proj", "layers.1.mlp.up_proj", "layers.1.mlp.down_proj"]
    -> ["layers.{0,1}.{mlp.up_proj,mlp.down_proj}"]; "layers.{0..31}.moe.router" is 32 layers.
    """
    # (head, suffixes under one index) -> indices, in order of first appearance.
    under: dict[tuple[str, int], list[str]] = {}
    order: list[tuple[str, int] | str] = []
    for fqn in fqns:
        m = _FIRST_INDEX.match(fqn)
        if m is None:
            order.append(fqn)
            continue
        key = (m.group(1), int(m.group(2)))
        if key not in under:
            under[key] = []
            order.append(key)
        under[key].append(m.group(3) or "")
    shared: dict[tuple[str, tuple[str, ...]], list[int]] = {}
    for (head, index), suffixes in under.items():
        shared.setdefault((head, tuple(suffixes)), []).append(index)
    out: list[str] = []
    done: set[tuple[str, tuple[str, ...]]] = set()
    for item in order:
        if isinstance(item, str):
            out.append(item)
            continue
        key = (item[0], tuple(under[item]))
        if key in done:
            continue
        done.add(key)
        head, suffixes = key
        names = suffixes[0] if len(suffixes) == 1 else "{" + ",".join(suffixes) + "}"
        out.append(f"{head}.{_braced_indices(shared[key])}" + (f".{names}" if names else ""))
    return out


def _braced_indices(indices: list[int]) -> str:
    """[3] -> "3", [0, 2] -> "{0,2}", [0, 1, 2, 3, 7] -> "{0..3,7}"."""
    indices = sorted(indices)
    runs: list[list[int]] = []
    for i in indices:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    parts = [f"{r[0]}..{r[-1]}" if len(r) >= 3 else ",".join(map(str, r)) for r in runs]
    text = ",".join(parts)
    return text if len(indices) == 1 else "{" + text + "}"
