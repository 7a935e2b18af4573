"""The model the recipe trains: a `Qwen3_5ForCausalLM` (Gated DeltaNet : full attention = 3 : 1 —
transformers' default layer types put full attention on every 4th layer), its size, and the choice of
Gated-DeltaNet kernels to train with.

Gated-DeltaNet kernels on CUDA (docs/DESIGN.md, "The target and its kernels"): FLA's backward is wrong or refused on
Hopper with Triton < 3.7.1. With `gdn_kernels=auto`, the model's loss and gradients on a batch of the training shape are
computed once with the bound kernels (FLA) and once with transformers' pure-torch functions; FLA trains
only if it runs and agrees (relative gradient error ≤ `grad_check_tol` overall and ≤ 4× that for every
parameter with a non-negligible gradient). Otherwise the torch functions train. The module's functions
are restored afterwards, so the target itself still runs forward with FLA. The choice is recorded. The short
convolution always trains on transformers' torch path (cuDNN conv1d); FLA's Triton short convolution, which
`dflash.target.model` installs when it loads a target on CUDA, is used forward-only.
"""
from __future__ import annotations

import importlib.util
import inspect
import math

import torch

from dflash.pretrain.config import PretrainConfig
from dflash.pretrain.evaluate import lm_loss


# -- model ------------------------------------------------------------------------------------------
def build_hf_config(cfg: PretrainConfig, vocab_size: int, eos_id: int, pad_id: int):
    from transformers import Qwen3_5TextConfig
    return Qwen3_5TextConfig(
        vocab_size=vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
        linear_num_key_heads=cfg.linear_num_key_heads, linear_num_value_heads=cfg.linear_num_value_heads,
        linear_key_head_dim=cfg.linear_head_dim, linear_value_head_dim=cfg.linear_head_dim,
        linear_conv_kernel_dim=cfg.linear_conv_kernel_dim, max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings, eos_token_id=eos_id, pad_token_id=pad_id,
        bos_token_id=None,
    )  # RoPE: the config's defaults (partial rotary, as in Qwen3.5)


def build_model(hf_cfg, seed: int):
    from transformers import AutoModelForCausalLM
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(hf_cfg)


def count_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def bf16_bytes(model) -> int:
    return 2 * count_params(model)


def estimate_bf16_bytes(cfg: PretrainConfig, vocab_size: int | None = None) -> int:
    """bf16 size of the model `cfg` describes, built on the meta device (no memory, no time)."""
    hf_cfg = build_hf_config(cfg, vocab_size or cfg.vocab_size, 0, 1)
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(hf_cfg)
    return bf16_bytes(m)


# -- Gated-DeltaNet kernel selection ---------------------------------------------------------------------
class GdnKernels:
    """Swaps transformers' module-level Gated-DeltaNet functions between what import bound (FLA when
    importable) and the pure-torch originals; `restore()` puts the bound ones back."""

    def __init__(self, model_type: str):
        from dflash.target.kernels import GDN_FUNCS, modeling_module
        self.model_type = model_type
        self.mod = modeling_module(model_type)
        self.bound = {n: getattr(self.mod, n) for n in GDN_FUNCS if self.mod is not None and hasattr(self.mod, n)}

    def use_torch(self) -> None:
        for n, fn in self.bound.items():
            setattr(self.mod, n, inspect.unwrap(fn))

    def restore(self) -> None:
        for n, fn in self.bound.items():
            setattr(self.mod, n, fn)

    def report(self) -> dict[str, str]:
        from dflash.target.kernels import kernel_report
        return kernel_report(self.model_type)


def _version_tuple(v: str) -> tuple[int, ...]:
    parts = []
    for p in v.split("+")[0].split("."):
        digits = "".join(ch for ch in p if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts + [0] * (3 - len(parts)))


def triton_known_bad(device: torch.device) -> tuple[bool, str]:
    """(FLA's GDN backward is known wrong here, triton version): Hopper with 3.4.0 <= Triton < 3.7.1."""
    try:
        import triton
        ver = triton.__version__
    except Exception:
        return False, "none"
    hopper = device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9
    return hopper and (3, 4, 0) <= _version_tuple(ver) < (3, 7, 1), ver


