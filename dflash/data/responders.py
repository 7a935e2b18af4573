"""Responses written by an inference server the user already runs (vLLM, SGLang, `transformers serve`): any
OpenAI-compatible `/v1/completions` endpoint serving the target.

`ServerResponder.continue_prompts(prompts, n_new, temperature, seed)` is the call of the shard writers: token prompts
in, exactly `n_new[i]` continuation tokens out for each, as the built-in writer returns them (`dflash.data.writing`).
Prompts go out as text (the target's tokenizer decodes them; every engine takes text, not every one takes token ids)
and the returned text is tokenized back with the same tokenizer. A row the server ends early (an end-of-turn token, a
tokenization that comes back shorter) is continued with a further request from where it stopped until it has its
length: like the built-in writer, a row never stops early. Requests run at once up to `concurrency`, shared by every
caller of one responder (a regen writing several shards at once), and each is retried with backoff on connection
errors, timeouts, 429 and 5xx, up to `retries` times. `complete_turn(prompt text, max_new, ...)` is the call of the
conversation-file regen (`dflash.app.regen_turns`): one assistant turn, ended where the server stops.

Exact length in one request where the engine allows it: `min_tokens` and `ignore_eos` (vLLM, SGLang) or a
`generation_config` with `min_new_tokens` (`transformers serve`); `engine` picks which (`auto` asks the server's
`/v1/models` for its `owned_by`, else sends the vLLM form). Hidden states are not the server's business: the
framework's target computes them from the written tokens when a run trains on them.
"""
from __future__ import annotations

import json
import logging
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Sequence

log = logging.getLogger(__name__)

ENGINES = ("auto", "vllm", "sglang", "transformers")
RETRY_HTTP = {408, 409, 425, 429, 500, 502, 503, 504}


@dataclass
class ServerConfig:
    url: str = ""  # the endpoint's base, e.g. http://host:8000/v1
    model: str = ""  # the served model's name; empty: the first of /v1/models
    engine: str = "auto"  # how to ask for an exact length: vllm | sglang | transformers | auto
    concurrency: int = 64  # requests in flight at once
    retries: int = 5  # per request, with exponential backoff
    timeout_s: float = 600.0  # per request
    api_key: str = ""  # sent as a bearer token when set


def validate_server(cfg: ServerConfig) -> None:
    from dflash.errors import ConfigError
    if not cfg.url.startswith(("http://", "https://")):
        raise ConfigError(f"url={cfg.url!r}: expected the server's OpenAI-compatible base URL, e.g. "
                          f"http://host:8000/v1")
    if cfg.engine not in ENGINES:
        raise ConfigError(f"server.engine={cfg.engine!r}: expected one of {list(ENGINES)}")
    if cfg.concurrency < 1 or cfg.retries < 0 or cfg.timeout_s <= 0:
        raise ConfigError(f"server.concurrency must be >= 1, server.retries >= 0 and server.timeout_s > 0; got "
                          f"{cfg.concurrency} / {cfg.retries} / {cfg.timeout_s}")


class ServerError(RuntimeError):
    pass


