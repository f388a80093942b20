"""The cluster launch for real: ranks on two "hosts" (network namespaces with their own address,
hostname and sshd; tests/multihost.py) started through DeepSpeed's multi-node runner over pdsh and
ssh, as on a cluster, and what a lost node looks like.

Every run here is compared with the same training on local ranks: the hosts change where the ranks
run and how they reach each other, not what they compute (gloo's all-reduce is the same algorithm
over a veth as over loopback), so the weights must be the same bit for bit.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests import multihost
from tests.conftest import (
    CPU_ONLY,
    ONE_THREAD,
    REPO,
    TINY,
    deepspeed_launcher,
    error_lines,
    run_cli,
)

WHY_NOT = multihost.unavailable()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(WHY_NOT is not None, reason=str(WHY_NOT)),
    pytest.mark.xdist_group("hosts"),  # one worker makes the hosts, one cluster at a time
]
DEEPSPEED = str(Path(sys.executable).parent / "deepspeed")


@pytest.fixture
def cluster(tmp_path):
    with multihost.Cluster(2, tmp_path / "cluster") as c:
        yield c


def trainer_args(fake_fmnist, run_dir, *extra: str) -> list[str]:
    return [
        "--deepspeed_config",
        "ds_configs/fp32.json",
        *TINY,
        f"data.root={fake_fmnist}",
        f"run_dir={run_dir}",
        *extra,
    ]


def module_state(run_dir: Path) -> dict:
    ckpt = run_dir / "checkpoints"
    tag = (ckpt / "latest").read_text().strip()
    return torch.load(ckpt / tag / "mp_rank_00_model_states.pt", weights_only=True)["module"]


def same_weights(a: Path, b: Path, parameters_only: bool = False) -> bool:
    """Bit for bit; ``parameters_only``: BN's running estimates and batch counters left out."""
    sa, sb = module_state(a), module_state(b)
    buffers = ("running_mean", "running_var", "num_batches_tracked")
    keys = [k for k in sa if not (parameters_only and k.endswith(buffers))]
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in keys)


def rank_records(run_dir: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((run_dir / "ranks").glob("rank*.json"))]


