"""responses=target: the target rewrites every assistant turn, in the loop (online writer) or ahead (experiments.regen)."""
import json

import pytest
import torch

from dflash.atomic import load_checked
from dflash.data.conversation_data import response_mask
from tests.conftest import resume_rewrites_the_same_data
from tests.test_conversations import SAMPLE, chat_cfg  # noqa: F401 - the fixture

TARGET = ("data.conversations.responses=target", "data.online.write_batch=4", "data.max_len=64",
          "data.pool.max_prompt_len=48", "data.conversations.coding10_chat=false")


def _rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _losses(run_dir):
    return {r["step"]: r["train/loss"] for r in _rows(run_dir) if "train/loss" in r}


def _shards(d):
    """{folder/batch: tokens} of the online writer's shards under `d` (the folder is the data fingerprint)."""
    out = {}
    for p in sorted(d.rglob("*.pt")):
        raw = p.read_bytes()
        key = json.loads(raw[len(b"DFLASH-ONLINE\n"):raw.index(b"\n", 14)])["key"]
        out[f"{p.parent.name}/{p.name}"] = load_checked(p, b"DFLASH-ONLINE\n", 1, key)["tokens"]
    return out


def test_response_mask_stops_at_the_first_end_of_turn():
    seq = torch.tensor([5, 6, 7, 8, 9, 1, 4, 4, 1, 3])
    assert response_mask(seq, 3, 1).tolist() == [False] * 3 + [True] * 3 + [False] * 4
    assert response_mask(seq, 3, None).tolist() == [False] * 3 + [True] * 7


def test_target_written_responses_train_and_resume_exactly(chat_cfg, tmp_path):
    from dflash.app.run import train
    shards = tmp_path / "shards"
    det = ("+buffer=deterministic", "buffer.max_depth=4", "buffer.min_ready=4", "trainer.producer_batch=3")
    full = train(chat_cfg(f"data.path={SAMPLE}", *TARGET, *det, f"data.online.shard_dir={shards}", run="full"))
    last = [r for r in _rows(full.run_dir) if "data/written_batches" in r][-1]
    assert last["data/written_batches"] >= 3 and last["data/prompts"] > 200 and last["data/conversations"] == 200
    tags = json.loads((full.run_dir / "tags.json").read_text())
    assert tags["data.responses"] == "target" and tags["data.kind"] == "conversations_online"
    resume_rewrites_the_same_data(full.run_dir, shards, chat_cfg, tmp_path, _losses)


def test_regen_writes_the_shards_a_run_reads_and_resumes(chat_cfg, tmp_path, capsys):
    from dflash.app.run import train
    from experiments.regen import main as regen
    ahead, inloop = tmp_path / "ahead", tmp_path / "inloop"
    args = [f"data.path={SAMPLE}", *TARGET, f"data.conversations.cache_dir={tmp_path / 'hf'}", "+target=tiny_random_chat",
            "+data=conversations", "target.random.hidden_size=64", "target.random.num_layers=4",
            "target.random.intermediate_size=128", "target.random.head_dim=16", "target.random.linear_head_dim=16",
            "target.layer_ids=[0,1,2]", f"data.online.shard_dir={ahead}"]
    first = regen([*args, "regen.batches=2"])  # a regen cut short ...
    assert first["data/regen_written_shards"] == 2 and first["data/written_tokens"] > 0
    again = regen([*args, "regen.batches=5"])  # ... resumes: only the missing shards are written
    assert again["data/regen_shards"] == 5 and again["data/regen_written_shards"] == 3
    assert "tok/s" in capsys.readouterr().err  # the progress bar
    # a run with the same data settings reads them and writes nothing
    run = train(chat_cfg(f"data.path={SAMPLE}", *TARGET, f"data.online.shard_dir={ahead}", run="reads"))
    last = [r for r in _rows(run.run_dir) if "data/written_batches" in r][-1]
    assert last["data/written_batches"] == 0 and last["data/shard_reads"] >= 3
    # and they are exactly what the run would have written in its loop
    train(chat_cfg(f"data.path={SAMPLE}", *TARGET, f"data.online.shard_dir={inloop}", run="writes"))
    mine, theirs = _shards(ahead), _shards(inloop)
    assert theirs and set(theirs) <= set(mine)
    for name, tokens in theirs.items():
        assert torch.equal(tokens, mine[name]), name
    assert len(next(iter(theirs.values()))) == 4  # write_batch rows per shard


def test_regen_refuses_data_that_is_not_target_written(chat_cfg):
    from dflash.config import ConfigError
    from dflash.app.regen_shards import RegenConfig, run_regen
    with pytest.raises(ConfigError, match="responses=target"):
        run_regen(chat_cfg(f"data.path={SAMPLE}"), RegenConfig())


