"""Code suites' stop rules (dflash.data.stops, `eval.stop`): stop sequences and the dedent below the prompt's body,
cut by the one first-stop cut (`dflash.data.writing.first_end`) against a plain reference on hand-made token
sequences; where the rules come from (config, keys, pins); and an end-to-end CPU evaluation on a tiny random
target whose continuations end where the rules say."""
from __future__ import annotations

import random

import pytest
import torch

from dflash.data.stops import END_REASONS, CodeStop, body_indent
from dflash.data.writing import ends_at_stop, first_end

# A toy vocabulary of text pieces: indentation, newlines, keywords, a multi-byte character split in two
PIECES = ["\n", "\n\n", "    ", "  ", "\t", "def", "class", " ", "x", "return", "#", "print(", "if __name__", ")",
          "pass", "\n    ", "\ndef ", "é"]
EOS = len(PIECES)
HUMANEVAL = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#")


def toy_decode(ids) -> str:
    return "".join(PIECES[i] for i in ids if i < len(PIECES))


def unstable_decode(ids) -> str:
    """A decoder whose prefixes are not prefixes of the whole (a tokenizer's clean-up): the cut must still hold."""
    return toy_decode(ids).rstrip(" ")


def plain_cut(tokens, start, stop_ids, prompt, sequences, dedent, decode):
    """The reference: scan every prefix of the continuation, and inside it every prefix of its text, for the first
    character at which a stop sequence has appeared (ending after the prompt) or a line begun after the prompt has a
    non-space character left of the body's indentation."""
    stops = set(stop_ids)
    eos = next((i for i in range(start, len(tokens)) if tokens[i] in stops), None)
    limit = eos if eos is not None else len(tokens)
    lead = prompt[prompt.rfind("\n"):] if "\n" in prompt else prompt
    body = None
    if dedent:
        last = [ln for ln in prompt.split("\n") if ln.strip()][-1]
        body = len(last.expandtabs(8)) - len(last.expandtabs(8).lstrip()) + last.rstrip().endswith(":")

    def rule_at(text):
        full = lead + text
        for c in range(len(lead) + 1, len(full) + 1):
            head = full[:c]
            if any(head.endswith(s) for s in sequences):
                return "stop"
            if body is not None:
                line_start = head.rfind("\n") + 1
                line = head[line_start:]
                if line_start >= len(lead) and line.strip() and line_start > 0:
                    ws = len(line) - len(line.lstrip())
                    if len(line[:ws].expandtabs(8)) < body and len(line) == ws + 1:
                        return "dedent"
        return None
    for k in range(start + 1, limit + 1):
        why = rule_at(decode(tokens[start:k]))
        if why:
            return k, why
    return (eos + 1, "eos") if eos is not None else (len(tokens), "length")


PROMPTS = ['def f(x):\n    """Doc."""\n', "def g():\n", "class A:\n    def m(self):\n        '''Doc.'''\n",
           "x = 1", "def h():\n\t'''tabbed'''\n"]


@pytest.mark.parametrize("decode", [toy_decode, unstable_decode])
def test_cut_matches_a_plain_reference(decode):
    rng = random.Random(0)
    cases = 0
    for trial in range(400):
        prompt = PROMPTS[trial % len(PROMPTS)]
        seqs = HUMANEVAL if trial % 3 == 0 else (() if trial % 3 == 1 else ("return", "\n#"))
        dedent = trial % 4 != 3
        tokens = [rng.choice(range(len(PIECES) + 1)) for _ in range(rng.randint(1, 30))]
        start = rng.randint(0, 2) if len(tokens) > 3 else 0
        rule = CodeStop(seqs, dedent)
        want = plain_cut(tokens, start, (EOS,), prompt, seqs, dedent, decode)
        got = first_end(tokens, start, (EOS,), rule.for_prompt(prompt, decode) if rule else None)
        assert got == want, (prompt, seqs, dedent, tokens, start, [decode(tokens[start:])])
        assert ends_at_stop(tokens, start, (EOS,), rule.for_prompt(prompt, decode) if rule else None) == got[0]
        cases += got[1] in ("stop", "dedent")
    assert cases > 100  # the rules fire often enough for the comparison to mean something


