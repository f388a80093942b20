"""launch.sh / dstrain/run/launch.py: hostfiles from fake scheduler environments and dry-run command lines."""

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dstrain.run.launch import LaunchError, expand_slurm, hostfile_text, scheduler_nodes
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
    # a host with slots in two queues: one row per queue, one host with their sum
    pe.write_text(
        "g0001 2 gpu.q@g0001 UNDEFINED\ng0002 4 gpu.q@g0002 UNDEFINED\n"
        "g0001 2 long.q@g0001 UNDEFINED\n"
    )
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


def system_bin_without_launchers() -> Path:
    """/usr/bin and /bin as links in one folder, less pdsh and mpirun: the tests choose which
    multi-node launcher is "installed" (the multi-host tests install the real pdsh)."""
    import tempfile

    folder = Path(tempfile.gettempdir()) / f"dstrain-test-bin-{os.getuid()}"
    if not (folder / ".done").exists():
        folder.mkdir(exist_ok=True)
        for system in ("/bin", "/usr/bin"):
            for tool in Path(system).iterdir():
                link = folder / tool.name
                if tool.name not in ("pdsh", "mpirun") and not link.exists():
                    link.symlink_to(tool)
        (folder / ".done").touch()
    return folder


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
    base["PATH"] = os.pathsep.join([*map(str, path_dirs), str(system_bin_without_launchers())])
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
        f"NCCL_SOCKET_IFNAME=ib0 GLOO_SOCKET_IFNAME=ib0 DS_ENV_FILE={tmp_path / 'hf'}.env "
        "MASTER_ADDR=hnode001 MASTER_PORT=29600 "
        f"{REPO}/.venv/bin/deepspeed --hostfile {tmp_path / 'hf'} --master_addr hnode001 "
        "--master_port 29600 --launcher openmpi --launcher_args '--mca btl_tcp_if_include ib0' "
        "dstrain/main.py --config fashion_mnist epochs=2"
    ) in proc.stdout
    assert not (tmp_path / "hf").exists()  # a dry run writes nothing
    assert not (tmp_path / "hf.env").exists()