def test_regen_splits_the_work_over_torchrun_ranks(tmp_path):
    """Two regen ranks (gloo on the CPU) write the shards of two training ranks between them: the same files as
    one process writing them all."""
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    common = ["+target=tiny_random_chat", "+data=conversations", f"data.path={SAMPLE}", *TARGET,
              f"data.conversations.cache_dir={tmp_path / 'hf'}", "regen.batches=2", "regen.train_world=2",
              "regen.progress=false", "target.random.hidden_size=64", "target.random.num_layers=4",
              "target.random.intermediate_size=128", "target.random.head_dim=16", "target.random.linear_head_dim=16",
              "target.layer_ids=[0,1,2]"]
    for nproc, out in ((2, tmp_path / "two"), (1, tmp_path / "one")):
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"] \
            if nproc > 1 else [sys.executable]
        proc = subprocess.run([*launcher, "-m", "experiments.regen", *common, f"data.online.shard_dir={out}"],
                              cwd=root, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        if nproc > 1:  # each rank wrote its half of the (training rank, batch) pairs
            assert proc.stdout.count("data/regen_written_shards=2") == 2, proc.stdout
    two, one = _shards(tmp_path / "two"), _shards(tmp_path / "one")
    assert len(one) == 4 and set(two) == set(one)  # 2 training ranks x 2 batches
    assert all(torch.equal(two[k], one[k]) for k in one)


def test_turns_are_regenerated_in_rounds_each_prompted_with_the_earlier_answers():
    from dflash.data.conversations import message
    from dflash.data.regen import regenerate_turns
    convs = [[message("system", "S"), message("user", "u1"), message("assistant", "a1"), message("user", "u2"),
              message("assistant", "a2", train=False), message("user", "u3"), message("assistant", "a3")],
             [message("user", "v1"), message("assistant", "b1")]]
    calls = []

    def respond(prompts):  # one call per round; the "response" names the prompt's last user turn
        calls.append(prompts)
        return [[len(calls), *p] for p in prompts]
    seen = {}

    def prompt_ids(c, msgs):
        seen.setdefault(c, []).append([m["content"] for m in msgs])
        return [len(msgs)]
    out = regenerate_turns(convs, respond, prompt_ids, lambda c, p, ids: {"content": f"round{ids[0]}:{ids[1]}"})
    assert [len(r) for r in calls] == [2, 1]  # round 1: both conversations' first turns; round 2: the third turn
    assert [m["content"] for m in out[0] if m["role"] == "assistant"] == ["round1:2", "a2", "round2:6"]
    assert out[1][1]["content"] == "round1:1"
    # the target's own earlier answer, then the dataset's (untrained) turn
    assert seen[0][1] == ["S", "u1", "round1:2", "u2", "a2", "u3"]
    assert convs[0][2]["content"] == "a1"  # the input is left alone


def test_the_target_responder_ends_each_turn_at_its_end_token():
    from dflash.data.regen import greedy_generate, target_responder, until_end
    from dflash.target.model import Target, TargetConfig, TinyTargetSpec
    spec = TinyTargetSpec(hidden_size=32, num_layers=4, intermediate_size=64, num_heads=2, num_kv_heads=1,
                          head_dim=16, linear_num_key_heads=2, linear_num_value_heads=2, linear_head_dim=16)
    target = Target(TargetConfig(random=spec, layer_ids=[0, 1, 2], device="cpu"))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 5, 7)]
    free = [greedy_generate(target, torch.tensor([p]), 12)[0].tolist() for p in prompts]
    end = free[0][3]  # a token the first prompt's answer writes at its 4th position
    out = target_responder(target, end, 12, batch_size=2)(prompts)
    assert out == [until_end(f, end) for f in free] and len(out[0]) <= 4 and out[0][-1] == end
    assert until_end([1, 2, 3], 9) == [1, 2, 3] and until_end([1, 9, 3, 9], 9) == [1, 9]
    hot = target_responder(target, None, 12, batch_size=2, sampling=5.0, seed=3)
    assert hot(prompts) == hot(prompts) != out and all(len(r) == 12 for r in hot(prompts))  # seeded draws


