"""Every cross-reference in the docs resolves: relative links to files that exist and to headings
they have (the dated benchmark records in docs/benchmarks/ included), and the `docs/X.md#anchor` pointers
that messages in the code print."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# The pages that describe the code as it is; their commands, keys, files and quoted lines are held to it below.
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# Dated benchmark records: what ran on that date, with that day's commands and file names. Their links are checked;
# what they quote is history, not held to today's code.
RECORDS = sorted((REPO / "docs" / "benchmarks").glob("*.md"))
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
_CODE_POINTER = re.compile(r"docs/((?:benchmarks/)?[\w-]+\.md)#([\w-]+)")


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation other than - and _ dropped, spaces to -,
    a repeated heading numbered -1, -2, ..."""
    seen: dict[str, int] = {}
    out = set()
    in_code = False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code or not (m := re.match(r"#{1,6} +(.*?) *#*$", line)):
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # links inside code blocks are not links
    return [t for t in _LINK.findall(text) if not re.match(r"[a-z]+:", t)]  # skip http:, https:, mailto:


@pytest.mark.parametrize("page", PAGES + RECORDS, ids=lambda p: p.name)
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target} (no heading #{anchor} in {dest.name})")
    assert not broken, f"{page.name}: {broken}"


def test_code_points_at_headings_that_exist() -> None:
    broken = []
    for source in [*(REPO / "trainer").rglob("*.py"), *(REPO / "scripts").glob("*.py")]:
        for page, anchor in _CODE_POINTER.findall(source.read_text()):
            if anchor not in anchors(REPO / "docs" / page):
                broken.append(f"{source.relative_to(REPO)}: docs/{page}#{anchor}")
    assert not broken


def test_the_fp8_page_points_to_the_sections_it_names() -> None:
    targets = set(links(REPO / "docs" / "fp8.md"))
    for target in ("distributed.md#fp8", "debug.md#shape-1-loss-diverges-early",
                   "debug.md#shape-4-slow-steps-reading-the-profiler-summary",
                   "benchmarks/2026-11-22-h100-and-2x-h200.md#fp8-vs-bf16-on-1x-h100"):
        assert target in targets, target
    shapes = [a for a in anchors(REPO / "docs" / "debug.md") if a.startswith("shape-")]
    assert sorted(a.split("-")[1] for a in shapes)[:4] == ["1", "2", "3", "4"]


def test_anchor_rules() -> None:
    page = REPO / "docs" / "benchmarks" / "2026-11-22-h100-and-2x-h200.md"
    assert "multi-gpu-1b-on-2x-h200-fsdp2-over-both-gpus" in anchors(page)
    assert "fp8-accuracy-vs-bf16-1b-real-text" in anchors(page)
    assert "fp8-format-and-mixed_precision--auto" in anchors(RECORDS[0].parent / "2026-11-26-h100-fp8-format-document-masking-cold-start.md")


# -- the docs against behaviour ------------------------------------------------------------------

_OVERRIDE = re.compile(r"--([a-z][a-z0-9]*)\.([a-z][a-z0-9_]*)\b")
_SECTION_KEY = re.compile(r"`([a-z][a-z0-9]*)\.([a-z][a-z0-9_]*)( = [^`]+)?`")
_FILE_SUFFIXES = {"json", "jsonl", "safetensors", "py", "sbatch", "toml", "md", "txt", "bin"}  # metrics.jsonl
_PATH = re.compile(r"\b((?:configs/train|scripts|trainer|tests)/[\w/.-]+\.(?:toml|py|sh))\b")


def _all_text() -> list[tuple[str, str]]:
    return [(page.name, page.read_text()) for page in PAGES]


def test_every_override_and_key_the_docs_name_exists() -> None:
    """`--section.key` and `section.key` in the docs are config keys (a renamed key leaves no stale doc)."""
    import dataclasses

    from trainer.config import JobConfig

    defaults = JobConfig()
    fields = {s.name: {f.name for f in dataclasses.fields(getattr(defaults, s.name))} for s in dataclasses.fields(defaults)}
    unknown = set()
    for name, text in _all_text():
        for section, key in _OVERRIDE.findall(text):
            if section in fields and key not in fields[section]:
                unknown.add(f"{name}: --{section}.{key}")
        for section, key, _ in _SECTION_KEY.findall(text):
            if section in fields and key not in fields[section] and key not in _FILE_SUFFIXES:
                unknown.add(f"{name}: {section}.{key}")
    assert not unknown, sorted(unknown)


def test_every_file_the_docs_name_exists() -> None:
    missing = {f"{name}: {path}" for name, text in _all_text() for path in _PATH.findall(text)
               if not (REPO / path).exists() and "*" not in path}
    assert not missing, sorted(missing)


def test_readme_says_how_ci_installs_torch() -> None:
    """The README's claim about .ci/run is .ci/run's own torch pin."""
    pin = re.search(r'"(torch==[\d.]+)"', (REPO / ".ci" / "run").read_text()).group(1)
    assert f"`.ci/run` pins `{pin}`" in (REPO / "README.md").read_text()


def test_the_readme_map_names_every_room() -> None:
    """The README's map names every script, every package of trainer/ and every file directly in it, each at the
    start of a line of the map's code block."""
    readme = (REPO / "README.md").read_text()
    block = readme.split("## Map of the code", 1)[1].split("```")[1]
    named = {line.split()[0].rstrip("/") for line in block.splitlines() if line and not line.startswith(" ")}
    rooms = {str(p.relative_to(REPO)) for p in (REPO / "trainer").iterdir()
             if p.name != "__init__.py" and (p.suffix == ".py" or (p / "__init__.py").exists())}
    rooms |= {str(p.relative_to(REPO)) for p in (REPO / "scripts").iterdir() if p.suffix in (".py", ".sh")}
    assert sorted(rooms - named) == [], "add to the README's map"
    assert sorted(n for n in named - rooms if not (REPO / n).exists()) == [], "the map names what is not there"


def test_the_fp8_headline_is_the_latest_sitting() -> None:
    """README's table, docs/benchmarks.md and docs/fp8.md quote one comparison (1x H100, 8B shapes x 8 layers, fp8 vs
    bf16): the figures of one record's table, read from it, and each links to it (they once said 1.37x and 1.31x)."""
    record = "benchmarks/2026-11-25-h100-cold-start-and-throughput.md#throughput-what-moved-and-what-did-not"
    path, _, anchor = record.partition("#")
    text = (REPO / "docs" / path).read_text()
    table = text[text.index("The defaults after these levers"):]
    table = table[:table.index("\n\n", table.index("| fp8 tensorwise"))]  # that table only
    tflops = {m.group(1): float(m.group(2)) for m in
              re.finditer(r"^\| (bf16|fp8 tensorwise) \| [\d.]+ \| [\d,]+ \| \**([\d.]+)\** \|", table, flags=re.M)}
    fp8, bf16 = tflops["fp8 tensorwise"], tflops["bf16"]
    quoted = f"{fp8:.1f}", f"{bf16:.1f}", f"{fp8 / bf16:.2f}x", record
    readme = (REPO / "README.md").read_text()
    row = next(line for line in readme.splitlines() if line.startswith("| FP8 vs bf16, 1x H100,"))
    page = next(line for line in (REPO / "docs" / "benchmarks.md").read_text().splitlines() if line.startswith("| 1x H100 |"))
    when = next(line for line in (REPO / "docs" / "fp8.md").read_text().splitlines()
                if line.startswith("| H100 / H200 (compute capability 9.0), compiled, large GEMMs |"))
    for where, body in (("README's table", row), ("benchmarks.md's table", page), ("fp8.md's 'When it helps' row", when)):
        assert [q for q in quoted if q not in body] == [], where
    assert anchor in anchors(REPO / "docs" / path)


def test_the_benchmarks_page_is_current_numbers_and_dated_records() -> None:
    """docs/benchmarks.md is a page of current tables (not a lab notebook) that lists every dated record; each record
    says when, on what, with which software and commands, and where its raw data is (or that none was kept)."""
    page = (REPO / "docs" / "benchmarks.md").read_text()
    assert len(page.splitlines()) < 400
    assert RECORDS and [r.name for r in RECORDS if f"(benchmarks/{r.name})" not in page] == []
    for record in RECORDS:
        text = record.read_text()
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}-[a-z0-9-]+\.md", record.name), record.name
        assert f"- **Date:** {record.name[:10]}" in text, record.name
        for field in ("- **Device:** ", "- **Software:** ", "- **Raw data:** "):
            assert field in text, f"{record.name}: {field}"
        raw = text[text.index("- **Raw data:** "):].split("\n- ")[0]
        assert "](../benchmark_data/" in raw or "not kept" in raw, record.name
        assert "```" in text or "scripts/gpu_checks.sh" in text, f"{record.name}: no command"


