"""Conversation data: formats, the assistant mask, the held-out split, bad input, training on assistant tokens only."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dflash.config import ConfigError
from dflash.data.chat import ChatConfig, TemplateError, prepare_tokenizer, render
from dflash.data.conversation_data import heldout_bucket, load_conversation_set
from dflash.data.conversations import ConversationInputError, read_conversations
from dflash.data.sources import DataConfig
from dflash.target.chat_tokenizer import OUT as TINY_CHAT
from dflash.training.lm_head_loss import IGNORE_INDEX

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "benchmarks" / "data" / "conversations_sample.jsonl"

# A run in seconds on the CPU: a tiny chat target, one drafter layer, short sequences.
CHAT_FAST = [
    "+target=tiny_random_chat", "+data=conversations", "+eval=off",
    "target.random.hidden_size=64", "target.random.num_layers=4", "target.random.intermediate_size=128",
    "target.random.head_dim=16", "target.random.linear_head_dim=16", "target.layer_ids=[0,1,2]",
    "drafter.num_layers=1", "drafter.head_dim=16", "drafter.intermediate_size=128", "drafter.block_size=8",
    "data.min_len=8", "data.max_len=96", "trainer.num_anchors=4",
    "trainer.max_steps=6", "trainer.warmup_steps=2", "trainer.checkpoint_every=3",
    "buffer.min_ready=2", "buffer.max_depth=4", "buffer.timeout_s=60", "tracking.log_every=1",
    "tracking.console=false", "tracking.system_metrics=false",
]


@pytest.fixture
def tok():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(TINY_CHAT), local_files_only=True)


@pytest.fixture
def chat_cfg(tmp_path):
    from experiments.config import compose_config

    def make(*overrides, run="run"):
        return compose_config(CHAT_FAST + [f"run_dir={tmp_path / run}",
                                           f"tracking.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}",
                                           f"data.conversations.cache_dir={tmp_path / 'hf'}", *overrides])
    return make


def _write_jsonl(path: Path, records) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records), encoding="utf-8")
    return path


CONV = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n2 + 3 = 5."},
        {"role": "user", "content": "And 4 + 4?"}, {"role": "assistant", "content": "4 + 4 = 8."}]


def _plain(messages):
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def _sharegpt(conv):
    names = {"system": "system", "user": "human", "assistant": "gpt"}
    return {"conversations": [{"from": names[m["role"]], "value": m["content"]} for m in conv]}


# -- formats ------------------------------------------------------------------------------------------------
def test_the_formats_read_into_the_same_messages(tmp_path):
    import datasets
    flat = {"system": "Be brief.", "prompt": "What is 2 + 3?", "response": "2 + 3 = 5."}
    _write_jsonl(tmp_path / "a.jsonl", [{"messages": CONV}])
    _write_jsonl(tmp_path / "b.jsonl", [_sharegpt(CONV)])
    (tmp_path / "c.json").write_text(json.dumps([flat]))
    datasets.Dataset.from_list([{"messages": CONV}]).to_parquet(str(tmp_path / "d.parquet"))
    datasets.Dataset.from_list([_sharegpt(CONV)]).save_to_disk(str(tmp_path / "saved"))
    ds, formats = read_conversations(str(tmp_path), str(tmp_path / "hf"))
    assert sorted(formats.values()) == ["flat", "openai", "openai", "sharegpt", "sharegpt"]
    rows = list(ds)
    assert len(rows) == 5
    full = [r["messages"] for r in rows if len(r["messages"]) == 5]
    assert len(full) == 4 and all(_plain(m) == CONV for m in full)  # multi-turn and the system prompt kept
    assert [_plain(r["messages"]) for r in rows if len(r["messages"]) == 3] == [CONV[:2] + [
        {"role": "assistant", "content": "2 + 3 = 5."}]]
    # the same conversation, the same prompt hashes (per assistant turn); the flat record shares its first prompt
    assert len({tuple(r["prompt_hashes"]) for r in rows if len(r["messages"]) == 5}) == 1
    assert rows[0]["prompt_hashes"][2] in {r["prompt_hashes"][2] for r in rows if len(r["messages"]) == 3}
    assert not list((tmp_path / "saved").glob("cache-*"))  # nothing written into the user's saved dataset
    # a glob, and a file that mixes two formats record by record
    _write_jsonl(tmp_path / "mixed.jsonl", [{"messages": CONV}, _sharegpt(CONV[:3])])
    ds, formats = read_conversations(str(tmp_path / "mix*.jsonl"), str(tmp_path / "hf"))
    assert list(formats.values()) == ["openai+sharegpt"] and [len(r["messages"]) for r in ds] == [5, 3]


def test_the_sample_dataset_has_both_formats_and_multi_turn():
    records = [json.loads(line) for line in SAMPLE.read_text().splitlines()]
    assert 150 <= len(records) <= 250
    assert {"messages" in r for r in records} == {True, False}
    turns = [r.get("messages") or r.get("conversations") for r in records]
    assert sum(len([m for m in t if m.get("role", m.get("from")) in ("assistant", "gpt")]) > 1 for t in turns) > 20


def _msgs(conv):
    from dflash.data.conversations import message
    return [message(m["role"], m["content"]) for m in conv]


# -- masks --------------------------------------------------------------------------------------------------
def _assistant_text(tok, ids, mask):
    return tok.decode([i for i, m in zip(ids, mask) if m])


def test_generation_markers_and_prefix_rendering_give_the_same_assistant_mask(tok):
    [(ids, mask)] = render(tok, _msgs(CONV), ChatConfig())
    assert _assistant_text(tok, ids, mask) == "<think>\nadd them\n</think>\n\n2 + 3 = 5.<|im_end|>4 + 4 = 8.<|im_end|>"
    plain = tok.chat_template.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    tok.chat_template = plain  # a template without generation markers: spans found by rendering prefixes
    [(ids2, mask2)] = render(tok, _msgs(CONV), ChatConfig())
    assert ids2 == ids and mask2 == mask
    [(ids3, mask3)] = render(tok, _msgs(CONV), ChatConfig(think="drop"))
    assert "<think>" not in tok.decode(ids3) and _assistant_text(tok, ids3, mask3) == "2 + 3 = 5.<|im_end|>4 + 4 = 8.<|im_end|>"


def test_a_template_file_serves_a_tokenizer_without_one(tok, tmp_path):
    tpl = tmp_path / "chat.jinja"
    tpl.write_text(tok.chat_template)
    tok.chat_template = None
    with pytest.raises(ValueError, match="data.chat.template"):
        prepare_tokenizer(tok, ChatConfig())
    prepare_tokenizer(tok, ChatConfig(template=str(tpl)))
    [(ids, mask)] = render(tok, _msgs(CONV[1:3]), ChatConfig(template=str(tpl)))
    assert sum(mask) > 0 and tok.decode(ids).startswith("<|im_start|>user\n")


def test_a_template_that_does_not_render_names_the_template_and_the_record(tok, tmp_path):
    tpl = tmp_path / "broken.jinja"
    tpl.write_text("{{ messages[0]['content'] | no_such_filter }}")
    with pytest.raises(TemplateError, match=r"broken\.jinja does not render record x#3"):
        render(prepare_tokenizer(tok, ChatConfig(template=str(tpl))), _msgs(CONV), ChatConfig(template=str(tpl)),
               where="record x#3")


def test_no_user_or_system_token_ever_carries_loss(chat_cfg, tmp_path):
    """Through the trainer's own path (data → producer → batch): every labelled block position predicts an
    assistant token, every anchor's first prediction is one, and assistant tokens do get labels."""
    from dflash.target.model import Target
    from dflash.training.batching import make_batch
    from dflash.app.chat_data import build_run_data
    from dflash.training.distributed import DistInfo
    from dflash.training.noise import NoiseConfig, build_noise
    from dflash.training.pipeline import ProducerPool
    cfg = chat_cfg(f"data.path={SAMPLE}", "data.max_len=160")
    target = Target(cfg.target)
    data = build_run_data(cfg, target, DistInfo())
    assert data.kind == "conversations" and data.stats["data/train_sequences"] > 150
    source = data.source(0, [], 0, 1)
    pool = ProducerPool(target, buffer=None, source=source, n=0, soft_top_k=0, batch=1, inline=True)
    items = pool.produce([source.claim() for _ in range(24)])
    batch = make_batch(items, block_size=8, num_anchors=64, seed=0, noise=build_noise(NoiseConfig(), 1),
                       sigma=0.0, device=torch.device("cpu"))
    im_start = target.tokenizer.convert_tokens_to_ids("<|im_start|>")
    labelled = ends = 0
    for b, it in enumerate(items):
        mask = it.loss_mask_T
        assert mask is not None and it.tokens_T[mask].ne(im_start).all()
        for n, a in enumerate(batch.anchors_BN[b].tolist()):
            for k in range(7):
                if batch.labels_BNK[b, n, k] != IGNORE_INDEX:
                    assert mask[a + k + 1], (b, a, k)  # the label at a + k is the target's token a + k + 1
                    labelled += 1
            if batch.labels_BNK[b, n].ne(IGNORE_INDEX).any():
                assert mask[a + 1]
        text = target.tokenizer.decode(it.tokens_T[mask].tolist())
        assert "<|im_start|>" not in text and "user\n" not in text and "system\n" not in text
        ends += "<|im_end|>" in text  # (a sequence cut at max_len may end inside its answer)
    assert labelled > 24 * 10 and ends > 12


