"""llama.cpp as a real engine in the loop (docs/engines.md): built from a pinned registry package's sources,
models converted with its own converter, `llama-server` run on 127.0.0.1 with DFlash speculative decoding.

- **Build** (`ensure_llamacpp`): the `llama-cpp-python` sdist at `VERSION` (sha256 `SDIST_SHA256`, fetched with
  `pip download` when it is not in the cache) vendors llama.cpp with its DFlash code (`src/models/dflash.cpp`,
  `common/speculative.cpp`). Only `llama-server` is built (`CMAKE_FLAGS`: static, no curl, no prebuilt web UI), in
  a temporary folder beside the cache that is renamed to `<cache>/<VERSION>` when whole, so an interrupted build
  never leaves a folder that looks built. The cache keeps the binary, the converter and gguf-py.
- **Convert** (`convert_to_gguf`): `convert_hf_to_gguf.py` of the same sources, run through `llamacpp_convert.py`,
  which adds `PRE_TOKENIZERS` (pre-tokenizer check hashes llama.cpp does not know, mapped to a rule of its own
  that splits the same way) to the converter's table at run time; no upstream file is changed. A folder the
  converter refuses raises `ConversionError` carrying the converter's own message.
- **Serve** (`LlamaServer`): one slot, a free port, started and stopped within bounded times (stopped on every
  exit path), `LLAMA_TRACE=1` so each verification round is logged (`accepted m/d draft tokens`), and
  `/completion` requests with prompts as token ids.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

VERSION = "0.3.36"  # llama-cpp-python; its vendored llama.cpp is the October 2026 commit with DFlash 1 and 2
SDIST = f"llama_cpp_python-{VERSION}.tar.gz"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
VENDORED = "vendor/llama.cpp"  # the llama.cpp tree inside the sdist
CMAKE_FLAGS = ["-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_CURL=OFF",
               "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
               "-DLLAMA_BUILD_EXAMPLES=OFF"]
BUILD_TARGETS = ["llama-server"]
KEPT_SOURCES = ["convert_hf_to_gguf.py", "conversion", "gguf-py"]  # what the converter needs at run time
BUILD_TIMEOUT_S = 3600.0  # 6 min on 2 idle cores; far longer when others compile beside it

# Pre-tokenizer check hash (llama.cpp's `get_vocab_base_pre`: sha256 of the token ids of its check text) -> the
# llama.cpp rule that splits text the same way. The shipped reference target's tokenizer isolates "\n", then
# splits with GPT-2's byte-level regex: its merges never join "\n" to anything (they were learnt on text split
# there), so llama.cpp's `gpt-2` rule, which does not isolate "\n", gives the same tokens (tested through the
# built server's /tokenize in tests/test_serve_check.py).
PRE_TOKENIZERS = {"f4b9e5cd1762e71db96334026888828a567ac6df8fe06347cb397788b0047db4": "gpt-2"}

_DRIVER = Path(__file__).with_name("llamacpp_convert.py")


class LlamaCppError(RuntimeError):
    """llama.cpp could not be fetched, built or run; the message says which step and shows its output."""


class ConversionError(LlamaCppError):
    """llama.cpp's converter refused a folder; the message carries the converter's own words."""


def cache_root() -> Path:
    """`DFLASH_LLAMACPP_CACHE`, else `$XDG_CACHE_HOME/dflash/llamacpp` (default ~/.cache/dflash/llamacpp)."""
    if os.environ.get("DFLASH_LLAMACPP_CACHE"):
        return Path(os.environ["DFLASH_LLAMACPP_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "dflash" / "llamacpp"


@dataclass(frozen=True)
class LlamaCpp:
    """A built llama.cpp in the cache: `<root>/bin/llama-server`, `<root>/src/` (converter + gguf-py)."""
    root: Path

    @property
    def server(self) -> Path:
        return self.root / "bin" / "llama-server"

    @property
    def converter(self) -> Path:
        return self.root / "src" / "convert_hf_to_gguf.py"

    @property
    def python_path(self) -> str:
        return os.pathsep.join([str(self.root / "src" / "gguf-py"), str(self.root / "src")])

    def manifest(self) -> dict:
        return json.loads((self.root / "manifest.json").read_text(encoding="utf-8"))


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _run(cmd: list[str], what: str, log: Path, timeout_s: float, **kw) -> None:
    """Runs `cmd` with its output in `log`; raises LlamaCppError with the log's tail on failure or timeout."""
    with open(log, "ab") as out:
        try:
            rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s, **kw).returncode
        except subprocess.TimeoutExpired:
            rc = None
    if rc != 0:
        tail = log.read_text(encoding="utf-8", errors="replace")[-4000:]
        why = f"timed out after {timeout_s:.0f} s" if rc is None else f"exit status {rc}"
        raise LlamaCppError(f"{what} failed ({why}); `{' '.join(cmd)}`; the end of {log}:\n{tail}")


