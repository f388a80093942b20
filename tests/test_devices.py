"""The same suite on CPU and GPU nodes: ranks per GPU, CPU ranks where a node has fewer GPUs than a
test's ranks, deterministic cuDNN where a test compares bits; tested here with the device count faked.

On a GPU node the suite itself is the test (``./run.sh gpu tests``); here each decision is made
with the devices a 1-GPU, a 2-GPU and a CPU node would show.
"""

from __future__ import annotations

import argparse
import os
import sys

import pytest
import torch

from dstrain.core import dist
from dstrain.core.errors import ConfigError
from dstrain.run import launch
from dstrain.run.train import set_cudnn
from tests import conftest
from tests.conftest import CPU_ONLY, launcher_ranks, rank_env, run_cli


@pytest.mark.parametrize(
    "ranks, gpus, expected",
    [(1, 0, CPU_ONLY), (1, 1, {}), (2, 1, CPU_ONLY), (2, 2, {}), (4, 2, CPU_ONLY), (2, 8, {})],
)
def test_a_test_gets_one_gpu_per_rank_or_cpu_ranks(ranks, gpus, expected):
    assert rank_env(ranks, gpus) == expected


def test_the_launchers_rank_count_is_read_from_its_command():
    assert launcher_ranks(["deepspeed", "--num_gpus", "2", "--master_port", "1"]) == 2
    assert launcher_ranks(None) == 1


@pytest.mark.parametrize("gpus, hidden", [(1, True), (2, False)])
def test_run_cli_hides_the_gpus_when_a_node_has_fewer_than_the_ranks(monkeypatch, gpus, hidden):
    monkeypatch.setattr(conftest, "gpu_count", lambda: gpus)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    show = "import os; print(repr(os.environ.get('CUDA_VISIBLE_DEVICES')))"
    proc = run_cli([], launcher=[sys.executable, "-c", show, "--num_gpus", "2"], timeout=60)
    assert proc.stdout.strip() == ("''" if hidden else "None")


