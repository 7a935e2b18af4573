"""Campaign cells that run out of GPU memory beside each other start again with fewer cells sharing the GPU
(sweeps.launcher.LocalLauncher's per-GPU limit, sweeps.campaign's restart), instead of being lost for the launch:
on a GPU with room for two cells, four started together all finish, and no more than two run at once afterwards."""
from __future__ import annotations

import dataclasses
import json
import threading
import time
from pathlib import Path

import sweeps.cells as sweep_cells
from sweeps.campaign_spec import load_campaign, stage_cells
from sweeps.cells import ran_out_of_gpu_memory, run_cell
from sweeps.campaign_report import _gpu_memory_lines
from sweeps.launcher import LauncherConfig, LocalLauncher

TORCH_OOM = ("Traceback (most recent call last):\n  File \"experiments/run.py\", line 1\n"
             "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity "
             "of 79.19 GiB of which 1.06 GiB is free.\n")


class TwoCellGpu:
    """A fake GPU with room for two cells: a cell that had more than two resident beside it while it allocated
    (its first `settle_s`) runs out of memory and leaves; one that fits trains for `train_s`."""

    def __init__(self, settle_s: float = 0.3, train_s: float = 0.1):
        self.lock, self.settle_s, self.train_s = threading.Lock(), settle_s, train_s
        self.allocating: list[list[int]] = []  # per cell allocating now: [the most resident meanwhile]
        self.resident = 0
        self.finished_beside: list[int] = []  # the most resident while each finished cell allocated

    def run_cell(self, c, cell, out, gpu=None, share=0, oom_restarts=0) -> dict:
        assert gpu == "0"
        restarts = {"oom_restarts": oom_restarts} if oom_restarts else {}
        most = [0]
        with self.lock:
            self.resident += 1
            self.allocating.append(most)
            for m in self.allocating:
                m[0] = max(m[0], self.resident)
        time.sleep(self.settle_s)
        with self.lock:
            self.allocating.remove(most)
        if most[0] > 2:
            with self.lock:
                self.resident -= 1
            return {**cell.labels(), "value": None, "consumed_tokens": None, "failed": 1, "oom": True, **restarts}
        time.sleep(self.train_s)
        with self.lock:
            self.resident -= 1
            self.finished_beside.append(most[0])
        return {**cell.labels(), "value": 2.0, "consumed_tokens": 1, **restarts}


def _four_cells(monkeypatch, workers: int = 4):
    """Four loss cells (two losses, two seeds: four distinct runs), keyed by their overrides: composing each
    cell's config would take longer than the deadline test's half second."""
    import sweeps.campaign as campaign
    monkeypatch.setattr(campaign, "config_key", lambda overrides: " ".join(overrides))
    c = load_campaign("served", [f"campaign.workers={workers}"])
    return c, stage_cells(c, 0, {})[:4]


def test_cells_out_of_gpu_memory_together_start_again_fewer_at_once_and_all_finish(monkeypatch, tmp_path):
    import sweeps.campaign as campaign
    c, cells = _four_cells(monkeypatch)
    gpu = TwoCellGpu()
    monkeypatch.setattr(sweep_cells, "run_cell", gpu.run_cell)
    launcher = LocalLauncher(LauncherConfig(gpus=["0"]))
    results = campaign._run_stage(c, cells, tmp_path, {}, None, launcher=launcher)
    assert [r["value"] for r in results] == [2.0] * 4 and not any(r.get("failed") for r in results)
    assert launcher.limit["0"] == 2  # lowered from four at once until two fit
    assert len(gpu.finished_beside) == 4 and max(gpu.finished_beside) <= 2
    assert all(r.get("oom_restarts", 0) >= 1 for r in results)  # all four started together and ran out
    lines = "\n".join(_gpu_memory_lines([{**r, "gpu_reserved_peak_gb": 11.5} for r in results]))
    assert "Started again after running out of GPU memory" in lines and "s0-loss-hard_ce-seed0 (" in lines
    assert "loss/hard_ce 11.5 GiB" in lines


def test_a_cell_that_runs_out_of_gpu_memory_alone_or_after_the_deadline_is_not_started_again(monkeypatch, tmp_path):
    import sweeps.campaign as campaign
    c, cells = _four_cells(monkeypatch, workers=1)
    starts = []

    def alone_oom(c_, cell, out, gpu=None, share=0, oom_restarts=0):
        starts.append(cell.id)
        return {**cell.labels(), "value": None, "consumed_tokens": None, "failed": 1, "oom": True}
    monkeypatch.setattr(sweep_cells, "run_cell", alone_oom)
    launcher = LocalLauncher(LauncherConfig(gpus=["0"]))
    results = campaign._run_stage(c, cells[:1], tmp_path, {}, None, launcher=launcher)
    assert starts == [cells[0].id] and results[0]["oom"] and results[0]["at_once"] == 1  # alone: it does not fit
    assert launcher.limit["0"] == 1

    c, cells = _four_cells(monkeypatch)
    gpu = TwoCellGpu(settle_s=1.0)
    monkeypatch.setattr(sweep_cells, "run_cell", gpu.run_cell)
    results = campaign._run_stage(c, cells, tmp_path, {}, time.time() + 0.5,
                                  launcher=LocalLauncher(LauncherConfig(gpus=["0"])))
    assert all(r["oom"] and "oom_restarts" not in r for r in results)  # out of memory after the deadline: left


