"""`python -m sweeps.campaign_headroom <campaign> [out=campaign_out] [samples=24] [prompts=0] [policy=]
[device=auto] [threads=0] [run override ...]`: the oracle τ of a campaign whose cells were evaluated without it (`eval.oracle.samples=0`),
measured once, after the fact, on the campaign's pinned ground truth (docs/evaluation.md, "Headroom").

The oracle's rounds and the target's entropy depend on the target, the ground truth, the setting, the samples, the
seed, the block size and the proposal policy, not on the drafter (dflash/evaluation/headroom.py), so one
measurement per policy serves every cell of the campaign:

1. the cells' records: every run folder's objective table (`<out>/<campaign>/runs/<cell>/eval/served/tasks.json`)
   says the policy its cell was scored under (`eval.engine=vllm`: DFlash 1 `argmax`, DFlash 2 `sampled`), its block
   size and its ground-truth key;
2. the campaign's base config composed as its cells compose it (the first cell's overrides, `eval.truth_dir=
   <out>/<campaign>/truth`, then the run overrides given here), the target loaded, and the objective suite's pin at
   the objective setting found and checked by the key a cell's evaluation reads it under
   (`load_or_build_ground_truth`); its ground-truth key must be the cells'. The ground truth of the prompts measured
   is built from the pin's tokens by the same call (`truths_from_tokens`), for those prompts alone;
3. `oracle_and_entropy` on the first `prompts` prompts of the suite (all their samples; 0: every prompt) with
   `samples` target samples a round, once per (policy, block size) of the records, the policies sharing the
   marginals at an anchor both reach (they do not depend on the policy);
4. `<out>/<campaign>/headroom.json`, written atomically: per policy the oracle τ with its interval over prompts
   (`pooled_ci`, the evaluator's), its reach per block position, its per-task τ sums and rounds, the seconds it
   took, and what it was measured on (its prompts, samples, device, date, command, the target's entropy there);
   the target's entropy profile on those prompts; samples, prompts, device, target fingerprint, ground-truth
   key and this command.

`policy=argmax` (or `sampled`) measures that policy's oracle alone and keeps the other policies' entries of an
existing headroom.json measured on the same pinned ground truth, each with its own prompts: the policies' costs
differ (an oracle that accepts more drafts in fewer, longer rounds), so each can be measured on as many prompts as a
machine affords (the engine campaign's argmax oracle on 32 prompts on a GPU, its sampled one on fewer on a CPU).

One oracle round is a cached decode of `samples` rows × (block size − 2) steps plus a forward, unbatched, so on a CPU
`prompts` keeps it affordable: the engine store's first 2 prompts × 2 samples at 8 samples a round took 13 min 50 s
on one of 2 loaded cores (`threads=1`, 2026-12-06; docs/evaluation.md). Its cache (`<eval.cache_dir>/headroom/`) is keyed by the prompts' own ground-truth key,
so a cut run continues where it stopped and never stands in for the whole suite's oracle. The campaign report's
headroom section reads the file (sweeps/headroom_section.py). Bad input (an unknown campaign or key, samples < 1,
prompts < 0, no cell tables, no pinned ground truth, a pin that is not the cells') exits 2 naming the key or file
before any target forward.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import shlex
import sys
import time
from pathlib import Path

from dflash.config import ConfigError
from dflash.overrides import apply_overrides
from sweeps.campaign_spec import Campaign, load_campaign, stage_cells
from sweeps.headroom_section import HEADROOM_FILE
from sweeps.shared_inputs import with_truth_pin

log = logging.getLogger("sweeps.campaign_headroom")
FORMAT = 1


@dataclasses.dataclass
class HeadroomArgs:
    out: str = "campaign_out"
    samples: int = 24  # target samples a round (the marginal's estimate)
    prompts: int = 0  # the first K prompts of the objective suite, every sample of each; 0: all
    device: str = "auto"  # the target's device (target.device)
    # torch's CPU threads (0: torch's default, one per core). On 2 cores shared with other work, 2 threads took
    # 14-25 s an oracle round (8 samples) and 1 thread 1.4-3.3 s (2026-12-06, load 5)
    threads: int = 0
    policy: str = ""  # argmax | sampled: that policy's oracle alone, the others' kept from headroom.json; '': all


def check_args(args: HeadroomArgs) -> None:
    from dflash.devices import check_device
    if args.samples < 1:
        raise ConfigError(f"samples={args.samples}: the oracle needs at least 1 target sample a round")
    if args.prompts < 0:
        raise ConfigError(f"prompts={args.prompts}: expected 0 (every prompt) or a positive count")
    if args.policy not in ("", "argmax", "sampled"):
        raise ConfigError(f"policy={args.policy!r}: expected argmax, sampled or '' (every policy the cells were scored "
                          f"under)")
    if args.threads < 0:
        raise ConfigError(f"threads={args.threads}: expected 0 (torch's default) or a positive count")
    try:
        check_device("device", args.device)
    except ValueError as e:
        raise ConfigError(str(e)) from e


def cell_records(folder: Path, suite: str) -> dict[tuple[str, int], dict]:
    """{(policy, block size): {"cells": [...], "ground_truth_keys": {...}}} from the objective tables of the run
    folders under `folder`/runs (module doc, step 1); ConfigError naming the folder where there are none."""
    out: dict[tuple[str, int], dict] = {}
    for f in sorted((folder / "runs").glob("*/eval/served/tasks.json")):
        info = json.loads(f.read_text()).get("info") or {}
        if info.get("suite_label", suite) != suite or "policy" not in info or "block_size" not in info:
            continue
        rec = out.setdefault((str(info["policy"]), int(info["block_size"])), {"cells": [], "ground_truth_keys": set()})
        rec["cells"].append(f.parents[2].name)
        rec["ground_truth_keys"].add(info.get("ground_truth_key"))
    if not out:
        raise ConfigError(f"{folder / 'runs'}: no cell's objective table (*/eval/served/tasks.json of suite "
                          f"{suite!r}) records its proposal policy and block size: nothing to measure the oracle for")
    return out


def compose(c: Campaign, folder: Path, args: HeadroomArgs, extra: list[str]):
    """The campaign's base config as its first cell composes it, on the pinned truth and the chosen device."""
    from experiments.config import compose_config
    device = [] if args.device == "auto" else [f"target.device={args.device}"]
    return compose_config([*stage_cells(c, 0, {})[0].overrides,
                           *with_truth_pin([*device, *extra], folder / "truth")])


