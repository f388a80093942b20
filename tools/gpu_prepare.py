"""``./run.sh gpu-prepare``: everything a GPU node without network needs, built here, in jobs that fit.

    ./run.sh gpu-prepare                        # for the node's Python 3.12 (requirements-gpu.txt)
    ./run.sh gpu-prepare --python-version 3.11  # for another Python
    ./run.sh gpu-prepare --plan                 # only the job list, from what .gpu/ holds

It writes, under ``.gpu/`` (ignored by git; a job brings folders of it with the device tool's
``carry``):

  .gpu/wheels/    the small wheels (DeepSpeed built from its sdist without ops, OmegaConf, pydantic,
                  timm, ...), ``MANIFEST.json`` (names, sizes, SHA-256, the Python they are for) and
                  ``SOURCE.json`` (the git SHA and a digest of every tracked file: the node has no
                  ``.git``); brought by every job
  .gpu/dali-N/    DALI's wheels, repacked (one xz tar) and split into parts that fit beside the tree
                  alone (a ferry job brings nothing else), each with ``PART.json`` (its number, the
                  part count, sizes and SHA-256 of the part and of the whole); one part per job
  .gpu/cache/     downloads, kept between calls (never brought)

and prints the slot plan: each job's folders to bring, its payload against the 64 MiB a job may
bring, its command and its seconds of device time (start, transfer and idle waits included), which
sum to at most 13 of the slot's 15 minutes: a measuring job, the DALI parts ferried in jobs that
only receive one (seconds each), a second measuring job. Downloads and the DALI repack are
skipped when their outputs are there and match the pins; ``SOURCE.json`` is rewritten every call
(run it again after a commit, seconds).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script: tools/ is on the path, the repository is not
    sys.path.insert(0, str(REPO))

from tools import gpu_pack  # noqa: E402
from tools.gpu_node import sha256, write_json  # noqa: E402

PINS = REPO / "requirements-gpu.txt"
GPU_DIR = REPO / ".gpu"
MIB = 1 << 20
JOB_LIMIT = 64 * MIB  # what one job may bring: the tree plus every carried folder
SMALL_LIMIT = 10 * MIB  # the small wheels travel with every job
STATE_ALLOWANCE = 2 * MIB  # runs/gpu, brought back to a bare node
HEADROOM = 3 * MIB  # the tree grows with commits made after gpu-prepare
# The slot (issue 50): 15 minutes of device time in all, every start, job and idle wait counted;
# the plan spends at most PLAN_S of it, the rest is slack for a slow reply or a failed start.
SLOT_S = 15 * 60
PLAN_S = 13 * 60
START_S = 30  # a fresh node's start (the 9a9aaeb pass: ~28 s with its first transfer)
GAP_S = 10  # between a job's reply and the next call: the warm node idles, and that is counted
# Bringing a job's payload (the device tool's held_s grows by more than a job's wall_s; the
# difference, over the payload, is the rate): the 7332174 pass's 61-MiB ferries cost 5-6 s of
# device time, node time included (10 MiB/s or more); 8 MiB/s keeps some slack (docs/gpu.md).
# --transfer-mib-s plans with another rate.
TRANSFER_MIB_S = 8.0
RECEIVE_S = 5  # a ferry job on the node: keep the part (a copy and its SHA-256)
DALI_INSTALL_S = 60  # the last ferry: join the parts, check, pip-install 9 wheels (13 s here)
FIRST_DEADLINE_S = 330  # job 1: the small wheels' install, then the throughput pairs (part a)
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in range(17, 40)] + [
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
]


class PrepareError(Exception):
    """A step that cannot go on: one line naming what and the fix."""


def say(message: str) -> None:
    print(f"[gpu-prepare] {message}", flush=True)


def read_pins(path: Path = PINS) -> dict[str, list[tuple[str, str]]]:
    """``{"small": [(name, version), ...], "dali": [...]}`` from requirements-gpu.txt's sections."""
    groups: dict[str, list[tuple[str, str]]] = {}
    group = None
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        header = re.fullmatch(r"#\s*\[(\w+)\]\s*", raw)
        if header:
            group = groups.setdefault(header.group(1), [])
            continue
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"([A-Za-z0-9_.\-]+)==([\w.\-+]+)", line)
        if not m or group is None:
            raise PrepareError(
                f"{path.name}:{number}: {raw.strip()!r}: expected NAME==VERSION under a "
                "'# [small]' or '# [dali]' header"
            )
        group.append((m.group(1), m.group(2)))
    for needed in ("small", "dali"):
        if needed not in groups:
            raise PrepareError(f"{path.name}: no '# [{needed}]' section")
    return groups


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def cached_wheel(cache: Path, name: str, version: str) -> Path | None:
    found = [
        p
        for p in cache.glob("*.whl")
        if normalise(p.name.split("-")[0]) == normalise(name) and p.name.split("-")[1] == version
    ]
    return found[0] if len(found) == 1 else None