def test_hand_made_ends():
    prompt = 'def f(x):\n    """Doc."""\n'
    end = CodeStop((), True).for_prompt(prompt, toy_decode)
    i = PIECES.index
    body = [i("    "), i("return"), i(" "), i("x"), i("\n\n")]
    assert first_end(body + [i("def"), i(" "), i("x")], 0, (EOS,), end) == (6, "dedent")  # "def" at column 0
    assert first_end(body + [i("  "), i("x")], 0, (EOS,), end) == (7, "dedent")  # indented, but left of the body
    assert first_end(body + [i("    "), i("x")], 0, (EOS,), end) == (7, "length")  # still inside the body
    assert first_end(body + [EOS, i("def")], 0, (EOS,), end) == (6, "eos")  # EOS first
    assert first_end(body + [i("    ")], 0, (EOS,), end) == (6, "length")  # a blank line decides nothing yet
    stop = CodeStop(HUMANEVAL, False).for_prompt(prompt, toy_decode)
    assert first_end([i("def"), i(" ")], 0, (), stop) == (2, "stop")  # "\ndef " across the prompt's last newline
    assert first_end(body + [i("#")], 0, (), stop) == (6, "stop")
    assert first_end(body + [i("  "), i("#")], 0, (), stop) == (7, "length")  # "\n  #" is not "\n#"
    assert body_indent(prompt) == 4 and body_indent("def g():\n") == 1 and body_indent("x") == 0


def test_config_names_the_rule_per_suite():
    from dflash.evaluation import EvalConfig, StopConfig, validate_stop
    from dflash.evaluation.prompts import resolve_suite, suite_stop
    cfg = EvalConfig()
    assert suite_stop(cfg, "heldout") == CodeStop((), True) and suite_stop(cfg, "coding10") == CodeStop((), True)
    assert suite_stop(cfg, "mine") is None
    assert resolve_suite("coding10", cfg).stop == CodeStop((), True)
    cfg = EvalConfig(stop=StopConfig(dedent=[], sequences={"coding10": list(HUMANEVAL)}))
    assert resolve_suite("coding10", cfg).stop == CodeStop(HUMANEVAL, False)
    assert suite_stop(EvalConfig(stop_at_eos=False), "heldout") is None  # fixed length: no end at all
    with pytest.raises(ValueError, match="eval.stop.sequences.coding10"):
        validate_stop(StopConfig(sequences={"coding10": [""]}))
    with pytest.raises(ValueError, match="eval.stop.dedent"):
        validate_stop(StopConfig(dedent="heldout"))


def test_the_command_line_spells_stop_sequences():
    from experiments.config import compose_config
    cfg = compose_config(['eval.stop.sequences={mine: ["\\ndef ", "\\n#"]}', "eval.stop.dedent=[heldout]"])
    assert cfg.eval.stop.sequences == {"mine": ["\ndef ", "\n#"]} and cfg.eval.stop.dedent == ["heldout"]
    assert compose_config([]).eval.stop.dedent == ["heldout", "coding10"]


def test_keys_and_pins_carry_the_rule(tmp_path):
    """A pin or cache written under one stop rule is never read under another: the keys differ, and a pin file
    read under another rule is refused by name."""
    from dflash.evaluation.ground_truth import TruthSpec
    from dflash.evaluation.truth_pin import PinError, PinnedSuite
    eos = TruthSpec(stop_ids=(0,))
    dedent = TruthSpec(stop_ids=(0,), code_stop=CodeStop((), True))
    seqs = TruthSpec(stop_ids=(0,), code_stop=CodeStop(HUMANEVAL, True))
    assert "code_stop" not in eos.key()  # a pin that ends at EOS alone keeps the key it was written under
    keys = {PinnedSuite("t", ("a",), ((1, 2),), 4, 0, s.key()).key() for s in (eos, dedent, seqs)}
    assert len(keys) == 3
    assert TruthSpec(code_stop=CodeStop((), True)).ends and not TruthSpec(code_stop=CodeStop((), True)).legacy
    pin = PinnedSuite("t", ("a",), ((1, 2),), 4, 0, dedent.key())
    path = pin.path(tmp_path)
    pin.write(path, "heldout", [[5, 6]])  # shorter than max_new_tokens: it ended at the dedent
    assert pin.read(path).continuations == [[5, 6]]
    with pytest.raises(PinError, match="protocol"):
        PinnedSuite("t", ("a",), ((1, 2),), 4, 0, eos.key()).read(path)


