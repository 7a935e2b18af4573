"""How degenerate the evaluation's ground truth and the training data are, at the served setting and greedy (the figures
docs/evaluation.md reports): `python -m benchmarks.truth_degeneracy [key=value ...]` (a run's config keys; default the
shipped reference target, the held-out suite at `+eval=full` size: 128 prompts x <= 256 tokens).

Prints, per setting (the target's served one, `eval.sampling`; and greedy), the held-out suite's ground truth:
4-gram repeat share, share of tokens inside a repeated 16-gram, share of prompts ending in a cycle, mean length,
prompt lookup's τ on it, and how many continuations ended by which rule (EOS, stop sequence, dedent: `eval.stop`,
length cap); beside them the same figures of the human continuations (the held-out files' own text)
and prompt lookup's τ there, and the ratio of the two τ. Then the training data the online writer writes with the
run's defaults (`data.online.*`; `--rows N` sequences, default 200): the same degeneracy figures and the share of
rows that end at a stop token. No drafter is needed; the ground truth is built through the evaluation's cache.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch


def suite_figures(target, cfg, suite, spec) -> dict:
    from dflash.evaluation.acceptance import simulate
    from dflash.data.stops import END_REASONS
    from dflash.evaluation.ground_truth import end_reasons, load_or_build_ground_truth
    from dflash.evaluation.prompt_lookup import PromptLookupProposer
    from dflash.evaluation.report import _sums, degeneracy_metrics, human_metrics, prompt_texts
    spec = spec.for_suite(suite)  # the suite's own code stop rule (eval.stop)
    truths, _ = load_or_build_ground_truth(target, suite.tasks, suite.max_new_tokens, cfg.eval.cache_dir, "",
                                           suite.name, spec)
    bs = cfg.drafter.block_size
    out = degeneracy_metrics("gt_", [t.continuation.tolist() for t in truths])
    pl = simulate(truths, PromptLookupProposer(bs, cfg.eval.prompt_lookup.min_n, cfg.eval.prompt_lookup.max_n), bs,
                  (), spec.sampling, cfg.eval.seed)
    s, n = _sums(pl)
    out["gt_tau_prompt_lookup"] = sum(s) / max(sum(n), 1)
    out["gt_mean_tokens"] = sum(t.n_new for t in truths) / len(truths)
    out["gt_count"] = len(truths)
    why = end_reasons(target, truths, spec, prompt_texts(suite, truths))
    out.update({f"gt_end_{r}": why.count(r) for r in END_REASONS})
    human = human_metrics(target, suite, truths, bs, cfg.eval, spec)
    out.update({k.removeprefix("eval/"): v for k, v in human.items()})
    return out


def data_figures(target, cfg, rows: int) -> dict:
    import dataclasses

    from dflash.data.corpus import load_corpus
    from dflash.data.online import OnlineWriter, resolve_online_config
    from dflash.data.pool import build_prompt_pool
    d = cfg.data
    seq_len = d.online_seq_len()
    pool = build_prompt_pool(load_corpus(d.corpus), target.tokenizer, d.pool, str(target.identity))
    online = dataclasses.replace(resolve_online_config(d.online, target, seq_len), write_batch=rows, shard_dir="")
    import dflash.data.online as online_mod
    online_mod.MEASURED_ROWS = rows  # every written row measured, not a sample
    writer = OnlineWriter(target, pool, online, seq_len)
    writer.sequence(0)
    return {**writer.stats(), "sampling": writer.sampling.describe(), "seq_len": seq_len}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=200, help="training sequences written for the data figures")
    ap.add_argument("--no-data", action="store_true", help="only the ground truth")
    args, overrides = ap.parse_known_args(argv)
    from experiments.config import compose_config
    from dflash.evaluation.prompts import resolve_suite
    from dflash.evaluation.protocol import truth_specs
    from dflash.target.model import Target
    from dflash.evaluation.ground_truth import TruthSpec
    cfg = compose_config(["+eval=full", *overrides])
    torch.manual_seed(0)
    target = Target(cfg.target)
    suite = resolve_suite("heldout", cfg.eval)
    specs = truth_specs(cfg.eval, target)
    if len(specs) == 1 and not specs[0].sampling.greedy:
        specs.append(TruthSpec(stop_ids=specs[0].stop_ids))
    print(f"target {cfg.target.name}; held-out suite {len(suite.tasks)} prompts x <= {suite.max_new_tokens} tokens; "
          f"stop tokens {list(specs[0].stop_ids)}; code stop: "
          f"{suite.stop.describe() if suite.stop else 'none'} (eval.stop)")
    for spec in specs:
        t0 = time.perf_counter()
        f = suite_figures(target, cfg, suite, spec)
        print(f"\n[{spec.sampling.label}: {spec.sampling.describe()}, {spec.per_prompt} sample(s) a prompt] "
              f"({time.perf_counter() - t0:.0f} s)")
        print(f"  ground truth: 4-gram repeats {f['gt_repeat4']:.3f}, tokens in repeated 16-grams "
              f"{f['gt_in_repeat16']:.3f}, cycles {100 * f['gt_cycle_share']:.1f}%, mean {f['gt_mean_tokens']:.0f} "
              f"tokens, prompt-lookup τ {f['gt_tau_prompt_lookup']:.3f}")
        print(f"  ends: {f['gt_end_eos']} at EOS, {f['gt_end_stop']} at a stop sequence, {f['gt_end_dedent']} at "
              f"the dedent, {f['gt_end_length']} at the length cap (of {f['gt_count']:.0f})")
        if "human_tau_prompt_lookup" in f:
            ratio = f["gt_tau_prompt_lookup"] / f["human_tau_prompt_lookup"]
            print(f"  human (first {suite.max_new_tokens} tokens of {f['human_prompts']:.0f}): 4-gram repeats "
                  f"{f['human_repeat4']:.3f}, in repeated 16-grams {f['human_in_repeat16']:.3f}, cycles "
                  f"{100 * f['human_cycle_share']:.1f}%, prompt-lookup τ {f['human_tau_prompt_lookup']:.3f}; "
                  f"ratio of prompt-lookup τ {ratio:.2f}")
    if not args.no_data:
        t0 = time.perf_counter()
        f = data_figures(target, cfg, args.rows)
        print(f"\ntraining data ({args.rows} rows x {f['seq_len']} tokens, {f['sampling']}; "
              f"{time.perf_counter() - t0:.0f} s): 4-gram repeats {f['data/repeat4']:.3f}, tokens in repeated "
              f"16-grams {f['data/in_repeat16']:.3f}, cycles {100 * f['data/cycle_share']:.1f}%, "
              f"{100 * f['data/ended_share']:.0f}% end at a stop token (measured on "
              f"all {args.rows} rows)")


if __name__ == "__main__":
    sys.exit(main())