class ServerResponder:
    def __init__(self, cfg: ServerConfig, tokenizer):
        validate_server(cfg)
        self.cfg, self.tokenizer = cfg, tokenizer
        self.base = cfg.url.rstrip("/")
        # the bound on requests in flight, shared by every caller (a regen writing several shards at once)
        self._pool = ThreadPoolExecutor(max_workers=cfg.concurrency, thread_name_prefix="dflash-responder")
        self.requests = self.retried = 0
        try:
            models = self._request("GET", "/models")["data"]
        except ServerError as e:  # before any shard is written: the url is wrong or the server is not up
            from dflash.errors import ConfigError
            raise ConfigError(f"url={cfg.url!r}: no OpenAI-compatible server answers there ({e})") from e
        if not models:
            raise ServerError(f"{self.base}/models lists no model")
        chosen = next((m for m in models if m["id"] == cfg.model), None) if cfg.model else models[0]
        if chosen is None:
            raise ServerError(f"{self.base} serves {[m['id'] for m in models]}, not model={cfg.model!r}")
        self.model = chosen["id"]
        self.engine = cfg.engine if cfg.engine != "auto" else _engine_of(chosen)
        log.info("responder: %s at %s (%s), %d requests at once", self.model, self.base, self.engine,
                 cfg.concurrency)

    # -- HTTP ---------------------------------------------------------------------------------------------------
    def _request(self, method: str, path: str, body: dict | None = None) -> dict:
        headers = {"Content-Type": "application/json"}
        if self.cfg.api_key:
            headers["Authorization"] = f"Bearer {self.cfg.api_key}"
        data = None if body is None else json.dumps(body).encode()
        delay = 1.0
        for attempt in range(self.cfg.retries + 1):
            req = urllib.request.Request(self.base + path, data=data, headers=headers, method=method)
            try:
                with urllib.request.urlopen(req, timeout=self.cfg.timeout_s) as resp:
                    return json.loads(resp.read())
            except urllib.error.HTTPError as e:
                detail = e.read()[:500].decode(errors="replace")
                if e.code not in RETRY_HTTP or attempt == self.cfg.retries:
                    raise ServerError(f"{method} {self.base + path}: HTTP {e.code}: {detail}") from e
            except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
                if attempt == self.cfg.retries:
                    raise ServerError(f"{method} {self.base + path}: {e} (after {attempt + 1} attempts)") from e
            self.retried += 1
            time.sleep(delay)
            delay = min(delay * 2, 30.0)
        raise AssertionError("unreachable")

    def _complete(self, text: str, n: int, temperature: float, seed: int, top_p: float = 1.0,
                  top_k: int = 0, exact: bool = True) -> tuple[str, str]:
        """One completion of at most n tokens (`exact`: where the engine allows, exactly n; else it ends at the
        server's stop, its end-of-turn or end-of-text token): (text, finish_reason)."""
        body = {"model": self.model, "prompt": text, "max_tokens": n, "temperature": float(temperature),
                "seed": int(seed) % (2 ** 31)}
        sampled = temperature > 0
        if sampled and top_p < 1.0:
            body["top_p"] = float(top_p)
        top = {"top_k": int(top_k)} if sampled and top_k else {}
        if self.engine == "transformers":
            length = {"min_new_tokens": n} if exact else {}
            body["generation_config"] = json.dumps({**length, "max_new_tokens": n, **top})
        elif exact:  # vLLM and SGLang sampling params
            body.update(min_tokens=n, ignore_eos=True, **top)
        else:
            body.update(top)
        self.requests += 1
        choice = self._request("POST", "/completions", body)["choices"][0]
        return choice.get("text") or "", choice.get("finish_reason") or ""

    # -- the one call -------------------------------------------------------------------------------------------
    def continue_one(self, prompt: Sequence[int], n_new: int, temperature: float = 0.0, seed: int = 0,
                     top_p: float = 1.0, top_k: int = 0) -> list[int]:
        """Exactly `n_new` continuation tokens of `prompt` (token ids of the target's tokenizer), greedy at
        temperature 0, else sampled at the target's settings."""
        tok = self.tokenizer
        text = tok.decode(list(prompt), skip_special_tokens=False)
        out: list[int] = []
        for step in range(8):  # a short answer is continued from where it stopped
            piece, _ = self._complete(text, n_new - len(out), temperature, seed + 7919 * step, top_p, top_k)
            ids = tok.encode(piece, add_special_tokens=False)
            if not ids:  # the server wrote nothing more: its end-of-text token stands for the rest, once
                ids = [tok.eos_token_id] if tok.eos_token_id is not None else []
                piece = tok.decode(ids, skip_special_tokens=False)
            out += ids
            text += piece
            if len(out) >= n_new:
                return out[:n_new]
        raise ServerError(f"{self.base}: a prompt of {len(prompt)} tokens got {len(out)} of {n_new} tokens after 8 "
                          f"requests")

    def complete_turn(self, prompt_text: str, max_new: int, temperature: float = 0.0, seed: int = 0,
                      top_p: float = 1.0, top_k: int = 0) -> tuple[str, str]:
        """One assistant turn: `prompt_text` (the conversation through the chat template, with the generation
        prompt) continued until the server stops (its end of turn) or `max_new` tokens: (text, finish_reason)."""
        return self._complete(prompt_text, max_new, temperature, seed, top_p, top_k, exact=False)

    def continue_prompts(self, prompts: Sequence[Sequence[int]], n_new: Sequence[int], temperature: float = 0.0,
                         seed: int = 0, top_p: float = 1.0, top_k: int = 0) -> list[list[int]]:
        """`continue_one` for every prompt, all at once (bounded by `concurrency`), in input order."""
        futures = [self._pool.submit(self.continue_one, p, int(n), temperature, seed * 1_000_003 + i, top_p, top_k)
                   for i, (p, n) in enumerate(zip(prompts, n_new))]
        return [f.result() for f in futures]

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _engine_of(model: dict) -> str:
    """The engine behind an endpoint, from its /v1/models entry: vLLM and SGLang name themselves in `owned_by`;
    `transformers serve` gives "local" or the model's Hub organization."""
    owner = str(model.get("owned_by", "")).lower()
    return owner if owner in ("vllm", "sglang") else "transformers"
