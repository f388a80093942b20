"""``./run.sh gpu`` played end to end on this CPU as the GPU node runs it.

The node, as the device tool lends it: its own interpreter with torch, torchvision, tensorboard and
the rest of its image but no DeepSpeed, OmegaConf, DALI or a timm with ``Lars(foreach=)``; no
network; a job of at most 10 minutes whose processes are killed at the limit; a work tree made only
of what travels (tracked and untracked-not-ignored files, plus the carried folders: 64 MiB in all);
files coming home only through ``$OUT`` (8 files, 16 MiB each, 64 MiB, 2 folders deep, plain names);
``/tmp`` kept while the node stays warm, and a bare node that kept nothing.

Played here: ``gpu-prepare`` for this machine's Python (the real small wheels; a stand-in DALI wheel
that loads the DALI installed here, split into 3 parts), a node interpreter that sees this venv's
packages except those the node lacks, each job in ``unshare -n`` in a fresh tree built from what
travels, with a hard limit that kills the job's process group, scaled down (a job's own deadline
150 s, the limit 200 s); job 1 killed as soon as its first item is packed, jobs 2-3 warm, job 4 on a
bare node, each job's ``$OUT`` checked against the limits and imported with ``gpu-import`` into a
copy of this checkout. It shows every part's result file back here, the killed job's finished items
kept (not rerun) and continued, and a bounded number of jobs finishing every part.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.test_gpu_run import dali_named_wheel
from tools.gpu_run import PARTS

pytestmark = pytest.mark.slow

MIB = 1 << 20
# what the node's image lacks (docs/gpu.md): hidden from the node interpreter played here
NODE_LACKS = {
    "deepspeed",
    "omegaconf",
    "hjson",
    "pydantic",
    "pydantic_core",
    "annotated_types",
    "typing_inspection",
    "timm",
    "nvidia_dali_cuda130",
    "xdist",  # pytest-xdist (the tests part's -n 8) and its execnet travel with the small wheels
    "pytest_xdist",
    "execnet",
    "mlflow",  # the tracking extra: not in the node's image (device/KINDS.md's package list)
    "mlflow_skinny",
    "wandb",
}
OUT_NAME = re.compile(r"^[A-Za-z0-9._-]+$")
DEADLINE_S, HARD_LIMIT_S = 150, 200


def _dist(name: str) -> str:
    """``pydantic_core`` for ``pydantic_core-2.50.5.dist-info``, ``typing_inspection`` for
    ``typing_inspection``: a site-packages entry's package name."""
    stem = name.split("-")[0] if name.endswith((".dist-info", ".egg-info")) else name
    return re.sub(r"[-.]+", "_", stem.removesuffix(".py")).lower()


def node_python(root: Path) -> Path:
    """An interpreter that sees this venv's packages but those in NODE_LACKS (and DALI's module)."""
    site_here = Path(next(p for p in sys.path if p.endswith("site-packages")))
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    python = root / "bin" / "python"
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    for entry in site_here.iterdir():
        if _dist(entry.name) in NODE_LACKS or entry.name.startswith("__pycache__"):
            continue
        if entry.name == "nvidia":  # CUDA libraries stay, DALI goes
            (site / "nvidia").mkdir()
            for sub in entry.iterdir():
                if sub.name != "dali":
                    (site / "nvidia" / sub.name).symlink_to(sub)
            continue
        (site / entry.name).symlink_to(entry)
    return python


def standin_dali_wheel(folder: Path) -> Path:
    """A wheel named as DALI's whose ``nvidia.dali`` loads the DALI installed here: the node's
    install path is played with a file of a few KiB instead of 200 MiB."""
    import nvidia.dali

    real = Path(nvidia.dali.__file__).parent
    shim = (
        "import os\n"
        f"__path__[:] = [{str(real)!r}]\n"
        f"__file__ = os.path.join({str(real)!r}, '__init__.py')\n"
        "exec(compile(open(__file__).read(), __file__, 'exec'))\n"
    )
    # 110 KiB of padding: the pack splits into 3 parts of 0.045 MiB
    return dali_named_wheel(folder, shim, 110 << 10)