def pip(*args: str, env: dict | None = None) -> None:
    cmd = [sys.executable, "-m", "pip", "--disable-pip-version-check", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})})
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise PrepareError(f"{' '.join(cmd[3:])} failed: {' | '.join(tail)}")


def fetch(pins: list[tuple[str, str]], python_version: str, cache: Path) -> list[Path]:
    """The wheels of ``pins`` (name, version) for the node's Python, downloaded once into ``cache``
    (those missing in one pip call: each call costs pip's start-up)."""
    cache = cache / f"cp{python_version.replace('.', '')}"
    cache.mkdir(parents=True, exist_ok=True)
    missing = [(n, v) for n, v in pins if cached_wheel(cache, n, v) is None]
    for name, version in missing:
        if normalise(name) == "deepspeed":
            build_deepspeed(version, cache)
    wanted = [f"{n}=={v}" for n, v in missing if normalise(n) != "deepspeed"]
    if wanted:
        say(f"downloading {', '.join(wanted)} for Python {python_version}")
        platforms = [a for p in PLATFORMS for a in ("--platform", p)]
        pip(
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--python-version",
            python_version,
            "--implementation",
            "cp",
            *platforms,
            "-d",
            str(cache),
            *wanted,
            env={"PIP_FIND_LINKS": ""},
        )
    wheels = [cached_wheel(cache, n, v) for n, v in pins]
    for (name, version), wheel in zip(pins, wheels):
        if wheel is None:
            raise PrepareError(f"{name}=={version}: pip left no single wheel in {cache}")
    return wheels


def build_deepspeed(version: str, cache: Path) -> None:
    """DeepSpeed has an sdist only: a pure-Python wheel without its CUDA ops. Asked by name, not
    from a downloaded sdist, so pip takes the wheel it built for ./run.sh setup from its cache
    (0.5 s) instead of building it again (14 s here)."""
    say(f"building deepspeed=={version} from its sdist (DS_BUILD_OPS=0), or pip's cached build")
    # --no-build-isolation: its setup.py imports torch, this venv's
    build = ("wheel", "--no-deps", "--no-build-isolation", "--no-binary", "deepspeed")
    target = ("-w", str(cache), f"deepspeed=={version}")
    env = {"DS_BUILD_OPS": "0", "PIP_FIND_LINKS": ""}
    pip(*build, *target, env=env)
    wheel = cached_wheel(cache, "deepspeed", version)
    if wheel is not None and not wheel.name.endswith("-py3-none-any.whl"):
        # pip's cache held a build with compiled ops (DS_BUILD_OPS=1 at install), which fits this
        # Python alone: built again without them, past the cache
        say(f"{wheel.name} has compiled ops: building it again without them")
        wheel.unlink()
        pip(*build, "--no-cache-dir", *target, env=env)


def wheel_entry(path: Path) -> dict:
    return {"file": path.name, "bytes": path.stat().st_size, "sha256": sha256(path)}


