"""launch.sh / dstrain/launch.py: hostfiles from fake scheduler environments and dry-run command lines."""

import os
import subprocess

import pytest

from dstrain.launch import LaunchError, expand_slurm, hostfile_text, scheduler_nodes
from tests.conftest import REPO


def test_pbs_duplicate_hosts_collapse_into_slots(tmp_path):
    nodefile = tmp_path / "nodes"
    nodefile.write_text("hnode001\n" * 4 + "hnode002\n" * 4 + "\n")
    name, nodes = scheduler_nodes({"PBS_NODEFILE": str(nodefile)})
    assert name == "pbs" and nodes == [("hnode001", 4), ("hnode002", 4)]
    assert hostfile_text(nodes, None) == "hnode001 slots=4\nhnode002 slots=4\n"
    assert hostfile_text(nodes, 8) == "hnode001 slots=8\nhnode002 slots=8\n"  # GPUS_PER_NODE wins


@pytest.mark.parametrize(
    "nodelist, hosts",
    [
        ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
        ("a5,b[8-10]", ["a5", "b8", "b9", "b10"]),
        ("gpu001", ["gpu001"]),
    ],
)
def test_slurm_nodelists_expand_like_scontrol(nodelist, hosts):
    assert expand_slurm(nodelist) == hosts


def test_slurm_and_uge_node_lists(tmp_path):
    name, nodes = scheduler_nodes(
        {"SLURM_JOB_NODELIST": "n[1-2]", "SLURM_NTASKS_PER_NODE": "4(x2)"}
    )
    assert name == "slurm" and nodes == [("n1", 4), ("n2", 4)]
    pe = tmp_path / "pe"
    pe.write_text("g0001 4 gpu.q@g0001 UNDEFINED\ng0002 4 gpu.q@g0002 UNDEFINED\n")
    assert scheduler_nodes({"PE_HOSTFILE": str(pe)}) == ("uge", [("g0001", 4), ("g0002", 4)])
    hosts = tmp_path / "hosts"
    hosts.write_text("g0001\ng0001\ng0002\ng0002\n")
    assert scheduler_nodes({"SGE_JOB_HOSTLIST": str(hosts)}) == (
        "uge",
        [("g0001", 2), ("g0002", 2)],
    )
    assert scheduler_nodes({}) is None


def test_empty_or_unreadable_node_lists_are_clear_errors(tmp_path):
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(LaunchError, match=r"\$PBS_NODEFILE=.*empty"):
        scheduler_nodes({"PBS_NODEFILE": str(empty)})
    with pytest.raises(LaunchError, match=r"\$SGE_JOB_HOSTLIST=.*cannot read"):
        scheduler_nodes({"SGE_JOB_HOSTLIST": str(tmp_path / "missing")})
    with pytest.raises(LaunchError, match="set GPUS_PER_NODE"):
        hostfile_text([("n1", 0), ("n2", 0)], None)


def dry_run(env: dict, *args: str, path_dirs=()) -> subprocess.CompletedProcess:
    base = {
        k: v
        for k, v in os.environ.items()
        if k
        not in (
            "PBS_NODEFILE",
            "SLURM_JOB_NODELIST",
            "PE_HOSTFILE",
            "SGE_JOB_HOSTLIST",
            "GPUS_PER_NODE",
        )
    }
    base["PATH"] = os.pathsep.join([*map(str, path_dirs), "/usr/bin", "/bin"])
    return subprocess.run(
        [str(REPO / "launch.sh"), "--dry-run", *args, "--config", "fashion_mnist", "epochs=2"],
        env={**base, "CUDA_VISIBLE_DEVICES": "", **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def fake_tool(tmp_path, name):
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    (bindir / name).write_text("#!/bin/sh\nexit 0\n")
    (bindir / name).chmod(0o755)
    return bindir


def test_dry_run_outside_a_job_starts_local_ranks():
    proc = dry_run({"DSTRAIN_CPU_RANKS": "2"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith(
        "deepspeed --num_gpus 2 --master_port 29500 dstrain/main.py --config fashion_mnist epochs=2"
    )


@pytest.mark.parametrize("scheduler", ["pbs", "slurm", "uge"])
def test_dry_run_in_a_job_prints_hostfile_and_multi_node_command(tmp_path, scheduler):
    nodes = tmp_path / "nodes"
    if scheduler == "pbs":
        nodes.write_text("hnode001\n" * 8 + "hnode002\n" * 8)
        env = {"PBS_NODEFILE": str(nodes)}
    elif scheduler == "slurm":
        env = {"SLURM_JOB_NODELIST": "hnode[001-002]", "GPUS_PER_NODE": "8"}
    else:
        nodes.write_text(
            "hnode001 8 gpu.q@hnode001 UNDEFINED\nhnode002 8 gpu.q@hnode002 UNDEFINED\n"
        )
        env = {"PE_HOSTFILE": str(nodes)}
    bindir = fake_tool(tmp_path, "mpirun")
    proc = dry_run(
        {**env, "MASTER_PORT": "29600"},
        "--iface",
        "ib0",
        "--hostfile",
        str(tmp_path / "hf"),
        path_dirs=[bindir],
    )
    assert proc.returncode == 0, proc.stderr
    assert "hnode001 slots=8\nhnode002 slots=8\n" in proc.stdout
    assert (
        f"NCCL_SOCKET_IFNAME=ib0 {REPO}/.venv/bin/deepspeed --hostfile {tmp_path / 'hf'} --master_addr hnode001 "
        "--master_port 29600 --launcher openmpi --launcher_args '--mca btl_tcp_if_include ib0' "
        "dstrain/main.py --config fashion_mnist epochs=2"
    ) in proc.stdout
    assert not (tmp_path / "hf").exists()  # a dry run writes nothing


def test_dry_run_prefers_pdsh_and_fails_clearly_without_a_multi_node_launcher(tmp_path):
    nodes = tmp_path / "nodes"
    nodes.write_text("a\na\nb\nb\n")
    proc = dry_run({"PBS_NODEFILE": str(nodes)}, path_dirs=[fake_tool(tmp_path, "pdsh")])
    assert proc.returncode == 0 and "--launcher pdsh dstrain/main.py" in proc.stdout
    proc = dry_run({"PBS_NODEFILE": str(nodes)})
    assert proc.returncode == 2 and "neither pdsh nor mpirun" in proc.stderr
    empty = tmp_path / "empty"
    empty.write_text("")
    proc = dry_run({"PBS_NODEFILE": str(empty)})
    assert proc.returncode == 2 and proc.stderr.startswith("launch.sh: error: $PBS_NODEFILE=")


@pytest.mark.parametrize("script", ["launch.sh", "run.sh", "hostfiles/abci_job.sh", ".ci/run"])
def test_shell_scripts_parse(script):
    assert subprocess.run(["bash", "-n", str(REPO / script)], capture_output=True).returncode == 0