@dataclasses.dataclass
class PinnedTruth:
    path: Path
    key: str  # `report.ground_truth_key` of the whole suite's pinned tokens: what the cells' tables record
    tasks: list  # the truths' tasks (`<prompt>#s<i>` at a sampled setting), prompt-major
    prompts: list[list[int]]
    continuations: list[list[int]]


def read_pin(target, suite, spec, truth_dir: str) -> PinnedTruth:
    """The pin a cell's evaluation reads for `suite` at `spec`, found by `load_or_build_ground_truth`'s own key and
    read (checked) without a forward. A missing pin is an error here: the evaluation would write one afresh, tokens
    the cells never ran on."""
    import torch

    from dflash.evaluation.ground_truth import TaskTruth, expand_tasks, prompt_token_ids
    from dflash.evaluation.report import ground_truth_key
    from dflash.evaluation.truth_pin import PinError, PinnedSuite
    spec = spec.for_suite(suite)
    tasks = expand_tasks(suite.tasks, spec)
    prompts = prompt_token_ids(target, tasks)
    pinned = PinnedSuite(str(target.identity), tuple(t.name for t in tasks), tuple(map(tuple, prompts)),
                         int(suite.max_new_tokens), int(getattr(target, "vocab_size", 0) or 0), spec.key())
    path = pinned.path(truth_dir)
    if not path.is_file():
        have = sorted(p.name for p in Path(truth_dir).glob("*.json"))
        raise ConfigError(f"eval.truth_dir={truth_dir}: no pinned ground truth {path.name} of suite {suite.name!r} "
                          f"at {spec.sampling.describe()} for this target (pins there: {have or 'none'})")
    try:
        pin = pinned.read(path)
    except PinError as e:
        raise ConfigError(str(e)) from e
    light = [TaskTruth(t.name, torch.tensor(ids, dtype=torch.long), torch.tensor(cont, dtype=torch.long),
                       torch.empty(0)) for t, ids, cont in zip(tasks, prompts, pin.continuations)]
    return PinnedTruth(path, ground_truth_key(target, light), tasks, prompts, pin.continuations)


def first_prompts(pin: PinnedTruth, k: int) -> list[int]:
    """The indices of the pinned tasks of the suite's first `k` prompts (every sample of each); k = 0: all."""
    from dflash.evaluation.ground_truth import _group_of
    groups: list[str] = []
    for t in pin.tasks:
        if (_group_of(t.name) or t.name) not in groups:
            groups.append(_group_of(t.name) or t.name)
    keep = set(groups[:k] if k else groups)
    return [i for i, t in enumerate(pin.tasks) if (_group_of(t.name) or t.name) in keep]