def prepare_small(wheels: list[Path], out: Path, python_version: str) -> dict:
    """Copy the small wheels into ``out`` (only those: stale ones removed) with their manifest."""
    out.mkdir(parents=True, exist_ok=True)
    keep = {w.name for w in wheels}
    for old in out.glob("*.whl"):
        if old.name not in keep:
            old.unlink()
    for wheel in wheels:
        target = out / wheel.name
        if not target.is_file() or target.stat().st_size != wheel.stat().st_size:
            shutil.copy2(wheel, target)
    manifest = {
        "python": python_version,
        "wheels": [wheel_entry(out / w.name) for w in sorted(wheels)],
    }
    total = sum(w["bytes"] for w in manifest["wheels"])
    if total > SMALL_LIMIT:
        raise PrepareError(
            f"the small wheels are {total / MIB:.1f} MiB, over {SMALL_LIMIT // MIB} MiB: move the "
            "largest to requirements-gpu.txt's [dali] section (it is split into parts)"
        )
    write_json(out / "MANIFEST.json", manifest)
    return manifest


def pack_dali(wheels: list[Path], cache: Path) -> Path:
    """DALI's wheels, rewritten uncompressed, in one xz tar in ``cache``: made once per set."""
    source = [wheel_entry(w) for w in sorted(wheels)]
    key = hashlib.sha256(json.dumps([source, "stored-zips.tar.xz"]).encode()).hexdigest()[:16]
    packed = cache / f"dali-{key}.tar.xz"
    if packed.is_file():
        return packed
    cache.mkdir(parents=True, exist_ok=True)
    total = sum(w["bytes"] for w in source)
    say(f"DALI: repacking {len(wheels)} wheels ({total / MIB:.0f} MiB) into one xz tar (minutes)")
    with tempfile.TemporaryDirectory(dir=cache, prefix="dali-repack-") as tmp:
        # a wheel is a deflated zip: rewritten uncompressed (the same files, the same RECORD; pip
        # installs a stored zip as it is), xz then compresses the contents ~30% better than deflate
        tar_path = Path(tmp) / "dali.tar"
        with tarfile.open(tar_path, "w") as tar:
            for wheel in sorted(wheels):
                stored = Path(tmp) / wheel.name
                with (
                    zipfile.ZipFile(wheel) as src,
                    zipfile.ZipFile(stored, "w", zipfile.ZIP_STORED) as dst,
                ):
                    for info in src.infolist():
                        data = src.read(info)
                        info.compress_type = zipfile.ZIP_STORED
                        dst.writestr(info, data)
                tar.add(stored, arcname=wheel.name)
                stored.unlink()
        done = Path(tmp) / "dali.tar.xz"
        if shutil.which("xz"):  # its own threads, on every core
            subprocess.run(["xz", "-T0", "-6", str(tar_path)], check=True)
        else:
            with open(tar_path, "rb") as src, lzma.open(done, "wb", preset=6) as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        done.replace(packed)
    return packed


