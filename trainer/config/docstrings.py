"""The docstring under each field of a dataclass: what `--help` and docs/config.md say of each key (the [model] and
[moe] keys carry their model dataclass field's)."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass: read from its source, or a generated field's own."""
    docs = {f.name: f.metadata["doc"] for f in dataclasses.fields(cls) if "doc" in f.metadata}
    if docs:
        return docs
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    for node, nxt in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)):
            docs[node.target.id] = nxt.value.value.strip()
    return docs
