"""The serving format (docs/serving.md): a folder with `config.json` (`DFlashDraftModel`, Qwen3 decoder fields,
`block_size`, `num_target_layers`, `dflash_config`) and `model.safetensors` whose tensor names are those
of the reference implementation (z-lab/dflash `dflash/model.py`), which our module names mirror.
z-lab / SGLang / vLLM load such a folder; `load_drafter` reads it back (ours, a published one, or one speculators
wrote: `dflash.serving.speculators_folder`).

What the engines read beyond the weights (checked against their source, docs/serving.md), and where it comes from:
- `max_position_embeddings`: the target's context length (SGLang refuses a drafter shorter than its target;
  vLLM sizes the drafter's RoPE table with it).
- `dflash_config.mask_token`: the target tokenizer's string for `mask_token_id` (SGLang checks it).
- `eagle_aux_hidden_state_layer_ids` = target_layer_ids + 1 (older vLLM builds read this key).
- `layer_types`, `sliding_window`, `use_sliding_window` when the drafter has sliding-window layers.
- `rope_parameters` / `rope_theta`: the drafter's RoPE, which is the target's when `drafter.rope_theta=0`.
- `auto_map` + `modeling_dflash.py` (dflash/serving/modeling_dflash.py, copied): the Transformers path,
  `AutoModel.from_pretrained(dir, trust_remote_code=True)`.
The target's facts (`TargetFacts`) are known to the trainer and to an export from a run; a bare
`save_drafter(d, dir)` without them writes only config.json + weights (no context length, mask string or
modelling file to vouch for).
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
from safetensors.torch import save_file

from dflash.atomic import atomic_write, atomic_write_text, dir_mode
from dflash.drafter.model import LAYER_TYPES, DFlashDrafter, DrafterConfig
from dflash.safe_load import MANIFEST, load_tensors, verify_manifest, write_manifest
from dflash.serving.dflash2_folder import dflash2_config_fields, dflash2_serving_fields, is_dflash2
from dflash.serving.speculators_folder import VERIFIER_TENSORS, is_speculators, serving_config_from_speculators

MODELING_FILE = "modeling_dflash.py"  # written into every complete folder; its source sits beside this module
AUTO_MAP = {"AutoModel": "modeling_dflash.DFlashDraftModel"}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
_UNKNOWN_TARGET_CONTEXT = 32768  # Qwen3Config's default: written only when the target is unknown (bare save)


@dataclass(frozen=True)
class TargetFacts:
    """What the serving folder takes from the target (config.json + tokenizer; no weights needed)."""
    hidden_size: int
    num_layers: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float
    mask_token: str | None = None  # the tokenizer's string for the mask token id (None: no tokenizer)
    mask_token_id: int | None = None  # the id that string has in the tokenizer (None: no tokenizer)


def rope_theta_of(text_cfg: dict, where: str = "target config") -> float:
    """rope_theta of a (text) config dict: transformers >= 5 `rope_parameters`, else the older fields."""
    for src in (text_cfg.get("rope_parameters") or {}, text_cfg, text_cfg.get("rope_scaling") or {}):
        if src.get("rope_theta") is not None:
            return float(src["rope_theta"])
    raise ValueError(f"{where}: no rope_theta (rope_parameters.rope_theta) to give the drafter")


def facts_from_text_config(t: dict, mask_token: str | None, where: str = "target config",
                           mask_token_id: int | None = None) -> TargetFacts:
    if t.get("max_position_embeddings") is None:
        raise ValueError(f"{where}: no max_position_embeddings (the target's context length)")
    return TargetFacts(int(t["hidden_size"]), int(t["num_hidden_layers"]), int(t["vocab_size"]),
                       int(t["max_position_embeddings"]), rope_theta_of(t, where), mask_token,
                       None if mask_token is None else mask_token_id)


def _mask_token_string(tokenizer, mask_token_id: int, where: str = "target tokenizer") -> str | None:
    """The tokenizer's string for `mask_token_id`; None for a tokenizer without token strings (the byte
    tokenizer of random targets). An id the tokenizer has no token for is refused: SGLang checks the string
    against the target tokenizer, and a made-up one ("None") would name another token or none."""
    convert = getattr(tokenizer, "convert_ids_to_tokens", None)
    if convert is None:
        return None
    token = convert(int(mask_token_id))
    if not isinstance(token, str) or not token:
        size = getattr(tokenizer, "vocab_size", None)
        raise ValueError(f"{where}: no token at mask_token_id={int(mask_token_id)} (the tokenizer has "
                         f"{size if size is not None else 'an unknown number of'} tokens); set target.mask_token_id "
                         f"to the id of the tokenizer's mask token")
    return token


def read_target_facts(tcfg) -> TargetFacts:
    """A `TargetConfig`'s facts from its config.json and tokenizer (a random target: its built config)."""
    from dflash.target.model import text_config_dict, tiny_hf_config, checkpoint_path, resolve_mask_token
    if not tcfg.path:
        return facts_from_text_config(tiny_hf_config(tcfg.random).to_dict(), None, "target.random")
    path = Path(checkpoint_path(tcfg))
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"target.path={tcfg.path!r}: no config.json there")
    mask_token, mask_id, tok = None, resolve_mask_token(tcfg), None
    has_tokenizer = any((path / f).is_file() for f in _TOKENIZER_FILES)  # else transformers makes an empty one
    if tcfg.tokenizer == "auto" and has_tokenizer:
        try:
            from transformers import AutoTokenizer
            tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except (OSError, ValueError):
            tok = None  # no tokenizer in the folder: the mask string stays unknown (and is not written)
    if tok is not None:
        mask_token = _mask_token_string(tok, mask_id, f"{path} tokenizer")
    return facts_from_text_config(text_config_dict(path), mask_token, str(path / "config.json"), mask_id)


