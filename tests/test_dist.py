"""Multi-process pieces on gloo, without the launcher (torch.multiprocessing)."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dstrain.core.dist import free_port, sync_bn_buffers
from dstrain.data import Shard
from dstrain.data.fashion_mnist import TensorLoader
from dstrain.loop.evaluate import evaluate
from tests.conftest import spawn_ranks

pytestmark = pytest.mark.oldest  # ./run.sh test-oldest runs this module on torch 2.11


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(1, 3, 3),
        torch.nn.BatchNorm2d(3),
        torch.nn.Flatten(),
        torch.nn.Linear(48, 4),
    )
    return model


def _eval_data():
    images = torch.randint(
        0, 255, (13, 1, 6, 6), dtype=torch.uint8, generator=torch.Generator().manual_seed(1)
    )
    return images, torch.arange(13) % 4


def _worker(rank: int, world: int, port: int, out: dict) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world)
    )
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = _model()
    # rank-specific statistics, as after an epoch of DeepSpeed training (it syncs params, not buffers)
    bn = model[1]
    bn.running_mean.fill_(float(rank))
    bn.running_var.fill_(1.0 + 2 * rank)
    sync_bn_buffers(model)
    out[f"mean{rank}"] = bn.running_mean.clone()
    out[f"var{rank}"] = bn.running_var.clone()
    # distributed eval over 13 images: each counted once
    images, labels = _eval_data()
    loader = TensorLoader(
        images, labels, Shard(rank, world, 4, 1, eval_batch=3), "val", norm=(0.0, 1.0)
    )
    out[f"eval{rank}"] = evaluate(model, loader, torch.float32)
    dist.destroy_process_group()


def test_bn_sync_and_exact_distributed_eval():
    with mp.Manager() as manager:
        out = manager.dict()
        spawn_ranks(_worker, 2, 2, free_port(), out)
        out = dict(out)
    for r in range(2):
        assert torch.allclose(out[f"mean{r}"], torch.full((3,), 0.5))
        assert torch.allclose(out[f"var{r}"], torch.full((3,), 2.0))
    assert out["eval0"] == out["eval1"]
    assert out["eval0"]["val_images"] == 13
    # equals a single-process evaluation of all 13 images with the synced statistics
    model = _model()
    model[1].running_mean.fill_(0.5)
    model[1].running_var.fill_(2.0)
    images, labels = _eval_data()
    single = evaluate(
        model,
        TensorLoader(images, labels, Shard(0, 1, 4, 1, eval_batch=5), "val", norm=(0.0, 1.0)),
        torch.float32,
    )
    assert single["val_images"] == 13
    assert (
        single["val_top1"] == out["eval0"]["val_top1"]
        and single["val_top5"] == out["eval0"]["val_top5"]
    )
    assert (
        abs(single["val_loss"] - out["eval0"]["val_loss"]) < 1e-6
    )  # fp32 batch means, summed in fp64


@pytest.mark.parametrize(
    "env, gpu, threads",
    [
        ({"LOCAL_SIZE": "2"}, False, "half"),  # DeepSpeed's launcher, 2 CPU ranks
        ({"LOCAL_WORLD_SIZE": "2"}, False, "half"),  # torchrun, mpirun through launch.sh
        ({"LOCAL_WORLD_SIZE": "1"}, False, None),  # alone on its node: every core
        ({"LOCAL_SIZE": "2", "OMP_NUM_THREADS": "2"}, False, None),  # the user chose
        ({"LOCAL_SIZE": "2"}, True, None),  # a GPU rank
        ({"LOCAL_SIZE": "64"}, False, 1),  # more ranks than cores: one thread, never zero
    ],
)
def test_cpu_ranks_on_one_node_share_its_cores(monkeypatch, env, gpu, threads):
    """Each CPU rank takes cores // local ranks torch threads unless OMP_NUM_THREADS says (two
    ranks with a thread per core each on 2 cores trained at half the speed: docs/multinode.md)."""
    from dstrain.core import dist as ddist

    for var in ("LOCAL_SIZE", "LOCAL_WORLD_SIZE", "OMP_NUM_THREADS"):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    monkeypatch.setattr(ddist, "use_gpu", lambda: gpu)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    before = torch.get_num_threads()
    try:
        got = ddist.share_cpu_cores()
        expected = 4 if threads == "half" else threads
        assert got == expected
        assert torch.get_num_threads() == (expected or before)
    finally:
        torch.set_num_threads(before)


@pytest.mark.slow  # a fresh process joining a group: over ~5 s on 2 cores
def test_a_cpu_rank_joins_its_group_without_building_deepspeeds_shared_memory_op(tmp_path):
    """DeepSpeed's CPU backend would JIT-build deepspeed_shm_comm (about 80 s on a cold machine)
    for inference_all_reduce, which dstrain never calls: dist.init_process_group skips it, and
    nothing lands in an empty extensions folder."""
    import subprocess
    import sys

    code = (
        "from dstrain.core import dist\n"
        "dist.setup_env_for_single_process()\n"
        "dist.init_process_group(60)\n"
        "import deepspeed.comm.comm as c\n"
        "assert c.cdb.shm_comm_op is None\n"
        "dist.shutdown()\n"
    )
    extensions = tmp_path / "extensions"
    extensions.mkdir()
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "TORCH_EXTENSIONS_DIR": str(extensions)}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert list(extensions.iterdir()) == []
