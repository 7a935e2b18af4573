"""Host syncs inside the training step, from a profiler trace (the rule: no host sync in the step loop).

Two kinds are counted on the consumer's own thread, inside the `dflash.train_step` ranges the trainer marks:
blocking CUDA runtime calls (seen on a GPU only) and ops that read a device value back to the host (`.item()`,
`nonzero`, …: a sync on CUDA, and visible in a CPU trace too, so a CPU test can guard against them). Each is
given a site: the innermost `dflash.*` phase, the op around it, and with `stacks` the nearest frame of our code.
"""
from __future__ import annotations

from pathlib import Path

# CUDA runtime calls that block the host until the GPU catches up (their *Async variants do not).
SYNC_CALLS = frozenset({"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
                        "cudaMemcpy", "cudaMemcpy2D", "cudaMemset", "cudaStreamWaitEvent_sync"})


# Ops that read a GPU value back to the host (an implicit sync on CUDA); visible in a CPU trace too.
HOST_READ_OPS = frozenset({"aten::_local_scalar_dense", "aten::item", "aten::nonzero", "aten::masked_select",
                           "aten::_unique2", "aten::unique_consecutive"})


def count_step_syncs(events, step_name: str = "dflash.train_step") -> dict:
    """Blocking CUDA runtime calls and host-read ops made *inside* the traced training steps, on the step's
    own thread (producer threads sync on purpose, to time their forwards; the consumer must not). `sites`
    names each one's place: the innermost `dflash.*` phase, the innermost op around it, and the nearest frame
    of our code when the trace has stacks."""
    steps = [e for e in events if e.name == step_name and on_cpu(e)]  # not the GPU-side annotation
    threads = {e.thread for e in steps}
    spans = [(e.time_range.start, e.time_range.end) for e in steps]

    def in_step(e) -> bool:
        return e.thread in threads and any(a <= e.time_range.start <= b for a, b in spans)
    syncs = [e for e in events if e.name in SYNC_CALLS and in_step(e)]
    reads = [e for e in events if e.name in HOST_READ_OPS and in_step(e)]
    out: dict = {"steps": len(steps), "syncs": len(syncs), "host_reads": len(reads), "sites": {}}
    ops = [e for e in events if e.thread in threads and on_cpu(e) and e.name not in SYNC_CALLS
           and e.name != step_name] if syncs or reads else []
    for e in syncs:
        out[e.name] = out.get(e.name, 0) + 1
    for e in syncs + reads:
        site = _sync_site(e, ops)
        out["sites"][site] = out["sites"].get(site, 0) + 1
    return out


def on_cpu(e) -> bool:
    return str(getattr(e, "device_type", "CPU")).endswith("CPU")


def _sync_site(event, ops) -> str:
    """'phase: op @ file:line' for an event, from the CPU ops of its thread that enclose it."""
    t = event.time_range.start
    around = sorted((e for e in ops if e is not event and e.thread == event.thread
                     and e.time_range.start <= t <= e.time_range.end), key=lambda e: -e.time_range.start)
    phase = next((e.name for e in around if e.name.startswith("dflash.")), "")
    op = next((e.name for e in around if not e.name.startswith("dflash.")), None)
    frames = [f for e in around for f in (getattr(e, "stack", None) or []) if "dflash" in f or "experiments" in f]
    where = event.name if op is None or event.name in HOST_READ_OPS else op
    if event.name in HOST_READ_OPS and op is not None:
        where = f"{op} > {event.name}"
    return (f"{phase}: " if phase else "") + where + (f" @ {frames[0]}" if frames else "")