def test_regen_turns_writes_a_conversation_file_a_run_reads(chat_cfg, tmp_path, monkeypatch):
    from dflash.data.conversations import read_conversations
    from experiments.regen import main as regen
    src = [{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                         {"role": "assistant", "content": "Hello there."}, {"role": "user", "content": "Bye"},
                         {"role": "assistant", "content": "Goodbye."}]},
           {"conversations": [{"from": "human", "value": "Q"}, {"from": "gpt", "value": "A", "weight": 0},
                              {"from": "human", "value": "Q2"}, {"from": "gpt", "value": "A2"}]}]
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in src))
    import dflash.data.regen as regen_lib
    out = tmp_path / "regen" / "turns.jsonl"
    args = ["+target=tiny_random_chat", "+data=conversations", f"data.path={path}", *TARGET,
            f"data.conversations.cache_dir={tmp_path / 'hf'}", "data.conversations.heldout_per_10k=0",
            "target.random.hidden_size=64", "target.random.num_layers=4", "target.random.intermediate_size=128",
            "target.random.head_dim=16", "target.random.linear_head_dim=16", "target.layer_ids=[0,1,2]",
            "regen.turn_tokens=6"]
    real, calls = regen_lib.target_responder, []

    def dies_in_round_2(*a, **k):  # a regen killed during its second round ...
        inner = real(*a, **k)
        return lambda prompts: (_ for _ in ()).throw(KeyboardInterrupt()) if calls.append(1) or len(calls) > 1 \
            else inner(prompts)
    monkeypatch.setattr(regen_lib, "target_responder", dies_in_round_2)
    with pytest.raises(KeyboardInterrupt):
        regen([*args, f"regen.turns_out={out}"])
    assert not out.exists() and (out.parent / ".turns.jsonl.rounds").is_file()
    asked = []

    def counted(*a, **k):
        inner = real(*a, **k)
        return lambda prompts: asked.extend(prompts) or inner(prompts)
    monkeypatch.setattr(regen_lib, "target_responder", counted)
    stats = regen([*args, f"regen.turns_out={out}"])  # ... resumes after its first round
    assert len(asked) == 1 and not (out.parent / ".turns.jsonl.rounds").exists()  # round 2's one turn only
    assert stats["data/regen_conversations"] == 2 and stats["data/regen_turns"] == 3
    fresh = tmp_path / "fresh" / "turns.jsonl"
    regen([*args, f"regen.turns_out={fresh}"])
    assert out.read_text() == fresh.read_text()
    ds, _ = read_conversations(str(out), str(tmp_path / "hf2"))
    rows = list(ds)
    assert [m["content"] for m in rows[0]["messages"] if m["role"] != "assistant"] == ["Be brief.", "Hi", "Bye"]
    assert rows[0]["messages"][2]["content"] != "Hello there."  # the target's own answer
    assert rows[1]["messages"][1]["content"] == "A" and not rows[1]["messages"][1]["train"]  # weight 0 kept
    assert not list(out.parent.glob(".*"))  # written atomically


def test_in_the_loop_each_later_turn_is_prompted_with_the_targets_own_answer(chat_cfg, tmp_path):
    """responses=target in training: turn 2's prompt holds the target's turn-1 answer, not the dataset's; each row is
    the target's own continuation of its prompt, trained up to its end of turn, never on the prompt."""
    from dflash.app.chat_data import build_run_data
    from dflash.data.writing import write_continuations
    from dflash.target.model import Target
    from dflash.training.distributed import DistInfo
    conv = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                         {"role": "assistant", "content": "Hello there."}, {"role": "user", "content": "Bye"},
                         {"role": "assistant", "content": "Goodbye."}]}
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps(conv) + "\n")
    common = (f"data.path={path}", *TARGET, "data.conversations.heldout_per_10k=0", "data.online.shard_dir=")
    cfg = chat_cfg(*common)
    target = Target(cfg.target)
    tok = target.tokenizer
    end = tok.convert_tokens_to_ids("<|im_end|>")
    writer = build_run_data(cfg, target, DistInfo()).writer
    first = writer.pool.prompts[0]
    free = write_continuations(target, [first], len(first) + 8)[0, len(first):].tolist()
    with torch.no_grad():  # the random target ends its turn where it would write its 4th token (or before)
        target.lm_head_weight()[end] = 1.5 * target.lm_head_weight()[free[3]]
    writer = build_run_data(cfg, target, DistInfo()).writer
    assert [writer.stream.locate(g)[2] for g in range(2)] == [0, 1]  # the conversation's two turns, in order
    rows = [(writer.sequence(g), writer.prompt_len(g), writer.loss_mask(g)) for g in range(2)]
    (seq1, p1, m1), (seq2, p2, m2) = rows
    answer1 = seq1[p1:p1 + int(m1.sum())].tolist()
    assert 1 < len(answer1) <= 4 and answer1[-1] == end  # the target's first answer, ended at its end of turn
    prompt2 = tok.decode(seq2[:p2].tolist())
    assert tok.decode(answer1) in prompt2 and "Hello there." not in prompt2 and "Bye" in prompt2
    # each row is exactly the target's continuation of its own prompt
    for seq, p, _ in rows:
        assert torch.equal(seq, write_continuations(target, [seq[:p].tolist()], seq.numel())[0])
    # the loss mask covers the written turn only: up to and including its first end token (the row's end when it
    # wrote none), never the prompt
    for seq, p, mask in rows:
        written = mask.nonzero().flatten().tolist()
        assert written == list(range(p, written[-1] + 1))
        assert seq[written[-1]] in writer.stop_ids or written[-1] == seq.numel() - 1
        assert all(t not in writer.stop_ids for t in seq[p:written[-1]].tolist())
    # sampled at data.online.sampling: seeded (a resume writes the same), not the greedy rows
    hot = [build_run_data(chat_cfg(*common, "data.online.sampling.temperature=1.0"), target, DistInfo()).writer
           for _ in range(2)]
    assert hot[0].sampling.temperature == 1.0
    assert torch.equal(hot[0].sequence(1), hot[1].sequence(1)) and not torch.equal(hot[0].sequence(0), seq1)