def loss_and_grads(model, ids_BT: torch.Tensor, amp_dtype) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = lm_loss(model, ids_BT, amp_dtype)
    loss.backward()
    grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return float(loss.detach()), grads


def compare_grads(ref: dict[str, torch.Tensor], other: dict[str, torch.Tensor]) -> dict:
    """Global and worst per-parameter relative L2 error of `other` against `ref`."""
    num, den, worst, worst_name = 0.0, 0.0, 0.0, ""
    norms = {n: float(g.norm()) for n, g in ref.items()}
    total = math.sqrt(sum(v * v for v in norms.values()))
    finite = True
    for n, g in ref.items():
        o = other.get(n)
        if o is None or not bool(torch.isfinite(o).all()):
            finite = False
            continue
        d = float((o - g).norm())
        num += d * d
        den += norms[n] ** 2
        if norms[n] >= 1e-4 * total:
            rel = d / max(norms[n], 1e-12)
            if rel > worst:
                worst, worst_name = rel, n
    missing = sorted(set(ref) ^ set(other))
    return {"global_rel_err": math.sqrt(num) / max(math.sqrt(den), 1e-12), "worst_rel_err": worst,
            "worst_param": worst_name, "finite": finite and not missing, "missing": missing[:5]}


def select_gdn_kernels(model, device: torch.device, cfg: PretrainConfig, amp_dtype,
                       model_type: str) -> tuple[str, dict, GdnKernels]:
    """Chooses the kernels to train with; returns (choice 'fla' | 'torch', details, swapper)."""
    sw = GdnKernels(model_type)
    bound = sw.report()
    details: dict = {"bound": bound, "fla_importable": importlib.util.find_spec("fla") is not None}
    bad, tver = triton_known_bad(device) if device.type == "cuda" else (False, "n/a")
    details.update(triton=tver, triton_known_bad=bad)
    uses_fla = any(v == "fla" for v in bound.values())
    if device.type != "cuda" or not uses_fla or cfg.gdn_kernels == "torch":
        sw.use_torch()
        details["reason"] = ("not CUDA" if device.type != "cuda" else
                             "FLA not bound by transformers" if not uses_fla else "gdn_kernels=torch")
        return "torch", details, sw
    if cfg.gdn_kernels == "fla":
        details["reason"] = "gdn_kernels=fla (no check)"
        return "fla", details, sw
    # auto: measure FLA against torch on a batch of the training shape
    g = torch.Generator().manual_seed(cfg.seed + 7)
    B = max(1, min(cfg.batch_size, 4))
    ids = torch.randint(3, model.config.vocab_size, (B, cfg.seq_len), generator=g).to(device)
    try:
        sw.use_torch()
        loss_t, grads_t = loss_and_grads(model, ids, amp_dtype)
    except Exception as e:  # nothing to compare against: train on the torch functions
        model.zero_grad(set_to_none=True)
        details["reason"] = f"torch reference step raised {type(e).__name__}: {str(e)[:300]}"
        return "torch", details, sw
    sw.restore()
    try:
        loss_f, grads_f = loss_and_grads(model, ids, amp_dtype)
    except Exception as e:  # FLA refuses (e.g. its Hopper/Triton guard) or crashes
        model.zero_grad(set_to_none=True)
        sw.use_torch()
        details.update(reason=f"FLA forward+backward raised {type(e).__name__}: {str(e)[:300]}",
                       loss_torch=loss_t)
        return "torch", details, sw
    del ids
    cmp = compare_grads(grads_t, grads_f)
    ok = (cmp["finite"] and math.isfinite(loss_f) and abs(loss_f - loss_t) <= 1e-2 * max(abs(loss_t), 1)
          and cmp["global_rel_err"] <= cfg.grad_check_tol and cmp["worst_rel_err"] <= 4 * cfg.grad_check_tol)
    details.update(grad_check=cmp, loss_torch=loss_t, loss_fla=loss_f, grad_check_shape=[B, cfg.seq_len])
    if ok:
        details["reason"] = "FLA gradients agree with torch"
        return "fla", details, sw
    sw.use_torch()
    details["reason"] = "FLA gradients disagree with torch"
    return "torch", details, sw
