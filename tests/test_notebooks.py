"""The notebooks run headless (nbclient) against a small MLflow store produced by CPU training runs, and
draw their figures. They are committed with their outputs cleared."""
import json
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
        from dflash.evaluation import EvalConfig, make_evaluator
        evaluator = make_evaluator(EvalConfig(subset=1, max_new_tokens=16, cache_dir=str(d / "cache")))
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
        assert "hard_ce" in text and "±" in text and "(n=2)" in text  # two seeds of hard_ce: mean ± std


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
    assert table.loc["hard_ce", ("eval/tau_vanilla", "n")] == 2
    assert table.loc["hard_ce", ("runs", "seeds")] == "0,1"
    pos = A.position_acceptance(runs)
    assert list(pos.columns) == list(range(1, 8))  # block_size 8 -> positions 1..7
    json.dumps(A.format_table(table).to_dict())  # plain strings
