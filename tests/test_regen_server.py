"""`python -m experiments.regen backend=openai url=...`: a real `transformers serve` (pip extra
`transformers[serving]`) serving the tiny chat target writes the responses; the shards are the ones a run reads,
the regen resumes, and a run trains on them with the framework's own target computing the hidden states."""
from __future__ import annotations

import contextlib
import json
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from tests.test_conversations import SAMPLE, chat_cfg  # noqa: F401 - the fixture
from tests.test_conversations_target import TARGET, _rows, _shards

ROOT = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def save_chat_target(tmp_path, chat_cfg) -> Path:
    """The tiny chat target saved as a Hugging Face folder (weights, config, the tiny chat tokenizer)."""
    from dflash.target.model import ASSETS, build_random_model
    spec = chat_cfg().target.random
    ckpt = tmp_path / "ckpt"
    build_random_model(spec, torch.device("cpu"), torch.float32).save_pretrained(ckpt)
    for f in (ASSETS / "tiny_chat").iterdir():
        shutil.copy(f, ckpt / f.name)
    return ckpt


@contextlib.contextmanager
def transformers_serve(ckpt: Path, tmp_path: Path):
    """`transformers serve` of `ckpt` on the CPU at 127.0.0.1, up and answering: yields the endpoint's base URL."""
    pytest.importorskip("openai")  # transformers serve's own requirement (transformers[serving])
    port = _free_port()
    log = open(tmp_path / "serve.log", "w")
    server = subprocess.Popen([sys.executable, "-c", "from transformers.cli.transformers import main; main()",
                               "serve", str(ckpt), "--host", "127.0.0.1", "--port", str(port), "--device", "cpu",
                               "--dtype", "float32"], stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
    url = f"http://127.0.0.1:{port}/v1"
    try:
        for _ in range(600):  # its imports and the model's load take minutes on busy shared cores
            try:
                with urllib.request.urlopen(url + "/models", timeout=2) as r:
                    if json.loads(r.read())["data"]:
                        break
            except OSError:
                pass
            assert server.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            time.sleep(0.5)
        else:
            pytest.fail("transformers serve did not come up in 300 s")
        yield url
    finally:
        server.terminate()
        server.wait(timeout=60)
        log.close()


@pytest.fixture
def served_target(tmp_path, chat_cfg):
    """The tiny chat target saved as a Hugging Face folder and served by `transformers serve` on the CPU:
    (its folder, the endpoint's base URL)."""
    ckpt = save_chat_target(tmp_path, chat_cfg)
    with transformers_serve(ckpt, tmp_path) as url:
        yield ckpt, url


@pytest.mark.slow
def test_regen_through_transformers_serve_writes_shards_that_train(served_target, chat_cfg, tmp_path):
    from dflash.app.run import train
    from experiments.regen import main as regen
    ckpt, url = served_target
    ahead = tmp_path / "ahead"
    data = [f"data.path={SAMPLE}", *TARGET, f"target.path={ckpt}", f"data.online.shard_dir={ahead}"]
    args = [*data, f"data.conversations.cache_dir={tmp_path / 'hf'}", "+target=tiny_random_chat",
            "+data=conversations", "target.layer_ids=[0,1,2]", "backend=openai", f"url={url}",
            "server.concurrency=4"]
    first = regen([*args, "regen.batches=1"])  # a regen cut short ...
    assert first["data/regen_written_shards"] == 1 and first["data/written_tokens"] > 0
    again = regen([*args, "regen.batches=2"])  # ... resumes: only the missing shard is written
    assert again["data/regen_shards"] == 2 and again["data/regen_written_shards"] == 1
    assert again["perf/write_tok_s"] > 0
    shards = _shards(ahead)
    assert len(shards) == 2 and all(t.shape == (4, 64) for t in shards.values())  # write_batch × data.max_len
    # a run with the same data settings reads them, writes nothing, and trains on them
    run = train(chat_cfg(*data, run="reads"))
    rows = _rows(run.run_dir)
    last = [r for r in rows if "data/written_batches" in r][-1]
    assert last["data/shard_reads"] >= 2, last  # both server-written batches read (the run writes the later ones)
    losses = [r["train/loss"] for r in rows if "train/loss" in r]
    assert losses and all(x == x and x < 1e4 for x in losses)
    # greedy on the server is greedy on the same weights: the rows agree with the built-in writer's mostly
    inloop = tmp_path / "inloop"
    regen([*args[:-3], f"data.online.shard_dir={inloop}", "regen.batches=1", "regen.progress=false"])
    mine, server = _shards(inloop), {k: v for k, v in shards.items() if k.endswith("00000000.pt")}
    assert set(mine) == set(server)
    same = sum(int((mine[k] == server[k]).sum()) for k in mine) / sum(t.numel() for t in mine.values())
    print(f"tokens equal to the built-in writer's: {same:.3f}")
    assert same > 0.5  # the prompts at least; retokenizing the server's text may shift a few tokens


def test_a_bad_server_setting_is_named_before_any_work():
    from dflash.app.regen_shards import regen_config_from, validate_regen
    from dflash.data.responders import ServerConfig, ServerResponder
    from dflash.errors import ConfigError
    from experiments.config import compose_config
    from tests.test_conversations import CHAT_FAST
    cfg = compose_config([*CHAT_FAST, f"data.path={SAMPLE}", "data.conversations.responses=target"])
    for args, msg in ((["backend=vllm"], "backend='vllm'"), (["backend=openai"], "url=''"),
                      (["backend=openai", "url=http://h:1/v1", "server.engine=tgi"], "server.engine"),
                      (["backend=openai", "url=http://h:1/v1", "server.concurrency=0"], "concurrency")):
        with pytest.raises(ConfigError, match=msg):
            validate_regen(cfg, regen_config_from(args)[0])
    with pytest.raises(ConfigError, match="no OpenAI-compatible server answers"):
        ServerResponder(ServerConfig(url=f"http://127.0.0.1:{_free_port()}/v1", retries=0), None)
