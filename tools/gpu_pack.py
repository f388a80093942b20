"""What a GPU job hands back, and ``./run.sh gpu-import`` here: the state and results through ``$OUT``.

On the node only what a job writes under ``$OUT`` comes back, within limits: at most 8 files, 16 MiB
each, 64 MiB in all, at most 2 folders deep, names of letters, digits, ``.``, ``_`` and ``-``.
``./run.sh gpu`` packs its whole state folder (``runs/gpu``: records, result files, test progress,
logs) into ``$OUT/gpu_state.tar.gz`` after every finished item, atomically, so a job killed at its
limit still hands back everything finished before. Checkpoints and images are never packed; logs
are cut to their last 64 KiB, and dropped, largest first, while the state is over 2 MiB: it
travels back to a bare node beside a DALI part.

    ./run.sh gpu-import FILE [--partial]    # here: FILE is the gpu_state.tar.gz a job brought back

unpacks it into ``runs/gpu`` (unless that already holds a later job's state), copies the result
files of every complete part into ``results/bench`` (``--partial``: of the others too), registers
them in ``results/gpu_imports.json`` (what a later pass need not measure again), fills in what a
file does not say of itself (title, headline, machine: results/evidence.py's fields) and rewrites
the results index. The next job brings ``runs/gpu`` back: a bare node continues where the last one stopped.
"""

from __future__ import annotations

import argparse
import io
import json
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script: tools/ is on the path, the repository is not
    sys.path.insert(0, str(REPO))

from tools.gpu_node import write_json  # noqa: E402

PACK_NAME = "gpu_state.tar.gz"
STATUS_NAME = "gpu_status.txt"
PACK_LIMIT = 15 << 20  # $OUT takes 16 MiB a file
LOG_TAIL = 64 << 10
STATE_LIMIT = 2 << 20  # unpacked: what runs/gpu may weigh when the next job brings it
NEVER = re.compile(
    r"(\.pt|\.pth|\.ckpt|\.JPEG|\.jpe?g|\.tmp|\.partial\.xml)$|/(checkpoints?|jpegs)/"
)
REGISTRY = REPO / "results/gpu_imports.json"


def _members(state: Path) -> list[Path]:
    return sorted(
        p
        for p in state.rglob("*")
        if p.is_file() and not NEVER.search("/" + str(p.relative_to(state)))
    )


def pack(state: Path, out: Path, status: str = "") -> Path | None:
    """``out/gpu_state.tar.gz`` from ``state`` (within $OUT's limits), and ``out/gpu_status.txt``.

    The state must also travel back to a bare node beside a DALI part (tools/gpu_prepare.py keeps
    2 MiB for it): logs are cut to their last 64 KiB, and the largest dropped while the whole is
    over 2 MiB unpacked; records, result files and test progress are always kept."""
    if not state.is_dir():
        return None
    out.mkdir(parents=True, exist_ok=True)
    contents = {}
    for path in _members(state):
        data = path.read_bytes()
        if path.suffix == ".log" and len(data) > LOG_TAIL:
            data = b"[... cut by gpu_pack: the last 64 KiB follow]\n" + data[-LOG_TAIL:]
        contents[str(path.relative_to(state))] = (data, int(path.stat().st_mtime))
    logs = sorted((k for k in contents if k.endswith(".log")), key=lambda k: -len(contents[k][0]))
    dropped = []
    while logs and sum(len(d) for d, _ in contents.values()) > STATE_LIMIT:
        dropped.append(logs.pop(0))
        del contents[dropped[-1]]
    note = json.dumps({"packed": time.strftime("%Y-%m-%d %H:%M:%S"), "dropped": dropped}).encode()
    contents["PACK.json"] = (note, int(time.time()))
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz", compresslevel=6) as tar:
        for rel, (data, mtime) in sorted(contents.items()):
            info = tarfile.TarInfo(rel)
            info.size, info.mtime = len(data), mtime
            tar.addfile(info, io.BytesIO(data))
    if buffer.tell() > PACK_LIMIT:  # only if records alone pass 15 MiB: a bug, said plainly
        raise RuntimeError(
            f"the state packs to {buffer.tell() >> 20} MiB, over $OUT's 16 MiB a file"
        )
    target = out / PACK_NAME
    tmp = out / (PACK_NAME + ".tmp")
    tmp.write_bytes(buffer.getvalue())
    tmp.replace(target)
    if status:
        (out / STATUS_NAME).write_text(status)
    return target


def _job_of(state: Path) -> int:
    records = list(state.glob("gpu_run_*.json")) if state.is_dir() else []
    return max((json.loads(r.read_text()).get("jobs", 0) for r in records), default=-1)


def unpack(archive: Path, state: Path) -> bool:
    """``archive`` into ``state``, unless ``state`` holds a later job's state; True when unpacked."""
    with tempfile.TemporaryDirectory(prefix="gpu-import-") as tmp:
        with tarfile.open(archive, "r:gz") as tar:
            tar.extractall(tmp, filter="data")
        new, old = _job_of(Path(tmp)), _job_of(state)
        if old > new:
            print(f"[gpu-import] {state} holds job {old}, newer than this pack's {new}: kept")
            return False
        if state.exists():
            shutil.rmtree(state)
        shutil.copytree(tmp, state)
    return True


