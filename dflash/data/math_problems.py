"""Seeded GSM8K-like word problems with worked solutions: the math reference target's task (docs/target.md).

A problem is a short story about one quantity (someone's marbles, cookies, stamps) changed by two to five
operations. Its worked solution writes every step as one operation with its result ("3 × 4 = 12"), in one of a few
phrasings of the step's kind, may restate the result, and ends with the answer line ("Answer: 7"); the text a model
sees is

    Problem: <the story and its question>
    Solution:
    <one line per step>
    Answer: <n>

and, in training, the end-of-text token after it. The arithmetic is a function of the problem; the wording is not:
each line picks its phrasing (four to six ways, `STEP_FORMS`) and some pick a connective, so a model that has
learned the task forks at a line's first words (about 1 nat) and copies the rest (near 0 nats). That is the profile
of a served chain-of-thought model: on Qwen3-8B's solutions over half the tokens sit near zero entropy and the 80th
percentile is 0.67 nats (Wang et al. 2025, "Beyond the 80/20 Rule", arXiv 2506.01939). A generator whose solution
is one sentence per step kind (this file before 2026-12-06) taught a target with 0.000 nats along its own samples:
a lookup table with nothing for a drafter to learn. The stories vary in names, objects, verbs and sentence forms,
so learning them is language, not a lookup table. Numbers stay small (products of factors up to 10, a multiple of
at most 4 × 25, gains up to 20, results under 200): a small model learns the arithmetic one digit token at a time.

Held-out split: a problem is held out when the hash of its text falls in `heldout_per_10k` of 10,000 buckets
(`is_heldout`). `training_problems` never yields one; `heldout_problems` yields only those, from another seed.
"""
from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass
from typing import Iterator

PROMPT_PREFIX = "Problem: "
SOLUTION_HEADER = "\nSolution:\n"
ANSWER_PREFIX = "Answer: "
SPLIT_SALT = "dflash-math-v1"  # the split hashes the prompt only: the phrasings of v2 keep it
HELDOUT_PER_10K = 500  # 5% of all problems are held out from training
ANSWER_RE = re.compile(r"Answer: (-?\d+)")

NAMES = [("Mia", "she"), ("Tom", "he"), ("Ava", "she"), ("Leo", "he"), ("Zoe", "she"), ("Sam", "he"),
         ("Ella", "she"), ("Ben", "he"), ("Lily", "she"), ("Max", "he"), ("Nora", "she"), ("Jack", "he"),
         ("Ruby", "she"), ("Owen", "he"), ("Ivy", "she"), ("Noah", "he"), ("Emma", "she"), ("Liam", "he"),
         ("Grace", "she"), ("Ethan", "he"), ("Chloe", "she"), ("Lucas", "he"), ("Hannah", "she"), ("Ryan", "he"),
         ("Sofia", "she"), ("Adam", "he"), ("Maya", "she"), ("Eli", "he"), ("Clara", "she"), ("Omar", "he"),
         ("Priya", "she"), ("Kenji", "he"), ("Fatima", "she"), ("Diego", "he"), ("Amara", "she"), ("Ivan", "he")]
# (thing, plural, container, container plural)
ITEMS = [("apple", "apples", "bag", "bags"), ("marble", "marbles", "jar", "jars"), ("pencil", "pencils", "box", "boxes"),
         ("cookie", "cookies", "tray", "trays"), ("sticker", "stickers", "sheet", "sheets"),
         ("egg", "eggs", "carton", "cartons"), ("book", "books", "shelf", "shelves"), ("card", "cards", "pack", "packs"),
         ("flower", "flowers", "pot", "pots"), ("shell", "shells", "bucket", "buckets"),
         ("stamp", "stamps", "album", "albums"), ("bead", "beads", "string", "strings"),
         ("orange", "oranges", "crate", "crates"), ("crayon", "crayons", "case", "cases"),
         ("toy car", "toy cars", "shelf", "shelves"), ("cupcake", "cupcakes", "plate", "plates"),
         ("ball", "balls", "basket", "baskets"), ("coin", "coins", "purse", "purses"),
         ("rock", "rocks", "pail", "pails"), ("button", "buttons", "tin", "tins")]