def test_run_cell_says_a_leg_ran_out_of_gpu_memory_from_its_own_log_only(monkeypatch, tmp_path):
    c, cells = _four_cells(monkeypatch)
    legs = iter([(TORCH_OOM, 1), ("Traceback (most recent call last):\nValueError: a bad batch\n", 1),
                 ("trained\n", 0)])

    def fake_call(cmd, gpu, stdout=None, **kw):
        text, rc = next(legs)
        stdout.write(text)
        stdout.flush()
        return rc
    monkeypatch.setattr(sweep_cells, "call", fake_call)
    first = run_cell(c, cells[0], tmp_path, gpu="0")
    assert first["failed"] == 1 and first["oom"] is True
    second = run_cell(c, cells[0], tmp_path, gpu="0")  # the same log, appended: its earlier OOM is not this leg's
    assert second["failed"] == 1 and "oom" not in second
    done = run_cell(c, cells[0], tmp_path, gpu="0", oom_restarts=1)  # its record keeps the restart for later reports
    assert json.loads((Path(done["run_dir"]) / "cell.json").read_text())["oom_restarts"] == 1
    log = tmp_path / "a.log"
    log.write_bytes(b"x" * (100 << 10) + TORCH_OOM.encode())
    assert ran_out_of_gpu_memory(log, 0) and not ran_out_of_gpu_memory(log, log.stat().st_size)
    for message in ("RuntimeError: CUDA error: out of memory", "CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate"):
        log.write_text(f"Traceback (most recent call last):\n{message}\n")
        assert ran_out_of_gpu_memory(log, 0)
    log.write_text("triton.runtime.errors.OutOfResources: out of resource: shared memory\n")  # a kernel's limit
    assert not ran_out_of_gpu_memory(log, 0)


def _failed_trial(study, error: str):
    """A trial of `study` told FAIL with the error text run_trial records (`sweep.error`)."""
    from optuna.trial import TrialState

    from sweeps.objective import ATTR_ERROR
    trial = study.ask()
    trial.suggest_float("lr", 1e-4, 1e-2, log=True)
    trial.set_user_attr(ATTR_ERROR, error)
    study.tell(trial, state=TrialState.FAIL)
    return study.trials[-1]


def test_a_sweep_worker_out_of_gpu_memory_beside_others_requeues_its_trial_and_stops(tmp_path):
    """A GPU sweep's workers share a GPU like a campaign's cells: a worker whose trial ran out of its memory while
    another worker stays on that GPU queues the same params again (with the trial's ticket) and stops, so one
    fewer shares the GPU; alone there, or failed for another reason, it goes on. Of two that run out together,
    one stays: the queued trials still have a worker."""
    import io

    import optuna
    from optuna.trial import TrialState

    from sweeps.storage import Lease, workers_on_gpu
    from sweeps.worker import Tickets, WorkerSpec, fewer_on_this_gpu
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="maximize")
    leases = tmp_path / "leases"
    spec = WorkerSpec(index=1, sweep=None, base_overrides=[], storage="", study_name="s", out_dir=str(tmp_path),
                      lease_dir=str(leases), parent_run_id=None, tracking_uri=None, experiment="e", gpu="0")
    mine = Lease(leases, gpu="0")
    tickets, console = Tickets(0), io.StringIO()
    oom = _failed_trial(study, "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB")
    other_gpu = Lease(leases, gpu="1")  # a worker on another GPU is no company
    assert workers_on_gpu(leases, "0") == 1 and not fewer_on_this_gpu(study, oom, spec, mine, tickets, console)
    beside = Lease(leases, gpu="0")
    assert workers_on_gpu(leases, "0") == 2
    bad_batch = _failed_trial(study, "ValueError: a bad batch")
    assert not fewer_on_this_gpu(study, bad_batch, spec, mine, tickets, console)
    assert tickets.left == 0 and not study.get_trials(states=(TrialState.WAITING,))
    assert fewer_on_this_gpu(study, oom, spec, mine, tickets, console)
    waiting = study.get_trials(states=(TrialState.WAITING,))
    assert [w.user_attrs["sweep.oom_retry_of"] for w in waiting] == [oom.number] and tickets.left == 1
    again = study.ask()  # the next worker's trial: the same params
    assert again.suggest_float("lr", 1e-4, 1e-2, log=True) == oom.params["lr"]
    assert "ran out of GPU 0's memory beside 1 other worker(s) that stay" in console.getvalue()
    # the worker beside ran out too: the one that left no longer counts, so this one stays for the queued trials
    assert workers_on_gpu(leases, "0") == 1
    assert not fewer_on_this_gpu(study, oom, dataclasses.replace(spec, index=2), beside, tickets, console)
    beside.release()
    assert workers_on_gpu(leases, "0") == 0  # a worker gone is not counted
    for lease in (mine, other_gpu):
        lease.release()