def repack_dali(
    wheels: list[Path],
    parts_root: Path,
    part_bytes: int,
    python_version: str,
    cache: Path | None = None,
) -> dict:
    """DALI's wheels as one xz tar (:func:`pack_dali`) split into ``.gpu/dali-N/`` folders of at
    most ``part_bytes`` each, with their checksums and the part count. Skipped when the existing
    parts were cut from the same pack at the same size."""
    packed = pack_dali(wheels, cache or parts_root / "cache")
    whole = {"bytes": packed.stat().st_size, "sha256": sha256(packed)}
    key = {"whole": whole, "part_bytes": part_bytes, "python": python_version}
    existing = sorted(parts_root.glob("dali-*/PART.json"))
    if existing:
        old = json.loads(existing[0].read_text())
        if old.get("made_from") == key and len(existing) == old["parts"]:
            if all((p.parent / json.loads(p.read_text())["file"]).is_file() for p in existing):
                say(f"DALI: {old['parts']} parts already cut from this pack")
                return old
    for folder in parts_root.glob("dali-*"):
        shutil.rmtree(folder)
    count = -(-whole["bytes"] // part_bytes)
    say(
        f"DALI: {whole['bytes'] / MIB:.0f} MiB packed, {count} parts of at most "
        f"{part_bytes / MIB:.1f} MiB"
    )
    with open(packed, "rb") as src:
        for n in range(1, count + 1):
            folder = parts_root / f"dali-{n}"
            folder.mkdir(parents=True, exist_ok=True)
            name = f"dali.tar.xz.part{n}"
            with open(folder / name, "wb") as dst:
                dst.write(src.read(part_bytes))
            meta = {
                "part": n,
                "parts": count,
                "file": name,
                "bytes": (folder / name).stat().st_size,
                "sha256": sha256(folder / name),
                "whole": whole,
                "wheels": [w.name for w in sorted(wheels)],
                "made_from": key,
            }
            write_json(folder / "PART.json", meta)
    return json.loads((parts_root / "dali-1" / "PART.json").read_text())


def tree_files(repo: Path = REPO) -> list[str]:
    """What a job brings of the work tree: tracked files and untracked ones git does not ignore."""
    proc = subprocess.run(
        ["git", "-C", str(repo), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise PrepareError(f"git ls-files failed in {repo}: {proc.stderr.strip()}")
    return sorted({f for f in proc.stdout.split("\0") if f and (repo / f).is_file()})


def source_record(repo: Path = REPO) -> dict:
    """The git SHA and each tracked file's SHA-256: the node, without .git, checks its copy against
    them (tools/gpu_node.py: the SHA it records, with ``-modified`` where a file differs)."""
    sys.path.insert(0, str(repo))
    from dstrain.core.provenance import git_sha

    tracked = subprocess.run(
        ["git", "-C", str(repo), "ls-files", "-z"], capture_output=True, text=True
    ).stdout.split("\0")
    files = {f: sha256(repo / f) for f in sorted(tracked) if f and (repo / f).is_file()}
    return {"git_sha": git_sha(), "files": files}


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else 0


def plan(
    gpu_dir: Path,
    repo: Path = REPO,
    transfer_mib_s: float = TRANSFER_MIB_S,
    state: Path | None = None,
    registry: Path | None = None,
    slug: str = "h100",
) -> list[dict]:
    """The slot plan: what each job brings, its payload against the limit, the command and its
    seconds of device time (start, transfer, node time, the idle wait before the next call).

    The parts run in priority order (throughput pairs, DALI, the GPU tests, ...), continued across
    jobs and slots from the state in ``runs/gpu`` (imported after each job). DALI's parts come in
    ferry jobs that bring one part and nothing else (the node keeps them, and the small wheels'
    install, while warm); they come after a first measuring job while the throughput pairs are
    still to measure, first where those are done, and not at all once DALI's part is done. The
    measuring jobs share what is left of PLAN_S, each ending itself within the node's limit."""
    tree = sum((repo / f).stat().st_size for f in tree_files(repo))
    small = folder_bytes(gpu_dir / "wheels")
    state_dir = state or repo / "runs/gpu"
    state = max(folder_bytes(state_dir), STATE_ALLOWANCE)
    parts = sorted(gpu_dir.glob("dali-*"), key=lambda p: int(p.name.split("-")[1]))
    done = parts_done(state_dir, gpu_pack.imported_complete(slug, registry))
    if "dali" in done:
        parts = []

    def transfer(payload: int) -> float:
        return payload / MIB / transfer_mib_s

    def job(carry: list[str], payload: int, command: str, node_s: float, what: str) -> dict:
        return {
            "carry": carry,
            "payload_bytes": payload,
            "fits": payload <= JOB_LIMIT,
            "command": command,
            "what": what,
            "node_s": round(node_s),
            "transfer_s": round(transfer(payload), 1),
        }

    measure = [".gpu/wheels", "runs/gpu"]
    jobs = []
    wheels_first = bool(parts) and "throughput" not in done  # the pairs first: they need no DALI
    if wheels_first:
        jobs.append(
            job(
                measure,
                tree + small + state,
                f"./run.sh gpu --deadline {FIRST_DEADLINE_S}",
                FIRST_DEADLINE_S,
                "install the small wheels; the parts in order (the throughput pairs first)",
            )
        )
    for n, folder in enumerate(parts, 1):
        # with the wheels installed by then, the last part installs DALI; else the next measuring job
        last = n == len(parts) and wheels_first
        jobs.append(
            job(
                [f".gpu/{folder.name}"],
                tree + folder_bytes(folder),
                "./run.sh gpu --receive",
                RECEIVE_S + (DALI_INSTALL_S if last else 0),
                f"keep DALI part {n} of {len(parts)}" + ("; install DALI" if last else ""),
            )
        )
    while True:  # measuring jobs in what is left of the plan
        spent = START_S + sum(j["transfer_s"] + j["node_s"] + GAP_S for j in jobs)
        payload = tree + small + state
        install = bool(parts) and not any(j["carry"] == measure for j in jobs)
        deadline = int(min(PLAN_S - spent - transfer(payload) - GAP_S, DEADLINE_CAP_S))
        if deadline < MIN_LAST_DEADLINE_S and any(j["carry"] == measure for j in jobs):
            break
        jobs.append(
            job(
                measure,
                payload,
                f"./run.sh gpu --deadline {max(deadline, 0)}",
                max(deadline, 0),
                "the parts in order, from where the last job stopped"
                + ("; installs DALI from the kept parts first" if install else ""),
            )
        )
    elapsed = START_S
    for n, j in enumerate(jobs, 1):
        elapsed += j["transfer_s"] + j["node_s"] + GAP_S
        j.update(job=n, device_s=round(elapsed))
    jobs[-1]["enough_time"] = jobs[-1]["node_s"] >= MIN_LAST_DEADLINE_S
    return jobs


def parts_done(state: Path, imported: set[str] = frozenset()) -> set[str]:
    """The parts ``runs/gpu``'s record calls complete (DALI's only when no test still waits for
    it), or that were imported complete in an earlier slot (``imported``: on a machine that has
    lost ``runs/gpu``, ``./run.sh gpu`` skips them too): what the plan need not bring anything for."""
    done: set[str] = set(imported)
    for path in state.glob("gpu_run_*.json"):
        try:
            record = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        for name, part in record.get("parts", {}).items():
            if part.get("complete") and not part.get("dali_pending"):
                done.add(name)
        if record.get("parts", {}).get("tests", {}).get("dali_pending"):
            done.discard("dali")
    return done


DEADLINE_CAP_S = 560  # a job's own end within the node's 10 minutes (tools/gpu_run.py DEADLINE_S)
MIN_LAST_DEADLINE_S = 120  # below it the last job measures too little: fewer or smaller parts


def print_plan(jobs: list[dict], transfer_mib_s: float = TRANSFER_MIB_S) -> None:
    total = jobs[-1]["device_s"] if jobs else 0
    print(
        f"\nThe slot plan: {len(jobs)} jobs, ~{total / 60:.1f} of the slot's {SLOT_S // 60} minutes "
        f"(plan <= {PLAN_S // 60}); run each as soon as the last one's reply arrives (the node "
        f"stays warm 30 s), with the device tool's carry=FOLDERS and command:"
    )
    print(
        f"  {'job':>3}  {'payload':>13}  {'carry':30}  {'command':32}  {'s':>4}  {'total':>5}  what"
    )
    for j in jobs:
        flag = "" if j["fits"] else "  OVER THE LIMIT"
        payload = f"{j['payload_bytes'] / MIB:4.1f}/{JOB_LIMIT // MIB} MiB"
        own = j["transfer_s"] + j["node_s"] + GAP_S
        print(
            f"  {j['job']:>3}  {payload:>13}  {' '.join(j['carry']):30}  {j['command']:32}  "
            f"{own:4.0f}  {j['device_s']:5d}  {j['what']}{flag}"
        )
    if jobs and not jobs[-1].get("enough_time", True):
        print("  WARNING: the last job has under 2 minutes: the ferries take too long")
    print(
        f"  Seconds: transfer at {transfer_mib_s:g} MiB/s (docs/gpu.md: the 7332174 pass saw 10 or "
        "more), "
        f"the node's time, {GAP_S} s before the next call; the first adds the {START_S}-s start.\n"
        "  After each measuring job: ./run.sh gpu-import <its gpu_state.tar.gz>; after the last, "
        "give the node back.\n"
        "  The DALI parts must all arrive while the node stays warm; a bare node needs them again. "
        "What the last job does not finish, the next slot's first job continues."
    )


def part_size(gpu_dir: Path, repo: Path = REPO) -> int:
    """The largest DALI part a ferry job brings beside the tree (and nothing else)."""
    tree = sum((repo / f).stat().st_size for f in tree_files(repo))
    room = JOB_LIMIT - tree - HEADROOM
    if room < 4 * MIB:
        raise PrepareError(
            f"the work tree ({tree / MIB:.1f} MiB) leaves {room / MIB:.1f} MiB for a DALI part: "
            "make the tree smaller"
        )
    return room


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--python-version", default="3.12", help="the node's Python (default 3.12)")
    p.add_argument("--out", default=str(GPU_DIR), help="where the folders go (default .gpu)")
    p.add_argument("--pins", default=str(PINS), help="the pins file (default requirements-gpu.txt)")
    p.add_argument(
        "--dali-wheels",
        help="take the [dali] wheels from this folder instead of downloading them "
        "(a stand-in set for tests)",
    )
    p.add_argument("--part-mib", type=float, help="DALI part size (default: what fits a job)")
    p.add_argument(
        "--transfer-mib-s",
        type=float,
        default=TRANSFER_MIB_S,
        help=f"the device tool's transfer rate for the plan's seconds (default {TRANSFER_MIB_S:g}: "
        "assumed until a GPU pass measures it)",
    )
    p.add_argument("--cache", help="where downloads are kept (default .gpu/cache)")
    p.add_argument(
        "--state",
        help="the imported GPU state the plan follows (default runs/gpu: what gpu-import wrote)",
    )
    p.add_argument(
        "--slug",
        default="h100",
        help="the GPU the plan is for, as its result files are named (default h100, the kind a "
        "plain device call gets): its parts imported complete are not planned again",
    )
    p.add_argument("--plan", action="store_true", help="print the job list only")
    p.add_argument(
        "--verify",
        action="store_true",
        help="join the DALI parts here as the node does, check them and install the wheels with "
        "pip into a temporary folder for the node's Python (pip --target --python-version)",
    )
    args = p.parse_args(argv)
    if not re.fullmatch(r"3\.\d+", args.python_version):
        p.error(f"--python-version {args.python_version}: expected 3.N, e.g. 3.12")
    gpu_dir = Path(args.out).resolve()
    try:
        if args.verify:
            verify(gpu_dir, args.python_version)
            return 0
        if not args.plan:
            prepare(args, gpu_dir)
        state = Path(args.state).resolve() if args.state else None
        jobs = plan(gpu_dir, transfer_mib_s=args.transfer_mib_s, state=state, slug=args.slug)
    except PrepareError as err:
        print(f"[gpu-prepare] error: {err}", file=sys.stderr)
        return 2
    print_plan(jobs, args.transfer_mib_s)
    write_json(gpu_dir / "JOBS.json", {"jobs": jobs})
    return 0 if all(j["fits"] for j in jobs) else 1


def verify(gpu_dir: Path, python_version: str) -> None:
    """The node's DALI install, here: every part's and the whole's SHA-256, the tar, each wheel's
    zip, and pip installing all of them (``--target``, for ``python_version``)."""
    metas = [json.loads(p.read_text()) for p in sorted(gpu_dir.glob("dali-*/PART.json"))]
    if not metas:
        raise PrepareError(f"no DALI parts in {gpu_dir}: run ./run.sh gpu-prepare first")
    count = metas[0]["parts"]
    if sorted(m["part"] for m in metas) != list(range(1, count + 1)):
        raise PrepareError(f"{gpu_dir}: parts {sorted(m['part'] for m in metas)} of {count}")
    with tempfile.TemporaryDirectory(prefix="dali-verify-") as tmp:
        whole = Path(tmp) / "dali.tar.xz"
        with open(whole, "wb") as out:
            for n in range(1, count + 1):
                part = gpu_dir / f"dali-{n}" / f"dali.tar.xz.part{n}"
                meta = next(m for m in metas if m["part"] == n)
                if sha256(part) != meta["sha256"]:
                    raise PrepareError(f"{part}: SHA-256 differs from its PART.json")
                out.write(part.read_bytes())
        if sha256(whole) != metas[0]["whole"]["sha256"]:
            raise PrepareError("the joined parts' SHA-256 differs from the pack's")
        with tarfile.open(whole, "r:xz") as tar:
            tar.extractall(tmp, filter="data")
        wheels = [Path(tmp) / name for name in metas[0]["wheels"]]
        for wheel in wheels:
            with zipfile.ZipFile(wheel) as z:
                bad = z.testzip()
                if bad:
                    raise PrepareError(f"{wheel.name}: {bad} is damaged")
        platforms = [a for p in PLATFORMS for a in ("--platform", p)]
        pip(
            "install",
            "--quiet",
            *("--no-index", "--no-deps", "--only-binary=:all:", "--no-compile"),
            *("--python-version", python_version, "--implementation", "cp", *platforms),
            *("--target", str(Path(tmp) / "site")),
            *map(str, wheels),
        )
        files = sum(1 for _ in (Path(tmp) / "site").rglob("*"))
        if not (Path(tmp) / "site" / "nvidia" / "dali" / "__init__.py").is_file():
            raise PrepareError("pip installed the wheels but nvidia/dali/__init__.py is not there")
    say(
        f"verified: {count} parts, the whole's SHA-256, {len(wheels)} wheels' zips, and pip "
        f"installed them for Python {python_version} ({files} files)"
    )


def prepare(args: argparse.Namespace, gpu_dir: Path) -> None:
    pins = read_pins(Path(args.pins))
    gpu_dir.mkdir(parents=True, exist_ok=True)
    cache = Path(args.cache) if args.cache else gpu_dir / "cache"
    small = fetch(pins["small"], args.python_version, cache)
    manifest = prepare_small(small, gpu_dir / "wheels", args.python_version)
    total = sum(w["bytes"] for w in manifest["wheels"])
    say(f"small wheels: {len(small)} in .gpu/wheels, {total / MIB:.1f} MiB")
    write_json(gpu_dir / "wheels" / "SOURCE.json", source_record())
    if args.dali_wheels:
        folder = Path(args.dali_wheels)
        dali = [w for n, v in pins["dali"] if (w := cached_wheel(folder, n, v)) is not None]
        if not dali:
            raise PrepareError(f"--dali-wheels {folder}: none of {pins['dali']} is there")
    else:
        dali = fetch(pins["dali"], args.python_version, cache)
    size = int(args.part_mib * MIB) if args.part_mib else part_size(gpu_dir)
    repack_dali(dali, gpu_dir, size, args.python_version, cache)
    stale = gpu_dir / "fmnist"  # brought for the accuracy part, which the GPU pass no longer runs
    if stale.is_dir():
        shutil.rmtree(stale)


if __name__ == "__main__":
    sys.exit(main())