# -- the split ----------------------------------------------------------------------------------------------
def _held_prompts(ds):
    return {r["prompt_hashes"][i] for r in ds for i in r["heldout_turns"]}


def _trained_prompts(ds):
    return {r["prompt_hashes"][i] for r in ds for i, m in enumerate(r["messages"]) if m["role"] == "assistant"
            and m["train"]}


def test_the_heldout_split_is_by_prompt_hash_and_no_heldout_prompt_is_trained_on(tmp_path, tok):
    # one prompt with two responses (and a second turn each): both land on the same side
    twins = [{"messages": [{"role": "user", "content": f"question {i}"},
                           {"role": "assistant", "content": f"answer {i} {v} " * 6},
                           {"role": "user", "content": "and then?"},
                           {"role": "assistant", "content": f"more {v} " * 6}]}
             for i in range(60) for v in ("a", "b")]
    data = _write_jsonl(tmp_path / "twins.jsonl", twins)
    d = DataConfig(source="conversations", path=str(data), min_len=8, max_len=512)
    d.conversations.cache_dir = str(tmp_path / "hf")
    d.conversations.heldout_per_10k = 2000
    cs = load_conversation_set(d, tok)
    held, trained = _held_prompts(cs.heldout), _trained_prompts(cs.normalized)
    assert held and trained and not held & trained  # no held-out prompt is ever trained on
    assert all(heldout_bucket(h, d.conversations.salt) < 2000 for h in held)
    first_turn_held = {r["messages"][0]["content"] for r in cs.heldout if 1 in r["heldout_turns"]}
    assert 4 < len(first_turn_held) < 25  # ~20% of 60 prompts
    for q in first_turn_held:  # both responses to a held-out prompt: that turn is context only
        rows = [r for r in cs.normalized if r["messages"][0]["content"] == q]
        assert all(not r["messages"][1]["train"] for r in rows)
    trained_text = [tok.decode([t for t, m in zip(ids, mask) if m]) for ids, mask in
                    zip(cs.train["input_ids"], cs.train["loss_mask"])]
    for q in first_turn_held:
        n = q.split()[1]
        assert not any(f"answer {n} " in t for t in trained_text), q
    # adding conversations moves none of the existing prompts across the split
    extra = _write_jsonl(tmp_path / "more.jsonl", [{"messages": [{"role": "user", "content": f"q{i}"},
                                                                 {"role": "assistant", "content": f"a{i} " * 20}]}
                                                   for i in range(30)])
    both = tmp_path / "both"
    both.mkdir()
    (both / "a.jsonl").write_text(data.read_text())
    (both / "b.jsonl").write_text(extra.read_text())
    cs2 = load_conversation_set(DataConfig(source="conversations", path=str(both), min_len=8, max_len=512,
                                           conversations=d.conversations), tok)
    assert held <= _held_prompts(cs2.heldout) and trained <= _trained_prompts(cs2.normalized)