def fake_gpus(monkeypatch, count: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def test_a_rank_without_a_gpu_of_its_own_is_refused_naming_the_fix(monkeypatch, tmp_path):
    """DeepSpeed 0.19.8 would give rank 1 of 2 on a 1-GPU node cuda:1 and fail deep inside; the
    trainer stops first with the fix (exit 2, one line)."""
    from deepspeed.accelerator import get_accelerator

    get_accelerator()  # chosen now, on this machine: DeepSpeed keeps its first choice for good
    fake_gpus(monkeypatch, 1)
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert dist.rank_without_gpu() is None and dist.device() == torch.device("cuda", 0)
    monkeypatch.setenv("LOCAL_RANK", "1")
    why = dist.rank_without_gpu()
    assert (
        why.startswith("local rank 1 has no GPU: this node shows 1 GPU")
        and "DSTRAIN_CPU_RANKS=N" in why
    )
    from dstrain.run.train import run
    from dstrain.settings.config import load_config

    monkeypatch.setattr(dist, "init_process_group", lambda timeout_s: None)
    monkeypatch.setenv("RANK", "1")  # rank 1 of a 2-rank job on this (1-GPU) node
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = load_config("fashion_mnist", [f"run_dir={tmp_path / 'run'}"])
    with pytest.raises(ConfigError, match="local rank 1 has no GPU"):
        run(cfg, "ds_configs/fp32.json")
    fake_gpus(monkeypatch, 0)
    assert dist.rank_without_gpu() is None and dist.device() == torch.device("cpu")


def test_ranks_told_to_use_deepspeeds_cpu_accelerator_train_on_the_cpu(monkeypatch):
    """DS_ACCELERATOR=cpu reaches remote ranks through DeepSpeed's env file (CUDA_VISIBLE_DEVICES
    does not): with a GPU visible they still train on the CPU over gloo, as DeepSpeed does, and a
    second local rank is not refused for want of a GPU."""
    fake_gpus(monkeypatch, 1)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    assert not dist.use_gpu() and dist.device() == torch.device("cpu")
    assert dist.rank_without_gpu() is None
    monkeypatch.delenv("DS_ACCELERATOR")
    assert dist.use_gpu() and dist.rank_without_gpu().startswith("local rank 1 has no GPU")


def launch_args(**kw) -> argparse.Namespace:
    base = dict(gpus_per_node=None, iface="", trainer_args=["--config", "x"], launcher="auto")
    return argparse.Namespace(**{**base, **kw})


def test_launch_starts_one_rank_per_gpu_or_the_cpu_ranks_asked_for(monkeypatch):
    monkeypatch.setattr(launch, "local_gpus", lambda: 1)
    cmd, hostfile, env = launch.build(launch_args(), {}, "deepspeed")
    assert cmd[:3] == ["deepspeed", "--num_gpus", "1"] and hostfile is None and env == {}
    # asked for 2 CPU ranks on a 1-GPU node: 2 ranks that see no GPU (the GPU count used to win)
    cmd, _, env = launch.build(launch_args(), {"DSTRAIN_CPU_RANKS": "2"}, "deepspeed")
    assert cmd[:3] == ["deepspeed", "--num_gpus", "2"]
    assert env == {"CUDA_VISIBLE_DEVICES": "", "DS_ACCELERATOR": "cpu"}
    monkeypatch.setattr(launch, "local_gpus", lambda: 0)
    cmd, _, env = launch.build(launch_args(), {}, "deepspeed")
    assert cmd[:3] == ["deepspeed", "--num_gpus", "1"]
    with pytest.raises(launch.LaunchError, match=r"DSTRAIN_CPU_RANKS='two'"):
        launch.build(launch_args(), {"DSTRAIN_CPU_RANKS": "two"}, "deepspeed")


def test_deterministic_turns_cudnn_autotuning_off():
    before = torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic
    try:
        set_cudnn(True)
        assert not torch.backends.cudnn.benchmark and torch.backends.cudnn.deterministic
        set_cudnn(False)
        assert torch.backends.cudnn.benchmark and not torch.backends.cudnn.deterministic
    finally:
        torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = before


def test_launch_sh_shows_the_cpu_ranks_environment():
    from tests.test_launch import dry_run

    proc = dry_run({"DSTRAIN_CPU_RANKS": "2"})
    assert proc.returncode == 0, proc.stderr
    assert "launch.sh: CUDA_VISIBLE_DEVICES='' DS_ACCELERATOR=cpu " in proc.stdout
    assert "deepspeed --num_gpus 2 " in proc.stdout


def test_ranks_started_by_mpirun_take_openmpis_rank_variables(monkeypatch):
    """DeepSpeed's openmpi launcher gives ranks OMPI_COMM_WORLD_*, and DeepSpeed would read them
    through mpi4py (not installed): with launch.sh's MASTER_ADDR/MASTER_PORT they become torch's."""
    from dstrain.run.launch import adopt_mpi_env

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.setenv(var, "x")  # recorded, so what adopt_mpi_env sets is undone after
        monkeypatch.delenv(var)
    ompi = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4"}
    ompi |= {"OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    for k, v in ompi.items():
        monkeypatch.setenv(k, v)
    adopt_mpi_env()  # no rendezvous given: left to DeepSpeed
    assert "RANK" not in os.environ
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    adopt_mpi_env()
    assert [os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")] == [
        "3",
        "4",
        "1",
        "2",
    ]
    assert dist.rank() == 3 and dist.world_size() == 4 and dist.local_rank() == 1


def test_adopting_the_mpi_ranks_is_undone_with_the_test():
    """The test above runs in pytest's process: the rank variables adopt_mpi_env sets must not
    leak (they once made every later in-process test rank 3 of 4). Checked here without the
    autouse fixture's help (it restores the process variables after every test anyway): inside
    its own monkeypatch context, every variable adopt_mpi_env writes must be one the test
    recorded, so leaving the context restores the environment as it was."""
    from dstrain.run.launch import OMPI_ENV, adopt_mpi_env

    before = dict(os.environ)
    with pytest.MonkeyPatch.context() as mp:
        for var in OMPI_ENV:  # what adopt_mpi_env may write: recorded, then removed
            mp.setenv(var, "x")
            mp.delenv(var)
        for k, v in {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4"}.items():
            mp.setenv(k, v)
        mp.setenv("MASTER_ADDR", "10.0.0.1")
        mp.setenv("MASTER_PORT", "29500")
        adopt_mpi_env()
        assert os.environ["RANK"] == "3"  # it did write
    assert dict(os.environ) == before
