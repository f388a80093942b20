"""Ground floor: process-group helpers; ranks come from the environment (DeepSpeed launcher, torchrun, mpirun).

Imports nothing of dstrain. Every helper is a no-op in a world of one.
"""

from __future__ import annotations

import logging
import os
import socket

import torch
import torch.distributed as torch_dist

log = logging.getLogger(__name__)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def setup_env_for_single_process() -> None:
    """`python dstrain/main.py` without a launcher: make a world of one."""
    if "RANK" in os.environ or "OMPI_COMM_WORLD_RANK" in os.environ or "PMI_RANK" in os.environ:
        return
    os.environ.update(
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
        LOCAL_WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
    )


def rank() -> int:
    return torch_dist.get_rank() if torch_dist.is_initialized() else int(os.environ.get("RANK", 0))


def world_size() -> int:
    return (
        torch_dist.get_world_size()
        if torch_dist.is_initialized()
        else int(os.environ.get("WORLD_SIZE", 1))
    )


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", 0))


def is_main() -> bool:
    return rank() == 0


def barrier() -> None:
    if torch_dist.is_initialized() and torch_dist.get_world_size() > 1:
        torch_dist.barrier()


_host_group = None  # a gloo group for small CPU messages when the default backend is NCCL


def init_host_group() -> None:
    """Collective: every rank calls it once after the process group is up."""
    global _host_group
    if (
        torch_dist.is_initialized()
        and torch_dist.get_world_size() > 1
        and torch_dist.get_backend() != "gloo"
    ):
        _host_group = torch_dist.new_group(backend="gloo")


def timeout_setter():
    """``set_timeout(timeout, group)`` as this torch offers it, or None where it cannot.

    ``torch.distributed.set_timeout`` is public from torch 2.12; torch 2.11 has the
    ``ProcessGroup.set_timeout`` method it wraps."""
    public = getattr(torch_dist, "set_timeout", None)
    if public is not None:
        return public
    if hasattr(torch_dist.ProcessGroup, "set_timeout"):

        def via_method(timeout, group):
            if torch_dist.distributed_c10d._rank_not_in_group(group):
                raise ValueError("not a member of this process group")
            group.set_timeout(timeout)

        return via_method
    return None


def set_timeout_everywhere(seconds: float) -> int:
    """Give every process group this rank is in the same collective timeout; returns how many.

    ``init_process_group(timeout=...)`` covers only the world group: groups made later with
    ``new_group`` (DeepSpeed's data-parallel group, which carries the gradient all-reduce, and ours)
    keep torch's default (10 minutes NCCL, 30 gloo), so a stuck peer would hang the run that long.
    On a torch that cannot change a group's timeout, says so and leaves the defaults.
    """
    from datetime import timedelta

    if not torch_dist.is_initialized():
        return 0
    setter = timeout_setter()
    if setter is None:
        log.warning(
            "torch %s cannot change a process group's timeout after it is made: "
            "fault.collective_timeout_s covers the world group only; groups DeepSpeed made keep "
            "torch's default (10 min NCCL, 30 min gloo) before a lost peer is noticed",
            torch.__version__,
        )
        return 0
    # torch keeps the group registry private
    world = getattr(torch_dist.distributed_c10d, "_world", None)
    groups = list(world.pg_map) if world is not None else [torch_dist.group.WORLD]
    n = 0
    for group in groups:
        try:
            setter(timedelta(seconds=seconds), group)
            n += 1
        except (ValueError, RuntimeError):  # not a member / a backend without settable timeouts
            continue
    return n


def sync_bn_buffers(model: torch.nn.Module) -> None:
    """Average BN running statistics over ranks (DeepSpeed broadcasts parameters, not buffers)."""
    bns = [
        m
        for m in model.modules()
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.running_mean is not None
    ]
    if world_size() == 1 or not bns:
        return
    flat = torch.cat([torch.cat([m.running_mean.float(), m.running_var.float()]) for m in bns])
    all_reduce_sum(flat).div_(world_size())
    offset = 0
    for m in bns:
        c = m.running_mean.numel()
        m.running_mean.copy_(flat[offset : offset + c])
        m.running_var.copy_(flat[offset + c : offset + 2 * c])
        offset += 2 * c


