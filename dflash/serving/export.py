"""The serving format (DESIGN §6): a folder with `config.json` (`DFlashDraftModel`, Qwen3 decoder fields,
`block_size`, `num_target_layers`, `dflash_config`) and `model.safetensors` whose tensor names are those
of the reference implementation (z-lab/dflash `dflash/model.py`), which our module names mirror.
z-lab / SGLang / vLLM load such a folder; `load_drafter` reads it back (ours or a published one).
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, save_file

from dflash.atomic import atomic_write, atomic_write_text, dir_mode
from dflash.drafter.model import DFlashDrafter, DrafterConfig


def serving_config(drafter: DFlashDrafter, vocab_size: int, dtype: torch.dtype) -> dict:
    c = drafter.cfg
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": drafter.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta},  # transformers >= 5
        "max_position_embeddings": 32768,
        "vocab_size": vocab_size,
        "tie_word_embeddings": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "block_size": drafter.block_size,
        "num_target_layers": drafter.num_target_layers,
        "dflash_config": {"mask_token_id": drafter.mask_token_id,
                          "target_layer_ids": list(drafter.target_layer_ids)},
    }


def save_drafter(drafter: DFlashDrafter, out_dir: str | os.PathLike, dtype: torch.dtype | None = None,
                 extra: dict | None = None, vocab_size: int | None = None) -> Path:
    """Writes config.json + model.safetensors atomically (each file replaced whole). `vocab_size`
    defaults to the attached LM head's (0 when none is attached)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dtype = dtype or next(drafter.parameters()).dtype
    tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in drafter.state_dict().items()}
    atomic_write(out / "model.safetensors", lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))
    if vocab_size is None:
        vocab_size = int(drafter.lm_head_VH.shape[0]) if drafter.lm_head_VH.numel() else 0
    cfg = serving_config(drafter, int(vocab_size), dtype)
    if extra:
        cfg["dflash_training"] = extra
    atomic_write_text(out / "config.json", json.dumps(cfg, indent=2))
    return out


def drafter_config_from_serving(cfg: dict) -> DrafterConfig:
    return DrafterConfig(
        num_layers=cfg["num_hidden_layers"], num_heads=cfg["num_attention_heads"],
        num_kv_heads=cfg["num_key_value_heads"],
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
        intermediate_size=cfg["intermediate_size"], block_size=int(cfg.get("block_size", 16)),
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=float(cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 1e6)))


_REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads")


def read_serving_config(folder: str | os.PathLike) -> dict:
    """config.json of a serving folder, checked for what `load_drafter` needs; errors name the file."""
    folder = Path(folder)
    f = folder / "config.json"
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: not a folder (expected a DFlash serving folder with config.json "
                                f"and *.safetensors)")
    if not f.is_file():
        raise FileNotFoundError(f"{f}: missing (expected a DFlash serving folder: config.json with "
                                f"\"architectures\": [\"DFlashDraftModel\"] and *.safetensors weights)")
    try:
        cfg = json.loads(f.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{f}: not valid JSON ({e})") from e
    if not isinstance(cfg, dict):
        raise ValueError(f"{f}: expected a JSON object, got {type(cfg).__name__}")
    arch = cfg.get("architectures") or []
    if arch and not any("DFlash" in a for a in arch):
        raise ValueError(f"{f}: architectures={arch}; expected [\"DFlashDraftModel\"] (is this a target "
                         f"model folder rather than a drafter?)")
    missing = [k for k in _REQUIRED if k not in cfg]
    if missing:
        raise ValueError(f"{f}: missing Qwen3 decoder field(s) {missing}")
    dcfg = cfg.get("dflash_config") or {}
    if dcfg.get("target_layer_ids", cfg.get("target_layer_ids")) is None:
        raise ValueError(f"{f}: missing dflash_config.target_layer_ids (the target layers the drafter reads)")
    if dcfg.get("mask_token_id", cfg.get("mask_token_id")) is None:
        raise ValueError(f"{f}: missing dflash_config.mask_token_id")
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
        raise ValueError(f"{f}: rope type {rope.get('rope_type', rope.get('type'))!r} is not supported "
                         f"(this drafter implements plain RoPE only)")
    if cfg.get("use_sliding_window"):
        raise ValueError(f"{f}: use_sliding_window=true is not supported (DFlash drafters attend to all context)")
    if cfg.get("attention_bias"):
        raise ValueError(f"{f}: attention_bias=true is not supported (DFlash drafters have no biases)")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{f}: hidden_act={cfg['hidden_act']!r}; expected \"silu\"")
    return cfg