def fetch_sdist(into: Path, sdist: Path | None, log: Path) -> Path:
    """The pinned sdist: `sdist` when given, else `pip download` (no dependencies, sources only) into `into`;
    refused when its sha256 is not `SDIST_SHA256`."""
    if sdist is None:
        _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
              "--disable-pip-version-check", "-d", str(into), f"llama-cpp-python=={VERSION}"],
             f"pip download llama-cpp-python=={VERSION}", log, timeout_s=900)
        sdist = into / SDIST
    if not sdist.is_file():
        raise LlamaCppError(f"{sdist}: no such file (the llama-cpp-python {VERSION} sdist)")
    got = sha256_of(sdist)
    if got != SDIST_SHA256:
        raise LlamaCppError(f"{sdist}: sha256 {got}, expected {SDIST_SHA256} (llama-cpp-python {VERSION})")
    return sdist


def _extract_vendored(sdist: Path, dest: Path) -> None:
    prefix = f"llama_cpp_python-{VERSION}/{VENDORED}/"
    with tarfile.open(sdist) as tar:
        members = []
        for m in tar.getmembers():
            if m.name.startswith(prefix) and len(m.name) > len(prefix):
                m.name = m.name[len(prefix):]
                members.append(m)
        tar.extractall(dest, members=members, filter="data")