def host_all_reduce(values: list[float], op: str = "sum") -> list[float]:
    """Reduce a few host numbers over ranks (CPU, gloo): no device sync, safe inside a signal-driven stop."""
    t = torch.tensor(values, dtype=torch.float64)
    if torch_dist.is_initialized() and torch_dist.get_world_size() > 1:
        torch_dist.all_reduce(t, op=_reduce_op(op), group=_host_group)
    return t.tolist()


def _reduce_op(name: str):
    return {
        "sum": torch_dist.ReduceOp.SUM,
        "max": torch_dist.ReduceOp.MAX,
        "min": torch_dist.ReduceOp.MIN,
    }[name]


def quiet_deepspeed() -> None:
    """Keep DeepSpeed's start-up noise off the console; call before anything else imports
    DeepSpeed. On a machine without a GPU, DeepSpeed 0.19 warns that it falls back to the CPU,
    torch warns that there is no CUDA runtime, and every process group it joins JIT-builds (first
    run: ~30 s, compiler lines on the console; later runs: ~20 s of loading) a shared-memory op
    that only its inference all-reduce uses. None of it concerns training: the accelerator is named
    (``DS_ACCELERATOR=cpu``, unless the user set one), the warning is dropped, and the op is not
    built (training collectives go through torch.distributed either way). A GPU machine is left as
    it is: there the op build and CUDA messages can matter. DeepSpeed's own logger is set to
    warnings (it logs its world size and every setting at INFO)."""
    if torch.cuda.device_count() == 0:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    try:
        from deepspeed.utils import logger as deepspeed_logger
    except ImportError:
        return
    deepspeed_logger.setLevel(logging.WARNING)


def skip_shm_op() -> None:
    """Keep DeepSpeed's CPU backend from building its shared-memory op, which only its
    ``inference_all_reduce`` uses and dstrain never calls: ``TorchBackend.__init__`` builds it
    through the module function ``build_shm_op`` (a JIT C++ build of about 80 s on a machine's
    first run, then shared-memory set-up in every process); returning None there is DeepSpeed's
    own "op not available" path. Call before ``deepspeed.init_distributed`` on CPU ranks."""
    import importlib

    backend = importlib.import_module(
        "deepspeed.comm.torch"
    )  # `deepspeed.comm.torch` is torch itself
    if hasattr(backend, "build_shm_op"):
        backend.build_shm_op = lambda: None


def local_ranks() -> int:
    """Ranks on this node: LOCAL_WORLD_SIZE (torchrun, mpirun via launch.sh) or LOCAL_SIZE
    (DeepSpeed's launcher); 1 when neither says."""
    return int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or 1)


