"""Cluster launch: scheduler node list -> DeepSpeed hostfile -> the ``deepspeed`` command (used by launch.sh).

    ./launch.sh [--dry-run] [--launcher auto|pdsh|openmpi] [--iface IFACE] [--gpus-per-node N] TRAINER ARGS...

Node lists, first found wins:
  PBS (ABCI 3.0)   $PBS_NODEFILE: one line per MPI process slot (``select=N:mpiprocs=8``);
                   a host listed k times gets k slots
  Slurm            $SLURM_JOB_NODELIST: ``node[01-04,07],gpu5``; slots = $SLURM_NTASKS_PER_NODE or GPUs
  UGE (ABCI 2.0)   $PE_HOSTFILE (``host slots queue processors`` lines) or $SGE_JOB_HOSTLIST (one host per line)
``--gpus-per-node`` (or $GPUS_PER_NODE) overrides the slot counts. One node, or no
scheduler: ``deepspeed --num_gpus N`` on this machine, N = visible GPUs, or 1 CPU rank
without a GPU; $DSTRAIN_CPU_RANKS=N asks for N CPU ranks whatever GPUs there are (GPUs
hidden from the ranks: CUDA_VISIBLE_DEVICES='' and DS_ACCELERATOR=cpu, so gloo on CPU;
how tests run more ranks than a node has GPUs). Several nodes: a hostfile,
the first node as rendezvous (``--master_addr``), and a multi-node launcher: pdsh
when installed, else OpenMPI's mpirun. ``--iface`` names the network interface
for rendezvous and NCCL's bootstrap (NCCL_SOCKET_IFNAME, exported by DeepSpeed's
launchers; for OpenMPI also ``--mca btl_tcp_if_include``, which DeepSpeed
otherwise sets to eth0) and gloo's (GLOO_SOCKET_IFNAME). On several nodes the variables remote
ranks need (DSTRAIN_*, GLOO_*, NCCL_*, TORCH_*, OMP_NUM_THREADS, DS_ACCELERATOR) go to
DeepSpeed's env file (``DS_ENV_FILE``, written next to the hostfile): DeepSpeed's runner exports
only a few prefixes on its own.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections import OrderedDict
from pathlib import Path

from dstrain.core.errors import ConfigError
from dstrain.core.files import RUN_DIR_FILE_ENV, write_private
from dstrain.run import hostfile

REPO = Path(__file__).resolve().parents[2]


class LaunchError(Exception):
    """A problem with the job environment; the message says what to fix."""


def expand_slurm(nodelist: str) -> list[str]:
    """``a[01-03,07],b5`` -> [a01, a02, a03, a07, b5] (what ``scontrol show hostnames`` prints)."""
    hosts = []
    for match in re.finditer(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist):
        prefix, ranges = match.group(1), match.group(2)
        if not ranges:
            hosts.append(prefix)
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            width = len(lo)
            for i in range(int(lo), int(hi or lo) + 1):
                hosts.append(f"{prefix}{i:0{width}d}")
    return hosts


def _read_lines(path: str, var: str) -> list[str]:
    try:
        lines = [line.strip() for line in Path(path).read_text().splitlines() if line.strip()]
    except OSError as err:
        raise LaunchError(f"${var}={path}: cannot read the node list ({err.strerror})") from None
    if not lines:
        raise LaunchError(
            f"${var}={path}: the node list is empty; is this a multi-node job allocation?"
        )
    return lines


def _slots_by_repeats(hosts: list[str]) -> list[tuple[str, int]]:
    """A host listed k times gets k slots; first-seen order."""
    counts = OrderedDict()
    for host in hosts:
        counts[host] = counts.get(host, 0) + 1
    return list(counts.items())


def scheduler_nodes(env: dict) -> tuple[str, list[tuple[str, int]]] | None:
    """(scheduler name, [(host, slots), ...] in order) from the job environment, or None outside a job."""
    if env.get("PBS_NODEFILE"):
        return "pbs", _slots_by_repeats(_read_lines(env["PBS_NODEFILE"], "PBS_NODEFILE"))
    if env.get("SLURM_JOB_NODELIST"):
        hosts = expand_slurm(env["SLURM_JOB_NODELIST"])
        if not hosts:
            raise LaunchError(f"$SLURM_JOB_NODELIST={env['SLURM_JOB_NODELIST']!r}: no hosts in it")
        tasks = re.match(r"\d+", env.get("SLURM_NTASKS_PER_NODE", ""))  # "8" or "8(x2)"
        per = int(tasks.group(0)) if tasks else 0
        return "slurm", [(h, per) for h in OrderedDict.fromkeys(hosts)]
    if env.get("PE_HOSTFILE"):
        rows = [line.split() for line in _read_lines(env["PE_HOSTFILE"], "PE_HOSTFILE")]
        # a host granted slots in two queues has a row per queue: one host, their slots summed
        # (DeepSpeed refuses a hostfile that lists a host twice)
        slots: dict[str, int] = OrderedDict()
        for r in rows:
            slots[r[0]] = slots.get(r[0], 0) + (int(r[1]) if len(r) > 1 and r[1].isdigit() else 0)
        return "uge", list(slots.items())
    if env.get("SGE_JOB_HOSTLIST"):
        lines = _read_lines(env["SGE_JOB_HOSTLIST"], "SGE_JOB_HOSTLIST")
        return "uge", _slots_by_repeats([line.split()[0] for line in lines])
    return None


# OpenMPI's names for what torch reads (DeepSpeed's openmpi launcher starts ranks with mpirun)
OMPI_ENV = {
    "RANK": "OMPI_COMM_WORLD_RANK",
    "WORLD_SIZE": "OMPI_COMM_WORLD_SIZE",
    "LOCAL_RANK": "OMPI_COMM_WORLD_LOCAL_RANK",
    "LOCAL_WORLD_SIZE": "OMPI_COMM_WORLD_LOCAL_SIZE",
}


def adopt_mpi_env() -> None:
    """Under mpirun with the rendezvous given (MASTER_ADDR/MASTER_PORT; launch.sh exports them),
    OpenMPI's rank variables become torch's, before anything reads RANK (the log's rank filter):
    DeepSpeed would otherwise discover them through mpi4py, which is not installed."""
    if "OMPI_COMM_WORLD_RANK" not in os.environ or "RANK" in os.environ:
        return
    if {"MASTER_ADDR", "MASTER_PORT"} <= set(os.environ):
        os.environ.update({k: os.environ[v] for k, v in OMPI_ENV.items() if v in os.environ})


def hostfile_text(nodes: list[tuple[str, int]], gpus_per_node: int | None) -> str:
    lines = []
    for host, slots in nodes:
        slots = gpus_per_node or slots
        if slots < 1:
            raise LaunchError(f"no slot count for {host}: set GPUS_PER_NODE (or --gpus-per-node)")
        lines.append(f"{host} slots={slots}")
    return "\n".join(lines) + "\n"


def local_gpus() -> int:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip()])
    try:
        out = subprocess.run(
            ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def pick_launcher(choice: str) -> str:
    if choice != "auto":
        if shutil.which("pdsh" if choice == "pdsh" else "mpirun") is None:
            raise LaunchError(
                f"--launcher {choice}: {'pdsh' if choice == 'pdsh' else 'mpirun'} is not on PATH"
            )
        return choice
    if shutil.which("pdsh"):
        return "pdsh"
    if shutil.which("mpirun"):
        return "openmpi"
    raise LaunchError(
        "several nodes but neither pdsh nor mpirun is on PATH: load an MPI module "
        "(ABCI: `module load hpcx`) or install pdsh"
    )


def build(
    args: argparse.Namespace, env: dict, deepspeed: str
) -> tuple[list[str], str | None, dict]:
    """(command, hostfile text or None, extra environment)."""
    gpus = args.gpus_per_node or int(env.get("GPUS_PER_NODE", "0") or 0) or None
    port = env.get("MASTER_PORT", "29500")
    extra_env = (
        {"NCCL_SOCKET_IFNAME": args.iface, "GLOO_SOCKET_IFNAME": args.iface} if args.iface else {}
    )
    found = scheduler_nodes(env)
    trainer = ["dstrain/main.py", *args.trainer_args]
    if found is None or len(found[1]) == 1:
        cpu_ranks = env.get("DSTRAIN_CPU_RANKS", "").strip()
        if cpu_ranks:  # asked for: CPU ranks even on a GPU node
            if not cpu_ranks.isdigit() or int(cpu_ranks) < 1:
                raise LaunchError(
                    f"$DSTRAIN_CPU_RANKS={cpu_ranks!r}: expected a number of ranks >= 1"
                )
            extra_env.update(CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu")
            trainer_cmd = [deepspeed, "--num_gpus", cpu_ranks, "--master_port", port, *trainer]
            return trainer_cmd, None, extra_env
        n = gpus or (found[1][0][1] if found and found[1][0][1] else 0) or local_gpus() or 1
        return [deepspeed, "--num_gpus", str(n), "--master_port", port, *trainer], None, extra_env
    scheduler, nodes = found
    text = hostfile_text(nodes, gpus)
    try:  # what DeepSpeed will read, by the rules of `python -m dstrain --check --hostfile`
        read = [f"{host.name} slots={host.slots}" for host in hostfile.parse(text, args.hostfile)]
    except ConfigError as err:
        raise LaunchError(f"the {scheduler} node list made a bad hostfile: {err}") from None
    misread = [line for line in text.splitlines() if line.strip() not in read]  # a host with a #
    if misread:
        raise LaunchError(
            f"the {scheduler} node list made the hostfile line {misread[0]!r}, which DeepSpeed "
            "would not read as written"
        )
    launcher = pick_launcher(args.launcher)
    cmd = [
        deepspeed,
        "--hostfile",
        args.hostfile,
        "--master_addr",
        nodes[0][0],
        "--master_port",
        port,
        "--launcher",
        launcher,
    ]
    if launcher == "openmpi" and args.iface:
        cmd += ["--launcher_args", f"--mca btl_tcp_if_include {args.iface}"]
    # DeepSpeed exports to remote ranks only variables named PYTHON*, UCX*, MV2*, MLFLOW* (NCCL* on
    # CUDA) and those in its env file: the rest (DSTRAIN_*, GLOO_SOCKET_IFNAME, OMP_NUM_THREADS, ...)
    # would be missing there; launch.sh writes them to an env file next to the hostfile
    extra_env["DS_ENV_FILE"] = str(Path(args.hostfile).absolute()) + ".env"
    # mpirun starts the ranks without a rendezvous address (DeepSpeed would look for mpi4py)
    extra_env.update(MASTER_ADDR=nodes[0][0], MASTER_PORT=port)
    return cmd + trainer, text, extra_env


EXPORTED = (
    "DSTRAIN_",
    "GLOO_",
    "NCCL_",
    "TORCH_",
    "OMP_NUM_THREADS",
    "DS_ACCELERATOR",
    "MASTER_ADDR",
    "MASTER_PORT",
)


def env_file_text(env: dict) -> str:
    """KEY=value lines for DeepSpeed's env file (``DS_ENV_FILE``): what remote ranks must see."""
    keep = {k: v for k, v in env.items() if k.startswith(EXPORTED) and k != "DS_ENV_FILE"}
    for key, value in keep.items():
        if "\n" in value:
            raise LaunchError(f"${key} holds a newline; DeepSpeed's env file cannot carry it")
    return "".join(f"{k}={v}\n" for k, v in sorted(keep.items()))


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="launch.sh", description=__doc__.split("\n\n")[0], add_help=True
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        default=os.environ.get("DSTRAIN_DRY_RUN") == "1",
        help="print the hostfile and the command, run nothing (also DSTRAIN_DRY_RUN=1, e.g. to "
        "check a job script)",
    )
    p.add_argument("--launcher", choices=("auto", "pdsh", "openmpi"), default="auto")
    p.add_argument(
        "--iface", default=os.environ.get("DSTRAIN_IFACE", ""), help="network interface (e.g. ib0)"
    )
    p.add_argument(
        "--gpus-per-node", type=int, default=0, help="slots per node (default: from the scheduler)"
    )
    p.add_argument(
        "--drop-caches",
        action="store_true",
        help="flush the page cache on every node before the run (MLPerf's rule: 'You must flush the "
        "cache or restart the system prior to benchmarking'; root or passwordless sudo), and tell "
        "the ranks (DSTRAIN_CACHE_CLEARED=1: the MLPerf log's cache_clear is true only then)",
    )
    p.add_argument(
        "--hostfile",
        default="",
        help="where to write the hostfile, and the env file beside it (default: a private folder "
        "made in $TMPDIR for this job, removed at its end)",
    )
    args, rest = p.parse_known_args(argv)
    args.trainer_args = rest
    return args