def local_run(fake_fmnist, run_dir: Path, ranks: int, *extra: str) -> dict:
    # on the CPU, as the harness's hosts run (Cluster.env): the weights compared come from one device
    proc = run_cli(
        trainer_args(fake_fmnist, run_dir, *extra),
        launcher=deepspeed_launcher(ranks),
        env={**CPU_ONLY, **ONE_THREAD},
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads((run_dir / "summary.json").read_text())


@pytest.fixture
def two_local_ranks(tiny_on_two_ranks) -> tuple[Path, dict]:
    """The reference the two-host runs of TINY are compared with: the same training on 2 local
    ranks (run directory, summary), trained once for the session (conftest)."""
    proc, run_dir = tiny_on_two_ranks, tiny_on_two_ranks.run_dir
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return run_dir, json.loads((run_dir / "summary.json").read_text())


def run(cmd: list[str], env: dict, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def test_deepspeed_hostfile_on_two_hosts_trains_as_two_local_ranks(
    cluster, fake_fmnist, tmp_path, two_local_ranks
):
    """`deepspeed --hostfile` (2 hosts, slots=1) over pdsh: a rank on each host, the environment a
    remote rank needs given through DeepSpeed's env file, the same weights as 2 local ranks."""
    env_file = tmp_path / "ds_env"  # what a user puts in ~/.deepspeed_env or $DS_ENV_FILE
    # DS_ACCELERATOR=cpu: the remote ranks on the CPU on a GPU node too (DeepSpeed's launcher sets
    # CUDA_VISIBLE_DEVICES from the hostfile's slots; this reaches them through the env file)
    # OMP_NUM_THREADS=1: the local ranks compared with run one thread each (conftest.ONE_THREAD);
    # the remote ranks get only what the env file says
    env_file.write_text(
        "GLOO_SOCKET_IFNAME=eth0\nDSTRAIN_PROBE=arrived\nDS_ACCELERATOR=cpu\nOMP_NUM_THREADS=1\n"
    )
    h0 = cluster.hosts[0]
    run_dir = tmp_path / "hosts"
    cmd = [
        DEEPSPEED,
        "--hostfile",
        str(cluster.hostfile(slots=1)),
        "--master_addr",
        h0.addr,
        "--master_port",
        str(cluster.free_port()),
        "--launcher",
        "pdsh",
        "dstrain/main.py",
        *trainer_args(fake_fmnist, run_dir),
    ]
    proc = run(cmd, cluster.env(DS_ENV_FILE=str(env_file), PYTHONUNBUFFERED="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = rank_records(run_dir)
    assert [(r["rank"], r["host"], r["state"]) for r in records] == [
        (0, "dsnode0", "done"),
        (1, "dsnode1", "done"),
    ]
    for r in records:  # what had to reach the remote ranks did
        assert r["env"]["GLOO_SOCKET_IFNAME"] == "eth0" and r["env"]["DSTRAIN_PROBE"] == "arrived"
        assert r["env"]["MASTER_ADDR"] == h0.addr
    local, summary = two_local_ranks
    hosts = json.loads((run_dir / "summary.json").read_text())
    assert hosts["final_top1"] == summary["final_top1"] and hosts["world_size"] == 2
    assert same_weights(run_dir, local)


def pbs_job(cluster, tmp_path: Path, slots: int, **extra: str) -> dict:
    """A faked PBS job whose node file lists the harness's hosts (``slots`` lines each)."""
    nodefile = tmp_path / "pbs_nodefile"
    nodefile.write_text("".join(f"{h.addr}\n" * slots for h in cluster.hosts))
    env = cluster.env(
        PBS_NODEFILE=str(nodefile),
        PBS_JOBID="4242.pbs1",
        TMPDIR=str(tmp_path),
        MASTER_PORT=str(cluster.free_port()),
        PYTHONUNBUFFERED="1",
        **extra,
    )
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "DSTRAIN_CPU_RANKS"):
        env.pop(var, None)
    return env


def test_launch_sh_in_a_pbs_job_on_two_hosts(cluster, fake_fmnist, tmp_path, two_local_ranks):
    """launch.sh reads the node file, writes the hostfile and the env file (--iface eth0 becomes
    GLOO_SOCKET_IFNAME on every rank), starts pdsh; the same weights as 2 local ranks."""
    run_dir = tmp_path / "pbs"
    env = pbs_job(cluster, tmp_path, slots=1, DSTRAIN_PROBE="from-the-job")
    cmd = [str(REPO / "launch.sh"), "--iface", "eth0", *trainer_args(fake_fmnist, run_dir)]
    proc = run(cmd, env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "launch.sh: 2 nodes" in proc.stdout and "--launcher pdsh" in proc.stdout
    records = rank_records(run_dir)
    assert [r["host"] for r in records] == ["dsnode0", "dsnode1"]
    for r in records:
        assert r["env"]["GLOO_SOCKET_IFNAME"] == "eth0"
        assert r["env"]["DSTRAIN_PROBE"] == "from-the-job"
        assert r["env"]["DSTRAIN_RUN_DIR_FILE"]  # launch.sh's pointer: how it finds the run
    assert same_weights(run_dir, two_local_ranks[0])


def test_a_2x2_torus_over_four_ranks_on_two_hosts(cluster, fake_fmnist, tmp_path):
    """Rows of the 2D-Torus within a host, columns across hosts: the same weights as 4 local ranks."""
    run_dir = tmp_path / "torus"
    env = pbs_job(cluster, tmp_path, slots=2)
    # one epoch: the weights must be equal bit for bit after any number of steps
    extra = ["--deepspeed_config", "ds_configs/comm_torus2d.json", "epochs=1"]
    cmd = [str(REPO / "launch.sh"), "--iface", "eth0", *trainer_args(fake_fmnist, run_dir), *extra]
    proc = run(cmd, env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "gradient sync: torus2d 2x2" in proc.stdout, proc.stdout[-3000:]
    assert [r["host"] for r in rank_records(run_dir)] == ["dsnode0"] * 2 + ["dsnode1"] * 2
    local = tmp_path / "local"
    local_run(fake_fmnist, local, 4, *extra)
    assert same_weights(run_dir, local)


def launch_and_fail(env: dict, args: list[str], at: str, fault, timeout: int = 300):
    """launch.sh --iface eth0 with ``args``; ``fault()`` once a line contains ``at``. Returns the
    job's exit status, its whole output and the seconds from the fault to the job's end."""
    job = subprocess.Popen(
        [str(REPO / "launch.sh"), "--iface", "eth0", *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    seen = []
    try:
        for line in job.stdout:
            seen.append(line)
            if at in line:
                break
        t0 = time.monotonic()
        fault()
        out, _ = job.communicate(timeout=timeout)
        return job.returncode, "".join(seen) + out, time.monotonic() - t0
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()


def lost_host_report(text: str, timeout_s: float) -> tuple[str, list[str]]:
    """Rank 0's one line on losing rank 1 (pdsh prefixes each remote line with its host), checked
    to name rank 1 on dsnode1 and the timeout setting, and launch.sh's report lines."""
    said = [line.split(": ", 1)[1] for line in text.splitlines() if ": dstrain[rank 0]: " in line]
    assert len(said) == 1 and "lost contact with another rank: rank 1 (" in said[0], text[-4000:]
    assert "on dsnode1)" in said[0] and f"fault.collective_timeout_s={timeout_s:g}" in said[0]
    report = error_lines(text) + [line for line in text.splitlines() if line.startswith("  rank ")]
    assert "launch.sh: the job failed" in "\n".join(report)
    return said[0], report


def test_a_cut_link_ends_the_job_naming_the_rank_host_and_network(cluster, fake_fmnist, tmp_path):
    """Mid-epoch, host 1 loses its cable: the rank on host 0 exits 4 within
    fault.collective_timeout_s naming rank 1 on dsnode1, launch.sh reports it and names the
    network, the last checkpoint stays complete. (Host 1's processes killed instead:
    test_resume_on_the_remaining_host_with_fewer_ranks.)"""
    timeout_s = 20
    run_dir = tmp_path / "lost"
    env = pbs_job(cluster, tmp_path, slots=1)
    args = trainer_args(
        fake_fmnist, run_dir, "epochs=20", f"fault.collective_timeout_s={timeout_s}"
    )
    code, text, seconds = launch_and_fail(
        env, args, "epoch 2/20 step 4/16", lambda: cluster.cut_link(1)
    )
    assert code == 4, text[-4000:]
    said, _ = lost_host_report(text, timeout_s)
    # rank 1 times out too, and may say so before rank 0 reads the records
    assert "no final record" in said or "lost contact too and none crashed" in said
    # both sides of the cut timed out and said so (the file system is shared): the network
    assert "launch.sh: every rank stopped because it lost contact with the others" in text
    assert "the network between dsnode0, dsnode1 failed" in text
    assert seconds < timeout_s + 120, seconds
    ckpt = run_dir / "checkpoints"
    latest = (ckpt / "latest").read_text().strip()
    assert latest == "epoch0001" and (ckpt / latest / "mp_rank_00_model_states.pt").is_file()
    assert rank_records(run_dir)[0]["state"] == "lost_peer"


def test_resume_on_the_remaining_host_with_fewer_ranks(
    cluster, fake_fmnist, tmp_path, two_local_ranks
):
    """Host 1 lost in epoch 2 of 3 (its processes killed): the rank on host 0 exits 4 naming rank 1
    on dsnode1, launch.sh blames rank 1 (no final record), the last checkpoint stays complete. Then
    resume=auto on host 0 alone (1 rank, ZeRO 0, the same global batch of 32 as 16 micro x 2
    accumulation: the same micro batches the 2 ranks had) continues from epoch0001 and ends on the
    parameters of an uninterrupted 2-rank run, bit for bit."""
    timeout_s = 20
    run_dir = tmp_path / "shrunk"
    env = pbs_job(cluster, tmp_path, slots=1)
    args = trainer_args(fake_fmnist, run_dir, f"fault.collective_timeout_s={timeout_s}")
    code, text, seconds = launch_and_fail(
        env, args, "epoch 2/3 step 4/16", lambda: cluster.kill_host(1)
    )
    assert code == 4, text[-4000:]
    said, report = lost_host_report(text, timeout_s)
    assert "no final record" in said
    assert any(  # rank 1 wrote nothing more: it is blamed
        line.startswith("  rank 1 (pid")
        and "on dsnode1): no final record" in line
        and line.endswith("<- failed first")
        for line in report
    ), report
    assert seconds < timeout_s + 120, seconds
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "epoch0001"
    assert rank_records(run_dir)[0]["state"] == "lost_peer"
    # the job again, on the host that is left: its node file lists host 0 only (launch.sh: one
    # node, local ranks), run there over ssh (a login shell's environment: one thread per rank
    # given again, as the 2-rank run it is compared with bit for bit had)
    h0 = cluster.hosts[0]
    (tmp_path / "left").write_text(f"{h0.addr}\n")
    args = trainer_args(fake_fmnist, run_dir, f"fault.collective_timeout_s={timeout_s}")
    args += ["resume=auto", "batch.micro_per_rank=16"]
    remote = (
        f"cd {REPO} && PBS_NODEFILE={tmp_path / 'left'} PBS_JOBID=4243.pbs1 TMPDIR={tmp_path} "
        f"DSTRAIN_CPU_RANKS=1 OMP_NUM_THREADS=1 ./launch.sh " + " ".join(args)
    )
    proc = cluster.ssh(h0, remote, check=False, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "resum" in proc.stdout + proc.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 1 and summary["epochs"] == 3
    local, reference = two_local_ranks
    # exact: every parameter (and so the momentum that made it). Not exact: BN's running
    # estimates, which on 2 ranks are rank 0's own (its 16 images a step, the file holds rank 0's)
    # and on 1 rank see both micro batches; evaluation uses them, so top-1 is close, not equal
    assert same_weights(run_dir, local, parameters_only=True)
    assert not same_weights(run_dir, local)
    assert abs(summary["final_top1"] - reference["final_top1"]) < 0.05


@pytest.mark.skipif(
    __import__("shutil").which("mpirun") is None,
    reason="needs mpirun (apt-get install openmpi-bin)",
)
def test_the_abci_job_script_on_two_hosts_through_openmpi(cluster, tmp_path):
    """hostfiles/abci_job.sh as PBS would start it (environment modules faked), with its own
    launcher, OpenMPI's mpirun over ssh: each host runs a rank of a (shrunk) LARS bf16 run. Found
    here: DeepSpeed's openmpi path needs mpi4py to find ranks and rendezvous, so launch.sh exports
    MASTER_ADDR/MASTER_PORT and the trainer reads OpenMPI's rank variables."""
    modules = tmp_path / "modules.sh"
    modules.write_text('module() { echo "module $*" >&2; }\n')
    run_dir = tmp_path / "abci"
    env = pbs_job(
        cluster,
        tmp_path,
        slots=1,
        PBS_O_WORKDIR=str(REPO),
        DSTRAIN_IFACE="eth0",
        IMAGENET_ROOT=str(tmp_path / "not-read-with-synthetic-data"),
        DSTRAIN_MODULES_SH=str(modules),
        OMPI_ALLOW_RUN_AS_ROOT="1",  # this machine's tests run as root; a cluster user is not
        OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
    )
    shrink = [
        "data.loader=synthetic",
        "data.synthetic_train_size=64",
        "data.synthetic_val_size=16",
        "model.name=resnet18",
        "model.channels_last=false",
        "data.image_size=32",
        "data.val_resize=32",
        "batch.global_size=16",
        "batch.micro_per_rank=8",
        "batch.ramp=[]",
        "batch.eval_per_rank=8",
        "epochs=2",
        "optim.warmup_epochs=0",
        f"run_dir={run_dir}",
    ]
    proc = run(["bash", "hostfiles/abci_job.sh", *shrink], env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "module load hpcx" in proc.stderr and "--launcher openmpi" in proc.stdout
    records = rank_records(run_dir)
    assert [(r["rank"], r["host"], r["state"]) for r in records] == [
        (0, "dsnode0", "done"),
        (1, "dsnode1", "done"),
    ]
    assert all(r["env"]["GLOO_SOCKET_IFNAME"] == "eth0" for r in records)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["epochs"] == 2