# -- bad input ----------------------------------------------------------------------------------------------
def test_a_malformed_line_and_a_record_that_fits_no_format_name_file_line_and_field(tmp_path):
    good = {"messages": CONV}
    bad_json = _write_jsonl(tmp_path / "bad.jsonl", [good, "", good, '{"messages": [', good])
    with pytest.raises(ConversationInputError, match=r"bad\.jsonl: line 4: not valid JSON"):
        read_conversations(str(bad_json), str(tmp_path / "hf"))
    no_role = _write_jsonl(tmp_path / "norole.jsonl", [good, good, {"messages": [{"content": "hi"}]}])
    with pytest.raises(ConversationInputError, match=r"norole\.jsonl: line 3: .*field messages\[0\]\.role"):
        read_conversations(str(no_role), str(tmp_path / "hf"))
    unknown = _write_jsonl(tmp_path / "other.jsonl", [{"text": "plain"}])
    with pytest.raises(ConversationInputError, match=r"other\.jsonl: .*no field fits a conversation format"):
        read_conversations(str(unknown), str(tmp_path / "hf"))
    with pytest.raises(ConversationInputError, match="matches no file"):
        read_conversations(str(tmp_path / "nothing*.jsonl"), str(tmp_path / "hf"))


def test_skipped_and_truncated_conversations_are_counted(tmp_path, tok):
    long_answer = " ".join(f"word{i}" for i in range(300))
    path = _write_jsonl(tmp_path / "c.jsonl", [
        {"messages": CONV},
        {"messages": [{"role": "user", "content": "no answer here"}]},  # no assistant turn: skipped
        {"messages": [{"role": "user", "content": "long"}, {"role": "assistant", "content": long_answer}]}])
    for overflow, sequences in (("truncate", 2), ("split", None)):
        d = DataConfig(source="conversations", path=str(path), min_len=8, max_len=128)
        d.conversations.cache_dir, d.conversations.heldout_per_10k = str(tmp_path / "hf"), 0
        d.conversations.overflow = overflow
        cs = load_conversation_set(d, tok)
        assert cs.stats["data/skipped"] == 1 and cs.stats["data/truncated"] == 1, overflow
        assert all(n <= 128 for n in cs.train["length"])
        if sequences:
            assert len(cs.train) == sequences
        else:  # the long conversation split into max_len windows
            assert len(cs.train) > 3 and sum(cs.train["length"]) > 400