# flush dirty pages, then drop the page cache, dentries and inodes (as NVIDIA's MLPerf run.sub does)
DROP_CACHES = "sync && { sysctl -q -w vm.drop_caches=3 || sudo -n sysctl -q -w vm.drop_caches=3; }"


def drop_caches(hosts: list[str]) -> list[str]:
    """Flush the page cache on ``hosts`` (empty: this node; others over ssh, as DeepSpeed's pdsh
    reaches them); the hosts where it failed, each with the reason."""
    failed = []
    for host in hosts or [""]:
        cmd = (
            ["ssh", "-o", "BatchMode=yes", host, DROP_CACHES]
            if host
            else ["bash", "-c", DROP_CACHES]
        )
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            why = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
            if proc.returncode:
                failed.append(f"{host or 'this node'} ({why})")
        except (OSError, subprocess.TimeoutExpired) as err:
            failed.append(f"{host or 'this node'} ({err})")
    return failed


def private_folder(dry_run: bool) -> Path:
    """This job's folder for the hostfile and DeepSpeed's env file: made in $TMPDIR by
    ``mkdtemp`` (a fresh name, mode 0700: nobody else can read, replace or plant anything in it).
    A dry run makes nothing and shows where it would be."""
    tmp = os.environ.get("TMPDIR") or "/tmp"
    if dry_run:
        return Path(tmp) / "dstrain-launch.XXXXXXXX"
    return Path(tempfile.mkdtemp(prefix="dstrain-launch.", dir=tmp))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    private = None if args.hostfile else private_folder(args.dry_run)
    try:
        return launch(args, private)
    finally:  # the hostfile and env file go with the job (their contents are in the job's log)
        if private is not None and not args.dry_run:
            shutil.rmtree(private, ignore_errors=True)