def chosen_truths(target, pin: PinnedTruth, k: int, sampling) -> list:
    """The ground truth of the first `k` prompts, built from the pin's tokens by the call a pinned evaluation makes
    (`truths_from_tokens`, as `load_or_build_ground_truth` does for the whole suite): for these prompts alone, as
    the oracle reads only tokens and path probabilities (the whole held-out suite's features took 4 min on 2 CPU
    cores, 2026-12-06)."""
    from dflash.evaluation.ground_truth import truths_from_tokens
    idx = first_prompts(pin, k)
    return truths_from_tokens(target, [pin.tasks[i] for i in idx], [pin.prompts[i] for i in idx],
                              [pin.continuations[i] for i in idx], "pinned", sampling)


def computed_where(cache_dir: str, key: str, seconds: float, device: str) -> tuple[float, str]:
    """(`seconds`, `device`), or on a cache hit (seconds 0.0) the seconds the cached oracle took and the device it
    ran on when it was computed (a GPU's oracle read back on a CPU is still the GPU's measurement; '?' where the
    cache file predates saying it)."""
    if seconds or not cache_dir:
        return seconds, device
    try:
        data = json.loads((Path(cache_dir) / "headroom" / f"{key}.json").read_text())
        return float(data["seconds"]), str(data.get("device", "?"))
    except (OSError, ValueError, KeyError):
        return seconds, device


def oracle_entry(results: list, block_size: int, policy: str, level: float, n_boot: int) -> dict:
    """The oracle's τ (pooled over its rounds) with the evaluator's interval over prompts, reach, per-task sums."""
    from dflash.evaluation.headroom import oracle_tau, reach_metrics
    tau, ci = oracle_tau(results, level, n_boot)
    reach = reach_metrics(results, block_size, "")
    return {"policy": policy, "block_size": block_size, "tau": tau, "ci_low": ci.low,
            "ci_high": ci.high, "ci_level": level, "rounds": sum(len(r.taus_vanilla) for r in results),
            "reach": [reach[f"reach_pos{k:02d}"] for k in range(1, block_size)],
            "tasks": [{"task": r.name, "prompt": r.group, "tau_sum": sum(r.taus_vanilla), "rounds": len(r.taus_vanilla)}
                      for r in results]}


def entropy_profile_of(entropy: list[float]) -> dict:
    """headroom.json's entropy profile of the measured prompt samples (`entropy_metrics`, with the token count)."""
    from dflash.evaluation.headroom import entropy_metrics
    e = entropy_metrics(entropy)
    return {"mean": e["eval/target_entropy_mean"], "median": e["eval/target_entropy_median"],
            "below_0.1": e["eval/target_entropy_below_0.1"], "tokens": len(entropy)}