def test_the_cli_exits_2_naming_the_malformed_line(tmp_path):
    bad = _write_jsonl(tmp_path / "bad.jsonl", [{"messages": CONV}, "{not json"])
    out = subprocess.run([sys.executable, "-m", "experiments.run", "+target=tiny_random_chat", "+data=conversations",
                          f"data.path={bad}", f"data.conversations.cache_dir={tmp_path / 'hf'}", "+eval=off",
                          f"run_dir={tmp_path / 'run'}", "tracking.enabled=false", "trainer.max_steps=1"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "bad.jsonl: line 2: not valid JSON" in out.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_training_on_conversations_logs_data_metrics_and_tags(chat_cfg, tmp_path):
    from dflash.app.run import train
    res = train(chat_cfg(f"data.path={SAMPLE}", run="chat"))
    rows = [json.loads(line) for line in (res.run_dir / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in rows if "data/skipped" in r][-1]
    assert last["data/conversations"] == 200 and last["data/skipped"] >= 0 and "data/truncated" in last
    assert last["data/train_sequences"] + last["data/heldout_conversations"] >= 200
    # the budget counts every token; data/trained_tokens the assistant tokens among them (the loss's)
    tok = [r for r in rows if "data/trained_tokens" in r][-1]
    assert 0 < tok["data/trained_tokens"] < tok["data/consumed_tokens"]
    tags = json.loads((res.run_dir / "tags.json").read_text())
    assert tags["data.responses"] == "dataset" and tags["data.kind"] == "conversations"
    assert tags["data.formats"] == "openai+sharegpt"


def test_bad_conversation_settings_are_config_errors(chat_cfg):
    from dflash.config import validate
    with pytest.raises(ConfigError, match="data.conversations.responses"):
        validate(chat_cfg(f"data.path={SAMPLE}", "data.conversations.responses=engine"))
    with pytest.raises(ConfigError, match="data.chat.think"):
        validate(chat_cfg(f"data.path={SAMPLE}", "data.chat.think=maybe"))
    with pytest.raises(ConfigError, match="matches no file"):
        validate(chat_cfg("data.path=/no/such/conversations.jsonl"))


def test_the_heldout_split_and_coding10_chat_are_eval_suites_with_prompt_lookup_and_cis(tmp_path, capsys):
    from experiments.config import compose_config
    from dflash.app.run import train
    fast = [o for o in CHAT_FAST if o != "+eval=off"]
    cfg = compose_config(fast + [
        f"run_dir={tmp_path / 'run'}", f"tracking.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}",
        f"data.conversations.cache_dir={tmp_path / 'hf'}", f"data.path={SAMPLE}", "eval.extra_suites=[]",
        "eval.max_new_tokens=8", "eval.tree_budgets=[2]", "eval.bootstrap=50", "eval.train_tasks=0",
        f"eval.cache_dir={tmp_path / 'eval'}", "data.conversations.eval_prompts=3", "data.conversations.eval_tokens=8",
        "trainer.max_steps=2"])
    metrics = train(cfg).metrics
    labels = {k.split("/")[3] for k in metrics if k.startswith("eval/suite/chat_heldout/")}  # the settings (t0 ...)
    assert labels
    for suite, n, label in [(s, n, lb) for s, n in (("chat_heldout", 3), ("coding10_chat", 10)) for lb in labels]:
        pre = f"eval/suite/{suite}/{label}/"
        assert metrics[pre + "num_tasks"] == n
        for key in ("tau_vanilla", "tau_vanilla_ci_low", "tau_vanilla_ci_high", "tau_prompt_lookup",
                    "delta_prompt_lookup"):
            assert pre + key in metrics, pre + key
    out = capsys.readouterr().out
    assert re.search(r"\| chat_heldout \| t0[^|]* \| 3 \|", out)  # suite, setting, prompts
    assert re.search(r"\| coding10_chat \| t0[^|]* \| 10 \|", out)
    assert "not written by the target in this run" in out



def test_chat_suites_are_cut_from_heldout_conversations_through_the_template(chat_cfg, tok, tmp_path):
    from dflash.app.chat_data import chat_suites
    cfg = chat_cfg(f"data.path={SAMPLE}", "data.conversations.eval_prompts=5")
    cs = load_conversation_set(cfg.data, tok)
    held, coding = chat_suites(cs, tok, cfg)
    assert held.name == "chat_heldout" and len(held.tasks) == 5 and held.max_new_tokens == 128
    for task, row in zip(held.tasks, cs.heldout):
        turn = row["heldout_turns"][0]  # the first held-out turn's prompt
        assert task.prompt.endswith("<|im_start|>assistant\n")  # the target writes the next turn
        assert task.prompt.endswith(row["messages"][turn - 1]["content"] + "<|im_end|>\n<|im_start|>assistant\n")
    assert coding.name == "coding10_chat" and len(coding.tasks) == 10
    assert all(t.prompt.startswith("<|im_start|>user\n") for t in coding.tasks)


def test_trained_tokens_count_the_masks_and_survive_a_resume():
    """data/trained_tokens: the tokens inside the loss masks (assistant turns), beside the consumed tokens the
    budget counts; carried by a checkpoint; not logged for unmasked data (every token trains there)."""
    from types import SimpleNamespace

    import torch

    from dflash.training.batching import masked_tokens
    from dflash.training.datastream import DataMeter
    item = lambda mask: SimpleNamespace(tokens_T=torch.zeros(6, dtype=torch.long),
                                        loss_mask_T=None if mask is None else torch.tensor(mask, dtype=torch.bool))
    assert masked_tokens([item(None), item(None)]) is None
    assert masked_tokens([item([0, 0, 1, 1, 1, 0]), item(None)]) == 3 + 6
    data = SimpleNamespace(distinct_seen=lambda n: n, epochs=lambda n: 1.0, stats={}, writer=None)
    plain = DataMeter(data, 0)
    plain.add(12, 2, masked_tokens([item(None), item(None)]))
    assert "data/trained_tokens" not in plain.read()
    meter = DataMeter(data, 0)
    meter.add(12, 2, masked_tokens([item([0, 1, 1, 0, 0, 0]), item([1, 1, 1, 1, 0, 0])]))
    again = DataMeter(data, 0)
    again.load_state_dict(meter.state_dict())
    again.add(6, 1, masked_tokens([item([0, 0, 0, 0, 1, 1])]))
    out = again.read()
    assert (out["data/consumed_tokens"], out["data/trained_tokens"]) == (18.0, 8.0)
    old = DataMeter(data, 0)
    old.load_state_dict({"items": 2, "tokens": 12})  # a checkpoint from before the count
    assert "data/trained_tokens" not in old.read()