_TEAM_WORDS = re.compile(r"\bissues? \d+|\(issue|\bthis session\b|\blease\b|\bsittings?\b|\bhelper\b|device tools?", re.I)


def test_the_benchmark_docs_are_written_for_readers() -> None:
    """The README and the benchmark pages speak to someone who has only the repository: no issue numbers or work-log
    words (a "lease", "this session"); a measurement names its machine and date instead."""
    found = [f"{page.relative_to(REPO)}: {m.group(0)!r}" for page in [REPO / "README.md", REPO / "docs" / "benchmarks.md",
                                                                    *RECORDS]
             for m in _TEAM_WORDS.finditer(page.read_text())]
    assert found == []


def test_the_fp8_converted_table_names_the_experts_option() -> None:
    """The table of what FP8 converts says how the routed experts are converted (float8.moe_experts)."""
    text = (REPO / "docs" / "fp8.md").read_text()
    row = next(line for line in text.splitlines() if line.startswith("| MoE routed experts"))
    assert "float8.moe_experts" in row and "#fp8-routed-experts" in row, row


def test_every_data_source_is_listed() -> None:
    """docs/data.md's Sources list has every choice of data.source."""
    import typing

    from trainer.config.sections import DataSection

    text = (REPO / "docs" / "data.md").read_text()
    choices = typing.get_args(typing.get_type_hints(DataSection)["source"])
    assert [c for c in choices if f"\n- `{c}` —" not in text] == []


