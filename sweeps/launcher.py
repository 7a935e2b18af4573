"""Where campaign cells and sweep workers run: one launcher, two backends behind `Launcher.run(task, name)`.

- `local` (the default): on this machine. A task gets one GPU of `gpus` (default: the visible ones) through
  `CUDA_VISIBLE_DEVICES`, the least busy one, so N GPUs take N tasks one each and more tasks share them as
  today (a campaign's small cells share one GPU; the budget is in consumed tokens, so that is fair).
- `slurm`: each task is a job submitted through submitit (the library Hydra's Slurm launcher uses) with its
  GPUs, CPUs, memory and time limit. On preemption or at the time limit Slurm signals the job; submitit calls the
  task's `checkpoint()`, which stops the running training process with SIGTERM (the trainer saves a checkpoint on
  it) and requeues the job, which resumes from that checkpoint. `launcher.executor=local` runs the same jobs
  through submitit's local executor (tests, no cluster), signals and requeues included.

Keys (`launcher=slurm launcher.timeout_min=240 launcher.partition=gpu ...` on the campaign's or sweep's command
line): `LauncherConfig`. A task is a picklable callable taking the GPU it was placed on (None: leave the
environment's; Slurm sets CUDA_VISIBLE_DEVICES for a job's own GPUs) and returning a JSON-able result.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os
import signal
import subprocess
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from dflash.config import ConfigError

log = logging.getLogger(__name__)
BACKENDS = ("local", "slurm")


@dataclasses.dataclass
class LauncherConfig:
    backend: str = "local"  # local | slurm
    gpus: list[str] | None = None  # local: the GPUs to place tasks on (None: CUDA_VISIBLE_DEVICES or all)
    # local: GiB of each GPU that tasks of known need may fill (a campaign cell's recorded peak; 0: nvidia-smi's total
    # less what other processes hold, read whenever none of the tasks runs there, less RESERVE_GIB; < 0: place by
    # count alone)
    gpu_memory_gib: float = 0.0
    executor: str = "slurm"  # slurm backend: "slurm" submits to the cluster, "local" runs submitit's local executor
    folder: str = ""  # submitit's job files and logs (default: <out>/<name>/submitit)
    partition: str = ""
    gpus_per_job: int = 1
    cpus_per_job: int = 8
    mem_gb: int = 0  # 0: the partition's default
    timeout_min: float = 60  # a job's time limit (whole minutes on Slurm); a longer task is requeued and resumes from its checkpoint
    max_requeues: int = 10  # timeouts / preemptions a task may go through before it is given up
    signal_delay_s: int = 120  # Slurm signals this long before the limit: time for the trainer's checkpoint
    additional: dict[str, Any] = dataclasses.field(default_factory=dict)  # more sbatch keys (account, qos, ...)


def launcher_config(args: list[str]) -> tuple[LauncherConfig, list[str]]:
    """`launcher=<backend>` and `launcher.KEY=VALUE` arguments as a LauncherConfig; returns it and the rest."""
    from dflash.overrides import apply_overrides
    ours = [a.replace("launcher=", "launcher.backend=", 1) if a.startswith("launcher=") else a
            for a in args if a.startswith(("launcher=", "launcher."))]
    cfg = apply_overrides(LauncherConfig(), ours, prefix="launcher.")
    if cfg.backend not in BACKENDS:
        raise ConfigError(f"launcher={cfg.backend!r}: expected one of {list(BACKENDS)}")
    if cfg.executor not in ("slurm", "local"):
        raise ConfigError(f"launcher.executor={cfg.executor!r}: expected slurm or local (submitit's local executor)")
    if cfg.timeout_min <= 0 or cfg.gpus_per_job < 0 or cfg.cpus_per_job < 1:
        raise ConfigError("launcher.timeout_min must be > 0, launcher.cpus_per_job >= 1 and launcher.gpus_per_job >= 0")
    local_keys = ("launcher.backend=", "launcher.gpus=", "launcher.gpu_memory_gib=")
    if cfg.backend == "local" and any(not a.startswith(local_keys) for a in ours):
        raise ConfigError(f"{[a for a in ours if not a.startswith(local_keys)]}: "
                          f"Slurm settings, but launcher=local (give launcher=slurm)")
    return cfg, [a for a in args if not a.startswith(("launcher=", "launcher."))]


RESERVE_GIB = 0.5  # of a GPU's total that no task's need may fill (the driver's own; nvidia-smi counts it in)


def gpu_memory_gib(gpus: list[str]) -> dict[str, float]:
    """Each GPU's memory in GiB that tasks placed now may fill, by nvidia-smi (no CUDA context in this process): its
    total less what processes hold on it now, less RESERVE_GIB; {} when it cannot tell (no nvidia-smi, no GPU).
    Read while none of the launcher's tasks runs there, "what processes hold" is what is not the tasks': on an H100
    the campaign's own process held 6.1 GiB after making the shared inputs, and a cell placed against the total
    ran out of memory beside five others (2026-12-05)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index,memory.total,memory.used",
                              "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    # `gpus` name devices as CUDA_VISIBLE_DEVICES does (detect_gpus): nvidia-smi's indices; a GPU named otherwise
    # (a UUID) is left out, and its tasks are placed by count alone
    room = {}
    for line in out.strip().splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) == 3:
            try:
                room[fields[0]] = (float(fields[1]) - float(fields[2])) / 1024
            except ValueError:  # "[N/A]" on some devices: no figure, placed by count
                continue
    return {g: room[g] - RESERVE_GIB for g in gpus if g in room}


