"""Process-group helpers: ranks come from the environment (DeepSpeed launcher, torchrun, mpirun)."""
from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def setup_env_for_single_process() -> None:
    """`python dstrain/main.py` without a launcher: make a world of one."""
    if "RANK" in os.environ or "OMPI_COMM_WORLD_RANK" in os.environ or "PMI_RANK" in os.environ:
        return
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", 0))


def is_main() -> bool:
    return rank() == 0


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


_host_group = None  # a gloo group for small CPU messages when the default backend is NCCL


def init_host_group() -> None:
    """Collective: every rank calls it once after the process group is up."""
    global _host_group
    if dist.is_initialized() and dist.get_world_size() > 1 and dist.get_backend() != "gloo":
        _host_group = dist.new_group(backend="gloo")


def set_timeout_everywhere(seconds: float) -> int:
    """Give every process group this rank is in the same collective timeout; returns how many.

    ``init_process_group(timeout=...)`` covers only the world group: groups made later with
    ``new_group`` (DeepSpeed's data-parallel group, which carries the gradient all-reduce, and ours)
    keep torch's 30-minute default, so a stuck peer would hang the run for half an hour.
    """
    from datetime import timedelta

    if not dist.is_initialized():
        return 0
    world = getattr(dist.distributed_c10d, "_world", None)  # torch keeps the group registry private
    groups = list(world.pg_map) if world is not None else [dist.group.WORLD]
    n = 0
    for group in groups:
        try:
            dist.set_timeout(timedelta(seconds=seconds), group)
            n += 1
        except (ValueError, RuntimeError):  # not a member / a backend without settable timeouts
            continue
    return n


def host_all_reduce(values: list[float], op: str = "sum") -> list[float]:
    """Reduce a few host numbers over ranks (CPU, gloo): no device sync, safe inside a signal-driven stop."""
    t = torch.tensor(values, dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=_reduce_op(op), group=_host_group)
    return t.tolist()


def _reduce_op(name: str):
    return {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[name]


def host_all_reduce_async(values: list[float], op: str = "max"):
    """Start :func:`host_all_reduce` without waiting; returns (work, tensor): ``work.wait()``, then read it."""
    t = torch.tensor(values, dtype=torch.float64)
    work = dist.all_reduce(t, op=_reduce_op(op), group=_host_group, async_op=True)
    return work, t


def all_reduce_min(t: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return t


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """In-place sum across ranks (no-op for a world of one)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def broadcast_object(obj):
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    return obj
