"""Device and dtype names from configs (`auto`, `cuda`, `cuda:1`, `cpu`) turned into torch objects."""
from __future__ import annotations

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
