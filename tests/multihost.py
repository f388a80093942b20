"""Several "hosts" on one machine, for the multi-node launch tests: network namespaces on a bridge,
each with its own address and sshd, sharing this working tree as a cluster shares its file system.

    with Cluster(2, tmp_path) as cluster:       # namespaces, addresses, sshd, keys
        cluster.hosts[0].addr                   # 10.213.K.2, ...
        subprocess.run(cmd, env=cluster.env())  # ssh/pdsh reach the hosts with the harness's key
        cluster.kill_host(1)                    # every process of host 1 (a lost node)
        cluster.cut_link(1)                     # host 1's cable pulled (its veth down)

Everything stays on the addresses the harness made (one /24 on its own bridge; sshd listens only
there); every command is bounded in time; ``close`` removes namespaces, links and processes whatever
happened. Needs root, ``ip netns``, sshd and pdsh (Debian: openssh-server, pdsh); ``unavailable()``
says what is missing, for a skip reason.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from tests.conftest import CPU_ONLY, ONE_THREAD

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"
IFACE = "eth0"  # the name of each host's interface inside its namespace


def sh(*cmd: str, timeout: float = 20, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: exit {proc.returncode}: {proc.stderr.strip()}")
    return proc


def unavailable() -> str | None:
    """Why this machine cannot run the harness, or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    for tool in ("ip", "pdsh", "ssh", "ssh-keygen"):
        if shutil.which(tool) is None:
            return f"needs {tool} (Debian: apt-get install iproute2 openssh-server pdsh)"
    if not Path(SSHD).exists():
        return "needs sshd (Debian: apt-get install openssh-server)"
    probe = f"dstrain-probe-{os.getpid()}"
    made = sh("ip", "netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"cannot make a network namespace here: {made.stderr.strip()}"
    sh("ip", "netns", "del", probe, check=False)
    return None


@dataclass
class Host:
    index: int
    name: str  # its hostname (its own UTS namespace): what rank records and reports show
    ns: str  # network namespace
    addr: str  # its address on the harness's bridge
    veth: str  # the bridge side of its cable
    sshd: subprocess.Popen | None = None


class Cluster:
    def __init__(self, n: int, workdir: Path, subnet: int | None = None):
        self.n, self.dir = n, Path(workdir)
        tag = f"{os.getpid() % 10000}"
        self.subnet = subnet if subnet is not None else 100 + os.getpid() % 150
        self.prefix = f"10.213.{self.subnet}"
        self.bridge = f"dsbr{tag}"
        self.hosts = [
            Host(i, f"dsnode{i}", f"dstrain-{tag}-h{i}", f"{self.prefix}.{i + 2}", f"dsv{tag}h{i}")
            for i in range(n)
        ]
        self.bin = self.dir / "bin"

    # ------------------------------------------------------------ set-up and tear-down
    def __enter__(self) -> Cluster:
        try:
            self._network()
            self._ssh()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _network(self) -> None:
        sh("ip", "link", "add", self.bridge, "type", "bridge")
        sh("ip", "addr", "add", f"{self.prefix}.1/24", "dev", self.bridge)
        sh("ip", "link", "set", self.bridge, "up")
        for h in self.hosts:
            sh("ip", "netns", "add", h.ns)
            sh("ip", "link", "add", h.veth, "type", "veth", "peer", "name", IFACE, "netns", h.ns)
            sh("ip", "link", "set", h.veth, "master", self.bridge)
            sh("ip", "link", "set", h.veth, "up")
            sh("ip", "-n", h.ns, "addr", "add", f"{h.addr}/24", "dev", IFACE)
            sh("ip", "-n", h.ns, "link", "set", "lo", "up")
            sh("ip", "-n", h.ns, "link", "set", IFACE, "up")

    def _ssh(self) -> None:
        keys = self.dir / "ssh"
        keys.mkdir(parents=True, exist_ok=True)
        for name in ("client", "host"):
            if not (keys / name).exists():
                sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(keys / name))
        shutil.copy(keys / "client.pub", keys / "authorized_keys")
        Path("/run/sshd").mkdir(parents=True, exist_ok=True)  # sshd's privilege-separation dir
        config = keys / "ssh_config"
        config.write_text(
            "Host *\n"
            f"  IdentityFile {keys / 'client'}\n"
            "  StrictHostKeyChecking no\n"
            "  UserKnownHostsFile /dev/null\n"
            "  LogLevel ERROR\n"
            "  BatchMode yes\n"
            "  ConnectTimeout 5\n"
            "  ServerAliveInterval 5\n"  # a cut link ends the session (and pdsh) in ~15 s
            "  ServerAliveCountMax 3\n"
        )
        self.bin.mkdir(parents=True, exist_ok=True)
        wrapper = self.bin / "ssh"  # pdsh and DeepSpeed's ssh check both run `ssh` from PATH
        wrapper.write_text(f'#!/bin/sh\nexec {shutil.which("ssh")} -F {config} "$@"\n')
        wrapper.chmod(0o755)
        for h in self.hosts:
            cfg = keys / f"sshd_{h.index}"
            cfg.write_text(
                f"ListenAddress {h.addr}:22\n"
                f"HostKey {keys / 'host'}\n"
                f"AuthorizedKeysFile {keys / 'authorized_keys'}\n"
                f"PidFile {keys / f'sshd_{h.index}.pid'}\n"
                "PermitRootLogin prohibit-password\n"
                "PasswordAuthentication no\n"
                "KbdInteractiveAuthentication no\n"
                "UsePAM no\n"
                "StrictModes no\n"
                "AcceptEnv *\n"
            )
            start = f"hostname {h.name} && exec {SSHD} -D -e -f {cfg}"  # sessions inherit both
            h.sshd = subprocess.Popen(
                ["ip", "netns", "exec", h.ns, "unshare", "--uts", "sh", "-c", start],
                stdout=subprocess.DEVNULL,
                stderr=open(keys / f"sshd_{h.index}.log", "w"),
                start_new_session=True,
            )
        deadline = time.monotonic() + 20
        for h in self.hosts:
            while True:
                probe = self.ssh(h, "true", check=False, timeout=10)
                if probe.returncode == 0:
                    break
                if time.monotonic() > deadline:
                    log = (keys / f"sshd_{h.index}.log").read_text()
                    raise RuntimeError(f"sshd on {h.addr} did not answer: {probe.stderr}{log}")
                time.sleep(0.3)

    def close(self) -> None:
        """Remove everything the harness made; never raises."""
        for h in self.hosts:
            self._kill_ns(h)
            if h.sshd is not None and h.sshd.poll() is None:
                h.sshd.kill()
            sh("ip", "netns", "del", h.ns, check=False)
            sh("ip", "link", "del", h.veth, check=False)
        sh("ip", "link", "del", self.bridge, check=False)

    # ------------------------------------------------------------ use
    def env(self, **extra: str) -> dict:
        """This environment with the harness's ssh first on PATH, every rank on the CPU: the hosts
        share this machine, and its GPUs (if any) are not one per rank of the test's jobs."""
        path = f"{self.bin}{os.pathsep}{os.environ['PATH']}"
        # one torch thread per rank: the hosts share this machine's cores (a real host has its
        # own), and the local runs they are compared with bit for bit run so too (conftest)
        return {**os.environ, "PATH": path, **CPU_ONLY, **ONE_THREAD, **extra}

    def ssh(self, host: Host, command: str, check: bool = True, timeout: float = 30):
        return sh(str(self.bin / "ssh"), host.addr, command, check=check, timeout=timeout)

    def hostfile(self, slots: int = 1, hosts: list[Host] | None = None) -> Path:
        path = self.dir / f"hostfile_{slots}"
        lines = [f"{h.addr} slots={slots}" for h in (hosts or self.hosts)]
        path.write_text("\n".join(lines) + "\n")
        return path

    def pids(self, host: Host) -> list[int]:
        out = sh("ip", "netns", "pids", host.ns, check=False).stdout
        return [int(p) for p in out.split()]

    def _kill_ns(self, host: Host) -> None:
        for pid in self.pids(host):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def kill_host(self, index: int) -> None:
        """Every process of host ``index`` killed at once (its sshd too): a node lost."""
        self._kill_ns(self.hosts[index])

    def cut_link(self, index: int) -> None:
        """Host ``index``'s cable pulled: its processes live on, its packets go nowhere."""
        sh("ip", "link", "set", self.hosts[index].veth, "down")

    def free_port(self) -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