class StepProfiler:
    """Steps `start` .. start+n-1 (0-based loop indices) under the profiler, their syncs counted into `result`;
    entered and left through `Trainer.run(around_step=...)`, so the profiler starts after the previous step's
    metric read and stops before the next one (its own start-up is no part of a measured window)."""

    def __init__(self, device, start: int, n: int, result: dict, stacks: bool = False):
        from torch.profiler import ProfilerActivity, profile
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        self.prof = profile(activities=acts, with_stack=stacks) if n else None
        self.start, self.n, self.result = start, n, result

    def enter(self, step: int) -> None:
        if self.prof is not None and step == self.start:
            self.prof.start()

    def leave(self, step: int) -> None:
        if self.prof is not None and step == self.start + self.n - 1:
            self.prof.stop()
            self.result.update(count_step_syncs(self.prof.events()))  # the loop marks "dflash.train_step"


# Kernel families, first match wins (names of cuBLAS/CUTLASS/SDPA/Triton/fused-optimizer kernels on Hopper).
KERNEL_FAMILIES = (
    # FLA's Gated-DeltaNet kernels (the target's linear-attention layers) and its short convolution
    ("gdn (fla)", ("chunk_", "delta_rule", "solve_tril", "kkt", "recompute_w_u", "conv1d", "l2norm", "cumsum")),
    ("triton", ("triton_",)),  # torch.compile's fused kernels (their names list the ops they fuse)
    ("attention", ("fmha", "flash", "attention", "flex", "sdpa")),
    ("gemm", ("gemm", "cutlass", "nvjet", "cublas", "sm90_xmma", "matmul", "wgmma")),
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    ("softmax/reduce", ("softmax", "reduce", "logsumexp", "norm", "argmax", "max_kernel")),
    ("copy/index", ("copy", "cat", "fill", "index", "gather", "scatter", "embedding", "memcpy", "memset")),
    ("elementwise", ("elementwise", "vectorized", "unrolled")),
)


def kernel_family(name: str) -> str:
    low = name.lower()
    return next((fam for fam, keys in KERNEL_FAMILIES if any(k in low for k in keys)), "other")


def device_kernels(events) -> list:
    """The trace's GPU kernels: device-side events that are not annotations mirrored from the host."""
    return [e for e in events if not on_cpu(e) and e.name and not _is_annotation(e)]


def kernel_breakdown(events, steps: int, top: int = 8) -> dict:
    """GPU time per step by kernel family, and the costliest kernels, from a profiler's device events:
    where a step's time goes once the phases (forward, loss, backward, optimizer) are known."""
    per_kernel: dict[str, list] = {}
    for e in device_kernels(events):
        us = e.time_range.end - e.time_range.start
        k = per_kernel.setdefault(e.name, [0.0, 0])
        k[0] += us
        k[1] += 1
    families: dict[str, float] = {}
    for name, (us, _) in per_kernel.items():
        fam = kernel_family(name)
        families[fam] = families.get(fam, 0.0) + us / 1e3 / steps
    ranked = sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:top]
    return {"ms_per_step": dict(sorted(families.items(), key=lambda kv: -kv[1])),
            "top": [{"kernel": n[:90], "ms_per_step": us / 1e3 / steps, "calls_per_step": c / steps}
                    for n, (us, c) in ranked]}


def _is_annotation(e) -> bool:
    """A record_function range mirrored on the GPU timeline (e.g. 'Optimizer.step#AdamW.step'), not a kernel:
    counting it would count its kernels twice."""
    name = e.name
    if getattr(e, "is_user_annotation", False) or name.startswith(("dflash.", "ProfilerStep")):
        return True
    # 'Class.method#Class.method' is an annotation; kernels carry '#' only inside '{lambda()#1}' template args
    return "#" in name and not any(c in name for c in "(<{ ")


def profile_kernels(fn, steps: int = 2, top: int = 8, trace: str | None = None) -> dict:
    """Run `fn` `steps` times under the CUDA profiler and break the device time down by kernel. `trace`: a file the
    profile is also written to as a Chrome trace, recorded with Python stacks (which line launched each kernel; the
    host side runs slower for it, the kernels' own times do not change)."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=bool(trace)) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    if trace:
        Path(trace).parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(trace)
    return kernel_breakdown(prof.events(), steps, top)
