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
CUT_MARK = "@"  # `<name>@<k>`: a cut prompt's name (`header_prompts(cuts=...)`); no plain name holds it
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


# Nodes that can hold a def/class somewhere below them: statements (bodies of if / try / with / for …), except
# handlers and match cases. Expressions cannot (a lambda is not a def), and they are most of a tree's nodes:
# not descending into them made the walk over the installed corpus (17 K files) 10x faster.
_HOLDERS = (ast.stmt, ast.excepthandler, ast.match_case, ast.Module)


def _walk(tree: ast.AST, qual: str = "") -> Iterator[tuple[str, ast.AST]]:
    """(qualified name, node) of every def/class, in source order, nested ones after their parent."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, _DEFS):
            name = f"{qual}.{node.name}" if qual else node.name
            yield name, node
            yield from _walk(node, name)
        elif isinstance(node, _HOLDERS):  # defs under if / try / with blocks
            yield from _walk(node, qual)


def body_cuts(body_lines: int, cuts: int) -> list[int]:
    """How many body lines each of `cuts` cut prompts keeps after the docstring: evenly spaced through the body,
    at least one line, short of the whole body, no repeats (a 2-line body has room for one cut only)."""
    ks = {round(body_lines * i / (cuts + 1)) for i in range(1, cuts + 1)}
    return sorted(k for k in ks if 1 <= k < body_lines)


def documented_definitions(source: str, prefix: str = "") -> Iterator[tuple[str, ast.AST, list[str], int, int]]:
    """(name, node, lines, start, end) of each function / class with a docstring in `source`: its name
    (`<prefix><qualname>`, `-2`, `-3`, … on repeats), the source's lines, the first line of its decorators or header
    and its docstring's last line (1-based). A source that does not parse has none."""
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
        yield name, node, lines, start, end


def header_prompts(source: str, prefix: str = "", cuts: int = 0) -> Iterator[tuple[str, str]]:
    """(name, prompt) for each function / class with a docstring in `source` (module docstring). `cuts` > 0: after
    each such prompt, up to `cuts` more of the same definition, its header and docstring followed by the first k
    lines of its body (`body_cuts`; a cut that adds only blank lines is left out), named `<name>@<k>`: eval-shaped
    prompts at several points of one body, whose continuations are distinct sequences (data.pool.header_cuts)."""
    for name, node, lines, start, end in documented_definitions(source, prefix):
        last = _dedent(lines[start - 1:end], node.col_offset)
        yield name, last
        for k in body_cuts(node.end_lineno - end, cuts) if cuts else ():
            prompt = _dedent(lines[start - 1:end + k], node.col_offset)
            if prompt != last:  # a cut that adds only blank lines is the prompt before it
                yield f"{name}{CUT_MARK}{k}", prompt
                last = prompt


def headers_of_sources(items: list[tuple[str, str]], cuts: int = 0) -> list[tuple[str, str]]:
    """(name, prompt) of the header prompts of each (source, prefix), in order (a worker's share in
    `parallel_header_prompts`)."""
    return [x for text, prefix in items for x in header_prompts(text, prefix, cuts)]


# Below this many files the pool of worker processes costs more than it saves (spawning one takes ~0.1 s).
PARALLEL_MIN_FILES = 2000


def parallel_header_prompts(items: list[tuple[str, str]], workers: int | None = None,
                            cuts: int = 0) -> list[tuple[str, str]]:
    """`headers_of_sources(items)`, the files parsed by `workers` processes (default: the machine's cores) when
    there are many: `ast.parse` is most of building the installed corpus's pool (17 K files, minutes on one
    core). Same prompts, same order, as one process."""
    import logging
    import os
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool
    from functools import partial
    from multiprocessing import get_context
    workers = workers or os.cpu_count() or 1
    if workers < 2 or len(items) < PARALLEL_MIN_FILES:
        return headers_of_sources(items, cuts)
    step = max(1, len(items) // (workers * 8))
    shares = [items[i:i + step] for i in range(0, len(items), step)]
    try:  # spawn, not fork: the caller may hold a CUDA context and producer threads
        with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
            return [p for share in pool.map(partial(headers_of_sources, cuts=cuts), shares) for p in share]
    except (OSError, RuntimeError, BrokenProcessPool) as e:  # e.g. a __main__ that cannot be re-imported
        logging.getLogger(__name__).warning("prompt pool: parallel parsing failed (%s); parsing in this process", e)
        return headers_of_sources(items, cuts)
