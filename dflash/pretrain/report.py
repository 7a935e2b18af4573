"""The recipe's prompts and its results file (`benchmarks/reference_target.md`)."""
from __future__ import annotations

from typing import Callable, Sequence

PromptArg = Sequence | Callable[[], Sequence] | None


def normalize_prompts(prompts: PromptArg) -> list[tuple[str, str]]:
    """A list of strings, (name, prompt) pairs or objects with .name/.prompt — or a callable giving one."""
    if callable(prompts):
        prompts = prompts()
    out = []
    for i, p in enumerate(prompts or []):
        if isinstance(p, str):
            out.append((f"prompt{i}", p))
        elif isinstance(p, (tuple, list)) and len(p) == 2:
            out.append((str(p[0]), str(p[1])))
        elif hasattr(p, "prompt"):
            out.append((str(getattr(p, "name", f"prompt{i}")), str(p.prompt)))
        elif isinstance(p, dict):
            out.append((str(p.get("name", f"prompt{i}")), str(p["prompt"])))
        else:
            raise TypeError(f"prompt {i}: expected a string, (name, prompt) or an object with .prompt")
    return out


def _fmt(v, nd=3):
    return f"{v:.{nd}f}" if isinstance(v, float) else str(v)


def _header_lines(result: dict) -> list[str]:
    m, meta = result["metrics"], result["meta"]
    c, r = meta["corpus"], meta["recipe"]
    roots = ", ".join(f"`{x}`" for x in c.get("roots", [c["root"]]))
    return [
        f"- written: `{result['out_dir']}` ({meta.get('created', '')}, git {meta.get('git_sha', '?')}, "
        f"python {meta['env']['python']}, torch {meta['env']['torch']}, transformers {meta['env']['transformers']})",
        f"- device: {meta['env']['device']}; Gated-DeltaNet kernels for training: **{meta['gdn_kernels']['choice']}** "
        f"({meta['gdn_kernels'].get('reason', '')})",
        f"- model: `qwen3_5` text, {meta['model']['num_layers']} layers ({meta['model']['layer_types']}), hidden "
        f"{meta['model']['hidden_size']}, vocab {meta['model']['vocab_size']}; {m['params']:,} parameters, "
        f"{m['bf16_bytes'] / 1e6:.2f} MB in bf16 (safetensors on disk: {m['safetensors_bytes'] / 1e6:.2f} MB)",
        f"- corpus (scope `{c.get('scope', 'stdlib')}`: {roots}): {c['train_files']:,} train / "
        f"{c['val_files']:,} val / {c['test_files']:,} test files, {c['train_bytes'] / 1e6:,.1f} MB of train text, "
        f"{c.get('train_tokens', m['train_tokens']):,} train / {c.get('val_tokens', 0):,} val / "
        f"{c.get('test_tokens', 0):,} test tokens; skipped {c.get('skipped', {})}; "
        f"fingerprint `{c['fingerprint'][:16]}`",
        f"- training: {m['steps']} steps × {r['batch_size']} × {r['seq_len']} tokens = "
        f"{m['tokens_seen']:,} tokens ({m['epochs']:.2f} epochs) in {m['train_seconds']:.0f} s over "
        f"{m.get('jobs', 1)} job(s), **{m['tokens_per_s']:,.0f} tok/s**; stopped by {m['stop_reason']}; shipped step "
        f"{m['best_step']} ({'best val' if r['keep_best'] else 'last'}); this job's wall {m['wall_seconds']:.0f} s",
    ]


def _probe_lines(result: dict) -> list[str]:
    m = result["metrics"]
    lines = ["| held-out set | files | tokens | loss (nats/token) | perplexity | 95% CI (bootstrap over windows) "
             "| bits/byte |",
             "| --- | --- | --- | --- | --- | --- | --- |",
             f"| new test split | {result['meta']['corpus']['test_files']:,} | {m['test_tokens']:,} | "
             f"{_fmt(m['test_loss'])} | {_fmt(m['test_ppl'], 2)} | | {_fmt(m['test_bits_per_byte'])} |",
             f"| unigram on the same tokens (train counts, add-one) | | | {_fmt(m['unigram_loss'])} | "
             f"{_fmt(m['unigram_ppl'], 2)} | | {_fmt(m['unigram_bits_per_byte'])} |"]
    for name, p in result.get("probes", {}).items():
        ci = p.get("ppl_ci")
        ci_txt = f"[{_fmt(ci[0], 2)}, {_fmt(ci[1], 2)}] over {p.get('windows', '?')}" if ci else ""
        lines.append(f"| {name} | {p['files']} | {p['tokens']:,} | {_fmt(p['loss'])} | {_fmt(p['ppl'], 2)} | "
                     f"{ci_txt} | {_fmt(p['bits_per_byte'])} |")
    return lines + ["", f"Best val loss {_fmt(m['val_loss'])} (ppl {_fmt(m['val_ppl'], 2)})."]


def _continuation_lines(result: dict) -> list[str]:
    meta, tau = result["meta"], result.get("lookup_tau") or {}
    lines = [f"## Greedy continuations ({meta['recipe']['max_new_tokens']} tokens, loaded through "
             "`dflash.target.model.Target`)", ""]
    if result.get("continuations_note"):
        lines += [f"Gated-DeltaNet kernels for generation: {result['continuations_note']}.", ""]
    if tau:
        lines += [f"Prompt-lookup τ of these continuations: **{tau['tau']:.2f}** tokens per target forward "
                  f"({tau['proposer']}, {tau['draft_len']} tokens proposed per step).", ""]
        if "copy_rate" in tau:
            lines += [f"Copy rate: **{100 * tau['copy_rate']:.0f}%** of the continuations' {tau['copy_ngram']}-grams "
                      f"already occur earlier in prompt + continuation (`dflash.evaluation.prompt_lookup.copy_rate`).",
                      ""]
    for c in result.get("continuations", []):
        t = tau.get("per_prompt", {}).get(c["name"])
        lines += [f"### {c['name']}", "", f"Prompt ({c['prompt_tokens']} tokens):", "", "```python",
                  c["prompt"].rstrip("\n"), "```", "",
                  f"Target's greedy continuation ({len(c['continuation_ids'])} tokens"
                  + (f", prompt-lookup τ {t:.2f}" if t is not None else "") + "):", "",
                  "```python", c["continuation"].replace("```", "ʼʼʼ"), "```", ""]
    return lines


def results_markdown(result: dict, command: str = "") -> str:
    title = "Math reference target" if result.get("meta", {}).get("name") == "reference_math_target" \
        else "Reference target"
    lines = [f"# {title}: pretraining results", ""]
    if command:
        lines += ["Command:", "", "```", command, "```", ""]
    lines += _header_lines(result) + [""] + _probe_lines(result) + [""] + _continuation_lines(result)
    return "\n".join(lines) + "\n"
