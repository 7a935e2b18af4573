"""Runs llama.cpp's `convert_hf_to_gguf.py` with pre-tokenizer check hashes it does not know mapped to rules it
has (docs/engines.md, "The pre-tokenizer"). A script of its own, run by `dflash.serving.llamacpp.convert_to_gguf`
in a fresh interpreter with the converter's sources and gguf-py on PYTHONPATH; it imports nothing of dflash.

    python llamacpp_convert.py '{"<check hash>": "gpt-2"}' <convert_hf_to_gguf.py> <converter args...>

The mapping is consulted before the converter's own table, and only for the hashes it lists: any other tokenizer
meets the converter's table (and its error) as it is. The converter's files are not changed.
"""
from __future__ import annotations

import ast
import inspect
import json
import os
import runpy
import sys
from hashlib import sha256


def check_text(get_vocab_base_pre) -> str:
    """The text llama.cpp hashes to recognise a pre-tokenizer: the literal `chktxt` in its function."""
    tree = ast.parse(inspect.cleandoc("\n" + inspect.getsource(get_vocab_base_pre)))
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "chktxt" for t in node.targets):
            return ast.literal_eval(node.value)
    raise RuntimeError("llama.cpp's get_vocab_base_pre has no `chktxt` literal: this converter is not the pinned one")


def install(mapping: dict[str, str]) -> None:
    from conversion.base import TextModel
    upstream = TextModel.get_vocab_base_pre
    chktxt = check_text(upstream)

    def get_vocab_base_pre(self, tokenizer) -> str:
        chkhsh = sha256(str(tokenizer.encode(chktxt)).encode()).hexdigest()
        if chkhsh in mapping:
            print(f"pre-tokenizer {chkhsh}: llama.cpp's {mapping[chkhsh]!r} rule (dflash mapping)", file=sys.stderr)
            return mapping[chkhsh]
        return upstream(self, tokenizer)

    TextModel.get_vocab_base_pre = get_vocab_base_pre


def main(argv: list[str]) -> None:
    mapping, converter, args = json.loads(argv[0]), argv[1], argv[2:]
    sys.path[:] = [p for p in sys.path if p != os.path.dirname(os.path.abspath(__file__))]  # not dflash/serving
    install(mapping)
    sys.argv = [converter, *args]
    runpy.run_path(converter, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