def detect_gpus() -> list[str]:
    vis = os.environ.get("CUDA_VISIBLE_DEVICES")
    if vis is not None:
        return [g.strip() for g in vis.split(",") if g.strip() and g.strip() != "-1"]
    try:
        import torch
        return [str(i) for i in range(torch.cuda.device_count())]
    except Exception:  # noqa: BLE001
        return []


class LocalLauncher:
    """Tasks in the caller's thread, each on the GPU with the fewest tasks at that moment (thread-safe).

    A task whose result says it ran out of GPU memory (`oom`, a campaign cell's CUDA out-of-memory error) lowers
    its GPU's limit to one task fewer than shared it then, and the result says how many did (`at_once`): the
    caller may run it again, and it waits until the GPU has room. Ten 2-layer campaign cells at the GPU shapes
    (64 x 320 tokens) held 119.6 GiB of an H200 (benchmarks/log/2026-12-04.md), more than an H100 has, so
    `workers=10` there would otherwise lose the cells that did not fit instead of running them in fewer at once.

    A task of known need (`run(..., need_gib=)`: a campaign cell whose option recorded its peak in an earlier launch)
    starts on a GPU only where it fits beside the needs of the tasks running there (`gpu_memory_gib`), or where the
    GPU is idle; otherwise it waits. On an H100 the served campaign's streak cell started beside five cells that
    held 76.4 GiB of 79.2 and ran out of memory (benchmarks/log/2026-12-05.md): their recorded peaks would have
    kept it waiting for the first of them to end."""

    def __init__(self, cfg: LauncherConfig):
        self.gpus = cfg.gpus if cfg.gpus is not None else detect_gpus()
        self._busy = {g: 0 for g in self.gpus}
        self.limit: dict[str, int | None] = {g: None for g in self.gpus}  # None: as many as the caller starts
        self._most: dict[str, list[list[int]]] = {g: [] for g in self.gpus}  # per running task: most beside it
        self._room = threading.Condition()
        self._held = {g: 0.0 for g in self.gpus}  # the needs of the tasks running on each GPU (GiB)
        m = cfg.gpu_memory_gib
        self._measure = m == 0  # read each GPU's room again whenever none of the tasks runs on it
        self.memory: dict[str, float] = ({} if m < 0 or not self.gpus else {g: m for g in self.gpus} if m > 0
                                         else gpu_memory_gib(self.gpus))

    def _fits(self, gpu: str, need_gib: float | None) -> bool:
        if self.limit[gpu] is not None and self._busy[gpu] >= self.limit[gpu]:
            return False
        cap = self.memory.get(gpu)
        return need_gib is None or cap is None or self._busy[gpu] == 0 or self._held[gpu] + need_gib <= cap

    @contextmanager
    def placed(self, need_gib: float | None = None) -> Iterator[tuple[str | None, list[int]]]:
        """(the GPU a task runs on, [the most tasks that GPU held at once while it ran])."""
        if not self.gpus:
            yield None, [1]
            return
        with self._room:
            while not (open_ := [g for g in self.gpus if self._fits(g, need_gib)]):
                self._room.wait()
            gpu = min(open_, key=lambda g: self._busy[g])
            if self._measure and self._busy[gpu] == 0 and gpu in self.memory:
                # idle of our tasks: what is held there now is another process's (the campaign's own, a neighbour)
                self.memory[gpu] = gpu_memory_gib([gpu]).get(gpu, self.memory[gpu])
            self._busy[gpu] += 1
            self._held[gpu] += need_gib or 0.0
            most = [0]
            self._most[gpu].append(most)
            for m in self._most[gpu]:
                m[0] = max(m[0], self._busy[gpu])
        try:
            yield gpu, most
        finally:
            with self._room:
                self._busy[gpu] -= 1
                self._held[gpu] -= need_gib or 0.0
                self._most[gpu] = [m for m in self._most[gpu] if m is not most]  # this one: equal lists are not it
                self._room.notify_all()

    def run(self, task: Callable[[str | None], Any], name: str, need_gib: float | None = None) -> Any:
        with self.placed(need_gib) as (gpu, most):
            result = task(gpu)
        if gpu is not None and isinstance(result, dict) and result.get("oom"):
            result = {**result, "at_once": self._fewer_at_once(gpu, most[0], name)}
        return result

    def _fewer_at_once(self, gpu: str, at_once: int, name: str) -> int:
        """Lower `gpu`'s limit to one task fewer than the `at_once` that shared it while `name` ran out of its
        memory; returns `at_once`. Strictly fewer each time: a task runs again under the limit, so it terminates."""
        with self._room:
            lower = max(1, at_once - 1)
            if self.limit[gpu] is None or lower < self.limit[gpu]:
                self.limit[gpu] = lower
                log.warning("%s ran out of GPU %s's memory with up to %d task(s) on that GPU: at most %d at once "
                            "there from now on", name, gpu, at_once, lower)
            return at_once


