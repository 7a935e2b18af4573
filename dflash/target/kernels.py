"""Gated-DeltaNet kernel selection for transformers' hybrid models (`qwen3_5`, `qwen3_next`).

transformers binds FLA's Triton kernels when `fla` imports and silently falls back to slow torch code when it
does not (docs/DESIGN.md, "The target and its kernels": the original pipeline lost most of its throughput that way).
These functions patch the
modelling module process-wide: report which kernels are active, put FLA's short convolution behind
`causal_conv1d_fn`, or force the torch reference (CPU, or a side-by-side benchmark).
Public: `preflight_kernels`, `kernel_report`, `route_cpu_to_torch` (a CPU target: torch code for CPU tensors, the fast
kernels kept for CUDA ones), `force_torch_gdn` (torch code for all), `torch_gdn_path`, `use_fla_short_conv`.
"""
from __future__ import annotations

import functools
import inspect
import logging
import warnings
from contextlib import contextmanager

import torch

log = logging.getLogger(__name__)

GDN_FUNCS = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule",
              "causal_conv1d_fn", "causal_conv1d_update")


def modeling_module(model_type: str):
    import importlib
    name = {"qwen3_5": "qwen3_5", "qwen3_5_text": "qwen3_5", "qwen3_next": "qwen3_next"}.get(model_type)
    return importlib.import_module(f"transformers.models.{name}.modeling_{name}") if name else None


def _plain(fn):
    """The function behind a hub-kernel `Func` module. With the `kernels` package installed (a dependency of
    transformers since 5.25, which pip resolved on the CPU machine on 2026-12-03; 5.17-5.24 do not require it), `use_kernel_forward_from_hub` turns each decorated
    function into an `nn.Module` instance whose `forward` calls the function it closes over (`func`): no
    `__wrapped__`, not a Python function, so `inspect` saw nothing behind it (every CPU target failed in
    `getclosurevars`). Anything else comes back as it is."""
    if isinstance(fn, torch.nn.Module):
        cells = inspect.getclosurevars(type(fn).forward).nonlocals
        return cells.get("func", fn)
    return fn


def _reference(fn):
    """transformers' pure-torch code behind a bound Gated-DeltaNet function: its `__wrapped__` chain, through any
    `Func` module on the way (a wrapper of ours may wrap one)."""
    while (inner := inspect.unwrap(_plain(fn))) is not fn:
        fn = inner
    return fn


def _implementation(fn) -> str:
    """Module that really runs behind a transformers kernel-with-fallback wrapper."""
    fn = _plain(fn)
    impl = inspect.getclosurevars(fn).nonlocals.get("implementation", fn) if inspect.isfunction(fn) else fn
    return getattr(impl, "__module__", "?") or "?"


def _fla_conv1d():
    """FLA's Triton causal conv1d ([B, T, D] layout), across FLA versions; None when unavailable."""
    for mod_name in ("fla.modules.convolution", "fla.modules.conv", "fla.ops.convolution"):
        try:
            import importlib
            fn = getattr(importlib.import_module(mod_name), "causal_conv1d", None)
        except Exception:  # noqa: BLE001 - any import failure means "not available"
            fn = None
        if fn is not None:
            return fn
    return None


def use_fla_short_conv(model_type: str) -> bool:
    """causal-conv1d builds only from source (no offline install); FLA ships a Triton short convolution.
    Put it behind transformers' `causal_conv1d_fn` call ([B, D, T] in and out) when that is the torch path."""
    mod = modeling_module(model_type)
    current = getattr(mod, "causal_conv1d_fn", None) if mod else None
    conv = _fla_conv1d()
    if current is None or conv is None or getattr(current, "_dflash_backend", None):
        return bool(current is not None and getattr(current, "_dflash_backend", None))
    if not _implementation(current).startswith("transformers"):
        return False  # causal-conv1d itself is active

    reference = _reference(current)

    def causal_conv1d_fn(x, weight, bias=None, activation=None, **kwargs):
        if not x.is_cuda:  # bound process-wide: a CPU target of the same process keeps the torch code
            return reference(x, weight, bias, activation=activation, **kwargs)
        y = conv(x.transpose(1, 2), weight=weight, bias=bias, activation=activation)
        y = y[0] if isinstance(y, tuple) else y
        return y.transpose(1, 2)

    causal_conv1d_fn._dflash_backend = "fla"
    causal_conv1d_fn.__wrapped__ = reference  # the torch reference stays reachable
    mod.causal_conv1d_fn = causal_conv1d_fn
    return True