def launch(args: argparse.Namespace, private: Path | None) -> int:
    if private is not None:
        args.hostfile = str(private / "hostfile")
    venv = Path(os.environ.get("DSTRAIN_VENV", REPO / ".venv"))
    deepspeed = str(venv / "bin" / "deepspeed")
    try:
        cmd, hostfile, extra_env = build(args, dict(os.environ), deepspeed)
    except LaunchError as err:
        print(f"launch.sh: error: {err}", file=sys.stderr)
        return 2
    # the MLPerf log's cache_clear: what this job flushed, never a value the job inherited (an
    # exported shell, a re-submitted job script)
    if "DSTRAIN_CACHE_CLEARED" in os.environ:
        extra_env["DSTRAIN_CACHE_CLEARED"] = "0"
    if args.drop_caches and not args.dry_run:
        hosts = [line.split()[0] for line in (hostfile or "").splitlines() if line.strip()]
        failed = drop_caches(hosts)
        if failed:
            print(
                f"launch.sh: could not flush the page cache on {', '.join(failed)}: the run goes "
                "on, and an MLPerf log says cache_clear false (root or passwordless sudo needed)",
                file=sys.stderr,
            )
        else:
            extra_env["DSTRAIN_CACHE_CLEARED"] = "1"
            print(f"launch.sh: page cache flushed on {len(hosts) or 1} node(s)")
    env_text = " ".join(f"{k}={shlex.quote(v)}" for k, v in extra_env.items())
    if hostfile is not None:
        print(
            f"launch.sh: {hostfile.count(chr(10))} nodes, hostfile {args.hostfile}:\n{hostfile}",
            end="",
        )
    print(f"launch.sh: {(env_text + ' ') if env_text else ''}{shlex.join(cmd)}", flush=True)
    if args.dry_run:
        return 0
    if not Path(deepspeed).exists():
        print(f"launch.sh: error: {deepspeed} missing; run ./run.sh setup first", file=sys.stderr)
        return 2
    env = {**os.environ, **extra_env}
    if hostfile is not None:  # owner-only, never through a link planted in a shared folder
        write_private(Path(args.hostfile), hostfile)
        write_private(Path(env["DS_ENV_FILE"]), env_file_text(env))
    os.chdir(REPO)
    try:
        return supervise(cmd, env)
    finally:
        if hostfile is not None and private is None:  # a --hostfile path: its files go too
            for path in (Path(args.hostfile), Path(env["DS_ENV_FILE"])):
                path.unlink(missing_ok=True)


