"""Header + docstring prompts (dflash.data.prompts) from source text."""
from __future__ import annotations

import re
import sysconfig
from pathlib import Path

from dflash.data.prompts import header_prompts

SRC = '''"""Module docstring."""
import os


@staticmethod
def top(a: int,
        b: int) -> int:
    """Add two numbers.

    Returns a + b.
    """
    return a + b


def nodoc(x):
    return x


class Box:
    """A box."""

    def put(self, item):
        """Put an item in."""
        self.item = item

    if os.name == "nt":
        def get(self):
            """Windows get."""
    else:
        def get(self):
            """Posix get."""

    async def fetch(self):
        """Fetch async."""
'''


def test_headers_with_docstrings_in_source_order():
    got = list(header_prompts(SRC, prefix="m."))
    assert [n for n, _ in got] == ["m.top", "m.Box", "m.Box.put", "m.Box.get", "m.Box.get-2", "m.Box.fetch"]
    prompts = dict(got)
    assert prompts["m.top"] == ('@staticmethod\ndef top(a: int,\n        b: int) -> int:\n'
                                '    """Add two numbers.\n\n    Returns a + b.\n    """\n')
    assert prompts["m.Box"] == 'class Box:\n    """A box."""\n'
    assert prompts["m.Box.put"] == 'def put(self, item):\n    """Put an item in."""\n'  # dedented to column 0
    assert prompts["m.Box.get-2"] == 'def get(self):\n    """Posix get."""\n'
    assert prompts["m.Box.fetch"].startswith("async def fetch(self):")


def test_unparsable_or_docless_source_yields_nothing():
    assert list(header_prompts("def broken(:\n")) == []
    assert list(header_prompts("def f():\n    return 1\n")) == []
    assert list(header_prompts("x = '\\0'\0")) == []


def test_names_follow_the_suite_rule_on_a_real_file():
    text = (Path(sysconfig.get_paths()["stdlib"]) / "json" / "decoder.py").read_text()
    got = list(header_prompts(text, prefix="json/decoder.py:"))
    assert len(got) >= 3
    names = [n for n, _ in got]
    assert len(set(names)) == len(names)
    assert all(re.fullmatch(r"[A-Za-z0-9_.\-]+", n) for n in names)
    for _, p in got:
        compile(p + "    pass\n", "<prompt>", "exec")  # a header + docstring, completable by a body


def _walk_every_node(tree, qual=""):
    """The plain reference: descend into every node (what `_walk` did before it skipped expressions)."""
    import ast
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = f"{qual}.{node.name}" if qual else node.name
            yield name, node
            yield from _walk_every_node(node, name)
        else:
            yield from _walk_every_node(node, qual)


def test_the_walk_skipping_expressions_finds_every_def_the_full_walk_finds():
    import ast
    import sysconfig
    from pathlib import Path

    from dflash.data.prompts import _walk
    src = '''
if True:
    def a(): "doc"
else:
    class B:
        "doc"
        async def c(self): "doc"
try:
    def d(): "doc"
except ValueError:
    def e(): "doc"
finally:
    def f(): "doc"
with open("x") as fh:
    for i in range(3):
        while False:
            def g(): "doc"
match x:
    case 1:
        def h(): "doc"
def outer():
    "doc"
    class Inner:
        def m(self): "doc"
    return lambda: None
'''
    names = lambda tree, walk: [(q, n.lineno) for q, n in walk(tree)]  # noqa: E731
    tree = ast.parse(src)
    assert names(tree, _walk) == names(tree, _walk_every_node)
    assert [q for q, _ in _walk(tree)] == ["a", "B", "B.c", "d", "e", "f", "g", "h", "outer", "outer.Inner",
                                           "outer.Inner.m"]
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:60]:
        tree = ast.parse(path.read_text(errors="replace"))
        assert names(tree, _walk) == names(tree, _walk_every_node), path


def test_parallel_header_prompts_are_the_single_process_ones(caplog):
    from dflash.data.prompts import headers_of_sources, parallel_header_prompts
    items = [(f"def f{i}(x):\n    \"\"\"Doc {i}.\"\"\"\n    return x\n", f"m{i}.py:") for i in range(40)]
    assert parallel_header_prompts(items, workers=2) == headers_of_sources(items)  # below the file threshold
    import dflash.data.prompts as P
    old = P.PARALLEL_MIN_FILES
    P.PARALLEL_MIN_FILES = 10
    try:
        assert parallel_header_prompts(items, workers=2) == headers_of_sources(items)  # through two processes
        assert "parallel parsing failed" not in caplog.text  # the processes ran, no fallback
    finally:
        P.PARALLEL_MIN_FILES = old


