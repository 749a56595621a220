"""The package's shape: no import circle among trainer's modules, no file over 500 lines, no function over 80, imports
at the top of their files unless LAZY_IMPORTS says why not.

Read with `ast` (nothing imported). Every import counts, at any depth, under `if TYPE_CHECKING`
too: a circle that only type checkers see still ties the rooms together. A module's own package
is not an edge (a package __init__ re-exports its modules by design).
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.helpers import REPO

MAX_FILE_LINES, MAX_FUNCTION_LINES = 500, 80


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted((REPO / "trainer").rglob("*.py")):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(path: Path, module: str) -> set[str]:
    """Every module name an import statement in the file names (`from a.b import c` names a.b and a.b.c)."""
    is_package = path.name == "__init__.py"
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names.add(target)
            names.update(f"{target}.{a.name}" for a in node.names)
    return names


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {m: {d for d in _imports(p, m) if d in modules and d != m} for m, p in modules.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circle() -> None:
    graph = import_graph()
    assert len(graph) > 30 and "trainer.config" in graph and "trainer.config.checks" in graph
    assert circles(graph) == []


def test_circle_finder_finds_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]


def test_config_checks_and_schedule_syntax_are_leaves() -> None:
    # JobConfig (config/job.py) runs its checks, which read the sections and import the precision-schedule syntax,
    # the model-argument rules and the seed ranges: none may reach back, and the sections never import the checks.
    graph = import_graph()
    assert graph["trainer.config.checks"] <= {"trainer.errors", "trainer.config.phases", "trainer.seeds",
                                              "trainer.model_values", "trainer.config.sections"}
    assert not _reached(graph, {"trainer.config.sections"}) & {"trainer.config.checks", "trainer.config.job"}
    assert graph["trainer.model_values"] <= {"trainer.errors"}
    assert graph["trainer.config.phases"] <= {"trainer.errors"}
    assert graph["trainer.seeds"] == set()
    assert graph["trainer.hooks"] == set()


def test_config_imports_nothing_above_it() -> None:
    # trainer.config is the floor every layer stands on (and `--help` loads it alone, without torch): its modules
    # import each other, the errors and the leaves its checks need, never trainer.validate nor anything above.
    # Every import counts, at any depth (a lazy import in a function is still an arrow back up).
    graph = import_graph()
    config = {m for m in graph if m == "trainer.config" or m.startswith("trainer.config.")}
    assert {"trainer.config.sections", "trainer.config.checks", "trainer.config.load"} <= config
    leaves = {"trainer.errors", "trainer.config.phases", "trainer.seeds", "trainer.model_values"}
    above = {m: sorted(d for d in graph[m] if d not in config | leaves) for m in sorted(config)}
    assert {m: deps for m, deps in above.items() if deps} == {}
    assert not any(d.startswith("trainer.validate") for m in config for d in graph[m])


def _reached(graph: dict[str, set[str]], start: set[str]) -> set[str]:
    """Every module the `start` modules import, at any depth."""
    seen, stack = set(), list(start)
    while stack:
        for d in graph[stack.pop()] - seen:
            seen.add(d)
            stack.append(d)
    return seen


def test_checkpoints_import_no_optimizer_nor_fp8_module() -> None:
    # A checkpoint is a dict of parts, each feature's own (trainer/checkpoint/parts.py): the optimizer's part lives
    # in trainer/optim, FP8's state is its hook's. checkpoint/ reaches neither, at any depth, so a new stateful
    # feature adds a part in its own room and edits none of checkpoint/'s.
    graph = import_graph()
    checkpoint = {m for m in graph if m == "trainer.checkpoint" or m.startswith("trainer.checkpoint.")}
    assert {"trainer.checkpoint.parts", "trainer.checkpoint.manager", "trainer.checkpoint.values"} <= checkpoint
    features = ("trainer.optim", "trainer.parallel.float8")
    assert sorted(m for m in _reached(graph, checkpoint) if m.startswith(features)) == []
    assert any(m.startswith("trainer.optim.") for m in graph) and "trainer.parallel.float8" in graph


def test_files_and_functions_stay_short() -> None:
    long_files, long_functions = [], []
    for path in _modules().values():
        text = path.read_text(encoding="utf-8")
        if text.count("\n") > MAX_FILE_LINES:
            long_files.append(f"{path.relative_to(REPO)} ({text.count(chr(10))})")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    long_functions.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({length})")
    assert long_files == [] and long_functions == [], "split by concern: " + "; ".join(long_files + long_functions)


# -- imports at the top ---------------------------------------------------------------------------------------

# Why a module's top does not import what one of its functions imports. Every import inside a function of trainer/ or
# scripts/ is here, by module and by what it imports (a module, or a package's submodule), with its reason; any other
# import sits at the top of its file. A reason is one of these: a path that must not pay for torch, an optional
# dependency, Triton, a slow or prototype torchao module. A circle is never one (test_no_import_circle).
HELP = ("torch: `scripts/train.py --help` and a config error answer without importing torch or numpy "
        "(tests/unit/test_config.py::test_help_and_config_checks_do_not_import_torch); the run imports it after")
SCRIPT_HELP = "torch: the script's --help and argument errors answer without importing torch (tests/unit/test_docs.py)"
SCRIPT_HELP_NUMPY = "numpy: generate.py --help imports neither torch nor numpy; the tokenizer is found after it"
LOADER = ("torch: scripts/prepare_data.py and build_tokenizer.py read tokenizers and write shards through trainer.data "
          "without torch (~1 s to import); only the loader needs it")
TENSORBOARD = "tensorboard: ~0.2 s to import warm, seconds cold; only metrics.enable_tensorboard opens a writer"
TRITON = ("Triton: absent from CPU builds of torch; kernel.py imports it at its top, so only the GPU update (and the "
          "tests that run it in Triton's interpreter) load it")
TORCHAO = ("torchao.float8: ~0.2 s to import warm (more cold), and only an fp8 run converts; a bf16 run and a "
           "checkpoint load never import torchao (tests/cli/test_checkpoint.py pins the latter)")
TORCHAO_AT_TOP = "imports torchao.float8 at its top (tensorwise.py): only an fp8 run of that recipe loads it"
LOSS_TRITON = ("Triton: absent from CPU builds of torch; loss_kernels.py imports it at its top, so only the fused FP8 "
               "head loss on a GPU (and the tests that run it in Triton's interpreter) load it")
TORCHAO_PROTOTYPE = ("a torchao prototype (Triton kernels; a module that moves between torchao versions): only its "
                     "recipe or benchmark runs it")


def _optional(package: str, extra: str) -> str:
    return f"optional dependency {package} (pip install 'trainer[{extra}]'): imported where used, which says if absent"


LAZY_IMPORTS: dict[str, dict[str, str]] = {
    "trainer.cli": {
        "trainer.checkpoint.format": HELP, "trainer.checkpoint.space": HELP, "trainer.run.dry_run": HELP,
        "trainer.run.train": HELP,
    },
    "trainer.data": {"trainer.data.loader": LOADER},
    "trainer.data.inputs": {"pyarrow.parquet": _optional("pyarrow", "parquet")},
    "trainer.data.tokenizer": {"tokenizers": _optional("tokenizers", "tokenizers")},
    "trainer.hf.folder": {
        "safetensors": _optional("safetensors", "hf"), "safetensors.torch": _optional("safetensors", "hf"),
    },
    "trainer.loss": {
        "trainer.loss_kernels": LOSS_TRITON, "torchao.float8.config": TORCHAO, "torchao.float8.float8_linear": TORCHAO,
        "torchao.float8.float8_training_tensor": TORCHAO, "torchao.float8.float8_utils": TORCHAO,
        "torchao.float8.distributed_utils": TORCHAO, "torchao.float8.float8_scaling_utils": TORCHAO,
    },
    "trainer.metrics.logger": {"torch.utils.tensorboard": TENSORBOARD},
    "trainer.metrics.wandb_run": {"wandb": _optional("wandb", "wandb")},
    "trainer.optim.adamw": {"trainer.optim.kernel": TRITON},
    "trainer.parallel.float8.blockwise": {"torchao.prototype.blockwise_fp8_training.linear": TORCHAO_PROTOTYPE,
                                          "torchao.prototype.blockwise_fp8_training.kernels": TORCHAO_PROTOTYPE},
    "trainer.parallel.float8.linear": {
        "torchao.float8": TORCHAO, "torchao.float8.config": TORCHAO, "torchao.float8.float8_linear": TORCHAO,
        "trainer.parallel.float8.tensorwise": TORCHAO_AT_TOP, "trainer.parallel.float8.delayed": TORCHAO_AT_TOP,
        "trainer.parallel.float8.weights_per_step": TORCHAO_AT_TOP,
    },
    "scripts.bench_moe_experts": {
        "torchao.prototype.moe_training.fp8_grouped_mm": TORCHAO_PROTOTYPE, "triton.testing": TRITON,
    },
    "scripts.build_tokenizer": {"tokenizers": _optional("tokenizers", "tokenizers")},
    "scripts.convert_checkpoint": {name: SCRIPT_HELP for name in (
        "torch", "trainer.checkpoint", "trainer.checkpoint.tokenizer", "trainer.checkpoint.values", "trainer.hf",
        "trainer.hf.folder", "trainer.hf.output_folder", "trainer.hf.tokenizer", "trainer.models",
    )},
    "scripts.fp8_parity": {
        "torch": SCRIPT_HELP, "trainer.validate.resolve": SCRIPT_HELP,
        "matplotlib": _optional("matplotlib", "plot"), "matplotlib.figure": _optional("matplotlib", "plot"),
    },
    "scripts.generate": {
        **{name: SCRIPT_HELP for name in ("torch", "trainer.checkpoint", "trainer.checkpoint.tokenizer",
                                          "trainer.hf.tokenizer", "trainer.models", "trainer.models.generate")},
        "trainer.data": SCRIPT_HELP_NUMPY, "trainer.data.tokenizer": SCRIPT_HELP_NUMPY,
    },
}

def _sources() -> dict[str, Path]:
    return {**_modules(), **{f"scripts.{p.stem}": p for p in sorted((REPO / "scripts").glob("*.py"))}}


def function_imports(source: str, modules: set[str]) -> dict[str, int]:
    """What the imports inside functions of `source` name (`from a.b import c` names a.b, or a.b.c where that is a
    module), with the line of the first."""
    found: dict[str, int] = {}

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if in_function and isinstance(child, ast.Import):
                for a in child.names:
                    found.setdefault(a.name, child.lineno)
            elif in_function and isinstance(child, ast.ImportFrom):
                for a in child.names:
                    sub = f"{child.module}.{a.name}"
                    found.setdefault(sub if sub in modules else child.module, child.lineno)
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(ast.parse(source), False)
    return found


def test_imports_sit_at_the_top_unless_a_reason_is_written() -> None:
    sources = _sources()
    found = {m: function_imports(p.read_text(encoding="utf-8"), set(sources)) for m, p in sources.items()}
    unexplained = [f"{sources[m].relative_to(REPO)}:{line} imports {name} in a function" for m, names in found.items()
                   for name, line in names.items() if name not in LAZY_IMPORTS.get(m, {})]
    assert unexplained == [], "move it to the top, or write why not in LAZY_IMPORTS: " + "; ".join(unexplained)
    # An entry that no longer matches an import is an error too: a reason that explains nothing goes.
    stale = [f"{m}: {name}" for m, names in LAZY_IMPORTS.items() for name in names if name not in found.get(m, {})]
    assert stale == [], "no longer imported in a function: remove from LAZY_IMPORTS: " + "; ".join(stale)


def test_the_function_import_finder_sees_every_depth() -> None:
    source = ("import os\n"
              "def f():\n    import json\n    class C:\n        def g(self):\n            from a.b import c, d\n"
              "if True:\n    from e import f\n")
    assert function_imports(source, {"a.b", "a.b.c"}) == {"json": 3, "a.b.c": 6, "a.b": 6}


# -- the Trainer reads no config ------------------------------------------------------------------------------

CONFIG_NAMES = {"cfg", "run_cfg", "JobConfig", "load_job_config", "validate_job", "config"}


def config_reads(source: str, class_name: str) -> list[str]:
    """Where class `class_name` in `source` names a config (`cfg`, `self.cfg`, JobConfig, ...): line and name."""
    tree = ast.parse(source)
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name)
    found = []
    for node in ast.walk(cls):
        name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else \
            node.arg if isinstance(node, ast.arg) else None
        if name in CONFIG_NAMES:
            found.append(f"{node.lineno}: {name}")
    return found


def test_the_trainer_reads_no_config() -> None:
    """Trainer(job) runs from the ResolvedJob's typed options: its class never names a config, and its constructor
    takes the job alone (trainer.validate resolves every decision; train() holds the config)."""
    import inspect

    from trainer.run.train import Trainer

    assert config_reads((REPO / "trainer" / "run" / "train.py").read_text(encoding="utf-8"), "Trainer") == []
    assert list(inspect.signature(Trainer.__init__).parameters) == ["self", "job"]
    # The check sees a read reintroduced in any form.
    planted = "class Trainer:\n    def run(self):\n        return self.cfg.train.steps, JobConfig\n"
    assert sorted(config_reads(planted, "Trainer")) == ["3: JobConfig", "3: cfg"]


def test_below_the_trainer_nothing_takes_the_config() -> None:
    """The step, the pipeline, the builder, the checkpoint manager and the model never import trainer.config: they
    take narrow typed options (the validation pass resolves them)."""
    graph = import_graph()
    below = ["trainer.run.step", "trainer.parallel.pipeline", "trainer.parallel.pipeline_layout",
             "trainer.parallel.build", "trainer.parallel.apply", "trainer.checkpoint.manager",
             "trainer.checkpoint.options", "trainer.models.layers", "trainer.models.moe"]
    assert {m: sorted(d for d in graph[m] if d.startswith("trainer.config")) for m in below} == {m: [] for m in below}