# ---------------------------------------------------------------- supervision
GRACE_S = 120  # after the launcher's child exits, how long its leftover ranks may take (a checkpoint write)


def supervise(cmd: list[str], env: dict) -> int:
    """Run the deepspeed command in its own process group, forward SIGTERM/SIGINT to all of it once, wait
    for every process of the group (the ranks may outlive DeepSpeed's runner while they checkpoint), then
    print how each rank ended (RUN_DIR/ranks/) and exit with the job's status: 75 when every rank stopped
    with a checkpoint, else the first failed rank's status."""
    import signal
    import time

    fd, pointer = tempfile.mkstemp(prefix="dstrain-run-dir.")
    os.close(fd)
    if env.get("DS_ENV_FILE") and Path(env["DS_ENV_FILE"]).is_file():  # to rank 0 on another node
        with open(env["DS_ENV_FILE"], "a") as fh:
            fh.write(f"{RUN_DIR_FILE_ENV}={pointer}\n")
    proc = subprocess.Popen(cmd, env={**env, RUN_DIR_FILE_ENV: pointer}, start_new_session=True)
    forwarded = []

    def forward(signum, frame):
        if not forwarded:
            forwarded.append(signum)
            print(
                f"launch.sh: {signal.Signals(signum).name}: asking every rank to checkpoint and stop",
                flush=True,
            )
            _killpg(proc.pid, signal.SIGTERM)

    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, forward)
    code = proc.wait()
    deadline = time.monotonic() + GRACE_S
    while _group_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    if _group_alive(proc.pid):
        print(
            f"launch.sh: ranks still running {GRACE_S} s after the launcher exited; killing them",
            flush=True,
        )
        _killpg(proc.pid, signal.SIGKILL)
    run_dir = Path(pointer).read_text().strip()
    os.unlink(pointer)
    return report(Path(run_dir) if run_dir else None, code)


