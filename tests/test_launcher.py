"""The launcher of campaign cells and sweep workers (sweeps/launcher.py): GPU placement on this machine, and jobs
through submitit's local executor (the Slurm backend's code path without a cluster), killed and resumed."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from dflash.config import ConfigError
from sweeps import launcher as L

ROOT = Path(__file__).resolve().parent.parent


def test_launcher_keys_are_parsed_and_bad_ones_named():
    cfg, rest = L.launcher_config(["launcher=slurm", "launcher.timeout_min=90", "launcher.partition=gpu",
                                   "workers=4", "+loss=streak"])
    assert (cfg.backend, cfg.timeout_min, cfg.partition) == ("slurm", 90, "gpu") and rest == ["workers=4", "+loss=streak"]
    assert L.launcher_config(["launcher.gpus=[0,1]"])[0].gpus == ["0", "1"]
    for bad, msg in ((["launcher=pbs"], "launcher='pbs'"), (["launcher.timout_min=3"], "timout_min"),
                     (["launcher=slurm", "launcher.executor=k8s"], "executor"),
                     (["launcher.partition=gpu"], "launcher=local")):
        with pytest.raises(ConfigError, match=msg):
            L.launcher_config(bad)


def _visible(gpu):
    out = subprocess.run([sys.executable, "-c", "import os; print(os.environ.get('CUDA_VISIBLE_DEVICES'))"],
                         env={**os.environ, "CUDA_VISIBLE_DEVICES": gpu}, capture_output=True, text=True)
    return out.stdout.strip()


def test_local_tasks_get_one_gpu_each_and_share_when_there_are_more_tasks():
    launcher = L.LocalLauncher(L.LauncherConfig(gpus=["0", "1"]))
    seen, gate = [], threading.Barrier(4)

    def task(gpu):
        seen.append(gpu)
        gate.wait(timeout=10)  # all four placed at once
        return gpu
    threads = [threading.Thread(target=launcher.run, args=(task, f"t{i}")) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(seen) == ["0", "0", "1", "1"] and launcher._busy == {"0": 0, "1": 0}
    assert L.LocalLauncher(L.LauncherConfig(gpus=[])).run(lambda gpu: gpu, "cpu") is None
    # the training process sees only its GPU
    rc = L.call([sys.executable, "-c", "import os, sys; sys.exit(os.environ['CUDA_VISIBLE_DEVICES'] != '1')"], "1")
    assert rc == 0



def test_a_task_of_known_need_waits_until_it_fits_beside_the_running_ones():
    """With 20 GiB to fill: two 8 GiB tasks run together, a third waits for one of them to end; a task of unknown
    need is placed by count alone; an idle GPU takes even a task larger than itself (it would otherwise wait for
    ever, and alone it may still fit: the need is an earlier run's peak)."""
    launcher = L.LocalLauncher(L.LauncherConfig(gpus=["0"], gpu_memory_gib=20))
    running, most, lock = set(), [], threading.Lock()
    release = {n: threading.Event() for n in ("a", "b", "c", "u")}

    def task(name):
        def run(gpu):
            with lock:
                running.add(name)
                most.append(frozenset(running))
            release[name].wait(timeout=20)
            with lock:
                running.discard(name)
            return name
        return run
    threads = {n: threading.Thread(target=launcher.run, args=(task(n), n), kwargs={"need_gib": need})
               for n, need in (("a", 8.0), ("b", 8.0), ("c", 8.0), ("u", None))}
    for n in ("a", "b", "c", "u"):
        threads[n].start()
        time.sleep(0.2)
    assert running == {"a", "b", "u"} and launcher._held["0"] == 16.0  # c waits: 16 + 8 > 20
    release["a"].set()
    threads["a"].join(timeout=10)
    for _ in range(100):
        if "c" in running:
            break
        time.sleep(0.05)
    assert running == {"b", "c", "u"}
    for n in ("b", "c", "u"):
        release[n].set()
        threads[n].join(timeout=10)
    assert launcher._held["0"] == 0.0 and launcher._busy["0"] == 0
    assert not any({"a", "b", "c"} <= m for m in most)
    big = L.LocalLauncher(L.LauncherConfig(gpus=["0"], gpu_memory_gib=20))
    assert big.run(lambda gpu: gpu, "alone", need_gib=30.0) == "0"
    # place by count alone: gpu_memory_gib < 0, or no figure for the GPU
    assert L.LocalLauncher(L.LauncherConfig(gpus=["0"], gpu_memory_gib=-1)).memory == {}
    assert L.launcher_config(["launcher.gpu_memory_gib=70"])[0].gpu_memory_gib == 70


def test_a_cell_is_expected_to_hold_what_its_option_held_before(tmp_path):
    """A cell's need is the largest peak its option recorded in the store (any seed), else its stage's largest,
    plus the CUDA context; None where its stage recorded none."""
    from sweeps.campaign_spec import Cell, load_campaign
    from sweeps.cells import CONTEXT_GIB, expected_need_gib
    c = load_campaign("served")
    runs = tmp_path / c.name / "runs"
    for cell_id, stage, option, peak in (("s0-loss-dpace-seed0", 0, "dpace", 5.4), ("s0-loss-lk-seed0", 0, "lk", 7.1),
                                         ("s0-loss-lk-seed1", 0, "lk", 7.3), ("s0-loss-x-seed0", 0, "x", None)):
        (runs / cell_id).mkdir(parents=True)
        (runs / cell_id / "cell.json").write_text(json.dumps({"stage": stage, "option": option,
                                                               "gpu_reserved_peak_gb": peak}))
    need = lambda stage, option: expected_need_gib(c, tmp_path, Cell(stage, "f", option, 1, []))  # noqa: E731
    assert need(0, "lk") == pytest.approx(7.3 + CONTEXT_GIB)
    assert need(0, "streak") == pytest.approx(7.3 + CONTEXT_GIB)  # none of its own: the stage's largest
    assert need(1, "dflash2_adamw") is None
    # a new campaign in this store: an option of the same name elsewhere, else the store's largest
    new = load_campaign("engine")
    fresh = lambda stage, option: expected_need_gib(new, tmp_path, Cell(stage, "f", option, 1, []))  # noqa: E731
    assert fresh(0, "dpace") == pytest.approx(5.4 + CONTEXT_GIB)
    assert fresh(1, "dflash2_muon") == pytest.approx(7.3 + CONTEXT_GIB)
    assert expected_need_gib(new, tmp_path / "empty", Cell(0, "f", "dpace", 1, [])) is None


def test_a_preempted_job_stops_its_training_process_and_requeues_the_same_task(tmp_path):
    """submitit calls `checkpoint()` on the job's signal (timeout or preemption): the training process gets SIGTERM
    (the trainer saves its checkpoint on it) and the same task is resubmitted, which resumes it."""
    marker = tmp_path / "stopped"
    code = ("import signal, sys, time, pathlib\n"
            f"signal.signal(signal.SIGTERM, lambda *a: (pathlib.Path({str(marker)!r}).write_text('saved'), sys.exit(0)))\n"
            "time.sleep(60)\n")
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("rc", L.call([sys.executable, "-c", code], None)))
    t.start()
    for _ in range(200):
        if L._children:
            break
        time.sleep(0.05)
    time.sleep(1.0)  # the child installs its handler
    task = lambda gpu: "done"  # noqa: E731
    again = L.Requeueable(task).checkpoint()
    t.join(timeout=30)
    assert marker.read_text() == "saved" and result["rc"] == 0
    assert again.function.task is task and again.function() == "done"