def finished_results(state: Path, partial: bool) -> list[tuple[Path, dict]]:
    """The result files of each part the record lists, with the part they belong to."""
    found = []
    for record_path in sorted(state.glob("gpu_run_*.json")):
        record = json.loads(record_path.read_text())
        for name, part in record.get("parts", {}).items():
            if not (part.get("complete") or partial):
                continue
            for rel in part.get("files", []):
                path = state / rel
                if path.is_file():
                    found.append((path, {"part": name, "complete": bool(part.get("complete"))}))
    return found


def register(entries: list[dict], registry: Path = REGISTRY) -> None:
    old = json.loads(registry.read_text())["results"] if registry.is_file() else []
    by_file = {e["file"]: e for e in old}
    by_file.update({e["file"]: e for e in entries})
    data = {
        "what": "GPU result files imported by ./run.sh gpu-import (tools/gpu_pack.py): the parts a "
        "later pass need not measure again",
        "results": sorted(by_file.values(), key=lambda e: e["file"]),
    }
    write_json(registry, data)


def imported_complete(slug: str, registry: Path | None = None) -> set[str]:
    """The parts whose result files for this GPU (``*_<slug>.json``) were all imported complete
    (``results/gpu_imports.json``, committed): what a pass need not measure again when the
    ``runs/gpu`` state that imported them is gone with its machine."""
    registry = registry or REGISTRY
    if not registry.is_file():
        return set()
    flags: dict[str, list[bool]] = {}
    for entry in json.loads(registry.read_text()).get("results", []):
        if Path(entry["file"]).stem.endswith(f"_{slug}"):
            flags.setdefault(entry["part"], []).append(bool(entry.get("complete")))
    return {part for part, each in flags.items() if all(each)}


def headline(d: dict) -> str:
    """A one-line headline for a file of ``./run.sh gpu`` that does not carry its own, by what it holds."""
    if "counts" in d:
        from tools.suite import headline as suite_headline

        return suite_headline(d)
    rows = d.get("rows")
    if isinstance(rows, dict):  # smoke: one run per shipped JSON
        ok = sum(1 for r in rows.values() if r.get("exit") == 0)
        return f"{ok} of {len(rows)} runs exited 0"
    ratios = [r["vs_bare"] for r in rows or [] if isinstance(r, dict) and r.get("vs_bare")]
    if ratios:
        return f"dstrain vs its bare twin {min(ratios):.2f}x to {max(ratios):.2f}x ({len(ratios)} rows)"
    if "median_step_ms" in d:
        return f"{len(d['median_step_ms'])} optimizer steps timed"
    return f"{len(d.get('runs') or rows or [])} rows"


def described(data: dict, meta: dict, command: str) -> dict:
    """``data`` with what results/evidence.py needs of a result file filled in where it is missing:
    the part as its title, a headline, the command, and the SHA, date and GPU of its environment."""
    env = data.get("environment") if isinstance(data.get("environment"), dict) else data
    gpu = env.get("device") or env.get("cuda") or "GPU"
    filled = {
        "title": f"GPU `{meta['part']}` part" + ("" if meta["complete"] else " (partial)"),
        "headline": headline(data),
        "command": command,
        "git_sha": env.get("git_sha") or "unknown",
        "date": env.get("date") or time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": f"{gpu}, {env.get('cpu_count', '?')} CPU cores, torch {env.get('torch', '?')}",
    }
    head = {k: data.get(k) or v for k, v in filled.items()}
    return {**head, **{k: v for k, v in data.items() if k not in head}}


def import_pack(
    archive: Path, repo: Path = REPO, partial: bool = False, index: bool = True
) -> list[str]:
    state = repo / "runs/gpu"
    unpack(archive, state)
    results = repo / "results/bench"
    entries, copied = [], []
    for path, meta in finished_results(state, partial):
        target = results / path.name
        shutil.copy2(path, target)
        md = path.with_suffix(".md")
        if md.is_file():
            shutil.copy2(md, results / md.name)
        data = json.loads(path.read_text()) if path.suffix == ".json" else {}
        command = data.get("command") or f"./run.sh gpu {meta['part']}"
        if path.suffix == ".json":
            write_json(target, described(data, meta, command))
        entries.append(
            {
                "file": f"results/bench/{path.name}",
                "part": meta["part"],
                "complete": meta["complete"],
                "command": command,
            }
        )
        copied.append(str(target.relative_to(repo)))
    registry = repo / "results/gpu_imports.json"
    if entries:
        register(entries, registry)
    if index and entries:  # the results index and README's table list them (that tree's tool)
        subprocess.run(
            [sys.executable, str(repo / "results/evidence.py"), "index"], cwd=repo, check=True
        )
    return copied


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="import a GPU job's gpu_state.tar.gz")
    p.add_argument("archive", type=Path, help=f"the {PACK_NAME} a job brought back")
    p.add_argument("--partial", action="store_true", help="also the files of incomplete parts")
    p.add_argument(
        "--repo", type=Path, default=REPO, help="the checkout to import into (default: this one)"
    )
    args = p.parse_args(argv)
    if not args.archive.is_file():
        print(f"[gpu-import] error: {args.archive}: no such file", file=sys.stderr)
        return 2
    try:
        copied = import_pack(args.archive, repo=args.repo.resolve(), partial=args.partial)
    except (tarfile.TarError, OSError, json.JSONDecodeError, KeyError) as err:
        print(
            f"[gpu-import] error: {args.archive}: not a pack of ./run.sh gpu ({err})",
            file=sys.stderr,
        )
        return 2
    for rel in copied:
        print(f"[gpu-import] {rel}")
    print(f"[gpu-import] {len(copied)} result files into results/bench; state in runs/gpu")
    return 0


if __name__ == "__main__":
    sys.exit(main())
