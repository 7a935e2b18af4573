"""Header prompts: every function or class of a Python source that has a docstring, as a prompt made of
its header (decorators, `def`/`class` line(s)) and its docstring, dedented to column 0 — the same shape as
the hand-written `coding10` prompts, so that a code model continues it with the body.

`header_prompts(source, prefix)` yields `(name, prompt)` in source order. The name is `prefix` + the
qualified name (`Outer.method`), made of letters, digits, `_`, `.`, `-` only (the eval suites' task-name
rule); a repeated name (an `if/else` pair of definitions, a property setter) gets `-2`, `-3`, …. A source
that does not parse yields nothing. Standard library only (`ast`), so the CPU default needs no extra package.
"""
from __future__ import annotations

import ast
import re
from typing import Iterator

_DEFS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
_BAD_NAME_CHARS = re.compile(r"[^A-Za-z0-9_.\-]")


def _docstring_end(node) -> int | None:
    """1-based last line of the node's docstring, or None when it has none."""
    body = getattr(node, "body", None)
    if not body or not isinstance(body[0], ast.Expr):
        return None
    value = body[0].value
    if not (isinstance(value, ast.Constant) and isinstance(value.value, str)):
        return None
    return body[0].end_lineno


def _dedent(lines: list[str], col: int) -> str:
    """Removes `col` columns of leading whitespace (fewer where a docstring line has fewer)."""
    out = []
    for line in lines:
        lead = len(line) - len(line.lstrip(" \t"))
        out.append(line[min(col, lead):])
    return "\n".join(out).rstrip() + "\n"


def _walk(tree: ast.AST, qual: str = "") -> Iterator[tuple[str, ast.AST]]:
    """(qualified name, node) of every def/class, in source order, nested ones after their parent."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, _DEFS):
            name = f"{qual}.{node.name}" if qual else node.name
            yield name, node
            yield from _walk(node, name)
        else:  # defs under if / try / with blocks
            yield from _walk(node, qual)


def header_prompts(source: str, prefix: str = "") -> Iterator[tuple[str, str]]:
    """(name, prompt) for each function / class with a docstring in `source` (module docstring)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):  # ValueError: null bytes
        return
    lines = source.splitlines()
    seen: dict[str, int] = {}
    for qual, node in _walk(tree):
        end = _docstring_end(node)
        if end is None:
            continue
        start = min([node.lineno] + [d.lineno for d in node.decorator_list])
        name = _BAD_NAME_CHARS.sub("_", prefix + qual)
        seen[name] = seen.get(name, 0) + 1
        if seen[name] > 1:
            name = f"{name}-{seen[name]}"
        yield name, _dedent(lines[start - 1:end], node.col_offset)