def node_sizes(world: int) -> list[int]:
    """The ranks of each node of this job, in rank order, as far as this rank can tell: its own
    node's count (``local_ranks``) for every node when that divides the world, else nothing."""
    local = local_ranks()
    return [local] * (world // local) if local > 1 and world % local == 0 else []


def share_cpu_cores() -> int | None:
    """CPU ranks sharing a node each take their share of its cores for torch's threads, as torchrun
    does (DeepSpeed's launcher does not, without --bind_cores_to_rank): every rank otherwise opens
    a thread per core, and OpenMP threads spinning on cores the other ranks need halve a 2-rank
    run's speed on 2 cores, and cost more beside other work (results/bench/scaling_cpu_threads*
    .json, docs/multinode.md). The threads set, or None: a GPU rank, a rank alone on its node, or
    OMP_NUM_THREADS given (the user's choice)."""
    ranks = local_ranks()
    if use_gpu() or ranks <= 1 or os.environ.get("OMP_NUM_THREADS"):
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = max(1, (cores or 1) // ranks)
    torch.set_num_threads(threads)
    log.info(
        "%d CPU ranks on this node share its %d cores: %d torch thread(s) each "
        "(set OMP_NUM_THREADS to choose)",
        ranks,
        cores,
        threads,
    )
    return threads


def init_process_group(timeout_s: float) -> None:
    """Join the job's process group (NCCL on GPUs, gloo on CPUs) with ``timeout_s`` for every collective."""
    from datetime import timedelta

    import deepspeed

    if not use_gpu():
        skip_shm_op()
    share_cpu_cores()
    deepspeed.init_distributed(
        dist_backend="nccl" if use_gpu() else "gloo",
        timeout=timedelta(seconds=timeout_s),
    )
    init_host_group()


def shutdown() -> None:
    """Leave the process group before the interpreter exits (its teardown at exit is where native
    libraries have crashed after a finished run)."""
    if torch_dist.is_initialized():
        torch_dist.destroy_process_group()


def use_gpu() -> bool:
    """Whether this rank trains on a GPU: one is visible and DeepSpeed was not told to run on its CPU
    accelerator. ``DS_ACCELERATOR=cpu`` (what ``DSTRAIN_CPU_RANKS`` and the tests give CPU ranks, and
    what reaches remote ranks through DeepSpeed's env file where ``CUDA_VISIBLE_DEVICES`` does not)
    means gloo on the CPU; a model put on a GPU beside it would not match DeepSpeed's device."""
    return torch.cuda.is_available() and os.environ.get("DS_ACCELERATOR", "").lower() != "cpu"


def device() -> torch.device:
    """This rank's device: its local GPU, or the CPU (check :func:`rank_without_gpu` first)."""
    return torch.device("cuda", local_rank()) if use_gpu() else torch.device("cpu")


def rank_without_gpu() -> str | None:
    """Why this rank cannot have a GPU of its own, or None. DeepSpeed 0.19 does not check: two ranks
    on a 1-GPU node would put rank 1 on a missing cuda:1 and fail deep inside."""
    if not use_gpu() or local_rank() < torch.cuda.device_count():
        return None
    count = torch.cuda.device_count()
    return (
        f"local rank {local_rank()} has no GPU: this node shows {count} GPU(s) "
        f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')!r}). Start at "
        f"most {count} rank(s) per node, or CPU ranks: DSTRAIN_CPU_RANKS=N ./launch.sh ... "
        "(or CUDA_VISIBLE_DEVICES='' DS_ACCELERATOR=cpu deepspeed --num_gpus N ...)"
    )


def host_all_reduce_async(values: list[float], op: str = "max"):
    """Start :func:`host_all_reduce` without waiting; returns (work, tensor): ``work.wait()``, then read it."""
    t = torch.tensor(values, dtype=torch.float64)
    work = torch_dist.all_reduce(t, op=_reduce_op(op), group=_host_group, async_op=True)
    return work, t


def all_reduce_min(t: torch.Tensor) -> torch.Tensor:
    if torch_dist.is_initialized() and torch_dist.get_world_size() > 1:
        torch_dist.all_reduce(t, op=torch_dist.ReduceOp.MIN)
    return t


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """In-place sum across ranks (no-op for a world of one)."""
    if torch_dist.is_initialized() and torch_dist.get_world_size() > 1:
        torch_dist.all_reduce(t, op=torch_dist.ReduceOp.SUM)
    return t


def all_gather_object(obj) -> list:
    """Every rank's ``obj``, in rank order, on every rank (CPU, gloo: no device sync); ``[obj]``
    for a world of one."""
    if torch_dist.is_initialized() and torch_dist.get_world_size() > 1:
        out = [None] * torch_dist.get_world_size()
        torch_dist.all_gather_object(out, obj, group=_host_group)
        return out
    return [obj]


def broadcast_object(obj):
    if torch_dist.is_initialized() and torch_dist.get_world_size() > 1:
        box = [obj]
        torch_dist.broadcast_object_list(box, src=0)
        return box[0]
    return obj
