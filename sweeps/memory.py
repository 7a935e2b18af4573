"""A CPU sweep worker's memory, estimated from the run config before any worker starts, against what this machine
has (docs/faults.md, "Sweep memory").

A sweep's trials run at the shapes in its config; on a GPU machine the large tensors live on the GPU, on a CPU
machine they are host memory, and a GPU sweep's trial shapes there are tens of GiB. `fit_workers` compares
`workers` x `worker_peak` with `available_bytes` and lowers `workers` (one log line saying why), or refuses with
an error naming `workers` and the figures (exit 2) when not even one worker fits.

The estimate sums what a worker can hold at once (the online writer runs in producer threads beside the training
step, and the evaluation's ground truth stays in memory once built): a base (the process with its libraries),
the target's weights, the online writer's caches, the drafter's training step (the attention scores of the
anchor groups and the layers' activations, kept for the backward, and two [chunk, V] float32 logit blocks), and
the ground truth's features. Its constants come from peaks measured on a CPU with the shipped reference target
(docs/faults.md gives the figures and commands); it errs high rather than low.
"""
from __future__ import annotations

import math
import sys
from pathlib import Path
from types import SimpleNamespace

GiB = 1 << 30
BASE_BYTES = 1 * GiB  # a worker with torch, transformers, MLflow and Optuna, its prompt pool, its MLflow run
ATTN_KEPT = 2  # [group queries, keys] float32 score blocks per layer alive in the step: the scores and the softmax
ACT_PER_HIDDEN = 2  # float32 activations per position per layer, in units of the hidden size (norms, projections)
ACT_PER_INTER = 3  # ... and of the MLP's intermediate size (gate, up, their product)
GRADS_PER_POSITION = 4  # [P, D] float32 hidden-state tensors of the LM-head stats (the fused gradients, the input)
WRITER_CACHES = 2  # the writer's caches, counted twice: a decode step makes the new state beside the old
PROMPT_TOKENS = 256  # a ground-truth task's prompt, at most (the held-out suite's prompts are <= 1,000 characters)


def available_bytes() -> int:
    """Memory this process tree can still take: MemAvailable, or less under a cgroup limit (a container, a Slurm
    job's allocation)."""
    avail = _meminfo_available()
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            limit = Path(limit_file).read_text().strip()
            if limit != "max" and int(limit) < 1 << 60:  # cgroup v1 writes "no limit" as a huge number
                avail = min(avail, int(limit) - int(Path(usage_file).read_text()))
        except (OSError, ValueError):
            continue
    return max(avail, 0)


def _meminfo_available() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import psutil  # not Linux: psutil's own reading
    return int(psutil.virtual_memory().available)


def _target_facts(tc) -> SimpleNamespace:
    """The target's text config (num_hidden_layers, hidden_size, vocab_size, layer_types, the Gated-DeltaNet and
    attention shapes) without loading it; its weights' bytes on this machine (float32 on the CPU)."""
    from dflash.target.model import checkpoint_path, text_config_dict, tiny_hf_config
    if not tc.path:
        hf = tiny_hf_config(tc.random)
        facts = SimpleNamespace(**hf.to_dict())
        facts.weight_bytes = 4 * _tiny_params(facts)
        return facts
    path = Path(checkpoint_path(tc))
    facts = SimpleNamespace(**text_config_dict(path))
    on_disk = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    facts.weight_bytes = 2 * on_disk if "16" in str(getattr(facts, "dtype", "bfloat16")) else on_disk
    return facts


def _tiny_params(c) -> int:
    """About the parameters of a tiny random target: its layers' projections and the embeddings and head."""
    h, i = c.hidden_size, c.intermediate_size
    return c.num_hidden_layers * (4 * h * h + 3 * h * i) + 2 * c.vocab_size * h


def worker_peak(cfg) -> dict[str, int]:
    """Bytes a CPU worker of trials like `cfg` (a composed RunConfig) holds at its peak, by part, and their sum
    under "peak"."""
    from dflash.data.writing import CPU_WRITE_ROWS, cache_row_bytes
    from dflash.target.lm_head import resolve_chunk
    from dflash.training.datastream import uses_online
    t, d, e = cfg.trainer, cfg.drafter, cfg.eval
    facts = _target_facts(cfg.target)
    D, V = int(facts.hidden_size), int(facts.vocab_size)
    online = uses_online(cfg)
    ctx = cfg.data.online_seq_len() if online else cfg.data.max_len
    parts = {"base": BASE_BYTES, "target weights": int(facts.weight_bytes)}
    if online:
        rows = cfg.data.online.write_batch or CPU_WRITE_ROWS
        parts["online writer"] = WRITER_CACHES * rows * cache_row_bytes(facts, 4, ctx)
    g = d.attn_group if 0 < d.attn_group < t.num_anchors else t.num_anchors
    q = g * d.block_size  # queries of one anchor group; each meets the context and the group's blocks
    scores = t.sequences_per_step * math.ceil(t.num_anchors / g) * d.num_heads * q * (ctx + q) * 4
    positions = t.sequences_per_step * t.num_anchors * d.block_size
    acts = positions * 4 * (ACT_PER_HIDDEN * D + ACT_PER_INTER * d.intermediate_size)
    chunk = min(resolve_chunk(cfg.loss.chunk_size, V, "cpu"), positions)
    parts["training step"] = (d.num_layers * (ATTN_KEPT * scores + acts) + 2 * chunk * V * 4
                              + GRADS_PER_POSITION * positions * D * 4)
    if e.enabled:
        from sweeps.launch import eval_suites_size
        per_token = len(cfg.target.layer_ids or [0] * 5) * D * 4  # the features of the selected layers
        settings = e.samples + (1 if e.greedy_beside else 0)
        parts["eval ground truth"] = sum(n * settings * (PROMPT_TOKENS + k) * per_token
                                         for _, n, k in eval_suites_size(e))
    parts["peak"] = sum(parts.values())
    return parts


def describe(parts: dict[str, int]) -> str:
    return ", ".join(f"{k} {v / GiB:.1f}" for k, v in parts.items() if k != "peak") + " GiB"


def fit_workers(workers: int, parts: dict[str, int], avail: int, name: str) -> int:
    """The workers that fit `avail` bytes at `parts["peak"]` each: `workers` itself, or fewer with one warning;
    raises SweepError (exit 2) naming `workers` and the figures when not one fits."""
    from sweeps.space import SweepError
    peak = parts["peak"]
    fits = avail // max(peak, 1)
    if fits >= workers:
        return workers
    figures = (f"a worker's estimated peak is {peak / GiB:.1f} GiB ({describe(parts)}); this machine has "
               f"{avail / GiB:.1f} GiB available")
    if fits < 1:
        raise SweepError(
            f"workers={workers}: {figures}, so not even one trial fits in memory on this CPU. The trials' shapes "
            f"are a GPU's (trainer.sequences_per_step, trainer.num_anchors, data.max_len, data.online.write_batch, "
            f"eval.*): run it on a GPU, shrink them, or check the machinery with python -m sweeps.launch cpu_smoke; "
            f"memory_check=false launches anyway")
    print(f"[sweep {name}] workers={workers} lowered to {fits}: {figures}", file=sys.stderr, flush=True)
    return int(fits)