def facts_of_target(target) -> TargetFacts:
    """A live `dflash.target.model.Target`'s facts (its loaded config and tokenizer)."""
    hf = target.model.config
    t = (getattr(hf, "text_config", None) or hf).to_dict()
    return facts_from_text_config(t, _mask_token_string(target.tokenizer, target.mask_token_id), "target config",
                                  int(target.mask_token_id))


def modeling_source() -> str:
    return (Path(__file__).with_name(MODELING_FILE)).read_text()


def serving_config(drafter: DFlashDrafter, vocab_size: int, dtype: torch.dtype,
                   target: TargetFacts | None = None) -> dict:
    c = drafter.cfg
    ids = list(drafter.target_layer_ids)
    cfg = {
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
        "max_position_embeddings": target.max_position_embeddings if target else _UNKNOWN_TARGET_CONTEXT,
        "vocab_size": vocab_size,
        "tie_word_embeddings": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "block_size": drafter.block_size,
        "num_target_layers": drafter.num_target_layers,
        "dflash_config": {"mask_token_id": drafter.mask_token_id, "target_layer_ids": ids},
    }
    if "sliding_attention" in c.layer_types:
        # use_sliding_window: without it Qwen3Config drops sliding_window (vLLM then has no window to use)
        cfg.update(layer_types=list(c.layer_types), sliding_window=c.sliding_window, use_sliding_window=True,
                   max_window_layers=c.num_layers)
    if target is not None:
        cfg["auto_map"] = dict(AUTO_MAP)
        cfg["eagle_aux_hidden_state_layer_ids"] = [i + 1 for i in ids]  # decoder-layer inputs: output id + 1
        if target.mask_token is not None:
            cfg["dflash_config"]["mask_token"] = target.mask_token
    return dflash2_serving_fields(drafter, cfg) if c.is_dflash2 else cfg