def _killpg(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except ProcessLookupError:
        pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def report(run_dir: Path | None, launcher_code: int) -> int:
    """Print one line per rank that did not finish cleanly; return the job's exit status."""
    from dstrain.core.errors import EXIT_PEER_LOST, EXIT_PREEMPTED
    from dstrain.loop.fault import NO_NEW_CHECKPOINT, failed_ranks, read_records

    records = read_records(run_dir) if run_dir else []
    if not records:
        return launcher_code
    states = {r["state"] for r in records}
    if states == {"done"}:
        # the run is complete (summary.json written); only the process's teardown failed
        for r in records:
            if r.get("crash"):
                print(
                    f"launch.sh: rank {r['rank']} (pid {r.get('pid', '?')} on {r.get('host', '?')}) finished "
                    f"its run, then crashed while exiting: {r['crash'][:300]}. The results in {run_dir} "
                    "are complete",
                    flush=True,
                )
        return 0
    if states == {"preempted"}:
        late = [r for r in records if NO_NEW_CHECKPOINT in r.get("message", "")]
        how = (
            f"every rank stopped, {len(late)} without waiting for a new checkpoint (their step did "
            "not finish within fault.signal_grace_s, or a second signal came); resume=auto "
            "continues from the last complete one"
            if late
            else "every rank stopped with a checkpoint"
        )
        print(
            f"launch.sh: {how} ({run_dir}); rerun with resume=auto run_dir={run_dir} to continue",
            flush=True,
        )
        return EXIT_PREEMPTED
    blamed = failed_ranks(records, me=-1)
    print(f"launch.sh: the job failed ({run_dir}); how each rank ended:", flush=True)
    for r in records:
        mark = "  <- failed first" if blamed and r["rank"] == blamed[0]["rank"] else ""
        verdict = (
            r["verdict"]
            if r["state"] != "lost_peer"
            else "lost_peer (exit 4): stopped when a peer was lost"
        )
        print(
            f"  rank {r['rank']} (pid {r.get('pid', '?')} on {r.get('host', '?')}): {verdict[:300]}{mark}",
            flush=True,
        )
    if not blamed and states == {"lost_peer"}:
        hosts = sorted({str(r.get("host", "?")) for r in records})
        print(
            "launch.sh: every rank stopped because it lost contact with the others and none "
            f"crashed: the network between {', '.join(hosts)} failed (or a node stalled); "
            f"resume=auto run_dir={run_dir} continues from the last complete checkpoint",
            flush=True,
        )
        return EXIT_PEER_LOST
    if not blamed:
        return launcher_code or 1
    # a rank that vanished without a record: the job lost a rank (4); else the first failed rank's own status
    return blamed[0].get("exit_code") or EXIT_PEER_LOST


if __name__ == "__main__":
    sys.exit(main())
