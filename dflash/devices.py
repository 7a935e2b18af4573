"""Device and dtype names from configs (`auto`, `cuda`, `cuda:1`, `cpu`) turned into torch objects."""
from __future__ import annotations

import torch


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