def test_help_names_every_parallel_degree() -> None:
    """`train.py --help`'s [distributed] line (and docs/config.md's) names every degree of ParallelDims."""
    import dataclasses

    from trainer.config.sections import SECTION_HELP
    from trainer.parallel.parallel_dims import ParallelDims

    degrees = [f.name for f in dataclasses.fields(ParallelDims) if f.type in (int, "int") and f.name != "world_size"]
    assert len(degrees) == 6 and [d for d in degrees if d not in SECTION_HELP["distributed"]] == []


# Scripts whose `--help` is quick (no torch import) and that the docs give commands for.
_HELP_SCRIPTS = ("prepare_data", "build_tokenizer", "convert_checkpoint", "fp8_parity", "generate", "summarize_trace")
_SCRIPT_CMD = re.compile(r"scripts/(" + "|".join(_HELP_SCRIPTS) + r")\.py\b([^\n`|;#]*)")
_FLAG = re.compile(r"(?<![\w-])--([a-z][a-z0-9-]*)(?![\w.-])")


def test_every_script_flag_the_docs_use_exists() -> None:
    """The flags in the docs' commands for these scripts are options of theirs (of the subcommand, where the
    script has subcommands), from the scripts' own --help: a renamed flag leaves no stale command."""
    import subprocess
    import sys

    used: dict[tuple[str, str], set[str]] = {}
    for name, text in _all_text():
        for script, rest in _SCRIPT_CMD.findall(text.replace("\\\n", " ")):
            words = rest.split()
            sub = words[0] if words and re.fullmatch(r"[a-z]+", words[0]) else ""
            used.setdefault((script, sub), set()).update(f"{name}: --{f}" for f in _FLAG.findall(rest))
    assert {s for s, _ in used} >= {"prepare_data", "build_tokenizer"}
    unknown = []
    for (script, sub), flags in used.items():
        cmd = [sys.executable, str(REPO / "scripts" / f"{script}.py"), *([sub] if sub else []), "--help"]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, (cmd, out.stderr[-500:])
        known = set(re.findall(r"--[a-z][a-z0-9-]*", out.stdout))
        unknown += [f for f in flags if f.split(": ")[1] not in known]
    assert not unknown, sorted(unknown)


def _sbatch_train_args(text: str, variables: dict[str, str]) -> list[str]:
    """The scripts/train.py arguments of the sbatch script on docs/cluster.md, with its shell variables set."""
    import shlex

    script = next(b for b in re.findall(r"```bash\n(.*?)```", text, flags=re.S) if "#SBATCH" in b)
    command = next(line for line in script.replace("\\\n", " ").splitlines() if "scripts/train.py" in line)
    command = re.sub(r"\$\{?(\w+)\}?", lambda m: variables[m.group(1)], command.split("scripts/train.py", 1)[1])
    return shlex.split(command)