def test_encode_many_gives_the_tokenizers_own_ids():
    """The pool encodes through the fast tokenizer's Rust batch (no per-text conversion): the same ids as the
    tokenizer's own call, so pools built before and after match their fingerprints."""
    from pathlib import Path

    from transformers import AutoTokenizer

    import dflash
    from dflash.data.pool import encode_many
    tok = AutoTokenizer.from_pretrained(Path(dflash.__file__).parent / "assets/reference_target", local_files_only=True)
    assert tok.backend_tokenizer is not None
    texts = ["def f(x):\n    return x + 1\n", "  \u00e9t\u00e9 caf\u00e9 \u2192 ", "", "class A:\n\t\"\"\"Doc.\"\"\"\n" * 3]
    want = [list(ids) for ids in tok(texts, add_special_tokens=False)["input_ids"]]
    assert encode_many(tok, texts) == want and all(isinstance(i, int) for ids in want for i in ids)


def test_body_cuts_against_a_plain_reference():
    from dflash.data.prompts import body_cuts

    def reference(body, cuts):  # every cut point by hand: i / (cuts + 1) of the body, rounded, kept if 1..body-1
        out = []
        for i in range(1, cuts + 1):
            k = round(body * i / (cuts + 1))
            if 1 <= k < body and k not in out:
                out.append(k)
        return sorted(out)
    for body in range(0, 30):
        for cuts in range(0, 6):
            assert body_cuts(body, cuts) == reference(body, cuts), (body, cuts)
    assert body_cuts(8, 3) == [2, 4, 6] and body_cuts(2, 3) == [1] and body_cuts(1, 3) == []


def test_header_cuts_add_the_header_with_the_first_body_lines():
    src = ('class Bag:\n    """A bag."""\n\n    def add(self, x):\n        """Add x."""\n        y = x + 1\n'
           '        z = y * 2\n        w = z - 3\n        return w\n')
    got = dict(header_prompts(src, prefix="m.", cuts=3))
    base = dict(header_prompts(src, prefix="m."))
    assert {n: p for n, p in got.items() if "@" not in n} == base  # the plain prompts, unchanged
    assert got["m.Bag.add@1"] == 'def add(self, x):\n    """Add x."""\n    y = x + 1\n'
    assert got["m.Bag.add@2"] == 'def add(self, x):\n    """Add x."""\n    y = x + 1\n    z = y * 2\n'
    assert got["m.Bag.add@3"].endswith("    w = z - 3\n") and "m.Bag.add@4" not in got  # never the whole body
    bag = [n for n in got if n.startswith("m.Bag@")]  # the class body: 7 lines after its docstring, the first blank
    assert bag == ["m.Bag@2", "m.Bag@4", "m.Bag@5"]
    assert [n for n, _ in header_prompts(src, cuts=1)] == ["Bag", "Bag@4", "Bag.add", "Bag.add@2"]
    blank_only = 'class A:\n    """Doc."""\n\n    x = 1\n'  # its one cut would add only the blank line
    assert [n for n, _ in header_prompts(blank_only, cuts=1)] == ["A"]
    assert list(got)[:2] == ["m.Bag", "m.Bag@2"]  # each definition's cuts follow its own prompt


def test_human_continuations_are_the_rest_of_each_header_prompts_definition():
    from dflash.data.prompts import header_prompts
    from dflash.evaluation.heldout import human_continuations
    src = 'def f(x):\n    """Doc."""\n    return x + 1\n\n\nclass A:\n    """A doc."""\n    def g(self):\n' \
          '        """g doc."""\n        return 2\n\n\ndef f(y):\n    """Again."""\n    return y\n'
    prompts = dict(header_prompts(src, "m."))
    human = human_continuations(src, "m.")
    assert set(human) == set(prompts) == {"m.f", "m.A", "m.A.g", "m.f-2"}  # the same names, repeats numbered alike
    assert human["m.f"] == "    return x + 1\n" and human["m.A.g"] == "    return 2\n"
    assert prompts["m.A.g"] + human["m.A.g"] == 'def g(self):\n    """g doc."""\n    return 2\n'
