"""Conversation datasets as users hold them, read with Hugging Face `datasets` into one normalized table.

`data.path` is a file, a glob or a folder of `.jsonl` / `.json` / `.parquet` files, or a dataset saved with
`Dataset.save_to_disk`. Each file is read on its own (memory-mapped Arrow, cached by `datasets` under
`data.conversations.cache_dir`) and its format is detected from its fields (`FORMATS`; a file that mixes formats: per record):

- `openai`:   {"messages": [{"role": "system"|"developer"|"user"|"assistant"|"tool", "content": "..."}, ...],
              "tools": [...]?} (`developer` is read as `system`, as OpenAI documents it for its newer models)
              assistant turns may carry `tool_calls` (content null or ""), a legacy `function_call`, and
              `reasoning_content`; tool turns `tool_call_id` (role `function` is a tool turn)
- `sharegpt`: {"conversations": [{"from": "system"|"human"|"gpt"|"function_call"|"observation", "value": "...",
              "weight": 0|1?}, ...], "system": "..."?, "tools": "..."?} (function_call: the call as JSON text;
              observation: the tool's result; weight 0: a turn that is context, not trained on)
- `flat`:     {"prompt": "...", "response": "..."} (optional "system"): one user turn, one assistant turn

Every record becomes `messages` (role, content, reasoning, tool_calls as JSON text, tool_call_id, name, train),
`tools` (JSON text), `skip` (why nobody trains on it: `image_parts`, `empty_assistant_turn`; counted as
`data/skipped_<reason>`), `empty_turns` (with `skip_bad`: the assistant turns with nothing in them, kept as
untrained context so the record's other turns still train), `source` ("file#row"), `format`, `prompt_hashes` (per
assistant turn, the sha256 of the
conversation before it: the held-out split) and `error` (why it fits no format; "" when it does). A record whose
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

from dflash.registry import Registry

FILE_SUFFIXES = (".jsonl", ".json", ".parquet")
NORMALIZE_VERSION = 3  # the normalized table's layout (tool calls, reasoning, train flags, prompt hashes, empty turns)
# role spellings of the formats users hold (ShareGPT: human / gpt; a few exports: bot, model, chatgpt; OpenAI's
# `developer` is its newer name for the system message)
ROLE_NAMES = {"system": "system", "developer": "system", "user": "user", "human": "user", "assistant": "assistant",
              "gpt": "assistant",
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
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its own errors ("row 2") beside ours: noise
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


class Skip(Exception):
    """A record trained on by nobody, counted as data/skipped_<reason> (image parts, an empty assistant turn)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def _content(raw, field: str, *, empty_ok: bool = False) -> tuple[str, str]:
    if raw is None and empty_ok:
        return "", ""
    if isinstance(raw, list):  # OpenAI content parts: the text ones, in order; an image part skips the record
        if any(isinstance(p, dict) and (p.get("type") in ("image", "image_url", "input_image", "video")
                                        or p.get("image_url") or p.get("image")) for p in raw):
            raise Skip("image_parts")
        if any(isinstance(p, dict) and p.get("type", "text") != "text" for p in raw):
            raise Skip("non_text_parts")  # audio, files: nothing a text drafter trains on
        parts = [p.get("text") for p in raw if isinstance(p, dict) and p.get("type", "text") == "text"]
        if all(isinstance(t, str) for t in parts) and parts:
            return "".join(parts), ""
    if not isinstance(raw, str):
        return "", f"field {field}: expected a string, got {type(raw).__name__}"
    return raw, ""


def _drop_nulls(x):
    """Arrow gives every record the union of the fields of all records, missing ones as null: drop them."""
    if isinstance(x, dict):
        return {k: _drop_nulls(v) for k, v in x.items() if v is not None}
    if isinstance(x, list):
        return [_drop_nulls(v) for v in x]
    return x


def _json_field(raw, field: str, kind: type) -> tuple[object, str]:
    """A field that is JSON data or JSON text of it (ShareGPT exports write tools and calls as text)."""
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as e:
            return None, f"field {field}: not valid JSON ({e.msg})"
    raw = _drop_nulls(raw)
    if kind is list and isinstance(raw, dict):
        raw = [raw]
    if not isinstance(raw, kind):
        return None, f"field {field}: expected a JSON {kind.__name__}, got {type(raw).__name__}"
    return raw, ""


