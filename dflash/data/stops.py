"""Where a code continuation ends besides its stop token (docs/evaluation.md, "Ground truth that ends"): at a stop
sequence (HumanEval's "\\ndef ", "\\nclass ", "\\nif __name__", "\\nprint(", "\\n#") or at the dedent below the
prompt's body (the first non-empty line indented below it: the function being written is over).

Both rules read text, the continuation's tokens decoded; the continuation ends with the token that completes
the rule's text (as it ends with its stop token): an engine has sampled that token before its stop check fires,
so its rounds are the served ones. Both are causal (a prefix of the text decides them), so the real decoding loop
stops where the ground truth ends. `dflash.data.writing.first_end` is the one cut: stop token, then these rules.

- `CodeStop`: a suite's rule (`eval.stop`): its stop sequences and whether it ends at the dedent.
- `TextEnd`: one prompt's rule: the prompt's last line (`lead`: a stop sequence may begin there, a dedent is
  measured from its line starts) and the body's indentation (`dedent_below`), with the tokenizer's `decode`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

END_REASONS = ("eos", "stop", "dedent", "length")  # why a continuation ended: stop token, sequence, dedent, cap


def indent_of(line: str) -> int:
    """Columns of a line's leading whitespace (tabs to multiples of 8, as Python's tokenizer counts them)."""
    line = line.expandtabs(8)
    return len(line) - len(line.lstrip())


def body_indent(prompt: str) -> int:
    """The indentation a line must reach to stay inside the prompt's body: its last non-empty line's, one column
    more when that line opens a block (`def f():` with no docstring yet)."""
    lines = [ln for ln in prompt.split("\n") if ln.strip()]
    if not lines:
        return 0
    last = lines[-1]
    return indent_of(last) + (1 if last.rstrip().endswith(":") else 0)


@dataclass(frozen=True)
class TextEnd:
    """One prompt's text rule (module doc). `decode(ids) -> str` decodes continuation tokens."""
    decode: Callable[[Sequence[int]], str] = field(compare=False)
    sequences: tuple[str, ...] = ()
    dedent_below: int | None = None  # a non-empty line indented below this many columns ends it; None: off
    lead: str = ""  # the prompt from its last newline on (with it): where the continuation's first line starts

    def fires(self, text: str) -> tuple[int, str] | None:
        """(the end in `text` of the earliest rule that fires, 'stop' | 'dedent'), or None; `text` is the
        continuation's text only (`lead` is put in front here, and a match must end inside the continuation)."""
        full, n0 = self.lead + text, len(self.lead)
        best: tuple[int, str] | None = None
        for s in self.sequences:
            i = full.find(s, max(0, n0 - len(s) + 1))
            if i >= 0 and (best is None or i + len(s) < best[0]):
                best = (i + len(s), "stop")
        if self.dedent_below is not None:
            pos = full.find("\n", max(0, n0 - 1))
            while pos >= 0 and (best is None or pos + 1 < best[0]):
                line = full[pos + 1:].split("\n", 1)[0]
                if line.strip():
                    first = pos + 1 + len(line) - len(line.lstrip())  # the line's first non-space character
                    if indent_of(line) < self.dedent_below and (best is None or first + 1 < best[0]):
                        best = (first + 1, "dedent")
                pos = full.find("\n", pos + 1)
        return None if best is None else (best[0] - n0, best[1])

    def cut(self, tokens: Sequence[int]) -> tuple[int, str] | None:
        """(k, why): the shortest prefix tokens[:k] whose text fires, or None. The whole text locates the firing
        character; a binary search over prefixes finds its token (a decoded prefix is a prefix of the whole
        text for byte-level tokenizers); where that does not hold, a plain scan of the prefixes."""
        tokens = list(tokens)
        hit = self.fires(self.decode(tokens)) if tokens else None
        if hit is None:
            return None
        lo, hi = 1, len(tokens)  # the smallest k whose text reaches the firing character
        while lo < hi:
            mid = (lo + hi) // 2
            if len(self.decode(tokens[:mid])) >= hit[0]:
                hi = mid
            else:
                lo = mid + 1
        got = self.fires(self.decode(tokens[:lo]))
        if got is not None and (lo == 1 or self.fires(self.decode(tokens[:lo - 1])) is None):
            return lo, got[1]
        for k in range(1, len(tokens) + 1):  # decoding is not prefix-stable here: scan
            got = self.fires(self.decode(tokens[:k]))
            if got is not None:
                return k, got[1]
        return None


@dataclass(frozen=True)
class CodeStop:
    """A suite's rule (`eval.stop`): stop sequences, and the dedent below the prompt's body."""
    sequences: tuple[str, ...] = ()
    dedent: bool = False

    def __bool__(self) -> bool:
        return bool(self.sequences) or self.dedent

    def key(self) -> dict:
        """What enters the ground truth's cache and pin keys."""
        return {"sequences": list(self.sequences), "dedent": bool(self.dedent)}

    def describe(self) -> str:
        parts = (["the dedent below the prompt's body"] if self.dedent else []) \
            + [f"stop sequences {list(self.sequences)!r}"] * bool(self.sequences)
        return " or ".join(parts)

    def for_prompt(self, prompt: str, decode: Callable[[Sequence[int]], str]) -> TextEnd:
        j = prompt.rfind("\n")
        return TextEnd(decode, tuple(self.sequences), body_indent(prompt) if self.dedent else None,
                       prompt[j:] if j >= 0 else prompt)