def load_drafter(folder: str | os.PathLike, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32) -> DFlashDrafter:
    """Loads a serving-format folder (ours or a published DFlash drafter). Errors name the file and
    what was expected there."""
    folder = Path(folder)
    cfg = read_serving_config(folder)
    dcfg = cfg.get("dflash_config") or {}
    layer_ids = [int(i) for i in dcfg.get("target_layer_ids", cfg.get("target_layer_ids"))]
    mask = dcfg.get("mask_token_id", cfg.get("mask_token_id"))
    drafter = DFlashDrafter(drafter_config_from_serving(cfg), int(cfg["hidden_size"]),
                            int(cfg.get("num_target_layers", max(layer_ids) + 1)), int(mask), layer_ids)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no *.safetensors weight file next to config.json")
    state: dict[str, torch.Tensor] = {}
    origin: dict[str, Path] = {}
    for f in files:
        try:
            part = load_file(str(f))
        except Exception as e:
            raise ValueError(f"{f}: unreadable safetensors file ({type(e).__name__}: {e})") from e
        state.update(part)
        origin.update(dict.fromkeys(part, f))
    expected = drafter.state_dict()
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    if missing or unexpected:
        parts = ([f"{len(missing)} missing, e.g. {missing[:5]}"] if missing else []) + \
                ([f"{len(unexpected)} unexpected, e.g. {unexpected[:5]}"] if unexpected else [])
        raise ValueError(f"{folder}: tensor names in {[f.name for f in files]} do not match the "
                         f"DFlashDraftModel that config.json describes ({'; '.join(parts)})")
    bad = [(k, tuple(state[k].shape), tuple(v.shape)) for k, v in expected.items() if state[k].shape != v.shape]
    if bad:
        k, got, want = bad[0]
        raise ValueError(f"{origin[k]}: tensor {k!r} has shape {got}, but {folder / 'config.json'} implies "
                         f"{want} ({len(bad)} mismatched tensors)")
    drafter.load_state_dict(state, strict=True)
    return drafter.to(device=device, dtype=dtype)


