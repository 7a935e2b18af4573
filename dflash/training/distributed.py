"""Data-parallel training across processes launched by `torchrun` (no launcher of our own).

    torchrun --nproc_per_node=2 -m experiments.run +trainer=gpu ...        # one host, 2 GPUs
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_endpoint=HOST:29500 -m experiments.run ...

Every rank runs its own target producer(s) and drafter replica on its own GPU, so features never leave the
GPU they were made on (no CPU staging). Ranks split the data (global item index g = n·world + rank) and the
drafter replicas synchronise gradients through DistributedDataParallel. Rank 0 alone writes the run
directory, logs, checkpoints (which hold every rank's buffer state) and evaluates. NCCL on CUDA, gloo on CPU.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.world > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed() -> DistInfo:
    """Joins the process group torchrun describes (WORLD_SIZE > 1); a plain process is rank 0 of 1."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistInfo()
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(local_rank)  # "cuda" below means this rank's GPU
        dist.init_process_group(backend)
    return DistInfo(rank, world, local_rank)


def broadcast_object(obj, info: DistInfo):
    """Rank 0's value on every rank."""
    if not info.enabled:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather_objects(obj, info: DistInfo) -> list:
    """Every rank's value, in rank order, on every rank."""
    if not info.enabled:
        return [obj]
    out = [None] * info.world
    dist.all_gather_object(out, obj)
    return out


def _comm_device() -> torch.device:
    """NCCL reduces CUDA tensors only; gloo takes CPU tensors."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def sum_(t: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """Sum over ranks (a new tensor on t's device; t itself when not distributed)."""
    if not info.enabled:
        return t
    r = t.to(_comm_device())
    dist.all_reduce(r)
    return r.to(t.device)


def mean_(t: torch.Tensor, info: DistInfo) -> torch.Tensor:
    return sum_(t, info) / info.world if info.enabled else t


def wrap_ddp(model: torch.nn.Module, info: DistInfo, device: torch.device) -> torch.nn.Module:
    """DDP without broadcasting the target's shared embedding / LM head (non-persistent buffers, identical on
    every rank, 2.5 GB at a 250k vocabulary)."""
    if not info.enabled:
        return model
    from torch.nn.parallel import DistributedDataParallel
    model._ddp_params_and_buffers_to_ignore = [n for n, _ in model.named_buffers()]
    ids = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=ids, broadcast_buffers=False)


def shutdown(info: DistInfo) -> None:
    if info.enabled and dist.is_initialized():
        dist.destroy_process_group()
