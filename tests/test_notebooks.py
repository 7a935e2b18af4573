"""The notebooks run headless (nbclient) against a small MLflow store produced by CPU training runs, and
draw their figures. They are committed with their outputs cleared."""
import json
import re
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ["ablation.ipynb", "run_deep_dive.ipynb"]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """Three tiny runs with eval: hard_ce × seeds {0, 1}, streak × seed 0 (experiment 'nb')."""
    from dflash.app.run import train
    from experiments.config import compose_config
    from tests.conftest import FAST

    d = tmp_path_factory.mktemp("nbstore")
    uri = f"sqlite:///{d / 'mlflow.db'}"
    try:
        from dflash.evaluation import EvalConfig, StopConfig, make_evaluator
        # no dedent rule (eval.stop): the random target's bytes leave coding10's bodies at once (one token, no rounds)
        evaluator = make_evaluator(EvalConfig(subset=1, max_new_tokens=16, cache_dir=str(d / "cache"),
                                              stop=StopConfig(dedent=[])))
    except ImportError:
        evaluator = None
    ids = []
    for loss, seed in [("hard_ce", 0), ("hard_ce", 1), ("streak", 0)]:
        cfg = compose_config(FAST + [f"+loss={loss}", f"seed={seed}", f"run_dir={d / f'{loss}-{seed}'}",
                                     f"tracking.tracking_uri={uri}", "tracking.experiment=nb",
                                     "trainer.eval_every=3"])
        ids.append(train(cfg, evaluator).run_id)
    return uri, ids, evaluator is not None


def _execute(name: str, params: dict):
    nb = nbformat.read(ROOT / "notebooks" / name, as_version=4)
    cell = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
    cell.source += "\n# injected by the test\n" + "\n".join(f"{k} = {v!r}" for k, v in params.items())
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(ROOT)}}).execute()
    return nb


def _outputs(nb):
    return [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]


def _images(nb) -> int:
    return sum(1 for o in _outputs(nb) if "image/png" in o.get("data", {}))


def _text(nb) -> str:
    parts = []
    for o in _outputs(nb):
        parts.append(o.get("text", ""))
        parts.extend(str(v) for k, v in o.get("data", {}).items() if k.startswith("text/"))
    return "\n".join(parts)


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebooks_are_committed_clean(name):
    nb = nbformat.read(ROOT / "notebooks" / name, as_version=4)
    nbformat.validate(nb)
    for c in nb.cells:
        if c.cell_type == "code":
            assert c.outputs == [] and c.execution_count is None, f"{name}: clear the outputs before committing"
    params = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(params) == 1, f"{name}: exactly one cell tagged 'parameters'"
    # Library code stays in dflash/: the notebooks only call dflash.tracking.analysis (no mlflow client code here).
    src = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    assert "from dflash.tracking import analysis" in src and "MlflowClient" not in src


def test_ablation_notebook(store):
    uri, ids, has_eval = store
    nb = _execute("ablation.ipynb", {"TRACKING_URI": uri, "EXPERIMENT": "nb", "STUDY": ""})
    text = _text(nb)
    assert "3 training runs in 'nb'" in text
    # τ table, training curves, eval and train per-position acceptance
    assert _images(nb) >= 4
    if has_eval:
        assert "hard_ce" in text and "±" in text and "(n=2, ±" in text  # two seeds of hard_ce: pooled, ± std


def test_run_deep_dive_notebook(store):
    uri, ids, _ = store
    nb = _execute("run_deep_dive.ipynb", {"TRACKING_URI": uri, "EXPERIMENT": "nb", "RUN_ID": ids[0]})
    assert ids[0] in _text(nb)
    # 3 curve panels, per-position acceptance, buffer depths, perf
    assert _images(nb) >= 6


def test_analysis_table_on_store(store):
    from dflash.tracking import analysis as A

    uri, ids, has_eval = store
    runs = A.load_runs(uri, "nb")
    assert set(runs["run_id"]) == set(ids)
    assert sorted(runs["seed"].tolist()) == [0, 0, 1]
    assert A.latest_run(uri, "nb") == ids[-1]  # the deep dive's default run
    if not has_eval:
        pytest.skip("dflash.evaluation unavailable")
    table = A.ablation_table(runs, by=["loss"])
    objective = A.tau_metrics(runs)[0]  # the name the evaluation wrote (dflash.evaluation.protocol)
    assert table.loc["hard_ce", (objective, "n")] == 2
    assert table.loc["hard_ce", ("runs", "seeds")] == "0,1"
    pos = A.position_acceptance(runs)
    assert list(pos.columns) == list(range(1, 8))  # block_size 8 -> positions 1..7
    json.dumps(A.format_table(table).to_dict())  # plain strings


