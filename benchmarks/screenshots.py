"""What a researcher sees first, as PNGs at 1600 x 1000 (docs/tracking.md, "What the first screens show"):

    python benchmarks/screenshots.py                           # the committed campaign store, unpacked to a temp folder
    python benchmarks/screenshots.py --store /tmp/x/campaign_out --out docs/screenshots

1. `engine_runs_table.png`: the `dflash-campaign-engine` experiment's runs table in its saved view `dflash: key
   metrics` (grouped by stage: each stage's answer run with the winner, its τ [CI] and its paired Δ over the
   runner-up, then the cells);
2. `engine_stage_1.png`: the drafter stage's compare view (`dflash: stage 1 drafter`): its runs, best τ first, each
   with its option's paired Δ against the winner (or why it is not compared), the stage's answer run among them;
3. `ablations_first_screen.png`: the first screen of benchmarks/ABLATIONS.md rendered as markdown (python-markdown,
   GitHub-like styles).

It starts MLflow's own UI (`mlflow ui`, the full `mlflow` package) beside the store's `mlflow.db` on a free local
port, drives Debian's Chromium (`/usr/bin/chromium`, `apt-get install chromium`) headless through Playwright
(`pip install playwright markdown`; Playwright's own browser download is not used), closes the UI's assistant panel,
and writes each PNG as an 8-bit palette image (under 300 KB). Without Chromium, Playwright, markdown or mlflow's UI it
says which is missing and exits 2 before any work. Not part of the test suite.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STORE = ROOT / "benchmarks" / "ablations" / "campaign_out.tar.xz"
ABLATIONS = ROOT / "benchmarks" / "ABLATIONS.md"
CHROMIUM = "/usr/bin/chromium"
SIZE = {"width": 1600, "height": 1000}
# the flags a headless Chromium needs on a machine without a network or a sandbox for root
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
MARKDOWN_CSS = """
body { font-family: -apple-system, "Segoe UI", "DejaVu Sans", Helvetica, Arial, sans-serif; font-size: 16px;
       line-height: 1.5; color: #1f2328; max-width: 1012px; margin: 24px auto; padding: 0 32px; }
h1, h2 { border-bottom: 1px solid #d1d9e0; padding-bottom: .3em; } h1 { font-size: 2em; } h2 { font-size: 1.5em; }
h3 { font-size: 1.25em; } code { background: #eff1f3; border-radius: 6px; padding: .2em .4em; font-size: 85%; }
table { border-collapse: collapse; margin: 12px 0; font-size: 14px; } th, td { border: 1px solid #d1d9e0;
        padding: 4px 10px; } th { background: #f6f8fa; } li { margin: .25em 0; }
"""


def missing() -> list[str]:
    """What this machine lacks to take the screenshots."""
    out = []
    if not Path(CHROMIUM).is_file():
        out.append(f"Chromium ({CHROMIUM}: apt-get install chromium)")
    for module, package in (("playwright", "playwright"), ("markdown", "markdown"), ("mlflow.server", "mlflow")):
        try:
            __import__(module)
        except ImportError:
            out.append(f"the Python package {package} (pip install {package})")
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def mlflow_ui(store: Path, port: int, timeout_s: float = 120.0):
    """`mlflow ui` beside the store's mlflow.db (its artifact locations are relative to that folder), until done."""
    log = open(store / "mlflow_ui.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", "sqlite:///mlflow.db",
                             "--host", "127.0.0.1", "--port", str(port)], cwd=store, stdout=log,
                            stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"mlflow ui did not answer on port {port} (its log: {store / 'mlflow_ui.log'})")
            time.sleep(1)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=20)
        if proc.poll() is None:
            proc.kill()
        log.close()


def experiment_id(store: Path, name: str) -> str:
    from mlflow.tracking import MlflowClient
    exp = MlflowClient(f"sqlite:///{store / 'mlflow.db'}").get_experiment_by_name(name)
    if exp is None:
        raise SystemExit(f"error: {store / 'mlflow.db'} has no experiment {name!r}")
    return exp.experiment_id


def ablations_html(md_path: Path, html_path: Path) -> None:
    import markdown
    body = markdown.markdown(md_path.read_text(encoding="utf-8"), extensions=["tables", "fenced_code"])
    html_path.write_text(f"<!doctype html><html><head><meta charset='utf-8'><style>{MARKDOWN_CSS}</style></head>"
                         f"<body>{body}</body></html>", encoding="utf-8")


def save_small(png: Path) -> int:
    """Rewrite `png` as an 8-bit palette image (a UI screenshot has few colours); its size in bytes."""
    from PIL import Image
    with Image.open(png) as im:
        im.convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT).save(png, optimize=True)
    return png.stat().st_size


def shoot(page, url: str, out: Path, settle_s: float, close_panels: bool = True) -> None:
    page.goto(url)
    if close_panels:  # a runs table: until its rows are there (a UI just started answers its first search slowly)
        page.wait_for_function("() => /[1-9][0-9]* matching runs/.test(document.body.innerText)", timeout=120_000)
    page.wait_for_timeout(int(settle_s * 1000))
    if close_panels:
        for selector in ("[aria-label=Close]", "[aria-label='Hide banner']"):  # the assistant panel, the view banner
            with contextlib.suppress(Exception):
                page.locator(selector).first.click(timeout=3000)
                page.wait_for_timeout(1000)
    page.screenshot(path=str(out))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", type=Path, default=None,
                    help="an unpacked campaign store folder (mlflow.db inside); default: the committed store, "
                         "unpacked into a temporary folder")
    ap.add_argument("--ablations", type=Path, default=ABLATIONS, help="the markdown page of the third screenshot")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "screenshots")
    ap.add_argument("--experiment", default="dflash-campaign-engine")
    ap.add_argument("--stage", type=int, default=1, help="the stage whose compare view is shot (1: drafter)")
    ap.add_argument("--settle", type=float, default=5.0, help="seconds a page is given to draw once its rows are in")
    args = ap.parse_args(argv)
    lacking = missing()
    if lacking:
        print("error: cannot take the screenshots without " + "; ".join(lacking), file=sys.stderr)
        return 2
    from playwright.sync_api import sync_playwright

    from dflash.tracking.ui_view import KEY_METRICS_VIEW, ML_WORKFLOW, stage_view_key
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="dflash-shots-") as tmp:
        store = args.store
        if store is None:
            from dflash.tracking.packed_store import unpack
            unpack(STORE, tmp)
            store = Path(tmp) / "campaign_out"
        store = store.resolve()
        eid = experiment_id(store, args.experiment)
        html = Path(tmp) / "ablations.html"
        ablations_html(args.ablations, html)
        shots = []
        with mlflow_ui(store, free_port()) as base, sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            page = browser.new_page(viewport=SIZE)
            runs = f"{base}/#/experiments/{eid}/runs?viewStateShareKey="
            for name, url in ((f"{args.experiment.removeprefix('dflash-campaign-')}_runs_table.png",
                               f"{runs}{KEY_METRICS_VIEW}&{ML_WORKFLOW}"),
                              (f"{args.experiment.removeprefix('dflash-campaign-')}_stage_{args.stage}.png",
                               f"{runs}{stage_view_key(args.stage)}&{ML_WORKFLOW}")):
                shoot(page, url, args.out / name, args.settle)
                shots.append(args.out / name)
            shoot(page, html.as_uri(), args.out / "ablations_first_screen.png", 1.0, close_panels=False)
            shots.append(args.out / "ablations_first_screen.png")
            browser.close()
        with contextlib.suppress(OSError):
            os.remove(store / "mlflow_ui.log")
    for png in shots:
        print(f"{png} ({save_small(png) / 1024:.0f} KB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
