"""The engine check (docs/engines.md): a drafter served by llama.cpp next to the evaluator's rounds on the engine's
own tokens. `python -m experiments.serve_check` calls `serve_check`.

Order: build llama.cpp (cached), convert the target and the drafter folder to GGUF with llama.cpp's converter
(float32, so the engine's forwards round as little as they can away from torch's), start `llama-server` with the
drafter, send each prompt (token ids) at T=0 and at the target's sampling setting, read the engine's rounds and
tokens, then simulate the evaluator's rounds on those tokens (`dflash.evaluation.engine_check`).
"""
from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from dflash.evaluation.acceptance import BatchedDrafterProposer
from dflash.evaluation.engine_check import CheckResult, EngineRequest, simulate_requests
from dflash.evaluation.prompts import Task
from dflash.serving.export import load_drafter, read_serving_config
from dflash.serving.llamacpp import (LlamaCpp, LlamaCppError, LlamaServer, convert_to_gguf, ensure_llamacpp,
                                     rounds_by_task)
from dflash.target.sampling import GREEDY, Sampling


@dataclass
class ServeCheck:
    drafter_dir: Path  # the serving folder llama.cpp converts and the simulation loads
    target_dir: Path  # the target's checkpoint folder (config.json, safetensors, tokenizer)
    tasks: list[Task]
    max_new_tokens: int
    settings: list[Sampling]  # T=0 first, then the target's own setting when it samples
    seed: int = 0
    threads: int = 2


def _serve(server: LlamaServer, prompts: list[list[int]], names: list[str], chk: ServeCheck, setting: Sampling,
           seed_base: int) -> list[dict]:
    out = []
    for i, (name, ids) in enumerate(zip(names, prompts)):
        res = server.complete(ids, chk.max_new_tokens, setting.temperature, setting.top_p, setting.top_k,
                              seed_base + i)
        out.append({"name": name, "prompt_ids": ids, "response": res})
    return out


def run_engine(llama: LlamaCpp, chk: ServeCheck, target_gguf: Path, drafter_gguf: Path, work: Path,
               prompts: list[list[int]]) -> tuple[dict[Sampling, list[EngineRequest]], str]:
    """Every prompt at every setting on one llama-server; its rounds read from its log. Returns the requests per
    setting and the log's path."""
    block_size = int(read_serving_config(chk.drafter_dir)["block_size"])
    names = [t.name for t in chk.tasks]
    log = work / "llama-server.log"
    with LlamaServer(llama, target_gguf, drafter_gguf, draft_max=block_size - 1, log=log,
                     threads=chk.threads) as server:
        served = {s: _serve(server, prompts, names, chk, s, chk.seed + 1000 * k)
                  for k, s in enumerate(chk.settings)}
        n = sum(len(v) for v in served.values())
        rounds = rounds_by_task(_whole_log(server, n))
    if len(rounds) != n:
        raise LlamaCppError(f"{log}: {len(rounds)} tasks logged for {n} requests")
    out, k = {}, 0
    for s, reqs in served.items():
        out[s] = []
        for r in reqs:
            res = r["response"]
            tokens = [int(t) for t in res.get("tokens") or []]
            at_budget = res.get("stop_type") == "limit" or len(tokens) >= chk.max_new_tokens
            out[s].append(EngineRequest(r["name"], r["prompt_ids"], tokens, rounds[k], chk.max_new_tokens, at_budget))
            _check_totals(out[s][-1], res.get("timings") or {}, log)
            k += 1
    return out, str(log)


def _whole_log(server: LlamaServer, n_tasks: int, timeout_s: float = 30.0) -> str:
    """The server log once each of the `n_tasks` finished tasks has logged its timings (after its last round): a
    worker thread writes the log, so the last lines may land after the last response."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = server.log_text()
        if text.count(" total time =") >= n_tasks or time.monotonic() > deadline:
            return text
        time.sleep(0.2)


def _check_totals(req: EngineRequest, timings: dict, log: Path) -> None:
    """The logged rounds add up to the request's own statistics (`timings.draft_n[_accepted]`)."""
    got = (sum(m for m, _ in req.rounds), sum(d for _, d in req.rounds))
    want = (int(timings.get("draft_n_accepted", 0)), int(timings.get("draft_n", 0)))
    if got != want:
        raise LlamaCppError(f"{log}: request {req.name}: the logged rounds accept/draft {got}, its timings say {want}")


def serve_check(chk: ServeCheck, target, cache: Path | None = None, work: Path | None = None,
                say=print) -> list[CheckResult]:
    """The check (module doc) with `target` (a loaded `Target` of `chk.target_dir`, for the features). Raises
    ConversionError when llama.cpp cannot convert a folder, LlamaCppError when it cannot build or serve."""
    llama = ensure_llamacpp(cache, say=say)
    with tempfile.TemporaryDirectory(prefix="dflash-serve-check-") as tmp:
        work = Path(work) if work is not None else Path(tmp)
        t0 = time.monotonic()
        target_gguf = convert_to_gguf(llama, chk.target_dir, work / "target.gguf")
        drafter_gguf = convert_to_gguf(llama, chk.drafter_dir, work / "drafter.gguf", target_dir=chk.target_dir)
        say(f"converted the target and the drafter to GGUF in {time.monotonic() - t0:.0f} s")
        prompts = [list(target.tokenizer.encode(t.prompt)) for t in chk.tasks]
        t0 = time.monotonic()
        served, log = run_engine(llama, chk, target_gguf, drafter_gguf, work, prompts)
        say(f"llama-server served {sum(len(v) for v in served.values())} requests in {time.monotonic() - t0:.0f} s"
            f" (log {log})")
    drafter = load_drafter(chk.drafter_dir, device=target.device)
    drafter.attach_target_head(target.embed_weight(), target.lm_head_weight())  # a folder has neither (shared)
    block_size = int(drafter.block_size)
    return [simulate_requests(target, BatchedDrafterProposer(drafter, k=1), block_size, reqs, s)
            for s, reqs in served.items()]


def settings_for(recommended: Sampling) -> list[Sampling]:
    """T=0 and the target's own setting (once when that is greedy too)."""
    return [GREEDY] if recommended.greedy else [GREEDY, recommended]