def save_drafter(drafter: DFlashDrafter, out_dir: str | os.PathLike, dtype: torch.dtype | None = None,
                 extra: dict | None = None, vocab_size: int | None = None,
                 target: TargetFacts | None = None) -> Path:
    """Writes config.json + model.safetensors (+ modeling_dflash.py when the target is known) atomically (each
    file replaced whole), then their checksum manifest (`dflash.safe_load.MANIFEST`, which loading verifies; an
    old one goes first, so a stop midway leaves no manifest that disagrees). `vocab_size` defaults to the
    target's, else the attached LM head's (0 when none)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST).unlink(missing_ok=True)
    if target is not None:
        check_against_target(drafter, target, f"drafter for {out}")
    dtype = dtype or next(drafter.parameters()).dtype
    tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in drafter.state_dict().items()}
    atomic_write(out / "model.safetensors", lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))
    if vocab_size is None:
        vocab_size = target.vocab_size if target else (
            int(drafter.lm_head_VH.shape[0]) if drafter.lm_head_VH.numel() else 0)
    cfg = serving_config(drafter, int(vocab_size), dtype, target)
    if extra:
        cfg["dflash_training"] = extra
    if target is not None and not drafter.cfg.is_dflash2:  # DFlash 2: the engines' own class, no modelling file
        atomic_write_text(out / MODELING_FILE, modeling_source())
    atomic_write_text(out / "config.json", json.dumps(cfg, indent=2))
    write_manifest(out)
    return out


def check_against_target(drafter: DFlashDrafter, target: TargetFacts, where: str) -> None:
    """A drafter and a target that cannot work together: ValueError naming the field."""
    if drafter.hidden_size != target.hidden_size:
        raise ValueError(f"{where}: hidden_size={drafter.hidden_size} but the target's is {target.hidden_size} "
                         f"(the drafter reuses the target's embedding and LM head)")
    if drafter.num_target_layers != target.num_layers:
        raise ValueError(f"{where}: num_target_layers={drafter.num_target_layers} but the target has "
                         f"{target.num_layers} layers")
    bad = [i for i in drafter.target_layer_ids if not 0 <= i < target.num_layers]
    if bad:
        raise ValueError(f"{where}: dflash_config.target_layer_ids {bad} lie outside the target's "
                         f"{target.num_layers} layers")


def drafter_config_from_serving(cfg: dict, where: str = "config.json") -> DrafterConfig:
    layer_types = list(cfg.get("layer_types") or [])
    sliding = "sliding_attention" in layer_types
    dflash2 = dflash2_config_fields(cfg, where) if is_dflash2(cfg) else {}
    return DrafterConfig(**dflash2,
        num_layers=cfg["num_hidden_layers"], num_heads=cfg["num_attention_heads"],
        num_kv_heads=cfg["num_key_value_heads"],
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
        intermediate_size=cfg["intermediate_size"], block_size=_block_size(cfg),
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta_of(cfg, "config.json"),
        layer_types=layer_types if sliding else [], sliding_window=int(cfg["sliding_window"]) if sliding else 0)


def _block_size(cfg: dict) -> int:
    return int((cfg.get("dflash_config") or {}).get("block_size", cfg.get("block_size", 16)))


def facts_from_serving(cfg: dict) -> TargetFacts | None:
    """The target facts a complete serving folder records (None for a bare one: no auto_map)."""
    if "auto_map" not in cfg and not (is_dflash2(cfg) and "eagle_aux_hidden_state_layer_ids" in cfg):
        return None
    d = cfg.get("dflash_config") or {}
    token = d.get("mask_token")
    return TargetFacts(int(cfg["hidden_size"]), int(cfg["num_target_layers"]), int(cfg.get("vocab_size", 0)),
                       int(cfg["max_position_embeddings"]), rope_theta_of(cfg, "config.json"), token,
                       int(d["mask_token_id"]) if token is not None and "mask_token_id" in d else None)


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
    if is_speculators(cfg):  # trained or converted by speculators: its nested layout, read as ours
        cfg = serving_config_from_speculators(cfg, str(f))
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
    if _block_size(cfg) < 1:  # SGLang: "DFLASH block_size must be positive"
        raise ValueError(f"{f}: block_size={_block_size(cfg)}; expected a positive block size (16 for the "
                         f"published drafters)")
    token = dcfg.get("mask_token")
    if token is not None and (not isinstance(token, str) or not token or token == "None"):
        raise ValueError(f"{f}: dflash_config.mask_token={token!r} is not a token string (SGLang checks it against "
                         f"the target tokenizer; leave it out when unknown)")
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
        raise ValueError(f"{f}: rope type {rope.get('rope_type', rope.get('type'))!r} is not supported "
                         f"(this drafter implements plain RoPE only)")
    if cfg.get("attention_bias"):
        raise ValueError(f"{f}: attention_bias=true is not supported (DFlash drafters have no biases)")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{f}: hidden_act={cfg['hidden_act']!r}; expected \"silu\"")
    _check_attention_fields(cfg, f)
    _check_consistent(cfg, f)
    return cfg


def _check_attention_fields(cfg: dict, f: Path) -> None:
    """layer_types / sliding_window as this drafter implements them (sliding layers causal in the block)."""
    types = cfg.get("layer_types")
    if types is not None:
        bad = [t for t in types if t not in LAYER_TYPES]
        if bad:
            raise ValueError(f"{f}: layer_types has {bad}; supported: {list(LAYER_TYPES)}")
        if len(types) != cfg["num_hidden_layers"]:
            raise ValueError(f"{f}: layer_types has {len(types)} entries but num_hidden_layers="
                             f"{cfg['num_hidden_layers']}")
    sliding = bool(types) and "sliding_attention" in types
    if sliding and not isinstance(cfg.get("sliding_window"), int):
        raise ValueError(f"{f}: layer_types has sliding_attention layers but sliding_window="
                         f"{cfg.get('sliding_window')!r} (expected the window, an int)")
    if not types and cfg.get("use_sliding_window"):
        raise ValueError(f"{f}: use_sliding_window=true without layer_types is not supported (name the "
                         f"sliding_attention layers in layer_types)")
    if is_dflash2(cfg):  # DFlash 2 says whether its windowed layers are causal in the block: is_causal
        if not isinstance(cfg.get("is_causal", False), bool):
            raise ValueError(f"{f}: is_causal={cfg['is_causal']!r}; expected true or false")
        return
    for key, value in (("is_causal", cfg.get("is_causal")), ("dflash_config.causal",
                                                             (cfg.get("dflash_config") or {}).get("causal"))):
        if value is not None:
            raise ValueError(f"{f}: {key}={value!r} is not supported (this drafter is causal exactly in its "
                             f"sliding_attention layers, the engines' default; leave {key} unset)")


def _check_consistent(cfg: dict, f: Path) -> None:
    """Fields that say the same thing twice must agree; the error names the field."""
    d = cfg.get("dflash_config") or {}
    if "block_size" in d and "block_size" in cfg and int(d["block_size"]) != int(cfg["block_size"]):
        raise ValueError(f"{f}: block_size={cfg['block_size']} but dflash_config.block_size={d['block_size']}")
    ids = [int(i) for i in d.get("target_layer_ids", cfg.get("target_layer_ids"))]
    if "target_layer_ids" in d and "target_layer_ids" in cfg and list(cfg["target_layer_ids"]) != ids:
        raise ValueError(f"{f}: target_layer_ids={cfg['target_layer_ids']} but dflash_config.target_layer_ids="
                         f"{ids}")
    aux = cfg.get("eagle_aux_hidden_state_layer_ids")
    if aux is not None and [int(i) for i in aux] != [i + 1 for i in ids]:
        raise ValueError(f"{f}: eagle_aux_hidden_state_layer_ids={aux} but dflash_config.target_layer_ids={ids} "
                         f"(expected target_layer_ids + 1 = {[i + 1 for i in ids]})")
    n = cfg.get("num_target_layers")
    if n is not None and any(not 0 <= i < int(n) for i in ids):
        raise ValueError(f"{f}: dflash_config.target_layer_ids={ids} lie outside num_target_layers={n}")
    mask = d.get("mask_token_id")
    if mask is not None and cfg.get("mask_token_id") is not None and int(cfg["mask_token_id"]) != int(mask):
        raise ValueError(f"{f}: mask_token_id={cfg['mask_token_id']} but dflash_config.mask_token_id={mask}")


def check_folder_against_target(cfg: dict, target: TargetFacts, f: Path) -> None:
    """A serving config that does not fit `target`: ValueError naming the file and the field."""
    if int(cfg["hidden_size"]) != target.hidden_size:
        raise ValueError(f"{f}: hidden_size={cfg['hidden_size']} but the target's is {target.hidden_size}")
    n = cfg.get("num_target_layers")
    if n is not None and int(n) != target.num_layers:
        raise ValueError(f"{f}: num_target_layers={n} but the target has {target.num_layers} layers")
    ids = (cfg.get("dflash_config") or {}).get("target_layer_ids", cfg.get("target_layer_ids"))
    if any(not 0 <= int(i) < target.num_layers for i in ids):
        raise ValueError(f"{f}: dflash_config.target_layer_ids={ids} lie outside the target's "
                         f"{target.num_layers} layers")
    vocab = int(cfg.get("vocab_size") or 0)
    if vocab and vocab != target.vocab_size:
        raise ValueError(f"{f}: vocab_size={vocab} but the target's is {target.vocab_size}")
    if int(cfg.get("max_position_embeddings", 0)) < target.max_position_embeddings:
        raise ValueError(f"{f}: max_position_embeddings={cfg.get('max_position_embeddings')} is below the "
                         f"target's context length {target.max_position_embeddings} (SGLang refuses to start)")
    d = cfg.get("dflash_config") or {}
    token = d.get("mask_token")
    if token is not None and target.mask_token is not None and token != target.mask_token:
        raise ValueError(f"{f}: dflash_config.mask_token={token!r} but the target tokenizer's mask token is "
                         f"{target.mask_token!r}")
    mask_id = d.get("mask_token_id", cfg.get("mask_token_id"))
    if target.mask_token_id is not None and int(mask_id) != target.mask_token_id:
        raise ValueError(f"{f}: dflash_config.mask_token_id={mask_id} but the target tokenizer's mask token "
                         f"{target.mask_token!r} is id {target.mask_token_id} (SGLang refuses a drafter whose mask "
                         f"id and token disagree)")


def load_drafter(folder: str | os.PathLike, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, target: TargetFacts | None = None) -> DFlashDrafter:
    """Loads a serving-format folder (ours, a published DFlash drafter, or speculators' DFlash folder:
    `dflash.serving.speculators_folder`). Errors name the file and what was expected there; with `target`, also a
    folder that does not fit that target."""
    folder = Path(folder)
    verify_manifest(folder)  # ours: every file as exported; a published folder: its structure is checked below
    cfg = read_serving_config(folder)
    if target is not None:
        check_folder_against_target(cfg, target, folder / "config.json")
    dcfg = cfg.get("dflash_config") or {}
    layer_ids = [int(i) for i in dcfg.get("target_layer_ids", cfg.get("target_layer_ids"))]
    mask = dcfg.get("mask_token_id", cfg.get("mask_token_id"))
    try:
        dc = drafter_config_from_serving(cfg, str(folder / "config.json"))
        drafter = DFlashDrafter(dc, int(cfg["hidden_size"]),
                                int(cfg.get("num_target_layers", max(layer_ids) + 1)), int(mask), layer_ids,
                                int(cfg.get("vocab_size") or 0) or None)
    except ValueError as e:  # e.g. a window below the block size
        raise ValueError(f"{folder / 'config.json'}: {e}") from e
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no *.safetensors weight file next to config.json")
    state: dict[str, torch.Tensor] = {}
    origin: dict[str, Path] = {}
    for f in files:
        part = load_tensors(f)
        if is_speculators(cfg):  # the verifier's embedding and LM head copied in: ours come from the target
            part = {k: v for k, v in part.items() if k not in VERIFIER_TENSORS}
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
                         extra: dict | None = None, vocab_size: int | None = None,
                         target: TargetFacts | None = None) -> Path:
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
                                                              vocab_size=vocab_size, target=target))


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
    target: TargetFacts | None = None  # None: unknown (a bare folder as source) -> a bare export


def drafter_from_checkpoint(pt: Path, state: dict, run_serving: Path | None = None) -> ExportSource:
    """A trainer checkpoint's loaded state (`checkpoints/step_*.pt`) → drafter; target facts (mask token, layer
    ids, vocab) from the same run's serving folder `run_serving` (its final/, when it has one: dflash/run_dir.py
    `DrafterSource.run_serving`), else from the saved target config."""
    if "drafter" not in state or "config" not in state:
        raise ValueError(f"{pt}: not a dflash training checkpoint (expected a dict with 'drafter' and "
                         f"'config', as written by dflash/training/trainer.py)")
    weights, run_cfg = state["drafter"], state["config"]
    if "fc.weight" not in weights:
        raise ValueError(f"{pt}: 'drafter' state has no fc.weight (not a DFlash drafter state dict)")
    known = {f.name for f in dataclasses.fields(DrafterConfig)}
    dcfg = DrafterConfig(**{k: v for k, v in (run_cfg.get("drafter") or {}).items() if k in known})
    H, in_features = weights["fc.weight"].shape
    if run_serving is not None:
        sc = read_serving_config(run_serving)
        d = sc.get("dflash_config") or {}
        layer_ids, mask = list(d["target_layer_ids"]), int(d["mask_token_id"])
        n_target, vocab = int(sc["num_target_layers"]), int(sc.get("vocab_size", 0))
        facts, rope_theta = facts_from_serving(sc), rope_theta_of(sc, str(run_serving / "config.json"))
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
        facts = read_target_facts(tcfg)
        rope_theta = facts.rope_theta
    dcfg = dcfg.for_target(rope_theta)  # rope_theta 0 in the run's config: the target's
    if in_features != len(layer_ids) * H:
        raise ValueError(f"{pt}: fc.weight is {tuple(weights['fc.weight'].shape)} but the run's target "
                         f"layer ids {layer_ids} imply ({H}, {len(layer_ids) * H})")
    drafter = DFlashDrafter(dcfg, int(H), n_target, mask, layer_ids, vocab or None)
    try:
        drafter.load_state_dict(weights, strict=True)
    except RuntimeError as e:
        raise ValueError(f"{pt}: drafter weights do not match its saved config: {e}") from e
    extra = {"source_checkpoint": pt.name, "step": state.get("step")}
    for k in ("target", "loss"):
        name = (run_cfg.get(k) or {}).get("name")
        if name:
            extra[k] = name
    return ExportSource(drafter.float(), vocab, extra, pt, facts)


def source_from_serving(folder: Path) -> ExportSource:
    cfg = read_serving_config(folder)
    return ExportSource(load_drafter(folder), int(cfg.get("vocab_size", 0)),
                        dict(cfg.get("dflash_training") or {}), folder, facts_from_serving(cfg))