# --------------------------------------------------------------------------- the committed campaign store
# The figures are checked from the figure objects the executed notebook holds (a cell injected at the end
# describes every Figure variable): legends, line colours and styles, which runs are drawn, tick labels.
DESCRIBE_FIGURES = r'''
import json as _json
from matplotlib.backends.backend_agg import FigureCanvasAgg as _Agg
from matplotlib.colors import to_hex as _hex
from matplotlib.figure import Figure as _Figure

def _describe(fig):
    _Agg(fig)
    fig.canvas.draw()
    box = lambda a: list(a.get_window_extent().bounds)
    return {"size": list(fig.bbox.bounds),
            "legends": [{"bbox": box(lg), "texts": [t.get_text() for t in lg.get_texts()]} for lg in fig.legends],
            "axes": [{"bbox": box(ax), "title": ax.get_title(), "legend_inside": ax.get_legend() is not None,
                      "xticks": [t.get_text() for t in ax.get_xticklabels()],
                      "xtick_boxes": [box(t) for t in ax.get_xticklabels() if t.get_text()],
                      "lines": [{"gid": ln.get_gid(), "color": _hex(ln.get_color()), "ls": str(ln.get_linestyle()),
                                 "label": ln.get_label()} for ln in ax.lines if ln.get_gid()]}
                     for ax in fig.axes]}

print("FIGURES_JSON=" + _json.dumps({k: _describe(v) for k, v in dict(globals()).items()
                                     if isinstance(v, _Figure) and not k.startswith("_")}))
'''


def _execute_described(name: str, params: dict):
    nb = nbformat.read(ROOT / "notebooks" / name, as_version=4)
    cell = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
    cell.source += "\n# injected by the test\n" + "\n".join(f"{k} = {v!r}" for k, v in params.items())
    nb.cells.append(nbformat.v4.new_code_cell(DESCRIBE_FIGURES))
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(ROOT)}}).execute()
    text = _text(nb)
    line = next(ln for ln in text.splitlines() if ln.startswith("FIGURES_JSON="))
    return nb, text, json.loads(line[len("FIGURES_JSON="):])


def _overlaps(a, b) -> bool:
    (ax, ay, aw, ah), (bx, by, bw, bh) = a, b
    return ax < bx + bw and bx < ax + aw and ay < by + bh and by < ay + ah


def _legends_outside(fig: dict) -> None:
    assert fig["legends"], "one legend on the figure"
    assert not any(ax["legend_inside"] for ax in fig["axes"]), "no legend inside a panel"
    for lg in fig["legends"]:
        for ax in fig["axes"]:
            assert not _overlaps(lg["bbox"], ax["bbox"]), (lg["texts"][:3], ax["title"])


@pytest.fixture(scope="module")
def committed_store(tmp_path_factory):
    from dflash.tracking.packed_store import unpack
    d = tmp_path_factory.mktemp("committed")
    unpack(ROOT / "benchmarks" / "ablations" / "campaign_out.tar.xz", d)
    return f"sqlite:///{d / 'campaign_out' / 'mlflow.db'}"


def test_ablation_notebook_on_the_committed_store_draws_every_run_readably(committed_store):
    from dflash.tracking import analysis as A
    runs = A.load_runs(committed_store, "dflash-ablation")
    nb, text, figs = _execute_described("ablation.ipynb", {"TRACKING_URI": committed_store,
                                                           "EXPERIMENT": "dflash-ablation", "STUDY": "",
                                                           "CAMPAIGN": "reference",
                                                           # the store's runs predate eval/tau_served
                                                           "CAMPAIGN_EDITS": ["campaign.objective=eval/tau_vanilla"]})
    ids = set(runs["run_id"])
    assert len(ids) == 26 and "left out" not in text
    # the campaign's calls respect its own ties (its tables call uniform and proportional ties; gaussian, r10_60 and
    # fifo too since a Δ that one of the two seeds reverses is a tie)
    assert "noise: tie: uniform ~ none, gaussian, cosine" in text
    assert "buffer: tie: proportional ~ r10_20, r10_60, r30_90, fifo" in text
    # two seeds: the seed x prompt x sample interval is widened 9.17x (docs/evaluation.md), so dpace's lead is a tie now
    assert "loss: tie: dpace ~" in text and "winners {" not in text
    seeds = dict(zip(runs["run_id"], runs["seed"]))
    groups = {}
    for name in ("fig_curves", "fig_pos_eval", "fig_pos_train"):
        fig = figs[name]
        _legends_outside(fig)
        lines = [ln for ax in fig["axes"] for ln in ax["lines"]]
        assert {ln["gid"] for ln in lines} == ids, name  # every run of the store, none dropped
        # old names (train/streak) read under the new ones (this store logged no τ during training)
        assert all(ax["lines"] for ax in fig["axes"] if ax["title"].startswith("train/")), name
        for ax in fig["axes"]:  # panels keep a readable width beside the legend
            assert ax["bbox"][2] >= 0.45 * fig["size"][2] / len(fig["axes"]), (name, ax["title"])
        color = {ln["gid"]: ln["color"] for ln in lines}
        style = {ln["gid"]: ln["ls"] for ln in lines}
        for ln in lines:  # a run is drawn alike in every panel
            assert (color[ln["gid"]], style[ln["gid"]]) == (ln["color"], ln["ls"])
        # colour for the configuration, line style for the seed: 13 configurations × seeds {0, 1}
        assert len(set(color.values())) == 13 and len(set(style.values())) == 2
        assert all((style[a] == style[b]) == (seeds[a] == seeds[b]) for a in ids for b in ids)
        texts = [t for lg in fig["legends"] for t in lg["texts"]]
        assert len(texts) == 13 + 2 and {"seed 0", "seed 1"} <= set(texts)  # not 26 run labels
        groups[name] = color
    assert groups["fig_curves"] == groups["fig_pos_eval"]  # one colour per configuration in every figure
    tau = figs["fig_tau"]
    _legends_outside(tau)
    ticks = [t for ax in tau["axes"] for t in ax["xticks"]]
    assert len(ticks) == 13
    boxes = tau["axes"][0]["xtick_boxes"]
    assert not any(_overlaps(a, b) for i, a in enumerate(boxes) for b in boxes[i + 1:]), "bar labels overlap"
    for t in ticks:  # short labels: the option names its own settings; floats at a readable precision
        assert "buffer." not in t and "max_depth" not in t and not re.search(r"\d\.\d{5,}", t), t
        assert max(len(part) for part in t.split("\n")) <= 40, t


