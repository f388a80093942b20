"""Shared fixtures: Fashion-MNIST-shaped idx files that a small model can learn quickly."""

from __future__ import annotations

import contextlib
import gzip
import os
import re
import struct
import subprocess
import sys
from pathlib import Path
from unittest import mock

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
INJECT = REPO / "tests" / "inject"

# pytest-xdist (./run.sh test runs 2 workers): the workers share the cores as dstrain's ranks do
# (dist.share_cpu_cores), each with cores // workers torch threads, and so do the processes a test
# starts (they inherit it); with a thread per core each, OpenMP's spinning threads slow every
# worker down. Set before torch is imported anywhere in the worker.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT") and "OMP_NUM_THREADS" not in os.environ:
    _workers = int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // _workers))
    # inductor compiles in the process that asks (its pool of compile workers would start more
    # processes, each importing torch again, on cores the workers already share)
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")


def write_idx(path: Path, array: np.ndarray) -> None:
    header = struct.pack(">HBB", 0, 0x08, array.ndim) + struct.pack(
        ">" + "I" * array.ndim, *array.shape
    )
    with gzip.open(path, "wb") as fh:
        fh.write(header + array.astype(np.uint8).tobytes())


def gratings(n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """``n`` 28x28 images in 10 classes of oriented gratings (class k at angle k*18 degrees, random
    phase) plus noise, as uint8-range floats, and their labels.

    Like Fashion-MNIST, the class is in the local structure, so a small convnet
    with global pooling learns it within a few dozen steps.
    """
    yy, xx = np.mgrid[0:28, 0:28]
    labels = rng.integers(0, 10, size=n)
    theta = labels[:, None, None] * np.pi / 10
    phase = rng.uniform(0, 2 * np.pi, size=(n, 1, 1))
    wave = np.sin(2 * np.pi / 6 * (xx * np.cos(theta) + yy * np.sin(theta)) + phase)
    images = np.clip(128 + 90 * wave + rng.normal(0, 25, size=(n, 28, 28)), 0, 255)
    return images, labels


def make_fake_fashion_mnist(
    root: Path, n_train: int = 512, n_val: int = 301, seed: int = 0
) -> Path:
    """Fashion-MNIST's idx files holding :func:`gratings`: 512 training and 301 test images."""
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", n_train), ("t10k", n_val)):
        images, labels = gratings(n, rng)
        write_idx(root / f"{split}-images-idx3-ubyte.gz", images)
        write_idx(root / f"{split}-labels-idx1-ubyte.gz", labels)
    return root


PROCESS_ENV = (  # what the trainer sets in its own process (a world of one, DeepSpeed's device)
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "DS_ACCELERATOR",
)


@pytest.fixture(autouse=True)
def process_env_restored():
    """A test that runs the trainer's entry point in pytest's process (``main([...] + ["--check"])``)
    leaves RANK, MASTER_PORT, DS_ACCELERATOR... behind; restore them, so that a later test's
    subprocess does not inherit them (a dry run printed the leaked port instead of 29500)."""
    saved = {var: os.environ.get(var) for var in PROCESS_ENV}
    yield
    for var, value in saved.items():
        if value is None:
            os.environ.pop(var, None)
        else:
            os.environ[var] = value


@pytest.fixture(autouse=True)
def run_dirs_unlocked():
    """A trainer built in pytest's process (tests/test_trainer.py) holds its run directory's lock as
    a run's rank 0 does (dstrain/run/rundir.py hold) until the process ends: released after each
    test, as a run that ends releases it, so a later run in the directory is not refused."""
    yield
    rundir = sys.modules.get("dstrain.run.rundir")
    if rundir is not None:
        rundir.release_all()


@pytest.fixture(autouse=True)
def fresh_compiler_state():
    """Each test compiles as a fresh process would: dynamo's caches and its per-function record
    of which dimensions changed between calls (which makes later compiles symbolic) are reset."""
    yield
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None:
        dynamo.reset()


@pytest.fixture(scope="session")
def fake_fmnist(tmp_path_factory) -> Path:
    return make_fake_fashion_mnist(tmp_path_factory.mktemp("fmnist"))


@pytest.fixture(scope="session")
def tiny_on_two_ranks(fake_fmnist, tmp_path_factory) -> subprocess.CompletedProcess:
    """TINY in FP32 on 2 CPU ranks through DeepSpeed's launcher, trained once for the session: the
    run test_e2e inspects and the reference test_multihost's two-host runs (CPU ranks, as its hosts
    run) must equal bit for bit. The finished process, with ``run_dir`` set."""
    run_dir = tmp_path_factory.mktemp("tiny2") / "run"
    args = ["--deepspeed_config", "ds_configs/fp32.json", *TINY, f"data.root={fake_fmnist}"]
    env = {**CPU_ONLY, **ONE_THREAD}  # as test_multihost's hosts run
    proc = run_cli([*args, f"run_dir={run_dir}"], launcher=deepspeed_launcher(2), env=env)
    proc.run_dir = run_dir
    return proc


# ---------------------------------------------------------------- devices: the same suite on CPU and GPU nodes
CPU_ONLY = {"CUDA_VISIBLE_DEVICES": "", "DS_ACCELERATOR": "cpu"}  # ranks that see no GPU, gloo
# CPU ranks that must compute bit for bit what ranks elsewhere compute (two-host runs against local
# ones): one torch thread each, on a machine of any size (dstrain gives local ranks cores // ranks)
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


@contextlib.contextmanager
def one_thread_per_rank():
    """Processes spawned inside (torch.multiprocessing) start with one torch thread each: ranks
    spawned by a test share this machine's cores, as dstrain's own ranks do (dist.share_cpu_cores);
    with a thread per core each, OpenMP's spinning threads slow every rank down."""
    with mock.patch.dict(os.environ, ONE_THREAD):
        yield


def spawn_ranks(fn, world: int, *args) -> None:
    """Run ``fn(rank, *args)`` in ``world`` processes (torch.multiprocessing) and wait for them, one
    torch thread each. Forked from this process where it holds no process group: a forked rank has
    torch imported already, where a spawned one imports it again (~3 s of CPU a rank, some 50 ranks
    in the suite); spawned where a group is up (a forked copy of it would be a second owner)."""
    import torch.distributed as tdist
    import torch.multiprocessing as mp

    method = "spawn" if tdist.is_available() and tdist.is_initialized() else "fork"
    with one_thread_per_rank():
        mp.start_processes(_one_thread, args=(fn, args), nprocs=world, start_method=method)


def _one_thread(rank: int, fn, args: tuple) -> None:
    import torch

    # a forked rank keeps this process's thread count: OMP_NUM_THREADS is read once, at start-up
    torch.set_num_threads(1)
    fn(rank, *args)


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def rank_env(ranks: int, gpus: int | None = None) -> dict:
    """The environment for a test's ``ranks`` local ranks: one GPU each where the node has enough,
    else CPU ranks (GPUs hidden). DeepSpeed 0.19 would put rank 1 of 2 on a 1-GPU node on a missing
    cuda:1."""
    gpus = gpu_count() if gpus is None else gpus
    return {} if ranks <= gpus else dict(CPU_ONLY)


def launcher_ranks(launcher: list[str] | None) -> int:
    """How many local ranks a ``deepspeed --num_gpus N`` launcher starts (1 without a launcher)."""
    if launcher and "--num_gpus" in launcher:
        return int(launcher[launcher.index("--num_gpus") + 1])
    return 1


def injected(env: dict) -> dict:
    """``env`` with tests/inject on PYTHONPATH (once): its sitecustomize injects a fault where
    ``env`` sets a DSTRAIN_FAULT_* variable (fault injection lives in the tests, not in dstrain's
    code) and keeps DeepSpeed's launcher processes from loading MLflow."""
    path = [p for p in (env.get("PYTHONPATH") or "").split(os.pathsep) if p]
    if str(INJECT) in path:
        return env
    return {**env, "PYTHONPATH": os.pathsep.join([str(INJECT), *path])}


# Every process a test starts finds tests/inject/sitecustomize.py: DeepSpeed's launcher processes
# (its runner and per-node launch) import DeepSpeed before any dstrain code, and DeepSpeed's
# autotuner then loads MLflow (1.5-2 s a process, two a launch); dstrain's ranks guard themselves.
os.environ.update(injected(dict(os.environ)))


def run_cli(
    args: list[str],
    launcher: list[str] | None = None,
    env: dict | None = None,
    timeout: int = 300,
    module: str = "dstrain",
    script: str = "dstrain/main.py",
) -> subprocess.CompletedProcess:
    """Run a command as a user would: `python -m dstrain ...` or `<launcher> dstrain/main.py ...`;
    a launcher's ranks on GPUs where there are enough, else on CPU (:func:`rank_env`); a variable
    given as None in ``env`` is unset."""
    full_env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        **rank_env(launcher_ranks(launcher)),
        **(env or {}),
    }
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        full_env.pop(var, None)
    for var in [k for k, v in full_env.items() if v is None]:  # env={"X": None}: X unset
        del full_env[var]
    cmd = (launcher + [script]) if launcher else [sys.executable, "-m", module]
    return subprocess.run(
        cmd + args,
        cwd=REPO,
        env=injected(full_env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def deepspeed_launcher(num_procs: int) -> list[str]:
    from dstrain.core.dist import free_port  # a port no other test (pytest-xdist worker) holds

    exe = Path(sys.executable).parent / "deepspeed"
    return [str(exe), "--num_gpus", str(num_procs), "--master_port", str(free_port())]


# 512 images / 32 per step = 16 steps per epoch; peak LR 0.2 (no scaling)
TINY = [
    "--config",
    "fashion_mnist",
    "model.width=8",
    "batch.global_size=32",
    "optim.base_lr=0.2",
    "optim.lr_scaling=none",
    "epochs=3",
    "optim.warmup_epochs=0.25",
    "batch.eval_per_rank=64",
    "log.every_steps=4",
    "model.channels_last=false",
    "deterministic=true",  # on a GPU: cuDNN without autotuning, so the bit-comparing tests hold
]


# ---------------------------------------------------------------- image folders
CLASS_RED = (30, 130, 230)  # class c is painted with red level CLASS_RED[c]
FILE_GREEN_STEP, FILE_GREEN_BASE = 28, 16  # file i of a class has green level BASE + i * STEP


def make_jpeg_folder(root: Path, per_class: int = 8, val_per_class: int = 3, size=(48, 64)) -> Path:
    """root/{train,val}/{ant,bee,cat}/NNN.JPEG, each a flat colour that encodes (class, file index).

    A decoded, cropped, resized image keeps its colour, so a test can recover
    from pixels alone which file (and class) a sample came from.
    """
    from PIL import Image

    for split, n in (("train", per_class), ("val", val_per_class)):
        for c, name in enumerate(("ant", "bee", "cat")):
            (root / split / name).mkdir(parents=True, exist_ok=True)
            for i in range(n):
                h, w = size[0] + 4 * i, size[1]
                colour = np.array(
                    [CLASS_RED[c], FILE_GREEN_BASE + i * FILE_GREEN_STEP, 90], np.uint8
                )
                rgb = np.zeros((h, w, 3), np.uint8) + colour
                Image.fromarray(rgb).save(root / split / name / f"{i:03d}.JPEG", quality=95)
    return root


def make_noise_folder(root: Path, counts: dict, shape=(40, 48), seed: int = 0) -> Path:
    """Random-noise PNGs (lossless) in root/<split>/a/NNN.png, counts = {split: n}: every crop window
    and every flip of them gives different pixels."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    for split, n in counts.items():
        (root / split / "a").mkdir(parents=True)
        for i in range(n):
            pixels = rng.integers(0, 256, (*shape, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / split / "a" / f"{i:03d}.png")
    return root


def decode_colour(
    x, mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225)
) -> list[tuple[int, int]]:
    """(class, file index) of each image of an NCHW batch made by make_jpeg_folder."""
    import torch

    rgb = x.float().mean(dim=(2, 3)) * torch.tensor(std) + torch.tensor(mean)
    out = []
    for r, g, _ in (rgb * 255).tolist():
        c = min(range(3), key=lambda k: abs(CLASS_RED[k] - r))
        out.append((c, round((g - FILE_GREEN_BASE) / FILE_GREEN_STEP)))
    return out


@pytest.fixture(scope="session")
def jpeg_folder(tmp_path_factory) -> Path:
    return make_jpeg_folder(tmp_path_factory.mktemp("imagefolder"))


# ---------------------------------------------------------------- evidence table (results/bench/faults.md)
EVIDENCE: list[dict] = []


def pytest_addoption(parser):
    parser.addoption(
        "--evidence",
        default="",
        metavar="FILE.md",
        help="write the table of every bad input and fault the tests tried, with what was observed",
    )


def pytest_configure(config):
    workers = getattr(config.option, "numprocesses", None)
    if config.getoption("--evidence") and workers not in (None, 0):
        raise pytest.UsageError(
            f"--evidence collects every test's row in one process, not on {workers} pytest-xdist "
            "workers: add -n 0 (./run.sh evidence does not start workers)"
        )


LOST_GROUPS = "pytest-xdist ignored this test's xdist_group mark"
LOST_KEY = pytest.StashKey[bool]()


def pytest_collection_finish(session):
    """On a pytest-xdist worker under ``--dist loadgroup`` (./run.sh test), a test marked
    ``xdist_group`` must carry its group in its node id, which is how xdist keeps the group on one
    worker; pytest 9.2 with xdist 3.8 dropped it silently (each worker then trained the session's
    shared runs again, and two multi-host clusters could run at once). Such tests fail, saying so."""
    if not getattr(session.config.option, "loadgroup", False):
        return
    for item in session.items:
        if item.get_closest_marker("xdist_group") and "@" not in item.nodeid:
            item.stash[LOST_KEY] = True


def pytest_collection_modifyitems(session, config, items):
    """On pytest-xdist's workers, which hand tests out in this order: the modules holding tests
    marked ``slow`` first, and those tests first within their module, so no long test is handed out
    near the end while the other worker has nothing left (one core idled about a minute at the end
    of the suite). A module's tests stay together, so a module-scoped fixture (test_trainer.py's
    DeepSpeed world of one, which cannot be set up twice in a process) is set up once per worker."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    first: dict[Path, int] = {}
    slow_modules = set()
    for i, item in enumerate(items):
        first.setdefault(item.path, i)
        if item.get_closest_marker("slow"):
            slow_modules.add(item.path)

    def key(item):
        return (
            item.path not in slow_modules,
            first[item.path],
            item.get_closest_marker("slow") is None,
        )

    items.sort(key=key)  # stable: parametrized cases keep their order


def pytest_runtest_setup(item):
    if item.stash.get(LOST_KEY, False):
        pytest.fail(
            f"{LOST_GROUPS} (its node id has no @group): this pytest and pytest-xdist do not work "
            "together; install the versions requirements.txt pins",
            pytrace=False,
        )


def error_lines(text: str) -> list[str]:
    """The lines a user reads: `dstrain...: error|stopped: ...` and the launcher's report."""
    keep = ("dstrain: ", "dstrain[rank", "dstrain.polish: ", "launch.sh: ")
    return [
        line
        for line in text.splitlines()
        if line.startswith(keep)
        and ("error" in line or "stopped" in line or "rank " in line or "every" in line)
    ]


@pytest.fixture
def evidence(request):
    """evidence(category, case, exit=..., seen=..., disk=..., seconds=None): one row of the table, from what
    the test observed (call it after the assertions, so a failing behaviour is never recorded)."""

    def add(category: str, case: str, *, exit, seen: str, disk: str, seconds: float | None = None):
        EVIDENCE.append(
            {
                "category": category,
                "case": case,
                "exit": exit,
                "seen": seen,
                "disk": disk,
                "seconds": seconds,
                "test": request.node.nodeid,
            }
        )

    return add


def pytest_sessionfinish(session, exitstatus):
    path = session.config.getoption("--evidence")
    if not path or not EVIDENCE:
        return
    from dstrain.core.provenance import git_sha

    sha = git_sha()
    lines = [
        "# Reliability evidence: every bad input and fault the tests tried",
        "",
        "Generated by `./run.sh evidence` (pytest `--evidence`) from what each test observed; "
        f"git {sha}, pytest exit status {int(exitstatus)}. Exit statuses: "
        "docs/faults.md.",
        "",
        "| what | case | exit | what the user sees | on disk afterwards | time to exit |",
        "|---|---|---|---|---|---|",
    ]
    for row in EVIDENCE:
        seen = re.sub(r"/tmp/pytest-of-[^/\s]+/pytest-\d+/[^/\s]+", "<tmp>", row["seen"])
        seen = seen.replace("|", "\\|").replace("\n", " <br> ")
        disk = re.sub(r"/tmp/pytest-of-[^/\s]+/pytest-\d+/[^/\s]+", "<tmp>", row["disk"])
        secs = f"{row['seconds']:.1f} s" if row["seconds"] is not None else ""
        lines.append(
            f"| {row['category']} | {row['case']} | {row['exit']} | {seen} | {disk} | {secs} |"
        )
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text("\n".join(lines) + "\n")
    # the report's description (results/evidence.py reads result JSONs): the table stays the .md
    from bench.common import write_result
    from dstrain.core.provenance import record

    write_result(
        Path(path).with_suffix(".json"),
        {**record("./run.sh evidence"), "pytest_exit": int(exitstatus), "rows": EVIDENCE},
        title="Bad inputs and faults: what the user sees (the table: faults.md)",
        headline=f"{len(EVIDENCE)} bad inputs and faults, each with its exit status and message",
    )
