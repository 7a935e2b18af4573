"""Pretraining the shipped reference target: a small `qwen3_5` hybrid code model (benchmarks/reference_target.md).

`pretrain(cfg, prompts)` runs one job of the recipe:

1. data (`dflash.pretrain.data`): the corpus (`dflash.data.corpus`; the shipped recipe reads every installed
   package's Python with `corpus.scope=installed`, the CPU default the standard library), a byte-level BPE
   tokenizer trained on (a bounded sample of) the train split, the token streams encoded once and cached;
2. the model (`dflash.pretrain.model`): `Qwen3_5ForCausalLM`, Gated DeltaNet : attention = 3 : 1, checked to
   stay under `max_bf16_bytes` before any training, and the Gated-DeltaNet kernels to train with;
3. training (`dflash.pretrain.loop`), resumed from the run's own checkpoint when there is one, until
   `max_steps` or this job's time budget (which leaves `finalize_reserve_s` for what follows);
4. the best `val` snapshot, rounded to bf16, scored on the `test` files next to a unigram model, and on the
   probes (files outside the corpus: the first target's standard-library test files, modern Python);
5. the Hugging Face folder (bf16 safetensors, config, tokenizer, `dflash_target.json` with the mask token,
   layer ids, recipe, corpus record and held-out metrics), written to a temp dir then renamed;
6. greedy continuations of the eval prompts through `dflash.target.model.Target` exactly as every run loads
   the target, their prompt-lookup τ, and the results markdown (`results_path`).

Every job writes the folder, so the target is usable after each; the next job resumes where this one
stopped. Logs to MLflow through `dflash.tracking.loggers.build_loggers` (kind tag `pretrain_target`); a
resumed job reopens the same MLflow run.
"""
from __future__ import annotations

import copy
import json
import logging
import math
import platform
import shutil
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import torch

from dflash.data.corpus import EOS_TOKEN, MASK_TOKEN, PAD_TOKEN, save_tokenizer, tokenizer_fingerprint
from dflash.devices import resolve_device
from dflash.pretrain.config import PretrainConfig, validate_pretrain_config
from dflash.pretrain.data import PretrainData, WindowSampler, prepare_data
from dflash.pretrain.evaluate import (eval_windows, evaluate_nll, generate_continuations, lookup_tau,
                                      perplexity_on_texts, probe_files, token_byte_lengths, unigram_nll)
from dflash.pretrain.loop import (LoopState, PretrainLoop, build_optimizer, check_resumable, checkpoint_path,
                                  lr_at, read_checkpoint, restore, resume_signature, save_checkpoint)
from dflash.pretrain.model import (bf16_bytes, build_hf_config, build_model, compare_grads, count_params,
                                   estimate_bf16_bytes, select_gdn_kernels)
from dflash.pretrain.report import PromptArg, normalize_prompts, results_markdown
from dflash.serving.export import write_dir_atomically
from dflash.target.model import TARGET_META
from dflash.tracking.loggers import build_loggers
from dflash.tracking.run_info import default_run_name, git_sha

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
__all__ = ["PretrainConfig", "pretrain", "compare_grads", "estimate_bf16_bytes", "lr_at", "write_folder_atomically",
           "results_markdown", "normalize_prompts"]


def _env(device: torch.device) -> dict:
    import transformers
    env = {"python": platform.python_version(), "torch": torch.__version__,
           "transformers": transformers.__version__, "device": str(device)}
    if device.type == "cuda":
        env["device"] = torch.cuda.get_device_name(device)
    try:
        import tokenizers
        env["tokenizers"] = tokenizers.__version__
    except Exception:
        pass
    return env