def _tool_calls(raw, field: str) -> tuple[str, str]:
    """OpenAI `tool_calls` (or a legacy `function_call`, a ShareGPT function_call turn) as JSON text of the
    OpenAI list [{"type": "function", "function": {"name", "arguments"}}]."""
    calls, err = _json_field(raw, field, list)
    if err:
        return "", err
    out = []
    for k, c in enumerate(calls):
        fn = c.get("function", c) if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            return "", f"field {field}[{k}]: expected a call with a function name"
        call = {"type": "function", "function": {"name": fn["name"], "arguments": fn.get("arguments", {})}}
        if isinstance(c, dict) and c.get("id"):
            call["id"] = c["id"]
        out.append(call)
    return json.dumps(out, ensure_ascii=False), ""


def message(role: str, content: str, **extra) -> dict:
    """A normalized message: every field present (one Arrow schema for all records)."""
    return {"role": role, "content": content, "reasoning": extra.get("reasoning", ""),
            "tool_calls": extra.get("tool_calls", ""), "tool_call_id": extra.get("tool_call_id", ""),
            "name": extra.get("name", ""), "train": extra.get("train", True)}


def _turn(m: dict, field: str, role_key: str, content_key: str) -> tuple[dict | None, str]:
    rk = role_key if m.get(role_key) is not None else ("role" if m.get("role") is not None else role_key)
    ck = content_key if m.get(content_key) is not None else ("content" if m.get("content") is not None
                                                             else content_key)
    raw_role = m.get(rk)
    if isinstance(raw_role, str) and raw_role.lower() == "function_call":  # ShareGPT: the assistant calls a tool
        calls, err = _tool_calls(m.get(ck), f"{field}.{ck}")
        return (message("assistant", "", tool_calls=calls), "") if not err else (None, err)
    role, err = _role(raw_role, f"{field}.{rk}")
    if err:
        return None, err
    extra: dict = {}
    if role == "assistant":
        raw_calls = m.get("tool_calls") or m.get("function_call")
        if raw_calls:
            extra["tool_calls"], err = _tool_calls(raw_calls, f"{field}.tool_calls")
            if err:
                return None, err
        reasoning = m.get("reasoning_content") or m.get("reasoning")
        if reasoning is not None:
            extra["reasoning"], err = _content(reasoning, f"{field}.reasoning_content")
            if err:
                return None, err
    content, err = _content(m.get(ck), f"{field}.{ck}", empty_ok=bool(extra.get("tool_calls")))
    if err:
        return None, err
    for key in ("tool_call_id", "name"):
        if isinstance(m.get(key), str):
            extra[key] = m[key]
    weight = m.get("weight")
    if weight is not None and role == "assistant":
        extra["train"] = bool(weight)
    return message(role, content, **extra), ""


def _empty_turns(messages: list[dict], skip_bad: bool) -> int:
    """The trained assistant turns with no content, reasoning or call. Without `skip_bad` one skips the whole
    record (Skip); with it each becomes context (train false, never loss) and the record's other turns train.
    An untrained empty turn (weight 0) is context either way."""
    empty = [m for m in messages if m["role"] == "assistant" and m["train"]
             and not (m["content"].strip() or m["tool_calls"] or m["reasoning"].strip())]
    if empty and not skip_bad:
        raise Skip("empty_assistant_turn")
    for m in empty:
        m["train"] = False
    return len(empty)


def _turns(record: dict, column: str, role_key: str, content_key: str) -> tuple[list[dict], str]:
    turns = record.get(column)
    if not isinstance(turns, list) or not turns:
        return [], f"field {column}: expected a non-empty list of messages, got {type(turns).__name__}"
    out: list[dict] = []
    for i, m in enumerate(turns):
        if not isinstance(m, dict):
            return [], f"field {column}[{i}]: expected an object, got {type(m).__name__}"
        msg, err = _turn(m, f"{column}[{i}]", role_key, content_key)
        if err:
            return [], err
        prev = out[-1] if out else None
        if msg["tool_calls"] and not msg["content"] and prev and prev["role"] == "assistant" \
                and not prev["tool_calls"]:
            prev["tool_calls"] = msg["tool_calls"]  # ShareGPT: text, then its function_call turn: one OpenAI turn
            continue
        out.append(msg)
    return out, ""


def _tools(record: dict) -> tuple[str, str]:
    if record.get("tools") in (None, "", []):
        return "", ""
    tools, err = _json_field(record["tools"], "tools", list)
    return (json.dumps(tools, ensure_ascii=False), "") if not err else ("", err)


def _with_system(record: dict, messages: list[dict]) -> tuple[list[dict], str]:
    system = record.get("system")
    if system is None or system == "" or (messages and messages[0]["role"] == "system"):
        return messages, ""
    content, err = _content(system, "system")
    return ([message("system", content), *messages], err) if not err else ([], err)


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
    if not response.strip():
        raise Skip("empty_assistant_turn")
    return _with_system(record, [message("user", prompt), message("assistant", response)])


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