# ----------------------------------------------------------------------------------- export
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    key = str(name).removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"dtype {name!r}; expected one of {sorted(_DTYPES)}")
    return _DTYPES[key]


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE). False where unsupported."""
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    AT_FDCWD, RENAME_EXCHANGE = -100, 2
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE) == 0:
        return True
    return False


def replace_dir(tmp: Path, out: Path) -> None:
    """Put the finished folder `tmp` at `out`: an atomic swap where the OS allows, else two renames
    (the old folder is moved aside first, so `out` is never a half-written folder)."""
    if not out.exists():
        os.rename(tmp, out)
    elif _exchange(tmp, out):  # tmp now holds the old folder
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        old = out.with_name(f".{out.name}.old-{uuid.uuid4().hex[:8]}")
        os.rename(out, old)
        try:
            os.rename(tmp, out)
        except BaseException:
            os.rename(old, out)
            raise
        shutil.rmtree(old, ignore_errors=True)
    _fsync_dir(out.parent)


def write_serving_folder(drafter: DFlashDrafter, out_dir: str | os.PathLike, dtype: torch.dtype | None = None,
                         extra: dict | None = None, vocab_size: int | None = None) -> Path:
    """`save_drafter` into a temp folder beside `out_dir`, then swap it in whole. An existing `out_dir`
    must be a serving folder (config.json) or empty; anything else is refused, not overwritten."""
    out = Path(out_dir).absolute()
    if out.exists():
        if not out.is_dir():
            raise FileExistsError(f"{out}: exists and is not a folder")
        if any(out.iterdir()) and not (out / "config.json").is_file():
            raise FileExistsError(f"{out}: a non-empty folder that is not a serving folder (no config.json); "
                                  f"refusing to replace it")
    return write_dir_atomically(out, lambda tmp: save_drafter(drafter, tmp, dtype=dtype, extra=extra,
                                                              vocab_size=vocab_size))


def write_dir_atomically(out_dir: str | os.PathLike, write: Callable[[Path], object]) -> Path:
    """`write(tmp)` fills a temp folder beside `out_dir`, which is then swapped in whole (`replace_dir`);
    on any error the temp folder goes and `out_dir` stays as it was."""
    out = Path(out_dir).absolute()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        write(tmp)
        _fsync_dir(tmp)
        os.chmod(tmp, dir_mode())  # mkdtemp makes it 0700
        replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


@dataclass
class ExportSource:
    drafter: DFlashDrafter
    vocab_size: int
    extra: dict
    origin: Path


def drafter_from_checkpoint(pt: Path, state: dict) -> ExportSource:
    """A trainer checkpoint's loaded state (`checkpoints/step_*.pt`) → drafter; target facts (mask token, layer
    ids, vocab) from the same run's final/config.json when present, else from the saved target config."""
    if "drafter" not in state or "config" not in state:
        raise ValueError(f"{pt}: not a dflash training checkpoint (expected a dict with 'drafter' and "
                         f"'config', as written by dflash.training.trainer)")
    weights, run_cfg = state["drafter"], state["config"]
    if "fc.weight" not in weights:
        raise ValueError(f"{pt}: 'drafter' state has no fc.weight (not a DFlash drafter state dict)")
    known = {f.name for f in dataclasses.fields(DrafterConfig)}
    dcfg = DrafterConfig(**{k: v for k, v in (run_cfg.get("drafter") or {}).items() if k in known})
    H, in_features = weights["fc.weight"].shape
    from dflash.run_dir import RunDir
    run = RunDir(pt.parent.parent)  # checkpoints/ sits in the run folder
    if run.has_final():
        sc = read_serving_config(run.final)
        d = sc.get("dflash_config") or {}
        layer_ids, mask = list(d["target_layer_ids"]), int(d["mask_token_id"])
        n_target, vocab = int(sc["num_target_layers"]), int(sc.get("vocab_size", 0))
    else:
        from dflash.target.model import (
            TargetConfig,
            TinyTargetSpec,
            read_target_info,
            resolve_layer_ids,
            resolve_mask_token,
        )
        t = dict(run_cfg.get("target") or {})
        spec = TinyTargetSpec(**{k: v for k, v in (t.pop("random", None) or {}).items()
                                 if k in {f.name for f in dataclasses.fields(TinyTargetSpec)}})
        tcfg = TargetConfig(**{k: v for k, v in t.items() if k in {f.name for f in dataclasses.fields(TargetConfig)}},
                            random=spec)
        info = read_target_info(tcfg)
        layer_ids, mask = resolve_layer_ids(tcfg, info), resolve_mask_token(tcfg)
        n_target, vocab = info.num_layers, info.vocab_size
    if in_features != len(layer_ids) * H:
        raise ValueError(f"{pt}: fc.weight is {tuple(weights['fc.weight'].shape)} but the run's target "
                         f"layer ids {layer_ids} imply ({H}, {len(layer_ids) * H})")
    drafter = DFlashDrafter(dcfg, int(H), n_target, mask, layer_ids)
    try:
        drafter.load_state_dict(weights, strict=True)
    except RuntimeError as e:
        raise ValueError(f"{pt}: drafter weights do not match its saved config: {e}") from e
    extra = {"source_checkpoint": pt.name, "step": state.get("step")}
    for k in ("target", "loss"):
        name = (run_cfg.get(k) or {}).get("name")
        if name:
            extra[k] = name
    return ExportSource(drafter.float(), vocab, extra, pt)


def _from_serving(folder: Path) -> ExportSource:
    cfg = read_serving_config(folder)
    return ExportSource(load_drafter(folder), int(cfg.get("vocab_size", 0)),
                        dict(cfg.get("dflash_training") or {}), folder)


def resolve_export_source(source: str | os.PathLike) -> ExportSource:
    """A run dir (its final/ serving folder, else its newest intact checkpoint), a serving folder, or a .pt
    (`dflash.run_dir.resolve_drafter_source` decides which)."""
    from dflash.run_dir import resolve_drafter_source
    src = resolve_drafter_source(source)
    if src.serving is not None:
        return _from_serving(src.serving)
    return drafter_from_checkpoint(src.checkpoint, src.state)


def export_drafter(source: str | os.PathLike, out_dir: str | os.PathLike,
                   dtype: str | torch.dtype = "bfloat16") -> Path:
    """Writes the serving folder (DESIGN §6) for a run dir / serving folder / checkpoint, atomically."""
    src = resolve_export_source(source)
    return write_serving_folder(src.drafter, out_dir, dtype=parse_dtype(dtype), extra=src.extra or None,
                                vocab_size=src.vocab_size)
