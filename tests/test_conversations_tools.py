"""Agentic and reasoning conversations: tool calls and tools (OpenAI and ShareGPT forms), reasoning_content, ShareGPT
weights, skipped records, and the official Qwen3 / Qwen3.6 templates as they ship (no generation markers, earlier
turns rewritten): each trained assistant turn's tokens, and nothing else, carry loss."""
import json
import logging

import pytest

from dflash.data.chat import TEMPLATES, ChatConfig, TemplateError, prepare_tokenizer, render
from dflash.data.conversation_data import load_conversation_set, prompt_tokens
from dflash.data.conversations import ConversationInputError, read_conversations
from dflash.data.sources import DataConfig
from tests.test_conversations import SAMPLE, _write_jsonl, chat_cfg, tok  # noqa: F401 - fixtures

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
WEATHER = {"tools": TOOLS, "messages": [
    {"role": "system", "content": "You help with the weather."},
    {"role": "user", "content": "How warm is it in Paris?"},
    {"role": "assistant", "content": None, "reasoning_content": "I should look it up.",
     "tool_calls": [{"id": "c1", "type": "function",
                     "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "{\"celsius\": 21}"},
    {"role": "assistant", "content": "It is 21 °C in Paris.", "reasoning_content": "The tool said 21."},
    {"role": "user", "content": "And in Rome?"},
    {"role": "assistant", "content": "", "function_call": {"name": "get_weather", "arguments": "{\"city\": \"Rome\"}"}},
    {"role": "function", "name": "get_weather", "content": "{\"celsius\": 25}"},
    {"role": "assistant", "content": "25 °C in Rome."}]}
SHAREGPT = {"tools": json.dumps(TOOLS), "system": "Weather bot.", "conversations": [
    {"from": "human", "value": "Weather in Oslo?"},
    {"from": "gpt", "value": "Let me check.", "weight": 0},
    {"from": "function_call", "value": "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}"},
    {"from": "observation", "value": "{\"celsius\": 3}"},
    {"from": "gpt", "value": "3 °C in Oslo.", "weight": 1}]}


def _qwen3_turn(reasoning: str, content: str, calls=()) -> str:
    """Qwen3's rendering of a final assistant turn, written out by hand from its template (the reference)."""
    text = "<think>\n" + reasoning.strip("\n") + "\n</think>\n\n" + content.lstrip("\n")
    for k, (name, args) in enumerate(calls):
        text += ("\n" if content or k else "") + '<tool_call>\n{"name": "' + name + '", "arguments": ' + \
            json.dumps(args, ensure_ascii=False) + "}\n</tool_call>"
    return text + "<|im_end|>"


def _trained(tok, rows):
    return [tok.decode([t for t, m in zip(ids, mask) if m]) for ids, mask in rows]


def _rows(tok, tmp_path, records, template="qwen3", think="keep", name="c.jsonl"):
    path = _write_jsonl(tmp_path / name, records)
    ds, _ = read_conversations(str(path), str(tmp_path / "hf"))
    chat = ChatConfig(template=template, think=think)
    prepare_tokenizer(tok, chat)
    return [render(tok, r["messages"], chat, where=f"record {r['source']}", tools=r["tools"]) for r in ds]


def test_qwen3_trains_every_assistant_turn_of_a_tool_calling_conversation_on_its_own_row(tok, tmp_path):
    [rows] = _rows(tok, tmp_path, [WEATHER])
    assert len(rows) == 4  # Qwen3 rewrites earlier turns: one row per assistant turn, each over its own rendering
    assert _trained(tok, rows) == [
        _qwen3_turn("I should look it up.", "", [("get_weather", {"city": "Paris"})]),
        _qwen3_turn("The tool said 21.", "It is 21 °C in Paris."),
        _qwen3_turn("", "", [("get_weather", {"city": "Rome"})]),
        _qwen3_turn("", "25 °C in Rome.")]
    for ids, mask in rows:  # the trained tokens are the row's end: the turn; everything before it is context
        text = tok.decode(ids)
        assert mask == sorted(mask) and text.startswith("<|im_start|>system\nYou help with the weather.")
        assert '"name": "get_weather"' in text.split("<|im_end|>")[0]  # the tool schemas, in the system turn
    context = tok.decode([t for t, m in zip(*rows[3]) if not m])
    assert "<tool_response>\n{\"celsius\": 25}\n</tool_response>" in context  # tool results: context only
    assert "I should look it up." not in context  # Qwen3 drops earlier turns' reasoning, as when serving


def test_reasoning_drop_and_sharegpt_tools_weights_and_calls(tok, tmp_path):
    [rows] = _rows(tok, tmp_path, [WEATHER], think="drop")
    trained = _trained(tok, rows)
    assert not any("look it up" in t or "said 21" in t for t in trained)
    assert trained[1] == "It is 21 °C in Paris.<|im_end|>"  # drop: the empty think block is the prompt's
    [rows] = _rows(tok, tmp_path, [SHAREGPT], name="s.jsonl")
    # the weight-0 text and its function_call turn are one assistant turn (OpenAI's form), not trained on
    assert _trained(tok, rows) == [_qwen3_turn("", "3 °C in Oslo.")]
    assert "Let me check.\n<tool_call>\n{\"name\": \"get_weather\"" in tok.decode(rows[0][0])


def test_qwen3_6_renders_tool_calls_in_its_xml_form(tok, tmp_path):
    [rows] = _rows(tok, tmp_path, [WEATHER], template="qwen3_6")
    first = _trained(tok, rows)[0]
    assert first == ("I should look it up.\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis"
                     "\n</parameter>\n</function>\n</tool_call><|im_end|>")  # "<think>\n" is the generation prompt's
    assert all(TEMPLATES[n].is_file() for n in ("qwen3", "qwen3_6"))


def test_a_template_that_cannot_render_tools_is_an_error_naming_it(tok, tmp_path):
    with pytest.raises(TemplateError, match=r"the target tokenizer's chat template does not render record .*c\.jsonl#0"
                                            r".*does not render tools"):
        _rows(tok, tmp_path, [WEATHER], template="")
    calls_only = {"messages": WEATHER["messages"][1:5]}
    with pytest.raises(TemplateError, match="does not render tool calls .*'get_weather'"):
        _rows(tok, tmp_path, [calls_only], template="", name="d.jsonl")


def test_images_and_empty_turns_are_skipped_counted_and_named(tok, tmp_path, caplog):
    image = {"messages": [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                                       {"type": "image_url", "image_url": {"url": "x.png"}}]},
                          {"role": "assistant", "content": "A cat."}]}
    empty = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": ""}]}
    path = _write_jsonl(tmp_path / "c.jsonl", [WEATHER, image, empty, empty, SHAREGPT])
    d = DataConfig(source="conversations", path=str(path), min_len=8, max_len=1024)
    d.conversations.cache_dir, d.conversations.heldout_per_10k = str(tmp_path / "hf"), 0
    d.chat.template = "qwen3"
    with caplog.at_level(logging.WARNING):
        cs = load_conversation_set(d, tok)
    assert cs.stats["data/skipped_image_parts"] == 1 and cs.stats["data/skipped_empty_assistant_turn"] == 2
    assert cs.stats["data/skipped"] == 3 and cs.stats["data/train_sequences"] == 5  # 4 weather turns + 1 ShareGPT
    assert "c.jsonl#1" in caplog.text and "c.jsonl#2" in caplog.text


def test_the_sample_and_tool_records_train_with_qwen3s_shipped_template(chat_cfg, tmp_path):
    """The issue's bar: the test data plus tool-calling and reasoning_content records, Qwen3's own template (no
    markers), a short CPU run; then the trained tokens of every row are its last assistant turn only."""
    from dflash.app.run import train
    data = tmp_path / "data"
    data.mkdir()
    (data / "sample.jsonl").write_text(SAMPLE.read_text())
    _write_jsonl(data / "tools.jsonl", [WEATHER, SHAREGPT] * 4)
    cfg = chat_cfg(f"data.path={data}", "data.chat.template=qwen3", "data.max_len=256", run="qwen3")
    res = train(cfg)
    rows = [json.loads(line) for line in (res.run_dir / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in rows if "data/train_sequences" in r][-1]
    assert last["data/train_sequences"] > 200 and "train/loss" in rows[-1] or any("train/loss" in r for r in rows)
    from transformers import AutoTokenizer
    from dflash.target.chat_tokenizer import OUT
    tk = prepare_tokenizer(AutoTokenizer.from_pretrained(str(OUT), local_files_only=True), cfg.data.chat)
    cs = load_conversation_set(cfg.data, tk)
    spans = 0
    for ids, mask in zip(cs.train["input_ids"], cs.train["loss_mask"]):
        runs = [i for i in range(len(mask)) if mask[i] and (i == 0 or not mask[i - 1])]
        for a in runs:  # each trained span: an assistant turn from after its header to its end-of-turn token
            b = next((j for j in range(a, len(mask)) if not mask[j]), len(mask))
            text = tk.decode(ids[a:b])
            assert tk.decode(ids[:a]).endswith("<|im_start|>assistant\n") and "<|im_start|>" not in text
            assert text.endswith("<|im_end|>") and text.count("<|im_end|>") == 1 or b == len(ids) == 256, text
            spans += 1
    assert spans >= last["data/train_sequences"]
    import mlflow
    run_id = json.loads((res.run_dir / "tags.json").read_text()).get("mlflow.runId") or res.run_id
    names = [a.path for a in mlflow.MlflowClient(cfg.tracking.tracking_uri).list_artifacts(run_id, "data")]
    assert names == ["data/conversations.md"]  # the run's data report, as experiments.data inspect prints it


def test_prompts_are_cut_from_the_middle_keeping_the_system_prompt(tok):
    chat = ChatConfig()
    prepare_tokenizer(tok, chat)
    from dflash.data.conversations import message
    history = [message("system", "SYSTEM RULES")]
    for i in range(12):
        history += [message("user", f"question {i} " * 5), message("assistant", f"answer {i} " * 5)]
    history.append(message("user", "last question"))
    ids, cut = prompt_tokens(tok, history, chat, "", 120)
    text = tok.decode(ids)
    assert cut and len(ids) <= 120 and text.startswith("<|im_start|>system\nSYSTEM RULES<|im_end|>")
    assert text.endswith("last question<|im_end|>\n<|im_start|>assistant\n") and "question 0 " not in text
    assert prompt_tokens(tok, history[:3], chat, "", 120)[1] is False


def test_empty_and_blank_files_say_so(tmp_path):
    for name, text in (("empty.jsonl", ""), ("blank.jsonl", "\n\n  \n")):
        (tmp_path / name).write_text(text)
        with pytest.raises(ConversationInputError, match=rf"{name}: the file is empty"):
            read_conversations(str(tmp_path / name), str(tmp_path / "hf"))


@pytest.mark.slow
def test_chat_heldout_is_the_objective_of_a_sweep_and_the_gate(tmp_path):
    """eval.suite=chat_heldout: two sweep trials rank on the user's held-out prompts (eval/tau_vanilla from them),
    and the promotion gate judges the best trial by that figure."""
    import mlflow
    import yaml

    from dflash.serving.promotion import PromoteConfig, promote
    from sweeps.launch import main
    from tests.test_conversations import CHAT_FAST
    fixed = [o for o in CHAT_FAST if o not in ("+eval=off", "trainer.max_steps=6")] + [
        f"data.path={SAMPLE}", f"data.conversations.cache_dir={tmp_path / 'hf'}", "trainer.max_steps=3",
        "eval.suite=chat_heldout", "eval.extra_suites=[]", "eval.max_new_tokens=8", "eval.tree_budgets=[2]",
        "eval.bootstrap=20", "eval.train_tasks=0", "data.conversations.eval_prompts=3",
        "data.conversations.eval_tokens=8", "data.conversations.coding10_chat=false"]
    sweep = tmp_path / "chat_sweep.yaml"
    sweep.write_text(yaml.safe_dump({
        "name": "chat_sweep", "description": "chat_heldout as the objective", "fixed": fixed,
        "space": {"trainer.lr": {"type": "choice", "choices": [1.0e-4, 1.0e-3]}},
        "objective": {"metric": "eval/tau_served", "direction": "maximize"},
        "sampler": {"type": "random", "seed": 0}, "pruner": {"type": "none"}}))
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    out = main([str(sweep), f"out={tmp_path / 'out'}", f"tracking.tracking_uri={uri}", "tracking.experiment=chat",
                f"eval.cache_dir={tmp_path / 'eval'}", "n_trials=2", "workers=1"])
    assert out["n_trials"] == 2
    client = mlflow.MlflowClient(uri)
    exp = client.get_experiment_by_name("chat")
    runs = [r for r in client.search_runs([exp.experiment_id], f"tags.`mlflow.parentRunId` = '{out['parent_run_id']}'")]
    assert len(runs) == 2
    for r in runs:  # the objective is the held-out chat prompts: 3 tasks (eval/<setting>/...), no coding10
        m = r.data.metrics
        tasks = [v for k, v in m.items() if k.count("/") == 2 and k.endswith("/num_tasks")]
        assert tasks and set(tasks) == {3} and "eval/tau_served" in m
        assert not any("coding10" in k for k in m)
    best = max(runs, key=lambda r: r.data.metrics["eval/tau_served"])
    decision = promote(best.info.run_id, PromoteConfig(metric="eval/tau_served"), uri, dry_run=True)
    assert decision.candidate_value == pytest.approx(best.data.metrics["eval/tau_served"])
    assert "not evaluated" not in decision.reason


def test_chat_heldout_needs_conversation_data_with_a_heldout_split(chat_cfg):
    from dflash.config import ConfigError, validate
    from experiments.config import compose_config
    with pytest.raises(ConfigError, match="eval.suite=chat_heldout: built by data.source=conversations"):
        validate(compose_config(["+target=tiny_random", "eval.suite=chat_heldout"]))
    with pytest.raises(ConfigError, match="heldout_per_10k"):
        validate(chat_cfg(f"data.path={SAMPLE}", "eval.suite=chat_heldout", "data.conversations.heldout_per_10k=0",
                          "eval.enabled=true"))
    validate(chat_cfg(f"data.path={SAMPLE}", "eval.suite=chat_heldout", "eval.enabled=true"))


def test_inspect_shows_a_tool_calling_record_with_its_trained_tokens_marked(tmp_path, capsys):
    from experiments.data import main
    path = _write_jsonl(tmp_path / "c.jsonl", [WEATHER, SHAREGPT])
    text = main(["inspect", f"data.path={path}", "data.chat.template=qwen3", "n=2", f"out={tmp_path / 'r.md'}",
                 f"data.conversations.cache_dir={tmp_path / 'hf'}", "data.conversations.heldout_per_10k=0",
                 "data.max_len=1024"])
    assert (tmp_path / "r.md").read_text() == text and text in capsys.readouterr().out
    call = '⟦<think>\nI should look it up.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": ' \
           '{"city": "Paris"}}\n</tool_call><|im_end|>⟧'
    assert call in text and "<|im_start|>assistant\n" + call in text
    assert "⟦" not in text.split("### row 0")[1].split(call)[0]  # system, user and tool turns: unmarked
    for figure in ("| formats | {\"openai\": 1, \"sharegpt\": 1} |", "| tool_call_share | 0.500 |",
                   "| reasoning_share | 0.333 |", "| train_rows | 5 |", "| trained_token_share |"):
        assert figure in text, figure
    with pytest.raises(SystemExit):
        from experiments.config import run_cli
        run_cli(lambda: main(["inspect", "data.path=/no/such.jsonl"]))