GAIN_VERBS = ["finds", "buys", "gets", "is given", "picks up", "wins", "collects", "receives"]
LOSS_VERBS = ["gives away", "loses", "sells", "trades away", "gives", "uses"]
QUESTIONS = ["How many {p} does {n} have now?", "How many {p} does {n} have at the end?",
             "How many {p} are left with {n}?", "What is the number of {p} {n} has now?"]
SHARE_QUESTIONS = ["How many {p} does each {g} get?", "How many {p} go to each {g}?"]
GROUPS = [("friend", "friends"), ("child", "children"), ("classmate", "classmates"), ("neighbor", "neighbors"),
          ("cousin", "cousins"), ("team", "teams")]

# The solution lines' phrasings by step kind, one drawn per line: {P} the pronoun capitalised, {n} the name, {x} the
# quantity before the step, {b} the operand, {r} the result, {p} the plural, {g} the group; the "{x} op {b} = {r}"
# equation stays whole in every form (`check_steps` reads it).
STEP_FORMS = {
    "start": ["{n} starts with {r} {p}.", "At first {n} has {r} {p}.", "{n} begins with {r} {p}.",
              "In the beginning there are {r} {p}.", "We start from {r} {p}.", "The count starts at {r} {p}."],
    "boxes": ["{n} has {x} × {b} = {r} {p}.", "First, {x} × {b} = {r} {p}.",
              "{x} groups of {b} make {x} × {b} = {r} {p}.", "To start, {n} has {x} × {b} = {r} {p}.",
              "We multiply first: {x} × {b} = {r} {p}.", "There are {x} × {b} = {r} {p} at the start."],
    "+": ["{P} gets {b} more, {so} {x} + {b} = {r} {p}.", "Then {x} + {b} = {r} {p}.",
          "After {b} more, {x} + {b} = {r} {p}.", "Adding {b} gives {x} + {b} = {r} {p}.",
          "Now there are {x} + {b} = {r} {p}.", "With {b} more: {x} + {b} = {r} {p}."],
    "-": ["{P} loses {b}, {so} {x} - {b} = {r} {p}.", "Then {x} - {b} = {r} {p}.",
          "After {b} are gone, {x} - {b} = {r} {p}.", "Taking away {b} gives {x} - {b} = {r} {p}.",
          "Now there are {x} - {b} = {r} {p}.", "Without those {b}: {x} - {b} = {r} {p}."],
    "×": ["{P} now has {b} times as many, {so} {x} × {b} = {r} {p}.", "Then {x} × {b} = {r} {p}.",
          "{b} times as many is {x} × {b} = {r} {p}.", "Multiplying by {b} gives {x} × {b} = {r} {p}.",
          "Now there are {x} × {b} = {r} {p}."],
    "÷": ["Each {g} gets {x} ÷ {b} = {r} {p}.", "Sharing among {b}: {x} ÷ {b} = {r} {p} each.",
          "{x} ÷ {b} = {r}, {so} each {g} gets {r} {p}.", "We divide: {x} ÷ {b} = {r} {p} for each {g}."],
}
CONNECTIVES = ["so", "which makes", "and"]
RESTATE = ["So {n} has {r} {p} in the end.", "That leaves {n} with {r} {p}.", "In total {n} has {r} {p}.",
           "{n} ends up with {r} {p}."]  # before the answer, at half the lines


def _line(rng: random.Random, kind: str, **v) -> str:
    """One solution line: a phrasing of the step's kind, its connective drawn when the phrasing has one."""
    form = rng.choice(STEP_FORMS[kind])
    so = rng.choice(CONNECTIVES) if "{so}" in form else ""
    return form.format(so=so, **v)


@dataclass(frozen=True)
class MathProblem:
    prompt: str  # "Problem: ...\nSolution:\n": what a model is given
    solution: str  # the worked steps and the answer line (no end-of-text token)
    answer: int
    steps: tuple[tuple[int, str, int, int], ...]  # (a, op, b, result) of every written step, in order

    @property
    def text(self) -> str:
        return self.prompt + self.solution


