"""Conversation datasets as users hold them, read with Hugging Face `datasets` into one normalized table.

`data.path` is a file, a glob or a folder of `.jsonl` / `.json` / `.parquet` files, or a dataset saved with
`Dataset.save_to_disk`. Each file is read on its own (memory-mapped Arrow, cached by `datasets` under
`data.conversations.cache_dir`) and its format is detected from its fields (`FORMATS`; a file that mixes formats: per record):

- `openai`:   {"messages": [{"role": "system"|"user"|"assistant"|"tool", "content": "..."}, ...]}
- `sharegpt`: {"conversations": [{"from": "system"|"human"|"gpt", "value": "..."}, ...]} (optional "system")
- `flat`:     {"prompt": "...", "response": "..."} (optional "system"): one user turn, one assistant turn

Every record becomes `messages` (role / content), `source` ("file:line", for messages), `conv_hash` (sha256 of the
normalized conversation: the held-out split) and `error` (why it fits no format; "" when it does). A record whose
JSON does not parse or that fits no format stops the run before any work (`ConversationInputError`, exit 2),
naming the file, the line (the row, for parquet and saved datasets) and the field.
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
from pathlib import Path
from typing import Callable

from dflash.data.chat import ROLES
from dflash.registry import Registry

FILE_SUFFIXES = (".jsonl", ".json", ".parquet")
# role spellings of the formats users hold (ShareGPT: human / gpt; a few exports: bot, model, chatgpt)
ROLE_NAMES = {"system": "system", "user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant",
              "chatgpt": "assistant", "bot": "assistant", "model": "assistant", "tool": "tool", "function": "tool",
              "observation": "tool"}


class ConversationInputError(ValueError):
    """Bad conversation input (a path that matches nothing, a line that does not parse, a record that fits no
    format); the message names the file, the line and the field."""


def _offline_datasets():
    # no hub at run time: `datasets` reads local files only
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import datasets
    datasets.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    return datasets


def is_saved_dataset(p: Path) -> bool:
    return p.is_dir() and ((p / "dataset_info.json").is_file() or (p / "state.json").is_file()
                           or (p / "dataset_dict.json").is_file())


def resolve_files(path: str) -> list[Path]:
    """The files (or saved-dataset folders) `data.path` names, sorted; ConversationInputError when none."""
    if not path:
        raise ConversationInputError("data.path is empty; data.source=conversations needs a file, a glob or a folder")
    p = Path(path).expanduser()
    if is_saved_dataset(p):
        return [p]
    if p.is_dir():
        saved = [d for d in sorted(p.rglob("*")) if is_saved_dataset(d)]  # their own .json files are not data
        found = [f for f in sorted(p.rglob("*")) if f.is_file() and f.suffix in FILE_SUFFIXES
                 and not any(d in f.parents for d in saved)] + saved
    elif p.is_file():
        found = [p]
    else:
        found = [Path(f) for f in sorted(glob.glob(str(p), recursive=True))
                 if (Path(f).is_file() and Path(f).suffix in FILE_SUFFIXES) or is_saved_dataset(Path(f))]
    if not found:
        raise ConversationInputError(f"data.path={path!r} matches no file (expected a .jsonl, .json or .parquet "
                                     f"file, a glob or folder of them, or a dataset saved with save_to_disk)")
    return found


# -- formats ------------------------------------------------------------------------------------------------
def _role(raw, field: str) -> tuple[str, str]:
    role = ROLE_NAMES.get(str(raw).lower()) if isinstance(raw, str) else None
    if role is None:
        return "", f"field {field}: role {raw!r} is not one of {', '.join(sorted(ROLE_NAMES))}"
    return role, ""


def _content(raw, field: str) -> tuple[str, str]:
    if isinstance(raw, list):  # OpenAI content parts: the text ones, in order
        parts = [p.get("text") for p in raw if isinstance(p, dict) and p.get("type", "text") == "text"]
        if all(isinstance(t, str) for t in parts) and parts:
            return "".join(parts), ""
    if not isinstance(raw, str):
        return "", f"field {field}: expected a string, got {type(raw).__name__}"
    return raw, ""


def _turns(record: dict, column: str, role_key: str, content_key: str) -> tuple[list[dict], str]:
    turns = record.get(column)
    if not isinstance(turns, list) or not turns:
        return [], f"field {column}: expected a non-empty list of messages, got {type(turns).__name__}"
    out = []
    for i, m in enumerate(turns):
        if not isinstance(m, dict):
            return [], f"field {column}[{i}]: expected an object, got {type(m).__name__}"
        rk = role_key if m.get(role_key) is not None else ("role" if m.get("role") is not None else role_key)
        ck = content_key if m.get(content_key) is not None else ("content" if m.get("content") is not None
                                                                 else content_key)
        role, err = _role(m.get(rk), f"{column}[{i}].{rk}")
        content, err2 = _content(m.get(ck), f"{column}[{i}].{ck}")
        if err or err2:
            return [], err or err2
        out.append({"role": role, "content": content})
    return out, ""


def _with_system(record: dict, messages: list[dict]) -> tuple[list[dict], str]:
    system = record.get("system")
    if system is None or system == "" or (messages and messages[0]["role"] == "system"):
        return messages, ""
    content, err = _content(system, "system")
    return ([{"role": "system", "content": content}, *messages], err) if not err else ([], err)


def _openai(record: dict) -> tuple[list[dict], str]:
    return _turns(record, "messages", "role", "content")


def _sharegpt(record: dict) -> tuple[list[dict], str]:
    messages, err = _turns(record, "conversations", "from", "value")
    return _with_system(record, messages) if not err else ([], err)


def _flat(record: dict) -> tuple[list[dict], str]:
    prompt, err = _content(record.get("prompt"), "prompt")
    response, err2 = _content(record.get("response"), "response")
    if err or err2:
        return [], err or err2
    return _with_system(record, [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}])


# format name -> (the fields that identify it, record -> (messages, error)); detection tries them in this order
FORMATS: Registry[tuple[tuple[str, ...], Callable[[dict], tuple[list[dict], str]]]] = Registry(
    "data.conversations.format", {"openai": (("messages",), _openai), "sharegpt": (("conversations",), _sharegpt),
                                  "flat": (("prompt", "response"), _flat)})


def detect_formats(columns: list[str], where: str) -> list[str]:
    """The formats whose fields a file's records have, in `FORMATS` order (a file may mix them: each record then
    uses the first whose fields it sets); ConversationInputError when none fits."""
    found = [name for name, (fields, _) in FORMATS.items() if all(f in columns for f in fields)]
    if not found:
        raise ConversationInputError(
            f"{where}: line 1: no field fits a conversation format: expected 'messages' (OpenAI), 'conversations' "
            f"(ShareGPT) or 'prompt' + 'response' (flat); the records have fields {sorted(columns)}")
    return found


def conversation_hash(messages: list[dict]) -> str:
    text = json.dumps([[m["role"], m["content"]] for m in messages], ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


# -- reading -------------------------------------------------------------------------------------------------
def _json_error_line(path: Path) -> str:
    """Where a JSON / JSONL file stops parsing ("line N: why"), for the error message; '' when it parses."""
    text = path.read_text(encoding="utf-8", errors="replace")
    if path.suffix == ".json":
        try:
            json.loads(text)
            return ""
        except json.JSONDecodeError as e:
            return f"line {e.lineno}: not valid JSON ({e.msg})"
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            return f"line {n}: not valid JSON ({e.msg} at column {e.colno})"
        if not isinstance(obj, dict):
            return f"line {n}: expected a JSON object, got {type(obj).__name__}"
    return ""


def load_raw(path: Path, cache_dir: str):
    """One file (or saved dataset) as a `datasets.Dataset`; ConversationInputError names what does not parse."""
    ds_lib = _offline_datasets()
    try:
        if path.is_dir():
            ds = ds_lib.load_from_disk(str(path))
            if isinstance(ds, ds_lib.DatasetDict):
                ds = ds["train"] if "train" in ds else ds[sorted(ds)[0]]
            return ds
        builder = "parquet" if path.suffix == ".parquet" else "json"
        return ds_lib.load_dataset(builder, data_files=str(path), split="train", cache_dir=cache_dir or None)
    except Exception as e:  # noqa: BLE001 - datasets wraps the parser's error; find the line ourselves
        where = _json_error_line(path) if path.suffix in (".json", ".jsonl") else ""
        raise ConversationInputError(f"{path}: {where or f'cannot be read ({type(e).__name__}: {e})'}") from e


def _line_numbers(path: Path) -> Callable[[int], str]:
    """Row index → "line N" (JSONL: blank lines skipped as the reader skips them), else "record N" / "row N"."""
    if path.suffix != ".jsonl":
        kind = "record" if path.suffix == ".json" else "row"
        return lambda i: f"{kind} {i + 1}"
    lines = [n for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1)
             if line.strip()]
    return lambda i: f"line {lines[i] if i < len(lines) else i + 1}"


def _normalize(record: dict, index: int, *, formats: list[str], path: str) -> dict:
    fmt = next((f for f in formats if all(record.get(k) is not None for k in FORMATS[f][0])), formats[0])
    messages, err = FORMATS[fmt][1](record)
    if err and len(formats) > 1:
        err = f"{fmt}: {err}"
    return {"messages": messages if not err else [], "error": err, "source": f"{path}#{index}",
            "conv_hash": conversation_hash(messages) if not err else ""}


def read_conversations(path: str, cache_dir: str = "", num_proc: int = 1):
    """Every file of `data.path` normalized (module doc) and concatenated, in file order; (dataset, formats)."""
    ds_lib = _offline_datasets()
    parts, formats = [], {}
    for f in resolve_files(path):
        raw = load_raw(f, cache_dir)
        fmts = detect_formats(list(raw.column_names), str(f))
        formats[str(f)] = "+".join(fmts)
        norm = raw.map(_normalize, with_indices=True, fn_kwargs={"formats": fmts, "path": str(f)},
                       remove_columns=raw.column_names, num_proc=num_proc if len(raw) >= 4 * num_proc else None,
                       desc=f"conversations: {f.name}")
        bad = norm.filter(lambda e: e != "", input_columns="error")
        if len(bad):
            first = bad[0]
            index = int(first["source"].rpartition("#")[2])
            raise ConversationInputError(f"{f}: {_line_numbers(f)(index)}: the record fits no {'/'.join(fmts)} conversation "
                                         f"({first['error']})")
        parts.append(norm.remove_columns("error"))
    return (ds_lib.concatenate_datasets(parts) if len(parts) > 1 else parts[0]), formats
