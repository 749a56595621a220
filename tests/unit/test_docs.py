"""Every cross-reference in the docs resolves: relative links to files that exist and to headings
they have, and the `docs/X.md#anchor` pointers that messages in the code print."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
_CODE_POINTER = re.compile(r"docs/([\w-]+\.md)#([\w-]+)")


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


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
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
                   "debug.md#shape-4-slow-steps-reading-the-profiler-summary", "benchmarks.md#fp8-vs-bf16-on-1x-h100"):
        assert target in targets, target
    shapes = [a for a in anchors(REPO / "docs" / "debug.md") if a.startswith("shape-")]
    assert sorted(a.split("-")[1] for a in shapes)[:4] == ["1", "2", "3", "4"]


def test_anchor_rules() -> None:
    page = REPO / "docs" / "benchmarks.md"
    assert "multi-gpu-1b-on-2x-h200-fsdp2-over-both-gpus" in anchors(page)
    assert "fp8-accuracy-vs-bf16-1b-real-text" in anchors(page)


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