def test_the_cluster_sbatch_validates_at_16_gpus(tmp_path: Path, on_h100) -> None:
    """docs/cluster.md's sbatch command, as written, passes the whole validation pass at 16 ranks: its keys and
    values, Llama 3-sized shards (ids up to 128,255, uint32) under the tokenizer check, enough data for a
    global batch and for its validation steps. And its stop settings agree: SLURM's signal comes at least
    torchrun's shutdown timeout before the end."""
    import numpy as np

    from trainer.config import load_job_config
    from trainer.data import write_shard
    from trainer.data.tokenizer import tokenizer_fingerprint
    from trainer.validate import validate_job

    text = (REPO / "docs" / "cluster.md").read_text()
    data = tmp_path / "data"
    (data / "train").mkdir(parents=True)
    (data / "validation").mkdir()
    (data / "tokenizer.json").write_text('{"stand-in": "only its sha256 is checked at training time"}')
    fingerprint = tokenizer_fingerprint(str(data / "tokenizer.json"))
    rng = np.random.default_rng(0)
    # One step needs 8 x 2 x 16 = 256 windows of 4,097 tokens; 4 validation steps 4 x 8 x 16 = 512.
    for folder, windows in (("train", 256), ("validation", 512)):
        tokens = rng.integers(0, 128_256, windows * 4096 + 1, dtype=np.uint32)
        write_shard(data / folder / "shard_00000.bin", tokens, vocab_size=128_256, tokenizer_fingerprint=fingerprint)
    args = _sbatch_train_args(text, {"DATA": str(data), "RUN": str(tmp_path / "run")})
    cfg = load_job_config(args)
    assert cfg.validation.enable and cfg.data.tokenizer == str(data / "tokenizer.json")
    job = validate_job(cfg, world_size=16)
    assert job.parallel_dims.dp_shard == 16 and job.validation_source is not None and job.build.float8 is not None
    # The header lines the page says are computed from the config by the same code: the precision line.
    from trainer.validate.run_files import describe_precision

    precision = describe_precision(mixed_precision=job.run.mixed_precision, bf16_update=job.optimizer.bf16_update,
                                   build=job.build, float8_layers=job.float8_layers)
    assert f"`{precision}`" in text, precision

    signal_lead = int(re.search(r"#SBATCH --signal=TERM@(\d+)", text).group(1))
    shutdown = int(re.search(r"export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=(\d+)", text).group(1))
    assert shutdown > 30 and signal_lead >= shutdown


# -- log lines and errors the docs quote, against the program -------------------------------------------------------
# The dated records (docs/benchmarks/) quote the logs of their day as they were printed: they are not in PAGES.
_QUOTING = PAGES


def _quotes(text: str, start: str) -> list[str]:
    """Each quote of a line beginning `start`: inline code (wrapped lines joined) or a line of a code block (its
    `[rank0 ...]` prefix dropped). A bare mention (`start` alone) is not a quote."""
    inline = [" ".join(q.split()) for q in re.findall(r"`(" + re.escape(start) + r"[^`]*)`", text)]
    blocks = "\n".join(re.findall(r"```[^\n]*\n(.*?)```", text, flags=re.S))
    block = re.findall(r"^\s*(?:\[rank\d+ +[\d.]+s\] )?(" + re.escape(start) + r".*)$", blocks, flags=re.M)
    return [q for q in inline + block if q.strip() != start.strip()]


def _matches(quote: str, real: str) -> bool:
    """The quote is the real line, `...` standing for any text it leaves out."""
    return re.fullmatch(".*".join(re.escape(part) for part in quote.split("...")), real) is not None


