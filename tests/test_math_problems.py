"""The math target's problem generator (dflash.data.math_problems), its frozen suites and its data source."""
import json
import random
from importlib import resources

import pytest

from dflash.data.math_problems import (SUITE_SIZES, check_steps, heldout_problems, heldout_suite, is_heldout,
                                       make_problem, parse_answer, take, training_problems)


def test_the_same_seed_gives_the_same_problems_and_another_seed_others():
    a, b, c = (take(training_problems(s), 200) for s in (0, 0, 1))
    assert a == b
    assert len({p.prompt for p in a} & {p.prompt for p in c}) < 5


def test_every_step_is_its_operation_and_the_answer_is_the_last_result():
    rng = random.Random(7)
    for _ in range(3000):
        p = make_problem(rng)
        assert check_steps(p), p.text
        assert 2 <= len(p.steps) <= 5 and p.answer >= 0
        assert p.solution.endswith(f"Answer: {p.answer}") and parse_answer(p.solution) == p.answer
        assert p.prompt.startswith("Problem: ") and p.prompt.endswith("\nSolution:\n")


def test_a_wrong_step_fails_the_check():
    p = make_problem(random.Random(3))
    a, op, b, c = p.steps[0]
    bad = type(p)(p.prompt, p.solution.replace(f"= {c}", f"= {c + 1}", 1), p.answer, ((a, op, b, c + 1),) + p.steps[1:])
    assert not check_steps(bad)


def test_heldout_problems_never_come_from_the_training_stream():
    train = take(training_problems(0), 20000)
    held = take(heldout_problems(0), 300)
    assert not any(is_heldout(p) for p in train)
    assert all(is_heldout(p) for p in held)
    assert not {p.prompt for p in train} & {p.prompt for p in held}
    assert 0.02 < sum(is_heldout(make_problem(random.Random(i))) for i in range(4000)) / 4000 < 0.09


def test_the_templates_make_language_not_a_lookup_table():
    ps = take(training_problems(0), 5000)
    assert len({p.prompt for p in ps}) == 5000
    openings = {" ".join(p.prompt.split()[1:4]) for p in ps}
    assert len(openings) > 300  # names x verbs x sentence forms
    assert {op for p in ps for _, op, _, _ in p.steps} == {"+", "-", "×", "÷"}


@pytest.mark.parametrize("suite", sorted(SUITE_SIZES))
def test_the_shipped_suites_are_the_generators_frozen_output(suite):
    text = (resources.files("dflash.evaluation") / "suites" / f"{suite}.json").read_text(encoding="utf-8")
    tasks = json.loads(text)
    assert tasks == heldout_suite(SUITE_SIZES[suite])
    train = {p.prompt for p in take(training_problems(0), 20000)}
    assert not train & {t["prompt"] for t in tasks}
    for t in tasks:
        assert parse_answer(t["reference"]) == t["answer"]


def test_the_eval_suite_loader_reads_them():
    from dflash.evaluation.prompts import load_suite
    tasks = load_suite("math10")
    assert len(tasks) == 10 and tasks[0].reference.startswith(tasks[0].reference.split()[0])
    assert [t.prompt for t in tasks] == [t.prompt for t in load_suite("math_heldout")[:10]]


def test_the_math_data_source_gives_solutions_that_end_at_eos():
    from types import SimpleNamespace
    from dflash.data.sources import DataConfig, build_training_sequences
    from dflash.target.model import ByteTokenizer
    tok = ByteTokenizer()
    cfg = DataConfig(source="math", num_sequences=12, min_len=64, max_len=320)
    seqs = build_training_sequences(cfg, SimpleNamespace(tokenizer=tok), seed=0)
    assert len(seqs) == 12 and all(64 <= len(s) <= 320 for s in seqs)
    assert [s.tolist() for s in seqs] == [s.tolist() for s in build_training_sequences(cfg, SimpleNamespace(
        tokenizer=tok), seed=0)]
    flat = [t for s in seqs for t in s.tolist()]
    assert flat.count(tok.eos_token_id) >= 5
    first = tok.decode(flat[:flat.index(tok.eos_token_id)])
    assert first.startswith("Problem: ") and first.endswith(f"Answer: {parse_answer(first)}")