class SlurmLauncher:
    """Each task one submitit job; `run` blocks until its result (a requeued job's included)."""

    def __init__(self, cfg: LauncherConfig, folder: Path):
        import submitit
        self.cfg = cfg
        self.folder = Path(cfg.folder or folder)
        if cfg.executor == "local":
            self.executor = submitit.LocalExecutor(folder=str(self.folder), max_num_timeout=cfg.max_requeues)
            self.executor.update_parameters(timeout_min=cfg.timeout_min, gpus_per_node=cfg.gpus_per_job,
                                            signal_delay_s=cfg.signal_delay_s)
        else:
            self.executor = submitit.SlurmExecutor(folder=str(self.folder), max_num_timeout=cfg.max_requeues)
            params = dict(time=math.ceil(cfg.timeout_min), gpus_per_node=cfg.gpus_per_job, cpus_per_task=cfg.cpus_per_job,
                          signal_delay_s=cfg.signal_delay_s, ntasks_per_node=1, **cfg.additional)
            if cfg.partition:
                params["partition"] = cfg.partition
            if cfg.mem_gb:
                params["mem"] = f"{cfg.mem_gb}GB"
            self.executor.update_parameters(**params)
        self._lock = threading.Lock()
        self.jobs: dict[str, Any] = {}

    def run(self, task: Callable[[str | None], Any], name: str, need_gib: float | None = None) -> Any:
        """The task's result (`need_gib` is the local launcher's: a job has its GPUs to itself); a job that died
        without one (killed, node lost, out of requeues): the task's `lost(reason)` when it has one (a campaign cell:
        a failed record, left for the next launch), else raises."""
        with self._lock:  # update_parameters + submit as one step: the job's name is the task's
            if self.cfg.executor == "slurm":
                self.executor.update_parameters(job_name=name)
            job = self.executor.submit(Requeueable(task))
            self.jobs[name] = job
        try:
            return job.result()
        except Exception as e:  # noqa: BLE001 - submitit's UncompletedJobError / FailedJobError
            if not hasattr(task, "lost"):
                raise
            return task.lost(f"job {job.job_id} ({self.folder}): {type(e).__name__}: {str(e)[-2000:]}")


def make_launcher(cfg: LauncherConfig, folder: Path):
    return SlurmLauncher(cfg, folder) if cfg.backend == "slurm" else LocalLauncher(cfg)


# -- inside a job ---------------------------------------------------------------------------------------------
_children: list = []  # the training processes this job process runs now (subprocess.Popen or multiprocessing.Process)


def call(cmd: list[str], gpu: str | None, **popen) -> int:
    """`subprocess.call`, on `gpu` when given, with the process known to `Requeueable.checkpoint` (which stops it
    with SIGTERM before a requeue, so it saves a checkpoint) and stopped with it when the caller is interrupted."""
    env = dict(popen.pop("env", None) or os.environ)
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    proc = subprocess.Popen(cmd, env=env, **popen)
    return watched(proc, proc.wait)


def watched(proc, wait: Callable[[], Any]) -> Any:
    """`wait()` for `proc` (a Popen or a started multiprocessing.Process) with it known to `stop_children`."""
    _children.append(proc)
    try:
        return wait()
    except BaseException:
        stop_children()
        raise
    finally:
        _children.remove(proc)


def stop_children(timeout_s: float = 600) -> None:
    """SIGTERM to every training process of this job (the trainer saves its checkpoint and exits), then wait."""
    for proc in list(_children):
        if isinstance(proc, subprocess.Popen):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        elif proc.is_alive():
            proc.terminate()  # multiprocessing: SIGTERM too
    for proc in list(_children):
        if isinstance(proc, subprocess.Popen):
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
        else:
            proc.join(timeout_s)
            if proc.is_alive():
                proc.kill()


try:
    from submitit.helpers import Checkpointable as _Checkpointable
except ImportError:  # submitit is a dependency; without it only the local backend works
    _Checkpointable = object  # type: ignore[misc,assignment]


class Requeueable(_Checkpointable):
    """A task as a submitit job that requeues on a timeout or preemption: `checkpoint()` stops the task's
    training process (SIGTERM: it saves its checkpoint and exits) and resubmits the same task, which resumes it
    (a cell from its run folder's checkpoint, `sweeps.cells.cell_command`)."""

    def __init__(self, task: Callable[[str | None], Any]):
        self.task = task

    def __call__(self) -> Any:
        return self.task(None)

    def checkpoint(self, *args: Any, **kwargs: Any):
        """The task's `requeued()` when it has one (what is left of it: a sweep worker's remaining trials)."""
        import submitit
        stop_children()
        task = self.task.requeued() if hasattr(self.task, "requeued") else self.task
        return submitit.helpers.DelayedSubmission(Requeueable(task))