def _cap(s: str) -> str:
    return s[:1].upper() + s[1:]


def _start(rng: random.Random, name: str, pron: str, item: tuple) -> tuple[str, str, tuple, int]:
    """The story's first sentence, the solution's first line, its step (or None) and the starting quantity."""
    thing, plural, box, boxes = item
    if rng.random() < 0.35:
        a = rng.randint(5, 30)
        story = rng.choice([f"{name} has {a} {plural}.", f"{name} starts with {a} {plural}.",
                            f"There are {a} {plural} in {name}'s room."])
        return story, _line(rng, "start", n=name, r=a, p=plural), None, a
    a, b = rng.randint(2, 10), rng.randint(2, 10)
    story = rng.choice([f"{name} has {a} {boxes} of {plural} with {b} {plural} in each {box}.",
                        f"{name} buys {a} {boxes} of {plural}, and each {box} holds {b} {plural}.",
                        f"There are {a} {boxes} in {name}'s house, each with {b} {plural}."])
    return story, _line(rng, "boxes", n=name, x=a, b=b, r=a * b, p=plural), (a, "×", b, a * b), a * b


def _middle(rng: random.Random, name: str, pron: str, plural: str, x: int) -> tuple[str, str, tuple, int]:
    """A gain, a loss or a multiplication of the quantity `x`: (story sentence, solution line, step, new x)."""
    kinds = ["gain", "loss", "times"] if x <= 25 else ["gain", "loss"]
    kind = rng.choice(kinds if x > 1 else ["gain", "times"])
    if kind == "gain":
        b = rng.randint(1, 20)
        verb = rng.choice(GAIN_VERBS)
        story = rng.choice([f"Then {pron} {verb} {b} more {plural}.", f"Later {name} {verb} {b} {plural}.",
                            f"{_cap(pron)} {verb} {b} more."])
        line = _line(rng, "+", P=_cap(pron), x=x, b=b, r=x + b, p=plural)
        return story, line, (x, "+", b, x + b), x + b
    if kind == "loss":
        b = rng.randint(1, x - 1)
        verb = rng.choice(LOSS_VERBS)
        tail = " to a friend" if verb == "gives" else ""
        story = rng.choice([f"Then {pron} {verb} {b} of them{tail}.", f"{_cap(pron)} {verb} {b} {plural}{tail}.",
                            f"After that, {name} {verb} {b}{tail}."])
        line = _line(rng, "-", P=_cap(pron), x=x, b=b, r=x - b, p=plural)
        return story, line, (x, "-", b, x - b), x - b
    k = rng.randint(2, 4)
    word = {2: "doubles", 3: "triples"}.get(k)
    story = (rng.choice([f"Then {pron} {word} the number of {plural}.", f"{_cap(pron)} {word} {name}'s {plural}."])
             if word and rng.random() < 0.5 else
             rng.choice([f"Then {pron} ends up with {k} times as many {plural}.",
                         f"Later {name} has {k} times as many {plural} as before."]))
    return story, _line(rng, "×", P=_cap(pron), x=x, b=k, r=x * k, p=plural), (x, "×", k, x * k), x * k


