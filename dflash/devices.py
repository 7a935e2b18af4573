"""Device and dtype names from configs (`auto`, `cuda`, `cuda:1`, `cpu`) turned into torch objects, the user's cache
folder, and the compile caches there that make a repeated run's first step fast."""
from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import torch


def check_device(key: str, name: str) -> None:
    """ValueError (the config check's ConfigError) naming `key` unless `name` is auto, cpu, or a CUDA device this machine has (a run that asks
    for a GPU it lacks fails here, not deep in torch)."""
    if name == "auto":
        return
    try:
        dev = torch.device(name)
    except (RuntimeError, TypeError):
        raise ValueError(f"{key}={name!r}: not a device; expected auto, cpu, cuda or cuda:N") from None
    if dev.type == "cpu":
        return
    if dev.type != "cuda":
        raise ValueError(f"{key}={name}: expected auto, cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise ValueError(f"{key}={name}: this machine has no CUDA GPU that torch can use; use {key}=auto "
                          f"(a GPU when there is one) or {key}=cpu")
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"{key}={name}: this machine has {torch.cuda.device_count()} CUDA GPU(s) "
                          f"(cuda:0..cuda:{torch.cuda.device_count() - 1})")


def resolve_device(name: str) -> torch.device:
    """With an index always: a bare "cuda" means the *calling thread's* current GPU, which is GPU 0 in a
    fresh producer thread even on torchrun rank 1 (CUDA's current device is per host thread)."""
    dev = torch.device("cuda" if name == "auto" and torch.cuda.is_available() else
                       "cpu" if name == "auto" else name)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def cache_root(environ: Mapping[str, str] | None = None) -> Path:
    """The user's dflash cache folder: `$DFLASH_CACHE`, else `$XDG_CACHE_HOME/dflash`, else `~/.cache/dflash`. Compile
    caches and unpacked shipped assets live there, outside the checkout (which is copied to GPU machines whole).
    `os.environ` is read when called, not bound as a default: `datasets`' multi-process `map` replaces the object."""
    env = os.environ if environ is None else environ
    return Path(env.get("DFLASH_CACHE") or Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dflash")


def persist_compile_caches(environ: dict[str, str] | None = None) -> dict[str, str]:
    """Point inductor's and Triton's caches at the user's cache folder, keyed by the torch / Triton versions, and
    have Triton keep its autotuning results there too, so that a resumed or repeated run skips what the first one
    compiled and benchmarked. A cold first 27B step waits on ~97 s of compilation and ~70 s of FLA's autotuning in
    the first target forward (benchmarks/RESULTS.md); inductor's FX-graph and AOT-autograd caches key each entry by
    the graph, its input shapes and the config, Triton's by the kernel source and the autotune key (the shapes), so
    a hit is always the same computation. Defaults only: a variable the user set wins; DFLASH_COMPILE_CACHE=0 turns
    it off. Must run before Triton kernels are defined (FLA reads the autotuning switch at import): entry points
    call it first. Returns the variables it set (in `environ`, `os.environ` as it is when called: see `cache_root`)."""
    environ = os.environ if environ is None else environ
    if environ.get("DFLASH_COMPILE_CACHE", "1") == "0":
        return {}
    root = cache_root(environ)
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:  # no Triton (CPU-only builds): inductor's C++ kernels still cache under its folder
        triton_version = "none"
    wanted = {"TORCHINDUCTOR_CACHE_DIR": str(root / "inductor" / f"torch-{torch.__version__}"),
              "TRITON_CACHE_DIR": str(root / "triton" / f"triton-{triton_version}"),
              "TRITON_CACHE_AUTOTUNING": "1"}
    set_now = {k: v for k, v in wanted.items() if not environ.get(k)}
    environ.update(set_now)
    return set_now