def test_quoted_float8_startup_lines_are_what_the_program_prints() -> None:
    """Every `Applied Float8 training: ...` the docs quote is a line the Linears' converter prints (for some recipe, all-gather,
    format and scaling): the docs once quoted it without its `, format=...`."""
    import itertools

    from trainer.parallel.float8 import DelayedScalingSettings, Float8Options, float8_converters

    real = [float8_converters(Float8Options(recipe=recipe, enable_fsdp_float8_all_gather=gather, format=fmt,
                                            delayed=delayed, save_fp8_activations=save, forward=forward,
                                            backward=backward))[0].lines()[0]
            for recipe, gather, fmt, delayed, save, (forward, backward) in itertools.product(
                ("tensorwise", "rowwise", "rowwise_with_gw_hp", "blockwise"), (True, False), ("hybrid", "e4m3"),
                (None, DelayedScalingSettings()), (False, True), (("fp8", "fp8"), ("bf16", "fp8"), ("fp8", "bf16")))]
    quotes = [(page.name, q) for page in _QUOTING for q in _quotes(page.read_text(), "Applied Float8 training: ")]
    assert len(quotes) >= 8  # README, fp8.md, debug.md, checkpointing.md, cluster.md
    stale = [f"{name}: {q}" for name, q in quotes if not any(_matches(q, line) for line in real)]
    assert not stale, stale


def test_quoted_not_one_of_errors_are_what_the_config_says() -> None:
    """A quoted `section.key='value' is not one of ...` error is the config's own message for that value (the docs
    once listed float8.recipe's choices without 'blockwise')."""
    from trainer.config import load_job_config
    from trainer.errors import ConfigError

    quoted = [(page.name, m.group(0), m.group(1), m.group(2)) for page in _QUOTING
              for m in re.finditer(r"([a-z0-9_]+\.[a-z0-9_]+)='([^']*)' is not one of [^`|]*", page.read_text())]
    assert len(quoted) >= 2
    stale = []
    for name, quote, key, value in quoted:
        try:
            load_job_config([f"--{key}={value}"])
            stale.append(f"{name}: {quote} (accepted)")
        except ConfigError as e:
            if str(e) != quote.strip():
                stale.append(f"{name}: {quote!r} != {str(e)!r}")
    assert not stale, stale


def test_the_1b_rows_say_what_the_flavor_is() -> None:
    """The `1b` flavor has Llama 3.2 1B's layers with an untied head: the README's row gives its parameters and the
    published tied model's, from the shapes (the docs once said "Llama 3.2 1B shapes" of a 1.50B model)."""
    import dataclasses

    from trainer.models.counts import num_params_for
    from trainer.models import FLAVORS

    untied, _ = num_params_for(FLAVORS["1b"])
    tied, _ = num_params_for(dataclasses.replace(FLAVORS["1b"], tie_word_embeddings=True))
    row = next(line for line in (REPO / "README.md").read_text().splitlines()
               if line.startswith("| `configs/train/llama3_1b.toml` |"))
    assert not FLAVORS["1b"].tie_word_embeddings
    assert f"{untied / 1e9:.2f}B parameters" in row and f"{tied / 1e9:.2f}B" in row, row
    assert "--model.tie_word_embeddings=true" in row


def test_what_the_docs_commands_write_in_the_checkout_is_git_ignored() -> None:
    """A relative `--output` of the docs' data commands, and the folders their shell lines make, are git-ignored:
    run from the checkout as written, they leave `git status` clean (docs/data.md's mixture once wrote data/)."""
    import subprocess

    written = set()
    for _, text in _all_text():
        text = text.replace("\\\n", " ")
        written |= set(re.findall(r"scripts/(?:prepare_data|build_tokenizer)\.py [^\n`]*?--output[ =]([\w./-]+)", text))
        written |= set(re.findall(r"mkdir -p ([\w./-]+)", text))
        written |= set(re.findall(r"> (data/[\w./-]+)", text))
    written = {w for w in written if not w.startswith(("/", "$", "~"))}
    assert {"data/shards", "data/mix/docs", "data/raw/code"} <= written, written
    proc = subprocess.run(["git", "-C", str(REPO), "check-ignore", "--no-index", *sorted(written)],
                          capture_output=True, text=True)
    if proc.returncode == 128:
        pytest.skip("not a git checkout")
    assert sorted(written - set(proc.stdout.split())) == []