def conversation_hash(messages: list[dict], tools: str = "") -> str:
    """sha256 of a conversation (or of a prompt: the messages before a turn) and its tool schemas."""
    text = json.dumps([tools] + [[m["role"], m["content"], m.get("reasoning", ""), m.get("tool_calls", ""),
                                  m.get("tool_call_id", "")] for m in messages],
                      ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def prompt_hashes(messages: list[dict], tools: str = "") -> list[str]:
    """The hash of each assistant turn's prompt (the conversation before it): the held-out split's key, so one
    prompt lands on one side whatever responses the data holds for it ('' for other messages)."""
    return [conversation_hash(messages[:i], tools) if m["role"] == "assistant" else ""
            for i, m in enumerate(messages)]


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


def _blank(path: Path) -> bool:
    """Nothing but whitespace (read until the first other character)."""
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            if chunk.strip():
                return False
    return True


def load_raw(path: Path, cache_dir: str):
    """One file (or saved dataset) as a `datasets.Dataset`; ConversationInputError names what does not parse."""
    ds_lib = _offline_datasets()
    if path.is_file() and path.suffix in (".json", ".jsonl") and _blank(path):
        raise ConversationInputError(f"{path}: the file is empty (expected conversation records: one JSON object "
                                     f"per line, or a JSON list of them)")
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


def _normalize(record: dict, index: int, *, formats: list[str], path: str, skip_bad: bool = False,
               version: int = NORMALIZE_VERSION) -> dict:
    """One record → the normalized row (module doc); `version` only keys `datasets`' cache of this map."""
    fmt = next((f for f in formats if all(record.get(k) is not None for k in FORMATS[f][0])), formats[0])
    skip, empty = "", 0
    try:
        messages, err = FORMATS[fmt][1](record)
        tools, err2 = _tools(record) if not err else ("", "")
        err = err or err2
        empty = _empty_turns(messages, skip_bad) if not err else 0
    except Skip as s:
        messages, tools, err, skip = [], "", "", s.reason
    if err and len(formats) > 1:
        err = f"{fmt}: {err}"
    messages = messages if not err else []
    return {"messages": messages, "tools": tools, "skip": skip, "empty_turns": empty, "error": err,
            "source": f"{path}#{index}", "format": fmt, "prompt_hashes": prompt_hashes(messages, tools)}


def features():
    """The normalized table's schema, fixed (a batch of skipped records must not change it)."""
    ds_lib = _offline_datasets()
    text, flag = ds_lib.Value("string"), ds_lib.Value("bool")
    message = {"role": text, "content": text, "reasoning": text, "tool_calls": text, "tool_call_id": text,
               "name": text, "train": flag}
    return ds_lib.Features({"messages": [message], "tools": text, "skip": text, "empty_turns": ds_lib.Value("int32"),
                            "error": text, "source": text, "format": text, "prompt_hashes": [text]})


def read_conversations(path: str, cache_dir: str = "", num_proc: int = 1, skip_bad: bool = False):
    """Every file of `data.path` normalized (module doc) and concatenated, in file order; (dataset, formats).
    `skip_bad`: an empty assistant turn becomes context instead of skipping its record (`_empty_turns`)."""
    ds_lib = _offline_datasets()
    parts, formats = [], {}
    for f in resolve_files(path):
        raw = load_raw(f, cache_dir)
        fmts = detect_formats(list(raw.column_names), str(f))
        formats[str(f)] = "+".join(fmts)
        # a saved dataset's own folder is the user's: our caches go under cache_dir (or stay in memory)
        name = f"normalized-{NORMALIZE_VERSION}-{int(skip_bad)}-{raw._fingerprint}.arrow"
        where = {} if not f.is_dir() else {"keep_in_memory": True} if not cache_dir else {
            "cache_file_name": str(Path(cache_dir) / name)}
        norm = raw.map(_normalize, with_indices=True,
                       fn_kwargs={"formats": fmts, "path": str(f), "skip_bad": skip_bad, "version": NORMALIZE_VERSION},
                       remove_columns=raw.column_names, num_proc=num_proc if len(raw) >= 4 * num_proc else None,
                       features=features(), desc=f"conversations: {f.name}", **where)
        bad = norm.filter(lambda e: e != "", input_columns="error")
        if len(bad):
            first = bad[0]
            index = int(first["source"].rpartition("#")[2])
            raise ConversationInputError(f"{f}: {_line_numbers(f)(index)}: the record fits no {'/'.join(fmts)} conversation "
                                         f"({first['error']})")
        parts.append(norm.remove_columns("error"))
    return (ds_lib.concatenate_datasets(parts) if len(parts) > 1 else parts[0]), formats