def measure(c: Campaign, folder: Path, args: HeadroomArgs, extra: list[str], command: str) -> dict:
    """headroom.json's content (module doc)."""
    import torch

    from dflash.evaluation.headroom import headroom_key, oracle_and_entropy
    from dflash.evaluation.prompts import objective_suite
    from dflash.evaluation.protocol import truth_specs
    from dflash.evaluation.report import ground_truth_key
    from dflash.target.model import Target
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = compose(c, folder, args, extra)
    ev = cfg.eval
    suite = objective_suite(ev)
    records = cell_records(folder, suite.name)
    if not Path(ev.truth_dir).is_dir() or not any(Path(ev.truth_dir).glob("*.json")):
        raise ConfigError(f"eval.truth_dir={ev.truth_dir}: no pinned ground truth there (a campaign pins its own in "
                          f"<out>/<campaign>/truth)")
    target = Target(cfg.target)
    spec = truth_specs(ev, target)[0]
    pin = read_pin(target, suite, spec, ev.truth_dir)
    cells_on = {pk: rec for pk, rec in records.items() if pin.key in rec["ground_truth_keys"]}
    if not cells_on:
        raise ConfigError(f"{pin.path}: its ground-truth key {pin.key[:16]}… is none of the cells' "
                          f"({sorted(k[:16] for r in records.values() for k in r['ground_truth_keys'] if k)}): "
                          f"the cells did not run on this pin")
    if args.policy:
        cells_on = {pk: rec for pk, rec in cells_on.items() if pk[0] == args.policy}
        if not cells_on:
            raise ConfigError(f"policy={args.policy}: no cell on this pin was scored under it (theirs: "
                              f"{sorted({pk[0] for pk in records})})")
    chosen = chosen_truths(target, pin, args.prompts, spec.sampling)
    sub_key = ground_truth_key(target, chosen)
    prompts = len({t.group for t in chosen})
    entry = []
    entropy: list[float] = []
    memo: dict = {}  # the marginals at a position, computed once for both policies (they do not depend on it)
    for (policy, bs), rec in sorted(cells_on.items()):
        log.info("oracle under %s drafts (block size %d, %d cells): %d prompts × %d samples, %d target samples a "
                 "round, on %s", policy, bs, len(rec["cells"]), prompts,
                 spec.per_prompt, args.samples, target.device)
        t0 = time.perf_counter()
        results, entropy, seconds = oracle_and_entropy(target, chosen, spec.sampling, args.samples, ev.seed, bs,
                                                       policy, sub_key, ev.cache_dir, memo)
        seconds, device = computed_where(ev.cache_dir, headroom_key(sub_key, spec.sampling, args.samples, ev.seed,
                                                                    bs, policy), seconds, str(target.device))
        e = oracle_entry(results, bs, policy, ev.ci_level, ev.bootstrap)
        entry.append({**e, "cells": rec["cells"], "seconds": round(seconds, 1),
                      "wall_s_this_call": round(time.perf_counter() - t0, 1),
                      "prompts": prompts, "prompt_samples": len(chosen),
                      "prompts_ground_truth_key": sub_key, "samples": args.samples, "device": device,
                      "date": time.strftime("%Y-%m-%d", time.gmtime()), "command": command,
                      "entropy": entropy_profile_of(entropy)})
        log.info("oracle τ under %s drafts: %.3f [%.3f, %.3f] in %.0f s", policy, e["tau"], e["ci_low"],
                 e["ci_high"], seconds)
    return {"format": FORMAT, "campaign": c.name, "command": command,
            "date": time.strftime("%Y-%m-%d", time.gmtime()), "suite": suite.name,
            "setting": spec.sampling.describe(), "sampling": spec.sampling.as_dict(), "samples": args.samples,
            "seed": ev.seed, "prompts": prompts, "prompts_in_suite": len(suite.tasks),
            "samples_per_prompt": spec.per_prompt, "prompt_samples": len(chosen),
            "device": str(target.device), "dtype": str(getattr(target, "dtype", "")).removeprefix("torch."),
            "threads": torch.get_num_threads(), "target_fingerprint": target.fingerprint,
            "target": str(target.identity), "ground_truth_key": pin.key, "pin": pin.path.name,
            "prompts_ground_truth_key": sub_key, "oracles": entry,
            "entropy": entropy_profile_of(entropy)}


ENTRY_FROM_FILE = ("prompts", "prompt_samples", "prompts_ground_truth_key", "samples", "device", "date", "command",
                   "entropy")  # what an entry measured on; a file written before entries said it says it for all


def kept_entries(old: dict | None, result: dict, policy: str) -> list[dict]:
    """The entries of an existing headroom.json that a `policy=` run keeps: the other policies' oracles on the same
    pinned ground truth, each with what it was measured on (from the old file's own top level where the entry
    does not say it)."""
    if not policy or not old or old.get("ground_truth_key") != result["ground_truth_key"]:
        return []
    return [{**{k: old[k] for k in ENTRY_FROM_FILE if k in old}, **o}
            for o in old.get("oracles", []) if o.get("policy") != policy]


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return {}
    ref, rest = argv[0], argv[1:]
    own = tuple(f"{f.name}=" for f in dataclasses.fields(HeadroomArgs))
    args = apply_overrides(HeadroomArgs(), [a for a in rest if a.startswith(own)], "argument")
    extra = [a for a in rest if not a.startswith(own)]
    c = load_campaign(ref)
    check_args(args)
    folder = Path(args.out) / c.name
    if not folder.is_dir():
        raise ConfigError(f"out={args.out}: no campaign folder {folder} (run the campaign, or unpack its store)")
    command = "python -m sweeps.campaign_headroom " + " ".join(shlex.quote(a) for a in argv)
    result = measure(c, folder, args, extra, command)
    from sweeps.headroom_section import read_headroom
    kept = kept_entries(read_headroom(folder), result, args.policy)
    result["oracles"] = sorted([*kept, *result["oracles"]], key=lambda o: (o["policy"], int(o["block_size"])))
    from dflash.atomic import atomic_write_text
    atomic_write_text(folder / HEADROOM_FILE, json.dumps(result, indent=1))
    print(f"{folder / HEADROOM_FILE}: " + "; ".join(
        f"oracle τ under {o['policy']} drafts {o['tau']:.3f} [{o['ci_low']:.3f}, {o['ci_high']:.3f}] (the first "
        f"{o.get('prompts', result['prompts'])} of {result['prompts_in_suite']} prompts × "
        f"{result['samples_per_prompt']} samples, {o.get('samples', result['samples'])} target samples a round)"
        for o in result["oracles"]))
    return result


if __name__ == "__main__":
    from experiments.config import run_cli
    run_cli(main)
