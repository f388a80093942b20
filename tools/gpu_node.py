"""The node side of ``./run.sh gpu``: install what a job brought, offline, once, and say what is missing.

    python3 tools/gpu_node.py install     # prints shell assignments for run.sh (PY, PATH, ...)
    python3 tools/gpu_node.py receive     # a ferry job: keep the DALI part it brought, nothing else

What it does, on a node with no network, each step skipped when nothing changed (stamped):

- refuses, before pip runs, a wheel built for another Python (``./run.sh gpu-prepare
  --python-version 3.N`` makes the right ones) and a wheel whose SHA-256 differs from the manifest;
- makes a virtual environment in ``$DSTRAIN_GPU_HOME`` (default ``/tmp/dstrain-gpu/venv``) that
  sees the node's own packages (torch, torchvision, ...) behind its own, and installs
  ``.gpu/wheels`` into it with ``pip --no-index --no-deps``: DeepSpeed's launcher lands beside that
  interpreter, where the tests and ``launch.py`` look for it;
- keeps every DALI part a job brought (``.gpu/dali-N``) in ``$DSTRAIN_GPU_HOME/dali-parts``, and once
  all have arrived joins them, checks the whole against its SHA-256 and installs DALI; until then
  it names the parts still missing;
- without ``.git`` (a copied tree) reads the SHA from ``.gpu/wheels/SOURCE.json`` and checks every
  tracked file against it: ``<sha>-modified`` when one differs.

Where no wheels were brought and this interpreter already has every package (a development machine),
it is used as it is.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import site
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GPU_DIR = REPO / ".gpu"
NEEDED = ("torch", "torchvision", "deepspeed", "omegaconf", "tensorboard")


class NodeError(Exception):
    """One line naming what is wrong and the fix; ``./run.sh gpu`` exits 2 with it."""


def say(message: str) -> None:
    print(f"[gpu-node] {message}", file=sys.stderr, flush=True)


def home() -> Path:
    return Path(os.environ.get("DSTRAIN_GPU_HOME") or "/tmp/dstrain-gpu")


def write_json(path: Path, data: dict) -> None:
    """Atomically (a job cut off mid-write leaves the previous file), its folder made. The GPU
    pass's one writer: gpu_prepare and gpu_run take it from here, where only the standard
    library is imported (this module runs on the node before anything is installed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def supported_tags() -> set[str]:
    try:
        from packaging.tags import sys_tags
    except ImportError:  # pip vendors it
        from pip._vendor.packaging.tags import sys_tags
    return {str(t) for t in sys_tags()}


def wheel_tags(name: str) -> set[str]:
    """``{"cp312-cp312-manylinux_2_17_x86_64", ...}`` from a wheel's file name."""
    parts = name[: -len(".whl")].split("-")
    pythons, abis, platforms = parts[-3].split("."), parts[-2].split("."), parts[-1].split(".")
    return {f"{p}-{a}-{pl}" for p in pythons for a in abis for pl in platforms}


def check_wheels(wheels: list[Path]) -> None:
    """Every wheel must install on this interpreter: refused before pip runs, naming the fix."""
    tags = supported_tags()
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    wrong = [w.name for w in wheels if not wheel_tags(w.name) & tags]
    if wrong:
        raise NodeError(
            f"{wrong[0]} (and {len(wrong) - 1} more) is not for this Python {here} "
            f"({sys.executable}): run ./run.sh gpu-prepare --python-version {here} and bring "
            ".gpu/wheels again"
        )


def check_manifest(folder: Path) -> list[Path]:
    manifest = folder / "MANIFEST.json"
    entries = json.loads(manifest.read_text())["wheels"]
    wheels = []
    for entry in entries:
        path = folder / entry["file"]
        if not path.is_file():
            raise NodeError(f"{path}: listed in {manifest} but not here: bring .gpu/wheels whole")
        if path.stat().st_size != entry["bytes"] or sha256(path) != entry["sha256"]:
            raise NodeError(f"{path}: its SHA-256 differs from {manifest}: bring .gpu/wheels again")
        wheels.append(path)
    return wheels


def make_venv(venv: Path) -> Path:
    """A venv that sees this interpreter's packages behind its own (a .pth adds its site dirs)."""
    python = venv / "bin" / "python"
    if python.exists():
        return python
    say(f"creating {venv} (it sees this interpreter's packages: torch, torchvision, ...)")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    ours = [p for p in site.getsitepackages() if Path(p).is_dir()]
    ours += [sysconfig.get_paths()["purelib"]]
    lines = [f"import site; site.addsitedir({p!r})" for p in dict.fromkeys(ours)]
    Path(purelib, "_dstrain_node_site.pth").write_text("\n".join(lines) + "\n")
    return python


def pip_install(python: Path, wheels: list[Path]) -> None:
    cmd = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    cmd += ["--no-index", "--no-deps", "--no-compile", "--ignore-installed"]
    proc = subprocess.run(cmd + [str(w) for w in wheels], capture_output=True, text=True)
    if proc.returncode != 0:
        tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
        raise NodeError(f"pip could not install {len(wheels)} wheels: {tail}")


def stamped(path: Path, value: str) -> bool:
    return path.is_file() and path.read_text().strip() == value


def install_small(venv: Path, folder: Path) -> Path:
    wheels = check_manifest(folder)
    check_wheels(wheels)
    python = make_venv(venv)
    stamp = venv / ".dstrain-wheels"
    want = sha256(folder / "MANIFEST.json")
    if stamped(stamp, want):
        say(f"{len(wheels)} wheels already installed in {venv}")
    else:
        say(f"installing {len(wheels)} wheels into {venv} (pip --no-index --no-deps)")
        pip_install(python, wheels)
        stamp.write_text(want + "\n")
    return python


def collect_dali(gpu_dir: Path, store: Path) -> dict | None:
    """Keep the DALI parts this job brought; the parts' metadata, or None when none was ever seen."""
    store.mkdir(parents=True, exist_ok=True)
    for meta_path in sorted(gpu_dir.glob("dali-*/PART.json")):
        meta = json.loads(meta_path.read_text())
        part = meta_path.parent / meta["file"]
        if not part.is_file() or sha256(part) != meta["sha256"]:
            say(f"{part}: missing or its SHA-256 differs from PART.json: not kept (bring it again)")
            continue
        kept = store / "PART.json"
        if kept.is_file() and json.loads(kept.read_text())["whole"] != meta["whole"]:
            say("DALI parts of another pack were kept: dropped (this pack replaces them)")
            shutil.rmtree(store)
            store.mkdir(parents=True)
        if not (store / meta["file"]).is_file():
            shutil.copy2(part, store / meta["file"])
            say(f"DALI part {meta['part']} of {meta['parts']} kept in {store}")
        write_json(kept, {k: meta[k] for k in ("parts", "whole", "wheels")})
    kept = store / "PART.json"
    return json.loads(kept.read_text()) if kept.is_file() else None


def install_dali(python: Path, venv: Path, gpu_dir: Path) -> str:
    """Install DALI once every part has arrived; a line saying what happened or what is missing."""
    store = home() / "dali-parts"
    meta = collect_dali(gpu_dir, store)
    if meta is None:
        return "DALI: no part brought yet (.gpu/dali-1 ...): the dali part waits"
    stamp = venv / ".dstrain-dali"
    if stamped(stamp, meta["whole"]["sha256"]):
        return "DALI: installed"
    names = [f"dali.tar.xz.part{n}" for n in range(1, meta["parts"] + 1)]
    missing = [str(n) for n, name in enumerate(names, 1) if not (store / name).is_file()]
    if missing:
        have = meta["parts"] - len(missing)
        return (
            f"DALI: {have} of {meta['parts']} parts here, missing "
            + ", ".join(missing)
            + " (bring .gpu/dali-"
            + ", .gpu/dali-".join(missing)
            + " while the node is warm): the dali part waits"
        )
    with tempfile.TemporaryDirectory(prefix="dali-join-", dir=home()) as tmp:
        whole = Path(tmp) / "dali.tar.xz"
        with open(whole, "wb") as out:
            for name in names:
                with open(store / name, "rb") as part:
                    shutil.copyfileobj(part, out, 1 << 20)
        if sha256(whole) != meta["whole"]["sha256"]:
            shutil.rmtree(store)
            raise NodeError(
                "DALI: the joined parts' SHA-256 differs from the pack's: parts dropped, bring "
                ".gpu/dali-* again (./run.sh gpu-prepare made them)"
            )
        with tarfile.open(whole, "r:xz") as tar:
            tar.extractall(tmp, filter="data")
        wheels = [Path(tmp) / name for name in meta["wheels"]]
        check_wheels(wheels)
        say(f"DALI: all {meta['parts']} parts here, installing {len(wheels)} wheels")
        pip_install(python, wheels)
    stamp.write_text(meta["whole"]["sha256"] + "\n")
    return "DALI: installed from its parts"


def source_sha(repo: Path = REPO) -> str | None:
    """Without .git, the SHA ``SOURCE.json`` names, ``-modified`` where a tracked file differs."""
    if (repo / ".git").exists():
        return None
    source = repo / ".gpu" / "wheels" / "SOURCE.json"
    if not source.is_file():
        return None
    record = json.loads(source.read_text())
    changed = [
        f
        for f, digest in record["files"].items()
        if not (repo / f).is_file() or sha256(repo / f) != digest
    ]
    if changed:
        say(f"{len(changed)} files differ from SOURCE.json's commit (e.g. {changed[0]}): -modified")
    return record["git_sha"] + ("-modified" if changed else "")


def missing_packages(python: str) -> list[str]:
    code = "import importlib.util as u, sys; print(' '.join(m for m in sys.argv[1:] if u.find_spec(m) is None))"
    out = subprocess.run([python, "-c", code, *NEEDED], capture_output=True, text=True)
    return out.stdout.split()


def install(gpu_dir: Path = GPU_DIR) -> dict[str, str]:
    """The environment ``./run.sh gpu`` runs in: ``PY`` and the variables to export."""
    venv = home() / "venv"
    home().mkdir(parents=True, exist_ok=True)
    assignments: dict[str, str] = {}
    if (gpu_dir / "wheels" / "MANIFEST.json").is_file():
        python = install_small(venv, gpu_dir / "wheels")
    elif (venv / ".dstrain-wheels").is_file():
        python = venv / "bin" / "python"
        say(f"no .gpu/wheels brought: the environment installed earlier ({venv}) is used")
    else:
        python = Path(sys.executable)
    if python != Path(sys.executable):
        dali = install_dali(python, venv, gpu_dir)
        say(dali)
        assignments["DSTRAIN_GPU_DALI"] = dali
        assignments["DSTRAIN_VENV"] = str(venv)
        assignments["PATH"] = f"{venv / 'bin'}:{os.environ.get('PATH', '')}"
    missing = missing_packages(str(python))
    if missing:
        raise NodeError(
            f"missing Python packages: {', '.join(missing)}. Without network: run ./run.sh "
            "gpu-prepare where there is one and bring .gpu/wheels with the job (docs/gpu.md)"
        )
    sha = source_sha()
    if sha:
        assignments["DSTRAIN_GIT_SHA"] = sha
    assignments["PY"] = str(python)
    return assignments


def receive(gpu_dir: Path = GPU_DIR) -> str:
    """A ferry job (``./run.sh gpu --receive``): keep the DALI part it brought and, once every part
    is here and the small wheels' environment exists, install DALI; nothing else runs. A line
    saying what is here."""
    venv = home() / "venv"
    home().mkdir(parents=True, exist_ok=True)
    if (venv / ".dstrain-wheels").is_file():  # installed by an earlier job of this warm node
        return install_dali(venv / "bin" / "python", venv, gpu_dir)
    meta = collect_dali(gpu_dir, home() / "dali-parts")
    if meta is None:
        return "DALI: no part brought (carry .gpu/dali-N)"
    kept = len(list((home() / "dali-parts").glob("dali.tar.xz.part*")))
    return (
        f"DALI: {kept} of {meta['parts']} parts kept; a job that brings .gpu/wheels installs "
        "them (the node must stay warm until then)"
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["receive"]:
        start = float(os.environ.get("DSTRAIN_GPU_JOB_START") or 0) or None
        try:
            line = receive()
        except NodeError as err:
            print(f"[gpu-node] error: {err}", file=sys.stderr)
            return 2
        took = f" ({time.time() - start:.1f} s on the node)" if start else ""
        print(f"[gpu-node] receive: {line}{took}", flush=True)
        return 0
    if argv[:1] != ["install"]:
        print(__doc__, file=sys.stderr)
        return 2
    try:
        assignments = install()
    except NodeError as err:
        print(f"[gpu-node] error: {err}", file=sys.stderr)
        return 2
    for key, value in assignments.items():
        prefix = "" if key == "PY" else "export "
        print(f"{prefix}{key}={shlex.quote(value)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