def test_the_env_file_carries_what_remote_ranks_need():
    """DeepSpeed's runner exports PYTHON*, UCX*, MV2*, MLFLOW* (and NCCL* on CUDA) by itself."""
    from dstrain.run.launch import LaunchError, env_file_text

    env = {
        "DSTRAIN_CPU_RANKS": "1",
        "GLOO_SOCKET_IFNAME": "eth0",
        "NCCL_IB_HCA": "mlx5",
        "OMP_NUM_THREADS": "4",
        "HOME": "/root",
        "DS_ENV_FILE": "/tmp/x.env",
        "PATH": "/usr/bin",
    }
    assert env_file_text(env) == (
        "DSTRAIN_CPU_RANKS=1\nGLOO_SOCKET_IFNAME=eth0\nNCCL_IB_HCA=mlx5\nOMP_NUM_THREADS=4\n"
    )
    with pytest.raises(LaunchError, match="DSTRAIN_X holds a newline"):
        env_file_text({"DSTRAIN_X": "a\nb"})


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
def test_shell_scripts_parse_and_stop_on_errors(script):
    """Syntax (``bash -n``) and strict mode: a failing command, an unset variable or a failing
    pipeline stage ends the script instead of running on (what each script is for is tested by
    running it: the launch, dry-run, ABCI and run.sh tests)."""
    text = (REPO / script).read_text()
    proc = subprocess.run(["bash", "-n", str(REPO / script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    head = [line for line in text.splitlines() if line and not line.startswith("#")][:3]
    assert "set -euo pipefail" in head, (
        f"{script}: no `set -euo pipefail` before its first commands"
    )


def test_ci_runs_the_readme_test_command_and_run_sh_documents_its_commands():
    """CI must call README's test command; run.sh's header lists exactly the commands it handles."""
    readme = (REPO / "README.md").read_text().split("## Tests", 1)[1]
    block = re.search(r"```bash\n(.*?)```", readme, re.S)[1]
    readme_cmds = [line.split("#")[0].strip() for line in block.splitlines()]
    ci = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()]
    assert "./run.sh test" in readme_cmds
    assert any(line.startswith("./run.sh test ") or line == "./run.sh test" for line in ci), ci
    assert any(line.startswith("./run.sh test-oldest") for line in ci), ci
    run_sh = (REPO / "run.sh").read_text()
    handled = set(re.findall(r"^    ([a-z-]+)\)", run_sh, re.M))
    header = run_sh.split("set -euo pipefail", 1)[0]
    documented = set(re.findall(r"^#   \./run\.sh ([a-z-]+)", header, re.M))
    assert handled == documented, (sorted(handled - documented), sorted(documented - handled))


def test_the_abci_job_script_runs_under_a_faked_pbs_job(tmp_path):
    """hostfiles/abci_job.sh for real (not only `bash -n`, which passed while its unquoted
    `data.root=/groups/<group>/imagenet` was a shell redirection): 4 nodes x 8 MPI processes in the
    PBS node file, environment modules faked, launch.sh in dry-run mode: the script reaches
    launch.sh, which writes 4 nodes of 8 slots and the openmpi command over the InfiniBand
    interface."""
    nodes = tmp_path / "nodefile"
    nodes.write_text("".join(f"a{n:04d}\n" for n in range(4) for _ in range(8)))
    modules = tmp_path / "modules.sh"
    modules.write_text('module() { echo "module $*" >&2; }\n')
    env = {
        "PATH": os.pathsep.join([str(fake_tool(tmp_path, "mpirun")), "/usr/bin", "/bin"]),
        "HOME": str(tmp_path),
        "PBS_NODEFILE": str(nodes),
        "PBS_O_WORKDIR": str(REPO),
        "DSTRAIN_IFACE": "ib0",
        "IMAGENET_ROOT": "/groups/gx00/imagenet",
        "DSTRAIN_DRY_RUN": "1",
        "DSTRAIN_MODULES_SH": str(modules),
        "DSTRAIN_VENV": os.environ.get("DSTRAIN_VENV", str(Path(sys.executable).parent.parent)),
        "TMPDIR": str(tmp_path),
    }
    proc = subprocess.run(
        ["bash", str(REPO / "hostfiles/abci_job.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "module load hpcx" in proc.stderr
    out = proc.stdout
    assert "launch.sh: 4 nodes" in out
    assert all(f"a{n:04d} slots=8" in out for n in range(4))
    command = out.strip().splitlines()[-1]
    for part in (
        "--hostfile",
        "--launcher openmpi",
        "--mca btl_tcp_if_include ib0",
        "--master_addr a0000",
        "dstrain/main.py --deepspeed_config ds_configs/lars_bf16.json --config imagenet_resnet50_lars",
        "data.root=/groups/gx00/imagenet run_dir=runs/rn50-lars-32k resume=auto",
    ):
        assert part in command, (part, command)


def run_sh(*args, timeout=300):
    venv = Path(sys.executable).parent.parent
    return subprocess.run(
        [str(REPO / "run.sh"), *args],
        cwd=REPO,
        env={**os.environ, "DSTRAIN_VENV": str(venv)},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.slow  # over ~5 s on 2 cores: the full suite only (issue 42: quick loop < 3 min)
def test_run_sh_trains_for_real_and_refuses_an_unknown_command(fake_fmnist, tmp_path):
    """./run.sh as the README shows it (the venv it made is reused: no install here)."""
    venv = Path(sys.executable).parent.parent
    stamp = venv / ".dstrain-requirements"
    want = hashlib.sha256((REPO / "requirements.txt").read_bytes()).hexdigest()
    if not stamp.is_file() or stamp.read_text().strip() != want:
        pytest.skip(f"{venv} was not made by ./run.sh from this requirements.txt")
    run_dir = tmp_path / "run"
    proc = run_sh(
        "train",
        "--config",
        "fashion_mnist",
        "epochs=1",
        "model.width=8",
        "batch.global_size=64",
        "log.tensorboard=false",
        f"data.root={fake_fmnist}",
        f"run_dir={run_dir}",
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # run.sh's own messages on stderr, the command's output alone on stdout
    assert "[run.sh] virtual environment" in proc.stderr and "is up to date" in proc.stderr
    assert "[run.sh]" not in proc.stdout
    assert json.loads((run_dir / "summary.json").read_text())["epochs"] == 1
    bad = run_sh("trian")
    assert bad.returncode == 2 and "./run.sh train" in bad.stderr and not bad.stdout
    # as docs/mlperf.md has it: ./run.sh mlperf-package --template > my_system.json
    template = run_sh("mlperf-package", "--template")
    assert template.returncode == 0 and "division" in json.loads(template.stdout), template.stdout


@pytest.mark.parametrize(
    "args",
    [["setup"], ["setup", "--oldest"], ["test-oldest"]],
    ids=["setup", "setup --oldest", "test-oldest"],
)
def test_run_sh_setup_refuses_a_disk_too_full_for_the_install_before_writing_anything(
    tmp_path, args
):
    """A full disk stopped CI's pip half-way with Errno 28 (stop 86): setup now checks first and says
    which folder is short, by how much, and what to point elsewhere; it makes no venv. With
    --oldest (CI: both venvs side by side) one check covers the two, before either starts; test-oldest
    alone names its own venv's variable."""
    venv = tmp_path / "new" / "venv"
    oldest = tmp_path / "new" / "venv-oldest"
    proc = subprocess.run(
        [str(REPO / "run.sh"), *args],
        cwd=REPO,
        env={
            **os.environ,
            "DSTRAIN_VENV": str(venv),
            "DSTRAIN_OLDEST_VENV": str(oldest),
            "DSTRAIN_SETUP_NEED_GB": "100000000",
        },
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1, proc.stderr
    assert "setup needs about 100000000 GB free for " in proc.stderr, proc.stderr
    whose = {"setup": venv, "setup --oldest": f"{venv}, {oldest}", "test-oldest": oldest}
    assert f"free for {whose[' '.join(args)]} and pip's" in proc.stderr  # both venvs: both named
    assert str(tmp_path) in proc.stderr  # the nearest existing folder, whose disk was measured
    assert ("DSTRAIN_OLDEST_VENV" in proc.stderr) == (args != ["setup"])
    assert ("DSTRAIN_VENV " in proc.stderr) == (args != ["test-oldest"])
    assert "TMPDIR" in proc.stderr and not proc.stdout
    assert not venv.parent.exists()


def test_run_sh_setup_oldest_checks_each_venvs_own_disk(tmp_path):
    """``setup --oldest`` with test-oldest's venv on another disk (DSTRAIN_OLDEST_VENV) checks that
    disk for its venv: a need the venv's disk has and the other lacks is refused, naming the other
    disk's folder and the variable that moves it, and neither venv is made."""
    shm = Path("/dev/shm")
    if not shm.is_dir() or shm.stat().st_dev == tmp_path.stat().st_dev:
        pytest.skip("needs /dev/shm on a disk of its own")
    gib = 1024**3
    need = shutil.disk_usage(shm).free // gib + 1  # more than /dev/shm has
    if (
        shutil.disk_usage(tmp_path).free // gib <= need
        or shutil.disk_usage("/tmp").free // gib <= need
    ):
        pytest.skip("needs more free disk beside the venv and in /tmp than in /dev/shm")
    venv, oldest = tmp_path / "new" / "venv", shm / f"dstrain-test-{os.getpid()}" / "venv-oldest"
    proc = subprocess.run(
        [str(REPO / "run.sh"), "setup", "--oldest"],
        cwd=REPO,
        env={
            **os.environ,
            "DSTRAIN_VENV": str(venv),
            "DSTRAIN_OLDEST_VENV": str(oldest),
            "DSTRAIN_SETUP_NEED_GB": str(need),
            "TMPDIR": "/tmp",
            "PYTHON": "false",  # a check that let it through fails at once instead of installing
        },
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1, proc.stderr
    assert f"setup needs about {need} GB free for {oldest} and" in proc.stderr, proc.stderr
    assert "and /dev/shm has" in proc.stderr and "DSTRAIN_OLDEST_VENV" in proc.stderr
    assert not venv.parent.exists() and not oldest.parent.exists()


FAKE_DEEPSPEED = """#!/bin/sh
# records what the launcher handed DeepSpeed: the hostfile's and env file's modes and the hostfile
while [ $# -gt 0 ]; do [ "$1" = "--hostfile" ] && hostfile=$2; shift; done
{
  stat -c '%a %F' "$hostfile" "$DS_ENV_FILE" "$(dirname "$hostfile")"
  cat "$hostfile"
} > "$RECORD"
exit 0
"""


def _launch_for_real(tmp_path, *args: str) -> tuple[subprocess.CompletedProcess, str]:
    """launch.sh without --dry-run in a 2-node PBS job, DeepSpeed replaced by FAKE_DEEPSPEED."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (venv / "bin" / "python").chmod(0o755)
    (venv / "bin" / "deepspeed").write_text(FAKE_DEEPSPEED)
    (venv / "bin" / "deepspeed").chmod(0o755)
    nodes = tmp_path / "nodes"
    nodes.write_text("hnode001\nhnode002\n")
    shared = tmp_path / "shared-tmp"
    shared.mkdir(exist_ok=True)
    env = {
        **{k: v for k, v in os.environ.items() if k not in ("SLURM_JOB_NODELIST", "PE_HOSTFILE")},
        "PBS_NODEFILE": str(nodes),
        "DSTRAIN_VENV": str(venv),
        "TMPDIR": str(shared),
        "RECORD": str(tmp_path / "record"),
        "PATH": os.pathsep.join([str(fake_tool(tmp_path, "pdsh")), os.environ["PATH"]]),
    }
    proc = subprocess.run(
        [str(REPO / "launch.sh"), *args, "--config", "fashion_mnist"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return proc, (tmp_path / "record").read_text() if (tmp_path / "record").is_file() else ""


def test_the_hostfile_and_env_file_are_private_and_gone_after_the_job(tmp_path):
    """Issue 51: no predictable name in a shared $TMPDIR: a folder of its own (mkdtemp, 0700), files
    only its owner reads (0600), all removed when the job ends."""
    proc, record = _launch_for_real(tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    modes = record.splitlines()[:3]
    assert modes == ["600 regular file", "600 regular file", "700 directory"], record
    assert "hnode001 slots=1\nhnode002 slots=1\n" in record
    assert "dstrain-launch." in proc.stdout  # where the hostfile was, in the job's log
    assert list((tmp_path / "shared-tmp").iterdir()) == []  # nothing left behind


def test_a_symbolic_link_planted_at_the_hostfile_path_is_not_followed(tmp_path):
    """--hostfile PATH in a shared folder where another user placed links to a file of ours: the
    files are created afresh and renamed over the links, never written through them."""
    victim = tmp_path / "victim"
    victim.write_text("mine\n")
    shared = tmp_path / "shared-tmp"
    shared.mkdir()
    (shared / "hf").symlink_to(victim)
    (shared / "hf.env").symlink_to(victim)
    proc, record = _launch_for_real(tmp_path, "--hostfile", str(shared / "hf"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert record.splitlines()[:2] == ["600 regular file", "600 regular file"], record
    assert victim.read_text() == "mine\n"  # untouched
    assert not (shared / "hf").exists() and not (shared / "hf.env").exists()  # removed at the end


def test_write_private_replaces_a_link_and_leaves_its_target(tmp_path):
    from dstrain.core.files import write_private

    target = tmp_path / "target"
    target.write_text("keep\n")
    link = tmp_path / "file"
    link.symlink_to(target)
    write_private(link, "new\n")
    assert not link.is_symlink() and link.read_text() == "new\n"
    assert (link.stat().st_mode & 0o777) == 0o600 and target.read_text() == "keep\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "target"]  # no temporary left


def test_drop_caches_flushes_each_node_or_says_where_it_could_not(monkeypatch, capsys):
    """--drop-caches (MLPerf's cache rule): the ranks hear DSTRAIN_CACHE_CLEARED=1 only when the
    flush worked on every node; otherwise one line names the node and why, and the run goes on."""
    from dstrain.run import launch

    calls = []

    def fake_run(cmd, **kw):
        calls.append(cmd)
        ok = "refuses" not in " ".join(cmd)
        return subprocess.CompletedProcess(
            cmd, 0 if ok else 1, "", "" if ok else "permission denied"
        )

    monkeypatch.setattr(launch.subprocess, "run", fake_run)
    assert launch.drop_caches([]) == []
    assert calls[-1][:2] == ["bash", "-c"] and "vm.drop_caches=3" in calls[-1][2]
    monkeypatch.setattr(launch, "DROP_CACHES", "sync && refuses")
    assert launch.drop_caches(["n1", "n2"]) == ["n1 (permission denied)", "n2 (permission denied)"]
    assert calls[-1][:4] == ["ssh", "-o", "BatchMode=yes", "n2"]
    seen = {}
    monkeypatch.setattr(launch, "supervise", lambda cmd, env: seen.update(env) or 0)
    monkeypatch.setattr(launch.Path, "exists", lambda self: True)
    # a 1 inherited from the shell or a re-submitted job script does not pass: only this job's flush
    monkeypatch.setenv("DSTRAIN_CACHE_CLEARED", "1")
    for script, flag, cleared in (
        ("sync", "--drop-caches", "1"),
        ("sync && refuses", "--drop-caches", "0"),
        ("sync", "--config", "0"),  # not asked to flush
    ):
        monkeypatch.setattr(launch, "DROP_CACHES", script)
        seen.clear()
        assert launch.main([flag, "--config", "fashion_mnist"][flag == "--config" :]) == 0
        assert seen["DSTRAIN_CACHE_CLEARED"] == cleared, (script, flag)
    assert (
        "could not flush the page cache on this node (permission denied)" in capsys.readouterr().err
    )


def test_the_dstrain_command_runs_a_recipe_from_another_folder(tmp_path, fake_fmnist):
    """./run.sh setup installs the checkout (pip install -e .): the ``dstrain`` command pyproject
    declares is in the venv, and from any folder a recipe finds the DeepSpeed JSON it names
    relative to the checkout (ds_configs/fp32.json)."""
    exe = Path(sys.executable).parent / "dstrain"
    assert exe.is_file(), f"{exe} missing: ./run.sh setup installs it (pip install -e .)"
    proc = subprocess.run(
        [str(exe), "--config", "fashion_mnist", "--check", f"data.root={fake_fmnist}"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert str(REPO / "ds_configs" / "fp32.json") in proc.stdout
    assert not list(tmp_path.iterdir())  # --check wrote nothing