def _campaign(out: Path, *more: str) -> list[str]:
    return ["cpu_smoke", f"out={out}", "campaign.seeds=[0]", f"tracking.tracking_uri=sqlite:///{out}/mlflow.db",
            *more]


def _tables(c, summary) -> list[str]:
    """The report's table rows, less its cost tables (wall-clock GPU-seconds and tok/s differ from run to run)."""
    from sweeps.campaign_report import render_report
    out, cost = [], False
    for line in render_report(c, summary).splitlines():
        if not line.startswith("|"):
            cost = False
            continue
        cost = cost or "GPU-s" in line or "tok/s" in line
        if not cost and line.startswith("| "):
            out.append(line)
    return out


@pytest.mark.slow
def test_a_campaign_through_submitit_gives_the_local_results_table(tmp_path, monkeypatch):
    """4 CPU cells (3 runs) on this machine and as submitit jobs (its local executor): the same winners, values
    and report tables. Prints both tables (the comparison issue 58 asks for)."""
    from sweeps.campaign import main
    from sweeps.campaign_spec import load_campaign
    monkeypatch.chdir(ROOT)
    local = main(_campaign(tmp_path / "local"))
    jobs = main(_campaign(tmp_path / "slurm", "launcher=slurm", "launcher.executor=local"))
    assert local["complete"] and jobs["complete"] and local["winners"] == jobs["winners"]
    assert [(x["cell"], x["value"]) for x in local["cells"]] == [(x["cell"], x["value"]) for x in jobs["cells"]]
    c = load_campaign("cpu_smoke", ["campaign.seeds=[0]"])
    assert _tables(c, local) == _tables(c, jobs)
    print("\n".join(["local:", *_tables(c, local), "submitit local executor:", *_tables(c, jobs)]))
    submitted = list((tmp_path / "slurm" / "cpu_smoke" / "submitit").glob("*_submitted.pkl"))
    assert len(submitted) == 3  # one job per run: the reused cell submits none