def test_ground_truth_ends_where_the_rule_says(byte_target, tmp_path):
    """End to end on a tiny random target at T=1 and T=0: each continuation under a stop sequence (a byte the target
    writes often) is the uncut one up to the reference cut; the evaluation's table and metrics count the ends; the
    real sampled loop stops where the rule says."""
    from dflash.drafter.model import DrafterConfig, build_drafter
    from dflash.evaluation import EvalConfig
    from dflash.evaluation.ground_truth import TruthSpec, build_ground_truth, decoder, end_reasons
    from dflash.evaluation.prompts import Suite, Task
    from dflash.evaluation.protocol import stop_ids
    from dflash.evaluation.report import evaluate
    from dflash.evaluation.sampled_decode import sample_decode, sampled_speculative_decode
    from dflash.target.sampling import Sampling, SamplingConfig
    tgt, dec = byte_target, decoder(byte_target)
    tasks = [Task(f"p{i}", text) for i, text in enumerate(["def f(x):\n" + " " * 40 + "'''Doc.'''\n",
                                                             "import os\n", "class A:\n    x = 1\n"])]
    free = build_ground_truth(tgt, tasks, 48, TruthSpec(Sampling(1.0, 1.0, 0), 3, 0, stop_ids(tgt)))
    text = "".join(dec(t.continuation.tolist()) for t in free)
    seq = max(set(text) - {"\ufffd"}, key=text.count)  # the character the target writes most: the rule fires
    rule = CodeStop((seq,), True)
    spec = TruthSpec(Sampling(1.0, 1.0, 0), 3, 0, stop_ids(tgt), rule)
    cut = build_ground_truth(tgt, tasks, 48, spec)
    prompts = {t.name: t.prompt for t in tasks}
    fired = 0
    for a, b in zip(free, cut):
        whole = a.continuation.tolist()
        k, why = plain_cut(whole, 0, stop_ids(tgt), prompts[a.group], (seq,), True, dec)
        assert b.continuation.tolist() == whole[:k], a.name
        fired += why in ("stop", "dedent")
    assert fired >= 3
    reasons = end_reasons(tgt, cut, spec, [prompts[t.group] for t in cut])
    assert set(reasons) <= set(END_REASONS) and reasons.count("stop") + reasons.count("dedent") == fired

    torch.manual_seed(0)
    drafter = build_drafter(DrafterConfig(num_layers=1, head_dim=16, intermediate_size=64, block_size=4),
                            tgt.hidden_size, tgt.info.num_layers, tgt.mask_token_id, tgt.layer_ids)
    drafter.attach_target_head(tgt.embed_weight(), tgt.lm_head_weight())
    drafter.eval()
    cfg = EvalConfig(max_new_tokens=48, tree_budgets=[4], samples=3, cache_dir="", bootstrap=200,
                     sampling=SamplingConfig(1.0, 1.0, 0))
    suite = Suite("s", tasks, 48, rule)  # the served setting (T=1) and greedy beside it: both cut by the rule
    for s in (TruthSpec(Sampling(1.0, 1.0, 0), 3, 0, stop_ids(tgt)), TruthSpec(Sampling(), 1, 0, stop_ids(tgt))):
        rep = evaluate(drafter, tgt, cfg, suite=suite, spec=s)
        m = rep.metrics
        assert "stop sequences" in rep.info["ends"] and "dedent" in rep.info["ends"]
        ends = [row["gt_end"] for row in rep.table]
        for r in END_REASONS:
            assert m[f"eval/gt_end_{r}"] == ends.count(r) / len(ends)
        for row, tr in zip(rep.table, build_ground_truth(tgt, tasks, 48, s.for_suite(suite))):
            whole = tr.continuation.tolist()
            assert row["new_tokens"] == len(whole)
            assert plain_cut(whole, 0, stop_ids(tgt), prompts[tr.group], (seq,), True, dec) == (len(whole),
                                                                                               row["gt_end"])
        if not s.sampling.greedy:
            assert ends == reasons
        assert f"ends: {ends.count('eos')} EOS" in rep.headline()
    for i, t in enumerate(tasks * 3):  # the real loops, the target's own and the speculative one, stop there too
        ids, gen = tgt.tokenizer.encode(t.prompt), torch.Generator().manual_seed(i)
        end = rule.for_prompt(t.prompt, dec)
        for out in (sample_decode(tgt, ids, 48, Sampling(1.0, 1.0, 0), gen, stop_ids(tgt), end).tokens,
                    sampled_speculative_decode(drafter, tgt, ids, 48, Sampling(1.0, 1.0, 0), gen, stop_ids(tgt),
                                               text_end=end).tokens):
            k, why = plain_cut(out, 0, stop_ids(tgt), t.prompt, (seq,), True, dec)
            assert k == len(out) and (why != "length" or len(out) == 48), (out, why)