def travelling_files(repo: Path) -> list[str]:
    out = subprocess.run(
        ["git", "-C", str(repo), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [f for f in out.split("\0") if f and (repo / f).is_file()]


def job_tree(dest: Path, carry: dict[str, Path]) -> int:
    """A fresh work tree of what travels plus the carried folders; its size in bytes."""
    size = 0
    for rel in travelling_files(REPO):
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / rel, target)
        size += target.stat().st_size
    for rel, source in carry.items():
        if source.is_dir():
            shutil.copytree(source, dest / rel)
            size += sum(p.stat().st_size for p in (dest / rel).rglob("*") if p.is_file())
    return size


def check_out_limits(out: Path) -> list[Path]:
    files = [p for p in out.rglob("*") if p.is_file()]
    assert len(files) <= 8, files
    assert all(p.stat().st_size <= 16 * MIB for p in files)
    assert sum(p.stat().st_size for p in files) <= 64 * MIB
    for p in files:
        rel = p.relative_to(out)
        assert len(rel.parts) <= 3, rel  # $OUT/a/b/file at most
        assert all(OUT_NAME.match(part) for part in rel.parts), rel
    return files


class Node:
    """The lent machine: an interpreter, a /tmp kept while warm, jobs with a hard limit."""

    def __init__(self, root: Path, python: Path):
        self.root, self.python, self.jobs = root, python, 0

    def bare(self) -> None:
        shutil.rmtree(self.root / "tmp", ignore_errors=True)

    def job(self, carry: dict[str, Path], command: str, kill_when=None) -> tuple[int, str, Path]:
        self.jobs += 1
        tree = self.root / f"tree{self.jobs}"
        out = self.root / f"out{self.jobs}"
        out.mkdir(parents=True)
        size = job_tree(tree, carry)
        assert size <= 64 * MIB, f"job {self.jobs} brings {size / MIB:.1f} MiB"
        (self.root / "tmp").mkdir(exist_ok=True)
        env = {
            "PATH": "/usr/bin:/bin:/usr/sbin:/sbin",
            "HOME": str(self.root / "tmp"),
            "OUT": str(out),
            "PYTHON": str(self.python),
            "DSTRAIN_VENV": str(self.root / "no-venv"),  # the node has no .venv: its python3
            "DSTRAIN_GPU_HOME": str(self.root / "tmp" / "dstrain-gpu"),
            "DSTRAIN_GPU_DEADLINE_S": str(DEADLINE_S),
            "OMP_NUM_THREADS": "1",
            "DS_ACCELERATOR": "cpu",
            "CUDA_VISIBLE_DEVICES": "",
            "TORCHINDUCTOR_CACHE_DIR": str(self.root / "tmp" / "inductor"),
        }
        cmd = ["unshare", "-n", "sh", "-c", f"ip link set lo up && exec {command}"]
        with open(self.root / f"job{self.jobs}.log", "w") as log:
            proc = subprocess.Popen(
                cmd, cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
            t0 = time.monotonic()
            while proc.poll() is None:
                over = time.monotonic() - t0 > HARD_LIMIT_S
                if over or (kill_when and kill_when(out)):
                    os.killpg(proc.pid, signal.SIGKILL)  # the node's limit: nothing survives it
                    proc.wait()
                    break
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=0.5 if kill_when else 5)  # returns as the job ends
        shutil.rmtree(tree)  # the tree does not outlive the job here (stricter than a warm node)
        check_out_limits(out)
        return proc.returncode, (self.root / f"job{self.jobs}.log").read_text(), out


def gpu_import(home: Path, out: Path) -> str:
    proc = subprocess.run(
        [sys.executable, "tools/gpu_pack.py", str(out / "gpu_state.tar.gz"), "--repo", str(home)],
        cwd=home,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


@pytest.mark.skipif(
    shutil.which("ip") is None
    or subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode != 0,
    reason="unshare -n (root or user namespaces) and ip (iproute2): the node's no-network is "
    "played with a network namespace whose loopback is up",
)
def test_the_gpu_pass_played_as_the_node_runs_it(tmp_path):
    pytest.importorskip("nvidia.dali")
    if not _index_reachable():
        pytest.skip("gpu-prepare downloads the small wheels: the package index is not reachable")
    gpu = tmp_path / "gpu"
    dali_wheels = tmp_path / "dali-wheels"
    standin_dali_wheel(dali_wheels)
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    prepare = [
        sys.executable,
        "tools/gpu_prepare.py",
        *("--python-version", here, "--out", str(gpu), "--cache", str(REPO / ".gpu" / "cache")),
        *("--dali-wheels", str(dali_wheels), "--part-mib", "0.045"),
        # a new pass's plan, whatever this checkout's runs/gpu holds or imported for the H100: the
        # node played here has no GPU, so its result files are named *_cpu
        *("--state", str(tmp_path / "home" / "runs" / "gpu"), "--slug", "cpu"),
    ]
    proc = subprocess.run(prepare, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    parts = sorted(gpu.glob("dali-*"))
    assert len(parts) == 3, proc.stdout
    assert "The slot plan" in proc.stdout and "./run.sh gpu --receive" in proc.stdout
    jobs = json.loads((gpu / "JOBS.json").read_text())["jobs"]
    assert all(j["fits"] for j in jobs) and jobs[-1]["device_s"] <= 13 * 60
    # a new pass: a measuring job, a ferry per part, a measuring job
    assert [j["carry"] for j in jobs] == [
        [".gpu/wheels", "runs/gpu"],
        [".gpu/dali-1"],
        [".gpu/dali-2"],
        [".gpu/dali-3"],
        [".gpu/wheels", "runs/gpu"],
    ]

    # the checkout "here": gpu-import writes into a copy, not into this repository
    home = tmp_path / "home"
    for rel in travelling_files(REPO):
        (home / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / rel, home / rel)
    node = Node(tmp_path / "node", node_python(tmp_path / "nodepy"))
    # the tests part runs the tests marked gpu: tests/test_gpu.py (skipped without CUDA) and two
    # played ones, one of them needing DALI (skipped until its parts have all arrived)
    played = tmp_path / "played-tests"
    played.mkdir()
    (played / "test_played_gpu.py").write_text(
        "import pytest\n"
        "@pytest.mark.gpu\n"
        "def test_on_every_node():\n    pass\n"
        "@pytest.mark.gpu\n"
        "def test_with_dali():\n    pytest.importorskip('nvidia.dali')\n"
        "def test_not_a_gpu_question():\n    raise AssertionError('the GPU pass ran a CPU test')\n"
    )
    command = (
        "./run.sh gpu --tiny --test-files tests/test_gpu.py runs/played/test_played_gpu.py "
        "--deadline {deadline}"
    )

    def carry(*names: str) -> dict[str, Path]:
        c = {name: gpu / name.removeprefix(".gpu/") for name in names if name != "runs/gpu"}
        if "runs/gpu" in names and (home / "runs/gpu").is_dir():
            c["runs/gpu"] = home / "runs/gpu"
        c["runs/played"] = played
        return c

    # job 1: killed as the node's limit would, as soon as its first item is packed
    code, log, out = node.job(
        carry(*jobs[0]["carry"]),
        command.format(deadline=DEADLINE_S),
        kill_when=lambda out: bool(_packed_rows(out)),
    )
    assert code == -signal.SIGKILL, log[-3000:]
    assert "installing" in log, log[-3000:]
    killed_rows = _packed_rows(out)
    assert killed_rows, log[-3000:]  # what finished before the kill came home
    gpu_import(home, out)
    # jobs 2-4, warm: the ferries bring one part each and run nothing else; DALI whole in job 4
    for job in jobs[1:4]:
        code, log, out = node.job(carry(*job["carry"]), job["command"])
        assert code == 0, log[-3000:]
        assert "receive: DALI:" in log and "[gpu] job" not in log, log[-3000:]
        assert list(out.iterdir()) == []  # a ferry hands nothing back
    assert "DALI: installed from its parts" in log, log[-3000:]
    # then measuring jobs, warm, until every part is complete
    for _ in range(4):
        code, log, out = node.job(carry(*jobs[-1]["carry"]), command.format(deadline=DEADLINE_S))
        assert code in (0, 1), log[-3000:]  # it ended by itself, within its deadline
        assert "already installed" in log, log[-3000:]
        gpu_import(home, out)
        if code == 0:
            break
    assert code == 0, log[-3000:]
    # a bare node (nothing kept but what the job brings): it continues from the imported state
    node.bare()
    code, log, out = node.job(carry(*jobs[-1]["carry"]), command.format(deadline=DEADLINE_S))
    assert code == 0 and "complete in an earlier job" in log, log[-3000:]
    record = json.loads((home / "runs/gpu/gpu_run_cpu.json").read_text())
    assert list(record["parts"]) == list(PARTS) or set(record["parts"]) == set(PARTS)
    assert all(p["complete"] for p in record["parts"].values()), record["parts"]
    # the killed job's rows were kept, not rerun
    throughput = json.loads((home / "results/bench/throughput_cpu.json").read_text())
    for row in throughput["rows"]:
        if (row["loop"], row["repeat"]) in killed_rows:
            assert row["git_sha"] and row in _rows_of(killed_rows, throughput), row
    assert {r["repeat"] for r in throughput["rows"]} == {0, 1}  # --tiny: 2 repeats a pair
    # every part's result file is back here and registered
    results = home / "results/bench"
    for name in (
        "throughput_cpu.json",
        "throughput_cpu.md",
        "loader_cpu.json",
        "throughput_dali_cpu.json",
        "suite_gpu_cpu.json",
        "bn_span_cpu.json",
        "bn_group_cpu.json",
        "optimizer_step_cpu.json",
        "smoke_cpu.json",
        "profile_step_cpu.json",
    ):
        assert (results / name).is_file(), name
    registry = json.loads((home / "results/gpu_imports.json").read_text())["results"]
    assert {Path(e["file"]).name for e in registry} >= {"smoke_cpu.json", "suite_gpu_cpu.json"}
    check = subprocess.run(
        [sys.executable, "results/evidence.py", "check"], cwd=home, capture_output=True, text=True
    )
    # every file the jobs brought home describes itself (title, headline, command, SHA, date,
    # machine), so the index lists it; the check names a file that does not (the docs' numbers
    # linked to the files these tiny jobs overwrote differ, as they should, and are not asked)
    undescribed = [
        line for line in check.stdout.splitlines() if "bench.common.write_result" in line
    ]
    assert not undescribed, undescribed
    suite = json.loads((results / "suite_gpu_cpu.json").read_text())
    # the marked tests only; the DALI one ran once DALI had arrived
    assert suite["counts"]["passed"] == 2 and suite["counts"]["failed"] == 0, suite
    assert not any("dali" in reason.lower() for reason in suite["skipped"]), suite["skipped"]
    assert node.jobs <= 9


def _packed_rows(out: Path) -> list[tuple[str, int]]:
    """(loop, repeat) of the throughput rows a job's pack holds."""
    import tarfile

    pack = out / "gpu_state.tar.gz"
    if not pack.is_file():
        return []
    try:
        with tarfile.open(pack) as tar:
            data = json.load(tar.extractfile("results/throughput_cpu.json"))
    except (tarfile.TarError, KeyError, OSError, json.JSONDecodeError):
        return []
    return [(r["loop"], r.get("repeat", 0)) for r in data["rows"]]


def _rows_of(keys: list[tuple[str, int]], throughput: dict) -> list[dict]:
    return [r for r in throughput["rows"] if (r["loop"], r["repeat"]) in keys]


def _index_reachable() -> bool:
    """pip's index answers (not on a GPU node, which has no network)."""
    import socket

    try:
        socket.create_connection(("pypi.org", 443), timeout=5).close()
    except OSError:
        return False
    return True