def ensure_llamacpp(cache: Path | None = None, sdist: Path | None = None, jobs: int = 2,
                    timeout_s: float = BUILD_TIMEOUT_S, say=print) -> LlamaCpp:
    """The cached build for `VERSION`, built first when the cache has none (module doc). `sdist`: a local copy
    of the pinned sdist instead of `pip download`."""
    cache = Path(cache) if cache is not None else cache_root()
    built = LlamaCpp(cache / VERSION)
    if (built.root / "manifest.json").is_file() and built.server.is_file():
        return built
    if shutil.which("cmake") is None or shutil.which("c++") is None:
        raise LlamaCppError("building llama.cpp needs cmake and a C++ compiler (Debian: apt-get install cmake g++)")
    cache.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".build-{VERSION}-", dir=cache))
    try:
        log = work / "build.log"
        say(f"building llama.cpp (llama-cpp-python {VERSION}) in {work}; log {log}")
        t0 = time.monotonic()
        src = work / "src"
        _extract_vendored(fetch_sdist(work, sdist, log), src)
        build = work / "build"
        gen = ["-G", "Ninja"] if shutil.which("ninja") else []
        nice = ["nice", "-n", "10"] if shutil.which("nice") else []
        _run(nice + ["cmake", "-S", str(src), "-B", str(build), *gen, *CMAKE_FLAGS], "cmake configure", log,
             timeout_s)
        left = max(60.0, timeout_s - (time.monotonic() - t0))
        _run(nice + ["cmake", "--build", str(build), "--target", *BUILD_TARGETS, "-j", str(jobs)], "cmake build",
             log, left)
        _keep_only(src, build, work)
        manifest = {"llama_cpp_python": VERSION, "sdist": SDIST, "sdist_sha256": SDIST_SHA256,
                    "cmake_flags": CMAKE_FLAGS, "targets": BUILD_TARGETS, "build_seconds": time.monotonic() - t0,
                    "built": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        (work / "manifest.json").write_text(json.dumps(manifest, indent=1), encoding="utf-8")
        try:
            os.rename(work, built.root)  # atomic: the folder appears whole or not at all
        except OSError:
            if not built.server.is_file():  # not another builder that got there first
                raise
        say(f"built llama.cpp in {time.monotonic() - t0:.0f} s: {built.root}")
        return built
    finally:
        if work.exists():
            shutil.rmtree(work, ignore_errors=True)


def _keep_only(src: Path, build: Path, work: Path) -> None:
    """Leaves `work/bin/<targets>` and the converter's sources in `work/src`; drops the build tree and the rest."""
    (work / "bin").mkdir()
    for t in BUILD_TARGETS:
        shutil.copy2(build / "bin" / t, work / "bin" / t)
    shutil.rmtree(build)
    for p in src.iterdir():
        if p.name not in KEPT_SOURCES:
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
    for p in work.glob("*.tar.gz"):
        p.unlink()


def convert_to_gguf(llama: LlamaCpp, model_dir: Path, out: Path, *, target_dir: Path | None = None,
                    outtype: str = "f32", timeout_s: float = 900.0) -> Path:
    """`model_dir` (a transformers folder; with `target_dir`, a DFlash drafter folder and its target's) → the
    GGUF file `out`, written whole or not at all. Raises ConversionError with the converter's message."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    cmd = [sys.executable, str(_DRIVER), json.dumps(PRE_TOKENIZERS), str(llama.converter), str(model_dir),
           "--outfile", str(tmp), "--outtype", outtype]
    cmd += ["--target-model-dir", str(target_dir)] if target_dir is not None else ["--no-mtp"]
    env = dict(os.environ, PYTHONPATH=llama.python_path, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired as e:
        raise ConversionError(f"{model_dir}: llama.cpp's converter timed out after {timeout_s:.0f} s") from e
    if res.returncode != 0 or not tmp.is_file():
        tmp.unlink(missing_ok=True)
        msg = "\n".join((res.stderr or res.stdout).strip().splitlines()[-15:])
        raise ConversionError(f"{model_dir}: llama.cpp's converter (llama-cpp-python {VERSION}) cannot convert it "
                              f"(exit status {res.returncode}):\n{msg}")
    os.replace(tmp, out)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_ROUND = re.compile(r"\| task (\d+) \| accepted +(\d+)/ *(\d+) draft tokens")
_TASK = re.compile(r"\| task (\d+) \| processing task")


def rounds_by_task(log_text: str) -> list[list[tuple[int, int]]]:
    """The server log's verification rounds, one list per task in the order the tasks started, each round
    (accepted, drafted). Needs `LLAMA_TRACE` > 0 (`LlamaServer` sets it)."""
    order: list[str] = []
    rounds: dict[str, list[tuple[int, int]]] = {}
    for line in log_text.splitlines():
        if (m := _TASK.search(line)) and m.group(1) not in rounds:
            order.append(m.group(1))
            rounds[m.group(1)] = []
        elif (m := _ROUND.search(line)):
            if "restore checkpoint" in line:  # a replayed round: its stats are counted on the replay
                raise LlamaCppError("llama-server restored a checkpoint (partial acceptance without rollback): "
                                    "its rounds are not the evaluator's")
            rounds.setdefault(m.group(1), []).append((int(m.group(2)), int(m.group(3))))
    return [rounds[t] for t in order]


class LlamaServer:
    """`llama-server` with a target and a DFlash drafter (module doc), as a context manager."""

    def __init__(self, llama: LlamaCpp, target: Path, drafter: Path, draft_max: int, log: Path,
                 ctx_size: int = 4096, threads: int = 2, start_timeout_s: float = 300.0,
                 request_timeout_s: float = 600.0):
        self.cmd = [str(llama.server), "-m", str(target), "--spec-draft-model", str(drafter),
                    "--spec-type", "draft-dflash", "--spec-draft-n-max", str(draft_max), "--spec-draft-n-min", "0",
                    "--spec-draft-p-min", "0",
                    "-np", "1", "-c", str(ctx_size), "-t", str(threads), "--host", "127.0.0.1"]
        self.log, self.start_timeout_s, self.request_timeout_s = log, start_timeout_s, request_timeout_s
        self.proc: subprocess.Popen | None = None
        self.port = 0

    def __enter__(self) -> "LlamaServer":
        self.port = free_port()
        self.log.parent.mkdir(parents=True, exist_ok=True)
        out = open(self.log, "wb")
        try:
            self.proc = subprocess.Popen(self.cmd + ["--port", str(self.port)], stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=dict(os.environ, LLAMA_TRACE="1"))
        finally:
            out.close()
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise LlamaCppError(f"llama-server exited with status {self.proc.returncode} while starting; "
                                    f"the end of {self.log}:\n{self.log_text()[-3000:]}")
            try:
                if self._get("/health", 5).get("status") == "ok":
                    return
            except (OSError, ValueError):
                pass
            time.sleep(0.5)
        raise LlamaCppError(f"llama-server not ready after {self.start_timeout_s:.0f} s; the end of {self.log}:\n"
                            f"{self.log_text()[-3000:]}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)

    def log_text(self) -> str:
        return self.log.read_text(encoding="utf-8", errors="replace") if self.log.is_file() else ""

    def _get(self, path: str, timeout: float) -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=timeout) as r:
            return json.loads(r.read())

    def post(self, path: str, body: dict) -> dict:
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.request_timeout_s) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise LlamaCppError(f"llama-server {path}: HTTP {e.code}: {e.read()[:2000]!r}") from e

    def tokenize(self, text: str) -> list[int]:
        return self.post("/tokenize", {"content": text, "add_special": False})["tokens"]

    def complete(self, prompt_ids: list[int], n_predict: int, temperature: float, top_p: float, top_k: int,
                 seed: int) -> dict:
        """One request: the prompt as token ids, at most `n_predict` tokens, ending at the engine's own stop rule
        (its end-of-generation tokens or the budget). Only the named setting samples (min_p, penalties and the
        other samplers llama.cpp turns on by default are off), so T=0 is the target's argmax."""
        return self.post("/completion", {
            "prompt": prompt_ids, "n_predict": n_predict, "temperature": temperature, "top_p": top_p,
            "top_k": top_k, "min_p": 0.0, "typical_p": 1.0, "repeat_penalty": 1.0, "presence_penalty": 0.0,
            "frequency_penalty": 0.0, "dry_multiplier": 0.0, "xtc_probability": 0.0, "seed": seed,
            "samplers": ["top_k", "top_p", "temperature"], "return_tokens": True, "cache_prompt": False,
            "stream": False})
