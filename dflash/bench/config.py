"""`bench.*` keys (experiments.bench's own; everything else is the run config) and the before/after variants."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from dflash.config import ConfigError, RunConfig, validate
from dflash.overrides import apply_overrides


@dataclass
class BenchConfig:
    seq_len: int = 2048
    target_batch: int = 4  # sequences per target forward
    anchors: int = 256  # blocks per sequence in the drafter step
    drafter_batch: int = 1  # sequences per drafter step
    warmup: int = 3
    iters: int = 10
    peak_n: int = 8192
    # The pipeline's headline: tokens the drafter trained on per second, over `pipeline_steps` steps after
    # `pipeline_warmup` steps, measured as `pipeline_repeats` windows of pipeline_steps / repeats steps each,
    # rounded up to whole producer periods (dflash.bench.pipeline.Schedule; their spread is printed).
    # 0 steps skips the pipeline measurement.
    pipeline_steps: int = 20
    pipeline_warmup: int = 10  # rounded up to whole windows (the trainer reads its metrics once per window)
    pipeline_repeats: int = 2
    profile_steps: int = 5  # pipeline steps traced by the profiler to count host syncs (0: no trace)
    sync_stacks: int = 0  # 1: record Python stacks in that trace to name each sync's call site (slow to process)
    # target_torch: the torch GDN fallback beside the fast path; serving: what τ buys (dflash/bench/serving_speed.py)
    sections: str = "peak,target,target_torch,drafter,pipeline"
    # Before/after, side by side: the drafter step and the pipeline again under each variant, a variant being
    # config overrides joined by '&', variants separated by ';' (e.g. "drafter.attn_group=0;trainer.compile=true")
    drafter_variants: str = ""
    pipeline_variants: str = ""
    # the target section again under each variant: only keys applied to the one built target in place
    # (IN_PLACE_TARGET_KEYS, e.g. "target.fused_ops=off"); drafter and pipeline variants may set them too
    target_variants: str = ""
    kernel_profile: int = 1  # 1: break each drafter step's GPU time down by kernel family (profiler, 2 steps)
    kernel_top: int = 20  # the costliest kernels that breakdown names, each with its ms and calls a step
    # a folder: each drafter step's kernel profile also written there as a Chrome trace with Python stacks, named
    # after its run folder (drafter.json, drafter_variant0.json, ...): which line launched each kernel
    kernel_trace: str = ""
    # serving section: contexts (tokens already in the caches), DDTree budgets (nodes), timed calls of each
    serving_contexts: str = "1024,2048,4096,8192"
    serving_budgets: str = "16,64,256"
    serving_iters: int = 10


def int_list(text: str, key: str) -> list[int]:
    """'1024,2048' → [1024, 2048]; anything else names `bench.<key>`."""
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise ConfigError(f"bench.{key}={text!r}: expected comma-separated integers") from e
    if not out or min(out) <= 0:
        raise ConfigError(f"bench.{key}={text!r}: expected at least one integer, all > 0")
    return out


def check_bench_config(b: BenchConfig) -> None:
    """Semantic checks, before the target loads."""
    from dflash.bench.runner import SECTIONS
    unknown = sorted(set(s for s in b.sections.split(",") if s) - set(SECTIONS))
    if unknown:
        raise ConfigError(f"bench.sections: unknown section(s) {unknown}; expected some of {sorted(SECTIONS)}")
    if b.pipeline_steps < 0 or b.pipeline_warmup < 0 or b.pipeline_repeats < 1:
        raise ConfigError("bench.pipeline_steps and bench.pipeline_warmup must be >= 0, bench.pipeline_repeats >= 1")
    if b.pipeline_steps and b.pipeline_steps < b.pipeline_repeats:
        raise ConfigError(f"bench.pipeline_steps={b.pipeline_steps} is fewer than bench.pipeline_repeats="
                          f"{b.pipeline_repeats}: every window needs at least one step")
    if b.kernel_top < 1:
        raise ConfigError(f"bench.kernel_top={b.kernel_top}: the number of kernels the profile names must be >= 1")
    int_list(b.serving_contexts, "serving_contexts")
    int_list(b.serving_budgets, "serving_budgets")


def parse_variants(spec: str) -> list[tuple[str, list[str]]]:
    """'a=1&b=2;c=3' → [('a=1&b=2', ['a=1', 'b=2']), ('c=3', ['c=3'])]."""
    return [(v.strip(), [o for o in v.strip().split("&") if o]) for v in spec.split(";") if v.strip()]


# target.* keys a variant may change: applied to the bench's one target in place (Target.set_fused_ops); any other
# would need a second target (54 GB at the 27B shapes)
IN_PLACE_TARGET_KEYS = ("fused_ops",)


def variant_configs(cfg: RunConfig, spec: str, key: str) -> dict[str, RunConfig]:
    """Each variant's config, checked before any work starts (a bad key names `bench.<key>`)."""
    out = {}
    for label, overrides in parse_variants(spec):
        out[label] = apply_overrides(cfg, overrides, f"bench.{key}")
        validate(out[label])
        kept = {k: getattr(cfg.target, k) for k in IN_PLACE_TARGET_KEYS}
        if dataclasses.replace(out[label].target, **kept) != cfg.target:
            raise ConfigError(f"bench.{key}: variant {label!r} changes target keys other than "
                              f"{', '.join('target.' + k for k in IN_PLACE_TARGET_KEYS)}; the bench builds one target")
    return out