def kernel_report(model_type: str, device: torch.device | None = None) -> dict[str, str]:
    """Which Gated-DeltaNet kernels are active (for tensors on `device`; None: on a GPU):
    {'chunk_gated_delta_rule': 'fla' | 'torch', ...}."""
    mod = modeling_module(model_type)
    if mod is None:
        return {}
    out = {}
    for name in GDN_FUNCS:
        if hasattr(mod, name):
            fn = getattr(mod, name)
            if getattr(fn, "_dflash_fast", None) is not None:  # routed by device (route_cpu_to_torch)
                if device is not None and device.type != "cuda":
                    out[name.removeprefix("torch_")] = "torch"
                    continue
                fn = fn._dflash_fast
            backend = getattr(fn, "_dflash_backend", None)
            if backend:
                out[name.removeprefix("torch_")] = backend
                continue
            impl = _implementation(fn)
            out[name.removeprefix("torch_")] = ("torch" if impl.startswith("transformers") else impl.split(".")[0])
    return out


def _is_fast(fn) -> bool:
    """A bound function that is not transformers' torch code: ours (`_dflash_backend`, a by-device router) or a
    kernel package's."""
    return bool(getattr(fn, "_dflash_backend", None)) or _implementation(fn).split(".")[0] != "transformers"


def force_torch_gdn(model_type: str) -> None:
    """With `fla` importable but no CUDA, transformers binds the Triton kernels and crashes: rebind the
    module's functions to their pure-torch originals (the wrapped function under `__wrapped__`)."""
    mod = modeling_module(model_type)
    for name in GDN_FUNCS if mod else ():
        fn = getattr(mod, name, None)
        if fn is not None and _is_fast(fn):
            setattr(mod, name, _reference(fn))


def _by_device(fast, reference):
    """`fast` for CUDA tensors, `reference` (transformers' torch code) for any other: what a CPU target's preflight
    binds, so that a GPU target of the same process keeps the fast kernels. Binding the reference process-wide (as
    `force_torch_gdn` does) left every later GPU target on the torch path: the GPU tests after a CPU target saw
    chunk_gated_delta_rule = torch."""
    @functools.wraps(reference)  # __wrapped__: the reference, for inspect.unwrap
    def by_device(*args, **kwargs):
        x = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
        return (fast if x is not None and x.is_cuda else reference)(*args, **kwargs)
    by_device._dflash_fast = fast
    return by_device


def route_cpu_to_torch(model_type: str) -> None:
    """A CPU target's preflight: every fast Gated-DeltaNet function bound in the modelling module (FLA's Triton
    kernels crash on CPU tensors) runs transformers' torch code for CPU tensors and stays fast for CUDA ones."""
    mod = modeling_module(model_type)
    for name in GDN_FUNCS if mod else ():
        fn = getattr(mod, name, None)
        if fn is None or getattr(fn, "_dflash_fast", None):
            continue
        if _is_fast(fn):
            setattr(mod, name, _by_device(fn, _reference(fn)))


@contextmanager
def torch_gdn_path(model_type: str):
    """Temporarily run the Gated-DeltaNet functions on their pure-torch reference (benchmarks compare the
    fast path against it in one process); the bound kernels come back on exit."""
    mod = modeling_module(model_type)
    saved = {n: getattr(mod, n) for n in GDN_FUNCS if mod is not None and hasattr(mod, n)}
    try:
        force_torch_gdn(model_type)
        yield kernel_report(model_type)
    finally:
        for name, fn in saved.items():
            setattr(mod, name, fn)


def preflight_kernels(model_type: str, device: torch.device) -> dict[str, str]:
    if device.type != "cuda":
        route_cpu_to_torch(model_type)
    else:
        use_fla_short_conv(model_type)
    report = kernel_report(model_type, device)
    slow = [k for k, v in report.items() if v == "torch"]
    if device.type == "cuda" and slow:
        warnings.warn(f"SLOW PATH: Gated-DeltaNet kernels {slow} use the torch fallback on a GPU; install "
                      f"flash-linear-attention / causal-conv1d (pip install '.[gpu]'). Throughput will be "
                      f"a fraction of the fast path.", RuntimeWarning, stacklevel=2)
    log.info("Gated-DeltaNet kernels: %s", report)
    return report