# -- saving -------------------------------------------------------------------------------------------
def write_folder_atomically(out_dir, write: Callable[[Path], None]) -> Path:
    """`write(tmp)` fills a temp folder next to `out_dir`, which then replaces `out_dir` whole; temp folders
    a killed earlier run left behind are cleared first."""
    out = Path(out_dir).resolve()
    for stale in out.parent.glob(f".{out.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    return write_dir_atomically(out, write)


def _fix_tokenizer_config(folder: Path) -> None:
    """Name the long-standing class (transformers 4.x and 5.x both load it) and write the special-token map."""
    p = folder / "tokenizer_config.json"
    cfg = json.loads(p.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    p.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    (folder / "special_tokens_map.json").write_text(json.dumps(
        {"eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN, "mask_token": MASK_TOKEN}, indent=2) + "\n")


def target_meta(cfg: PretrainConfig, model, data: PretrainData, metrics: dict, kdetails: dict,
                device: torch.device, command: str) -> dict:
    from dflash.target.model import default_layer_ids
    hf_cfg, tok = model.config, data.tok
    meta = {
        "format": FORMAT_VERSION, "name": "reference_math_target" if cfg.data == "math" else "reference_target",
        "mask_token_id": data.mask_id,
        "eos_token_id": data.eos_id, "pad_token_id": data.pad_id,
        "layer_ids": list(cfg.layer_ids) or default_layer_ids(cfg.num_layers),
        "model": {"model_type": hf_cfg.model_type, "num_layers": hf_cfg.num_hidden_layers,
                  "hidden_size": hf_cfg.hidden_size, "vocab_size": hf_cfg.vocab_size,
                  "layer_types": "".join("A" if t == "full_attention" else "L" for t in hf_cfg.layer_types),
                  "params": metrics["params"], "bf16_bytes": metrics["bf16_bytes"]},
        "corpus": data.corpus_stats,
        "tokenizer": {"fingerprint": tokenizer_fingerprint(tok), "vocab_size": tok.get_vocab_size(),
                      "special_tokens": {EOS_TOKEN: data.eos_id, PAD_TOKEN: data.pad_id, MASK_TOKEN: data.mask_id}},
        "recipe": asdict(cfg), "metrics": metrics, "gdn_kernels": kdetails, "env": _env(device),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "git_sha": git_sha(), "command": command,
    }
    meta["recipe"]["tracking"] = {k: v for k, v in meta["recipe"]["tracking"].items() if k != "tracking_uri"}
    return meta


def save_target(cfg: PretrainConfig, model, data: PretrainData, meta: dict) -> Path:
    save_model = copy.deepcopy(model).to("cpu", torch.bfloat16)
    save_model.config.dtype = torch.bfloat16
    gc = getattr(save_model, "generation_config", None)
    if gc is not None:
        gc.eos_token_id, gc.pad_token_id, gc.bos_token_id = data.eos_id, data.pad_id, None
        gc.do_sample = cfg.serve_temperature > 0  # the served setting (dflash.target.sampling reads it back)
        gc.temperature, gc.top_p, gc.top_k = cfg.serve_temperature or 1.0, cfg.serve_top_p, cfg.serve_top_k

    def write(tmp: Path) -> None:
        save_model.save_pretrained(str(tmp))
        save_tokenizer(data.tok, tmp, cfg.max_position_embeddings)
        _fix_tokenizer_config(tmp)
        meta["metrics"]["safetensors_bytes"] = sum(f.stat().st_size for f in tmp.glob("*.safetensors"))
        (tmp / TARGET_META).write_text(json.dumps(meta, indent=1, default=str) + "\n")

    return write_folder_atomically(cfg.out_dir, write)


# -- scoring ------------------------------------------------------------------------------------------
def progress(cfg: PretrainConfig, st: LoopState, data: PretrainData) -> dict:
    """How far the run has trained, over all its jobs: steps, tokens, epochs of the train split, tok/s."""
    tokens_seen = st.step * cfg.batch_size * cfg.seq_len
    return {"steps": st.step, "tokens_seen": tokens_seen, "epochs": tokens_seen / max(data.train.numel(), 1),
            "train_seconds": st.train_seconds, "tokens_per_s": tokens_seen / max(st.train_seconds, 1e-9),
            "stop_reason": st.stop_reason, "jobs": st.jobs}


def final_scores(cfg: PretrainConfig, model, data: PretrainData, st: LoopState, amp_dtype,
                 device: torch.device) -> tuple[dict, dict]:
    """(metrics, probes) of the shipped weights: the best val snapshot rounded to bf16."""
    if cfg.keep_best and st.best_state is not None:
        model.load_state_dict(st.best_state)
    with torch.no_grad():  # the shipped weights are bf16: score exactly those values
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).to(p.dtype))
    windows = eval_windows(data.test, cfg.seq_len, cfg.final_eval_tokens)
    s, n = evaluate_nll(model, windows, cfg.batch_size, amp_dtype, device)
    us, un = unigram_nll(data.train, windows, model.config.vocab_size)
    byte_len = token_byte_lengths(data.tok)
    test_bytes = int(sum(int(byte_len[w[1:].long()].sum()) for w in windows))
    m = {"params": count_params(model), "bf16_bytes": bf16_bytes(model), **progress(cfg, st, data),
         "best_step": st.best_step if cfg.keep_best else st.step,
         "job_history": st.history, "train_tokens": int(data.train.numel()),
         "val_loss": st.best_loss, "val_ppl": math.exp(min(st.best_loss, 50)),
         "test_loss": s / max(n, 1), "test_ppl": math.exp(min(s / max(n, 1), 50)), "test_tokens": n,
         "test_bits_per_byte": s / math.log(2) / max(test_bytes, 1),
         "unigram_loss": us / max(un, 1), "unigram_ppl": math.exp(min(us / max(un, 1), 50)),
         "unigram_bits_per_byte": us / math.log(2) / max(test_bytes, 1)}
    if device.type == "cuda":
        m["peak_memory_gb"] = torch.cuda.max_memory_allocated(device) / 2 ** 30
    probes = {name: perplexity_on_texts(model, data.tok, [t for _, t in files], cfg.seq_len, cfg.batch_size,
                                        amp_dtype, device)
              for name, files in probe_files(cfg.probes, cfg.probe_stdlib_v1).items()}
    for name, p in probes.items():
        m[f"probe_{name}_ppl"] = p["ppl"]
    log.info("held-out test: loss %.4f ppl %.2f (unigram ppl %.1f), probes %s, %d steps, %.0f tok/s",
             m["test_loss"], m["test_ppl"], m["unigram_ppl"], {k: round(v["ppl"], 2) for k, v in probes.items()},
             st.step, m["tokens_per_s"])
    return m, probes


def continuations_and_tau(cfg: PretrainConfig, out: Path, meta: dict, prompts: PromptArg, device: torch.device,
                          kernels) -> tuple[list[dict], str, dict]:
    """Greedy continuations through the shipped-target loading path (the bound kernels first, the torch
    functions if those fail) and their prompt-lookup τ. A failure here costs the continuations, not the model."""
    plist = normalize_prompts(prompts)
    if not plist:
        return [], "", {}
    kernels.restore()  # the target runs forward with the kernels transformers bound (FLA on GPU)
    try:
        conts, rep = generate_continuations(out, meta, plist, cfg.max_new_tokens, str(device))
        note = ", ".join(f"{k}={v}" for k, v in rep.items())
    except Exception as e:
        log.exception("continuations with the target's kernels failed; retrying with the torch functions")
        note = f"the target's kernels failed ({type(e).__name__}: {str(e)[:200]}); "
        try:
            conts, rep = generate_continuations(out, meta, plist, cfg.max_new_tokens, str(device), force_torch=True)
            note += "generated with " + ", ".join(f"{k}={v}" for k, v in rep.items())
        except Exception as e2:
            log.exception("continuations failed")
            return [], note + f"torch functions failed too ({type(e2).__name__}: {str(e2)[:200]})", {}
        finally:
            kernels.restore()
    return conts, note, lookup_tau(conts, cfg.lookup_draft_len)


# -- the recipe ---------------------------------------------------------------------------------------
def _build(cfg: PretrainConfig, data: PretrainData, device: torch.device, amp_dtype, logger):
    """The model (size-checked before any training) on the device and the kernels it trains with."""
    hf_cfg = build_hf_config(cfg, data.tok.get_vocab_size(), data.eos_id, data.pad_id)
    model = build_model(hf_cfg, cfg.seed)
    n_params, nbytes = count_params(model), bf16_bytes(model)
    if nbytes >= cfg.max_bf16_bytes:
        raise ValueError(f"the model holds {n_params:,} parameters = {nbytes / 1e6:.1f} MB in bf16, over "
                         f"max_bf16_bytes={cfg.max_bf16_bytes / 1e6:.1f} MB: shrink it")
    model.to(device).train()
    choice, kdetails, kernels = select_gdn_kernels(model, device, cfg, amp_dtype, hf_cfg.model_type)
    kdetails["choice"] = choice
    log.info("Gated-DeltaNet kernels for training: %s (%s)", choice, kdetails.get("reason"))
    logger.set_tags({"gdn_kernels": choice})
    return model, kdetails, kernels


def _train(cfg: PretrainConfig, model, data: PretrainData, device: torch.device, amp_dtype, logger,
           ckpt: dict | None, ckpt_path: Path, deadline: float) -> LoopState:
    sampler = WindowSampler(data.train.to(device), cfg.seq_len, cfg.batch_size, cfg.seed)
    opt = build_optimizer(cfg, model, device)
    state = restore(ckpt, model, opt, sampler) if ckpt else LoopState()
    if ckpt:
        log.info("resumed from %s at step %d (%.0f s trained over %d job(s))", ckpt_path, state.step,
                 state.train_seconds, state.jobs)
    signature, tok_json = resume_signature(cfg, data.corpus.fingerprint), data.tok.to_str()

    def save(st: LoopState) -> None:
        save_checkpoint(ckpt_path, model, opt, sampler, st, signature, tok_json, logger.run_id)

    logger.log({**data.setup, "setup/resumed_step": float(state.step)}, state.step)
    loop = PretrainLoop(cfg, model, opt, sampler, data.val, logger, device, amp_dtype, state, save)
    return loop.run(deadline - cfg.finalize_reserve_s)


def _finish(cfg: PretrainConfig, model, data: PretrainData, st: LoopState, kdetails: dict, kernels, logger,
            device: torch.device, amp_dtype, prompts: PromptArg, command: str, run_dir: Path, t_start: float) -> dict:
    metrics, probes = final_scores(cfg, model, data, st, amp_dtype, device)
    meta = target_meta(cfg, model, data, metrics, kdetails, device, command)
    meta["probes"] = probes
    out = save_target(cfg, model, data, meta)
    log.info("wrote %s", out)
    continuations, note, tau = continuations_and_tau(cfg, out, meta, prompts, device, kernels)
    metrics["wall_seconds"] = time.perf_counter() - t_start
    if tau:
        metrics["lookup_tau"] = tau["tau"]
        metrics["copy_rate"] = tau["copy_rate"]  # the target repeating itself: a defect a drafter study inherits
    logger.log({f"final/{k}": float(v) for k, v in metrics.items() if isinstance(v, (int, float))}, st.step)
    result = {"metrics": metrics, "meta": meta, "out_dir": str(out), "continuations": continuations,
              "continuations_note": note, "lookup_tau": tau, "probes": probes, "run_dir": str(run_dir)}
    (run_dir / "pretrain_result.json").write_text(json.dumps(
        {k: v for k, v in result.items() if k != "meta"}, indent=1, default=str))
    if cfg.results_path:
        md = results_markdown(result, command)
        Path(cfg.results_path).parent.mkdir(parents=True, exist_ok=True)
        Path(cfg.results_path).write_text(md)
        logger.log_text(md, "reference_target.md")
    logger.log_dict({k: v for k, v in meta.items() if k != "recipe"}, TARGET_META)
    return result


INTERMEDIATE_STOPS = ("time budget", "job_max_steps")


def _intermediate(cfg: PretrainConfig, st: LoopState, data: PretrainData, ckpt_path: Path, run_dir: Path,
                  t_start: float) -> dict:
    """A job that stopped early under `finalize_every_job=false`: its checkpoint is the result."""
    metrics = {**progress(cfg, st, data), "max_steps": cfg.max_steps, "val_loss": st.best_loss,
               "wall_seconds": time.perf_counter() - t_start}
    log.info("intermediate job: step %d of %d (%s), checkpoint %s; the next job resumes it", st.step,
             cfg.max_steps, st.stop_reason, ckpt_path)
    (run_dir / "pretrain_result.json").write_text(json.dumps({"metrics": metrics, "intermediate": True,
                                                              "checkpoint": str(ckpt_path)}, indent=1))
    return {"metrics": metrics, "intermediate": True, "checkpoint": str(ckpt_path), "run_dir": str(run_dir)}


def pretrain(cfg: PretrainConfig, prompts: PromptArg = None, command: str = "") -> dict:
    """One job of the recipe (module docstring). Returns {"metrics", "meta", "out_dir", "continuations",
    "lookup_tau", "probes", "run_dir"}."""
    t_start = time.perf_counter()
    validate_pretrain_config(cfg)
    device = resolve_device(cfg.device)
    amp_dtype = (torch.bfloat16 if (cfg.autocast == "bfloat16" or (cfg.autocast == "auto" and device.type == "cuda"))
                 else None)
    deadline = t_start + cfg.time_budget_s if cfg.time_budget_s > 0 else math.inf
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(cfg.seed)
    run_dir = Path(cfg.run_dir or f"runs/{default_run_name()}-pretrain_target")
    run_dir.mkdir(parents=True, exist_ok=True)
    ckpt_path = checkpoint_path(cfg, run_dir)
    ckpt = read_checkpoint(ckpt_path) if cfg.resume else None
    logger = build_loggers(cfg.tracking, run_dir, asdict(cfg), {"dflash.kind": "pretrain_target"},
                           cfg.max_steps, run_id=(ckpt or {}).get("mlflow_run_id"))
    with logger:
        data = prepare_data(cfg, ckpt["tokenizer"] if ckpt else None)
        if ckpt:
            check_resumable(ckpt, cfg, data.corpus.fingerprint, ckpt_path)
        model, kdetails, kernels = _build(cfg, data, device, amp_dtype, logger)
        try:
            st = _train(cfg, model, data, device, amp_dtype, logger, ckpt, ckpt_path, deadline)
            if not cfg.finalize_every_job and st.step < cfg.max_steps and st.stop_reason in INTERMEDIATE_STOPS:
                return _intermediate(cfg, st, data, ckpt_path, run_dir, t_start)
            return _finish(cfg, model, data, st, kdetails, kernels, logger, device, amp_dtype, prompts, command,
                           run_dir, t_start)
        finally:
            kernels.restore()
