"""Gated-DeltaNet kernel selection for transformers' hybrid models (`qwen3_5`, `qwen3_next`).

transformers binds FLA's Triton kernels when `fla` imports and silently falls back to slow torch code when it
does not (docs/DESIGN.md, "The target and its kernels": the original pipeline lost most of its throughput that way).
These functions patch the
modelling module process-wide: report which kernels are active, put FLA's short convolution behind
`causal_conv1d_fn` and `causal_conv1d_update`, or force the torch reference (CPU, or a side-by-side benchmark).
Public: `preflight_kernels`, `kernel_report`, `route_cpu_to_torch` (a CPU target: torch code for CPU tensors, the fast
kernels kept for CUDA ones), `force_torch_gdn` (torch code for all), `torch_gdn_path`, `use_fla_short_conv` (FLA's
short convolutions behind `causal_conv1d_fn` and `causal_conv1d_update`), `fla_update_step`.
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


def _fla_function(name: str, modules: tuple[str, ...]):
    """FLA's Triton function `name` from the first of `modules` that has it (its home moved across FLA versions);
    None when FLA or the function is unavailable."""
    import importlib
    for mod_name in modules:
        try:
            fn = getattr(importlib.import_module(mod_name), name, None)
        except Exception:  # noqa: BLE001 - any import failure means "not available"
            fn = None
        if fn is not None:
            return fn
    return None


def _fla_conv1d():
    """FLA's Triton causal conv1d ([B, T, D] layout), across FLA versions; None when unavailable."""
    return _fla_function("causal_conv1d", ("fla.modules.convolution", "fla.modules.conv", "fla.ops.convolution"))


def _fla_conv1d_update():
    """FLA's Triton one-token causal conv1d step, `causal_conv1d_update(x [N, 1, D], cache [N, D, W], residual,
    weight [D, W], bias, activation) -> (y [N, 1, D], cache)` (FLA 0.6: fla/modules/causal_conv1d/ops.py); None
    when unavailable."""
    return _fla_function("causal_conv1d_update", ("fla.modules.causal_conv1d", "fla.modules.convolution"))


def _bind_fla(mod, name: str, make) -> bool:
    """Put `make(reference)` behind the modelling module's `name` when transformers' torch code is what runs there:
    True when an FLA binding of ours is in place afterwards."""
    current = getattr(mod, name, None) if mod else None
    if current is None or getattr(current, "_dflash_backend", None):
        return bool(current is not None and getattr(current, "_dflash_backend", None))
    if not _implementation(current).startswith("transformers"):
        return False  # the causal-conv1d package itself is active
    reference = _reference(current)
    fn = make(reference)
    if fn is None:
        return False
    fn._dflash_backend = "fla"
    fn.__wrapped__ = reference  # the torch reference stays reachable
    setattr(mod, name, fn)
    return True


def _short_conv(reference):
    conv = _fla_conv1d()
    if conv is None:
        return None

    def causal_conv1d_fn(x, weight, bias=None, activation=None, **kwargs):
        if not x.is_cuda:  # bound process-wide: a CPU target of the same process keeps the torch code
            return reference(x, weight, bias, activation=activation, **kwargs)
        y = conv(x.transpose(1, 2), weight=weight, bias=bias, activation=activation)
        y = y[0] if isinstance(y, tuple) else y
        return y.transpose(1, 2)
    return causal_conv1d_fn


def fla_update_step(update, hidden_states, conv_state, weight, bias=None, activation=None):
    """One cached decode step of transformers' `causal_conv1d_update(hidden_states [B, D, 1], conv_state [B, D, W],
    weight [D, W], bias, activation) -> [B, D, 1]` on FLA's `update` kernel ([B, 1, D] in and out). Both keep the
    last W inputs in the state, oldest first, and shift it left by one a step (transformers: cat, then copy_ of the
    last W; FLA: cache[w] = cache[w + 1], cache[W - 1] = x), so the state stays the one transformers' cache holds."""
    y_B1D, state = update(hidden_states.transpose(1, 2), conv_state, weight=weight, bias=bias, activation=activation)
    if state is not conv_state:  # FLA steps a contiguous copy of a strided state: the cache keeps its own tensor
        conv_state.copy_(state)
    return y_B1D.transpose(1, 2)


def _conv_update(reference):
    """FLA's kernel behind `causal_conv1d_update` (`fla_update_step`). What the kernel does not take runs the
    reference: CPU tensors, a step of more than one token, a state longer than the kernel (a cache recording past
    states), an activation other than SiLU or none."""
    update = _fla_conv1d_update()
    if update is None:
        return None

    def causal_conv1d_update(hidden_states, conv_state, weight, bias=None, activation=None):
        if (not hidden_states.is_cuda or hidden_states.shape[-1] != 1 or conv_state.shape[-1] != weight.shape[-1]
                or activation not in (None, "silu", "swish")):
            return reference(hidden_states, conv_state, weight, bias, activation=activation)
        return fla_update_step(update, hidden_states, conv_state, weight, bias, activation)
    return causal_conv1d_update


def use_fla_short_conv(model_type: str) -> bool:
    """causal-conv1d builds only from source (no offline install); FLA ships Triton short convolutions. Put them
    behind transformers' `causal_conv1d_fn` (a whole sequence, [B, D, T] in and out) and `causal_conv1d_update`
    (one cached decode step) where those are the torch path. True when the sequence convolution is FLA's."""
    mod = modeling_module(model_type)
    _bind_fla(mod, "causal_conv1d_update", _conv_update)
    return _bind_fla(mod, "causal_conv1d_fn", _short_conv)


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


def force_torch_gdn(model_type: str, names: tuple[str, ...] = GDN_FUNCS) -> None:
    """With `fla` importable but no CUDA, transformers binds the Triton kernels and crashes: rebind the
    module's functions (`names`, default all) to their pure-torch originals (the wrapped function under
    `__wrapped__`)."""
    mod = modeling_module(model_type)
    for name in names if mod else ():
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
def torch_gdn_path(model_type: str, names: tuple[str, ...] = GDN_FUNCS):
    """Temporarily run the Gated-DeltaNet functions (`names`, default all) on their pure-torch reference
    (benchmarks compare the fast path against it in one process); the bound kernels come back on exit."""
    mod = modeling_module(model_type)
    saved = {n: getattr(mod, n) for n in names if mod is not None and hasattr(mod, n)}
    try:
        force_torch_gdn(model_type, names)
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