def test_the_edit_selection_names_tests_that_exist() -> None:
    """tests/edit.args, the README's edit-test selection (`pytest @tests/edit.args`): every test it adds exists, and
    every name its -k leaves out matches a test, so a renamed test cannot slip back in unnoticed and slow it down."""
    args = (REPO / "tests" / "edit.args").read_text().splitlines()
    assert "python -m pytest -q @tests/edit.args" in (REPO / "README.md").read_text()
    for arg in (a for a in args if a.startswith("tests/")):
        path, _, name = arg.partition("::")
        assert (REPO / path).exists(), arg
        assert not name or f"def {name}(" in (REPO / path).read_text(), arg
    left_out = set(re.findall(r"\w+", args[args.index("-k") + 1])) - {"not", "or", "and"}
    defined = {name for source in (REPO / "tests").rglob("test_*.py")
               for name in re.findall(r"^def (test_\w+)\(", source.read_text(), flags=re.M)}
    assert left_out and sorted(n for n in left_out if not any(n in d for d in defined)) == []


_FULL_8B = ["--config", "configs/train/llama3_8b.toml", "--train.batch_size=4", "--train.seq_len=4096",
            "--train.activation_checkpointing=none", "--train.compile_model=true"]
# The multi-GPU plans the pages quote (nothing of these ran on their GPUs, so the plan is all a reader has): each
# (page, the quote with {} for the GiB, the job's arguments, its world size) is today's dry run, rounded to 0.1 GiB.
# A change to the plan or to a default that moves one fails here until the page says the new figure.
QUOTED_PLANS = [
    ("docs/fp8.md", "({} GiB per GPU, 15.0 GiB of it", ["--config", "configs/train/7b_16gpu_fp8.toml"], 16),
    ("docs/benchmarks.md", "planned at {} GiB per GPU (`--dry-run --world-size 16`)",
     ["--config", "configs/train/7b_16gpu_fp8.toml"], 16),
    ("docs/models.md", "plans {} GiB per GPU", ["--config", "configs/train/deepseek_v3_16b_16gpu_fp8.toml"], 16),
    ("configs/train/deepseek_v3_16b_16gpu_fp8.toml", "the dry run plans {} GiB per GPU",
     ["--config", "configs/train/deepseek_v3_16b_16gpu_fp8.toml"], 16),
    ("README.md", "planned by the dry run at {} GiB per GPU",
     ["--config", "configs/train/deepseek_v3_16b_16gpu_fp8.toml"], 16),
    ("docs/moe.md", "at 8, ep=8, it plans {} GiB per GPU",
     ["--config", "configs/train/moe_16b_4gpu_fp8.toml", "--distributed.ep=8"], 8),
    ("docs/benchmarks.md", "its ep=8 job is planned by dry run at {} GiB per GPU",
     ["--config", "configs/train/moe_16b_4gpu_fp8.toml", "--distributed.ep=8"], 8),
    ("docs/benchmarks.md", "planned by dry run at {} GiB per GPU at 128K tokens",
     ["--config", "configs/train/llama3_8b_128k_cp8.toml"], 8),
    ("docs/benchmarks.md", "({} / ", [*_FULL_8B, "--train.mixed_precision=bf16"], 4),
    ("docs/benchmarks.md", "/ {} GiB per GPU bf16 / fp8 at 4 GPUs", [*_FULL_8B, "--train.mixed_precision=fp8"], 4),
    ("docs/benchmarks.md", "at 4 GPUs, {} / ", [*_FULL_8B, "--train.mixed_precision=bf16"], 8),
    ("docs/benchmarks.md", " / {} at 8: today's defaults", [*_FULL_8B, "--train.mixed_precision=fp8"], 8),
]


@pytest.mark.parametrize("page, quote, argv, world_size", QUOTED_PLANS,
                         ids=[f"{p}:{q[:24]}:{n}" for p, q, _, n in QUOTED_PLANS])
def test_the_plans_the_pages_quote_are_todays_dry_run(page: str, quote: str, argv: list[str], world_size: int) -> None:
    from trainer.config import load_job_config
    from trainer.validate import validate_job
    from trainer.validate.memory import planned_gpus
    from trainer.validate.plan import GIB

    job = validate_job(load_job_config([*argv, "--data.source=synthetic"]), world_size=world_size,
                       target=planned_gpus(1000))
    planned = quote.format(f"{job.memory_plan.peak_bytes / GIB:.1f}")
    if planned not in (REPO / page).read_text().replace("\n", " "):
        pytest.fail(f"{page} should quote {planned!r} (the dry run of {' '.join(argv)} for {world_size} ranks)")