def make_problem(rng: random.Random) -> MathProblem:
    """One problem and its worked solution, drawn from `rng` (2 to 5 steps written out)."""
    name, pron = rng.choice(NAMES)
    item = rng.choice(ITEMS)
    plural = item[1]
    story, line, step, x = _start(rng, name, pron, item)
    sentences, lines, steps = [story], [line], [step] if step else []
    for _ in range(rng.randint(1, 3) if step else rng.randint(2, 3)):
        s, l, st, x = _middle(rng, name, pron, plural, x)
        sentences.append(s)
        lines.append(l)
        steps.append(st)
    divisors = [k for k in range(2, 7) if x % k == 0 and x // k >= 2]
    if divisors and rng.random() < 0.4:  # share equally: the last step divides exactly
        k = rng.choice(divisors)
        g, gs = rng.choice(GROUPS)
        sentences.append(f"{_cap(pron)} shares the {plural} equally among {k} {gs}. "
                         + rng.choice(SHARE_QUESTIONS).format(p=plural, g=g))
        lines.append(_line(rng, "÷", g=g, x=x, b=k, r=x // k, p=plural))
        steps.append((x, "÷", k, x // k))
        x //= k
    else:
        sentences.append(rng.choice(QUESTIONS).format(p=plural, n=name))
        if rng.random() < 0.5:
            lines.append(rng.choice(RESTATE).format(n=name, r=x, p=plural))
    prompt = PROMPT_PREFIX + " ".join(sentences) + SOLUTION_HEADER
    solution = "\n".join(lines) + f"\n{ANSWER_PREFIX}{x}"
    return MathProblem(prompt, solution, x, tuple(steps))


def is_heldout(problem: MathProblem, heldout_per_10k: int = HELDOUT_PER_10K, salt: str = SPLIT_SALT) -> bool:
    """Whether the problem's text hashes into the held-out buckets (a pure function of the problem statement)."""
    h = int.from_bytes(hashlib.sha256(f"{salt}\0{problem.prompt}".encode()).digest()[:8], "big")
    return h % 10_000 < heldout_per_10k


def training_problems(seed: int, heldout_per_10k: int = HELDOUT_PER_10K) -> Iterator[MathProblem]:
    """An endless seeded stream of problems, none of them held out."""
    rng = random.Random(f"math-train-{seed}")
    while True:
        p = make_problem(rng)
        if not is_heldout(p, heldout_per_10k):
            yield p


def heldout_problems(seed: int, heldout_per_10k: int = HELDOUT_PER_10K) -> Iterator[MathProblem]:
    """An endless seeded stream of held-out problems only (distinct texts, first occurrence kept)."""
    rng = random.Random(f"math-heldout-{seed}")
    seen: set[str] = set()
    while True:
        p = make_problem(rng)
        if is_heldout(p, heldout_per_10k) and p.prompt not in seen:
            seen.add(p.prompt)
            yield p


def take(stream: Iterator[MathProblem], n: int) -> list[MathProblem]:
    return [next(stream) for _ in range(n)]


def check_steps(problem: MathProblem) -> bool:
    """Every written step's result is its operation's value, each step starts from the one before's result or a
    number of the problem, and the answer is the last result."""
    ops = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "×": lambda a, b: a * b, "÷": lambda a, b: a / b}
    for a, op, b, c in problem.steps:
        if ops[op](a, b) != c or f"{a} {op} {b} = {c}" not in problem.solution:
            return False
    for (_, _, _, prev), (a, _, _, _) in zip(problem.steps, problem.steps[1:]):
        if a != prev:
            return False
    return bool(problem.steps) and problem.steps[-1][3] == problem.answer == parse_answer(problem.solution)


def parse_answer(text: str) -> int | None:
    """The first "Answer: n" of a written solution, or None when it has none."""
    m = ANSWER_RE.search(text)
    return int(m.group(1)) if m else None


SUITE_SEED = 2026  # the frozen held-out suites' generator seed (dflash/evaluation/suites/math*.json)


def heldout_suite(n: int, seed: int = SUITE_SEED) -> list[dict]:
    """The frozen held-out suite's tasks: {name, prompt, reference (the worked solution), answer} of `n` held-out
    problems (`python -m dflash.data.math_problems` rewrites the shipped files from this)."""
    return [{"name": f"math{i:03d}", "prompt": p.prompt, "reference": p.solution, "answer": p.answer}
            for i, p in enumerate(take(heldout_problems(seed), n))]


# the quality bar's suite; the drafter eval's objective suite (its first 10 problems: the stream is seeded)
SUITE_SIZES = {"math_heldout": 256, "math10": 10}


if __name__ == "__main__":
    import json
    from pathlib import Path
    from dflash.atomic import atomic_write_text
    root = Path(__file__).resolve().parents[1] / "evaluation" / "suites"
    for suite, size in SUITE_SIZES.items():
        atomic_write_text(root / f"{suite}.json", json.dumps(heldout_suite(size), indent=1, ensure_ascii=False) + "\n")
        print(f"wrote {root / f'{suite}.json'} ({size} problems)")