@pytest.mark.slow
def test_a_killed_campaign_job_resumes_from_its_checkpoint(tmp_path, monkeypatch):
    """`launcher=slurm` through submitit's local executor; the whole job tree is killed (a lost node) once a cell
    has a checkpoint; the same command again resumes that cell from it."""
    from dflash.run_dir import RunDir
    from sweeps.campaign import main
    monkeypatch.chdir(ROOT)
    out = tmp_path / "out"
    args = _campaign(out, "only=[loss/hard_ce]", "campaign.budget_tokens=20000", "launcher=slurm",
                     "launcher.executor=local")
    proc = subprocess.Popen([sys.executable, "-m", "sweeps.campaign", *args], start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    run = out / "cpu_smoke" / "runs" / "s0-loss-hard_ce-seed0"
    try:
        for _ in range(1800):  # the shared inputs alone took 144 s on this 2-core machine under load
            if run.is_dir() and RunDir(run).newest_checkpoint_step() is not None:
                break
            assert proc.poll() is None, "the campaign ended before its cell checkpointed"
            time.sleep(0.5)
        else:
            pytest.fail("no checkpoint within 900 s")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher, submitit's job and the training process
        proc.wait()
    assert not (run / "cell.json").exists()
    summary = main(args)
    rec = json.loads((run / "cell.json").read_text())
    assert rec["resumed"] and 0 <= rec["leg_tokens"] < rec["consumed_tokens"]  # only what the checkpoint lacked
    assert [x["cell"] for x in summary["cells"] if not x.get("failed")] == ["s0-loss-hard_ce-seed0"]


@pytest.mark.slow
def test_sweep_workers_as_submitit_jobs_share_the_trials(tmp_path, monkeypatch):
    """`sweeps.launch ... launcher=slurm`: each worker a job (submitit's local executor) with its share of n_trials,
    on one study: 3 trials over 2 jobs, each trial once."""
    import optuna

    from sweeps.launch import main
    from sweeps.storage import make_storage
    monkeypatch.chdir(ROOT)
    res = main(["cpu_smoke", "n_trials=3", "workers=2", "launcher=slurm", "launcher.executor=local",
                f"out={tmp_path / 'out'}", f"tracking.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}",
                "tracking.experiment=sweeps"])
    assert res["n_trials"] == 3 and res["lost_workers"] == [] and res["states"].get("FAIL", 0) == 0
    study = optuna.load_study(study_name="cpu_smoke", storage=make_storage(res["storage"]))
    assert sorted(t.number for t in study.trials) == [0, 1, 2]
    assert len(list((tmp_path / "out" / "cpu_smoke" / "submitit").glob("*_submitted.pkl"))) == 2


def test_the_room_is_what_other_processes_leave_read_again_when_idle(tmp_path, monkeypatch):
    """By default a GPU's room is nvidia-smi's total less what processes hold there (the campaign's own process kept
    6.1 GiB after the shared inputs), read again whenever none of the tasks runs on it; a set figure is kept."""
    smi = tmp_path / "nvidia-smi"
    used = tmp_path / "used"
    used.write_text("6240")
    smi.write_text(f'#!/bin/sh\necho "0, 81559, $(cat {used})"\necho "1, [N/A], [N/A]"\n')
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    assert L.gpu_memory_gib(["0", "1", "2"]) == {"0": (81559 - 6240) / 1024 - L.RESERVE_GIB}
    launcher = L.LocalLauncher(L.LauncherConfig(gpus=["0"]))
    assert launcher.memory["0"] == (81559 - 6240) / 1024 - L.RESERVE_GIB
    used.write_text("1024")  # the campaign's process gave its cache back
    assert launcher.run(lambda gpu: launcher.memory[gpu], "first", need_gib=5.0) == (81559 - 1024) / 1024 - L.RESERVE_GIB
    fixed = L.LocalLauncher(L.LauncherConfig(gpus=["0"], gpu_memory_gib=20))
    assert fixed.run(lambda gpu: fixed.memory[gpu], "t", need_gib=5.0) == 20