def test_ablation_notebook_says_which_runs_it_leaves_out(store):
    uri, ids, _ = store
    nb, text, figs = _execute_described("ablation.ipynb", {"TRACKING_URI": uri, "EXPERIMENT": "nb", "STUDY": "",
                                                           "MAX_CURVES": 2})
    assert "curves of 2 of 3 runs (MAX_CURVES=2); left out: streak-0" in text
    assert len({ln["gid"] for ax in figs["fig_curves"]["axes"] for ln in ax["lines"]}) == 2


def test_run_deep_dive_names_the_run_and_shows_its_ci(committed_store):
    from dflash.tracking import analysis as A
    runs = A.load_runs(committed_store, "dflash-ablation")
    r = runs[runs["run_name"] == "s0-loss-dpace-seed0"].iloc[0]
    nb, text, figs = _execute_described("run_deep_dive.ipynb", {"TRACKING_URI": committed_store,
                                                                "EXPERIMENT": "dflash-ablation",
                                                                "RUN_ID": r["run_id"]})
    head = next(o for c in nb.cells if "summary_frame" in c.source for o in c.outputs
                if "text/plain" in o.get("data", {}))["data"]["text/plain"]
    assert "ci_low" in head and "ci_high" in head and "eval/tau_vanilla" in head
    assert f"{r['eval/tau_vanilla_ci_low']:.6f}"[:5] in head
    for name in ("fig_tau", "fig_perf"):
        _legends_outside(figs[name])
    texts = [t for lg in figs["fig_tau"]["legends"] for t in lg["texts"]]
    assert texts == ["s0-loss-dpace-seed0"] and r["run_id"][:8] not in " ".join(texts)


@pytest.mark.slow
def test_both_notebooks_open_on_served_tau_of_the_served_campaign(committed_store):
    """On the served campaign's runs the deep dive's first figure is τ per setting, served (T=1) first with greedy
    (T=0) beside it and prompt lookup with each, and the ablation notebook's first figure is the objective at its
    setting alone: no greedy bar on its axis, every figure naming its setting (the eval per-position acceptance
    had shown T=0 unlabelled, and the deep dive's τ panel was empty)."""
    from dflash.tracking import analysis as A
    runs = A.load_runs(committed_store, "dflash-campaign-served")
    r = runs[runs["run_name"] == "s1-drafter-dflash2_muon-seed0"].iloc[0]
    nb, text, figs = _execute_described("run_deep_dive.ipynb", {"TRACKING_URI": committed_store,
                                                                "EXPERIMENT": "dflash-campaign-served",
                                                                "RUN_ID": r["run_id"]})
    first = next(name for c in nb.cells if c.cell_type == "code" for name in figs if f"{name} = " in c.source)
    assert first == "fig_tau_settings"
    axis = figs["fig_tau_settings"]["axes"][0]
    assert axis["xticks"] == ["T=1, served", "T=0, greedy"]
    assert "eval at T=1, served" in figs["fig_pos"]["axes"][0]["title"]
    nb, text, figs = _execute_described("ablation.ipynb", {"TRACKING_URI": committed_store,
                                                           "EXPERIMENT": "dflash-campaign-served", "STUDY": ""})
    assert figs["fig_tau"]["axes"][0]["title"].startswith("τ at T=1, served")
    assert figs["fig_tree"]["axes"][0]["title"].startswith("DDTree τ at T=0, greedy")
    assert figs["fig_pos_eval"]["axes"][0]["title"].startswith("eval at T=1, served")
