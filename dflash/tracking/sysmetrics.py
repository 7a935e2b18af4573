"""Host / GPU resource metrics: MLflow's System metrics tab, and ``sys/`` keys for metrics.jsonl.

``start_system_metrics(run_id, uri)`` runs MLflow's own system-metrics monitor on a client-made run
(``mlflow.system_metrics.SystemMetricsMonitor``, what ``log_system_metrics=True`` starts for a fluent run):
``system/cpu_utilization_percentage``, memory, disk, network and, with pynvml (nvidia-ml-py), per-GPU
``system/gpu_{i}_utilization_percentage`` / memory / power, plus this process's torch allocator
(``system/torch_gpu_{i}_allocated_gb`` / ``_peak_gb``, from ``TorchMemoryMonitor``). Those land in the run's
System metrics tab, sampled on a wall-clock interval from a background thread: nothing waits on the device.

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
    try:  # since the previous call (the first call of a process reads 0)
        out["sys/cpu_util_pct"] = float(psutil.cpu_percent(interval=None))
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

    Keys: ``sys/host_rss_gb``, ``sys/host_mem_used_pct``, ``sys/cpu_util_pct``; per GPU ``i``:
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


def _torch_memory_monitor():
    """A monitor of this process's torch allocator per GPU (NVML sees the device, not the process)."""
    from mlflow.system_metrics.metrics.base_metrics_monitor import BaseMetricsMonitor

    class TorchMemoryMonitor(BaseMetricsMonitor):
        def collect_metrics(self):
            import torch
            if not torch.cuda.is_available() or not torch.cuda.is_initialized():
                return
            for i in range(torch.cuda.device_count()):
                self._metrics[f"torch_gpu_{i}_allocated_gb"].append(torch.cuda.memory_allocated(i) / _GIB)
                self._metrics[f"torch_gpu_{i}_peak_gb"].append(torch.cuda.max_memory_allocated(i) / _GIB)

        def aggregate_metrics(self):
            return {k: round(max(v), 3) for k, v in self._metrics.items() if v}

    return TorchMemoryMonitor()


def start_system_metrics(run_id: str, tracking_uri: str, interval_s: float = 10.0, resume: bool = False):
    """MLflow's system-metrics monitor on `run_id` (a background thread), or None when it cannot start
    (psutil missing, old MLflow). It stops by itself once the run is no longer RUNNING."""
    try:
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor
        mon = SystemMetricsMonitor(run_id, sampling_interval=max(float(interval_s), 0.05),
                                   resume_logging=resume, tracking_uri=tracking_uri)
        mon.monitors.append(_torch_memory_monitor())
        mon.start()
        return mon
    except Exception as e:  # noqa: BLE001 - resource metrics are never worth a failed run
        import warnings
        warnings.warn(f"MLflow system metrics not logged: {type(e).__name__}: {e}", RuntimeWarning, stacklevel=2)
        return None


def stop_system_metrics(monitor) -> None:
    """Stop the monitor and log what it sampled since its last publish (its loop drops that on shutdown,
    so a run shorter than one interval would have no system metrics at all). Call it before the run is
    set terminated. Never raises."""
    try:
        monitor.finish()  # joins the thread: the monitors below are ours alone from here
        pending = monitor.aggregate_metrics()
        if pending:
            monitor.publish_metrics(pending)
            monitor.mlflow_logger.flush()
    except Exception:  # noqa: BLE001
        pass


__all__ = ["system_metrics", "start_system_metrics", "stop_system_metrics"]
