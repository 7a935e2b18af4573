"""Cheap host / GPU resource metrics for periodic logging (keys under ``sys/``).

``system_metrics()`` never raises: anything unavailable (psutil, CUDA, pynvml, a
driver hiccup) simply leaves its keys out. It is cheap enough to call every
``log_every`` steps (a few microseconds for psutil + torch, well under a
millisecond per GPU for NVML).

Memory sizes are in GiB (2**30 bytes), reported under ``*_gb`` keys.
"""

from __future__ import annotations

import os
from typing import Any

_GIB = float(1 << 30)

# NVML state: None = not tried yet, False = unavailable (do not retry), module = ready.
_nvml: Any = None
_nvml_handles: dict[int, Any] = {}


def _host_metrics(out: dict[str, float]) -> None:
    try:
        import psutil
    except Exception:
        return
    try:
        out["sys/host_rss_gb"] = psutil.Process().memory_info().rss / _GIB
    except Exception:
        pass
    try:
        out["sys/host_mem_used_pct"] = float(psutil.virtual_memory().percent)
    except Exception:
        pass


def _get_nvml() -> Any:
    global _nvml
    if _nvml is None:
        try:
            import pynvml  # provided by the nvidia-ml-py package

            pynvml.nvmlInit()
            _nvml = pynvml
        except Exception:
            _nvml = False
    return _nvml


def _visible_nvml_indices() -> list[str] | None:
    """CUDA_VISIBLE_DEVICES entries (indices or UUIDs), or None when unset."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is None:
        return None
    return [e.strip() for e in env.split(",") if e.strip()]


def _nvml_handle(nvml: Any, torch: Any, i: int) -> Any:
    """NVML handle for torch-visible device ``i`` (honours CUDA_VISIBLE_DEVICES)."""
    if i in _nvml_handles:
        return _nvml_handles[i]
    handle = None
    # Exact mapping via the device UUID, only if CUDA is already initialised
    # (get_device_properties would otherwise initialise CUDA in this process).
    if torch.cuda.is_initialized():
        try:
            uuid = str(torch.cuda.get_device_properties(i).uuid)
            if not uuid.startswith("GPU-"):
                uuid = "GPU-" + uuid
            handle = nvml.nvmlDeviceGetHandleByUUID(uuid)
        except Exception:
            handle = None
    if handle is None:
        visible = _visible_nvml_indices()
        try:
            if visible is None:
                handle = nvml.nvmlDeviceGetHandleByIndex(i)
            else:
                entry = visible[i]
                if entry.isdigit():
                    handle = nvml.nvmlDeviceGetHandleByIndex(int(entry))
                else:
                    handle = nvml.nvmlDeviceGetHandleByUUID(entry)
        except Exception:
            handle = None
    _nvml_handles[i] = handle
    return handle


def _gpu_metrics(out: dict[str, float]) -> None:
    try:
        import torch

        if not torch.cuda.is_available():
            return
        n = torch.cuda.device_count()
    except Exception:
        return
    for i in range(n):
        try:
            # Both return 0 without initialising CUDA if this process never used it.
            out[f"sys/gpu{i}_mem_alloc_gb"] = torch.cuda.memory_allocated(i) / _GIB
            out[f"sys/gpu{i}_mem_peak_gb"] = torch.cuda.max_memory_allocated(i) / _GIB
        except Exception:
            pass
    nvml = _get_nvml()
    if not nvml:
        return
    for i in range(n):
        try:
            h = _nvml_handle(nvml, torch, i)
            if h is None:
                continue
        except Exception:
            continue
        try:
            out[f"sys/gpu{i}_util_pct"] = float(nvml.nvmlDeviceGetUtilizationRates(h).gpu)
        except Exception:
            pass
        try:
            out[f"sys/gpu{i}_temp_c"] = float(
                nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU)
            )
        except Exception:
            pass
        try:
            out[f"sys/gpu{i}_mem_used_gb"] = nvml.nvmlDeviceGetMemoryInfo(h).used / _GIB
        except Exception:
            pass


def system_metrics() -> dict[str, float]:
    """Host RSS / memory use and, with CUDA, per visible GPU memory (+ NVML util/temp).

    Keys: ``sys/host_rss_gb``, ``sys/host_mem_used_pct``; per GPU ``i``:
    ``sys/gpu{i}_mem_alloc_gb``, ``sys/gpu{i}_mem_peak_gb`` (torch allocator of
    this process) and, when pynvml works, ``sys/gpu{i}_util_pct``,
    ``sys/gpu{i}_temp_c``, ``sys/gpu{i}_mem_used_gb`` (whole device). Never raises.
    """
    out: dict[str, float] = {}
    try:
        _host_metrics(out)
    except Exception:
        pass
    try:
        _gpu_metrics(out)
    except Exception:
        pass
    return out


__all__ = ["system_metrics"]
