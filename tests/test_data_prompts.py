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
