"""What a checkpoint's manifest costs (dstrain/loop/manifest.py), per GB of checkpoint.

    .venv/bin/python bench/checkpoint.py [--gb 4] [--files 8] [--dir DIR] [--repeats 3]

Writes ``--files`` torch.save files of ``--gb`` GB in all into a fresh folder under ``--dir`` (your
cluster file system, to measure it there; default: the system's temporary folder), then times, each
``--repeats`` times: the save itself, the manifest a save adds (every file read back and its CRC-32,
one process as on one rank: with N ranks each reads 1/N), and the check ``resume=auto`` makes
(presence, size, CRC-32). Right after the save the files come from the page cache, as at save time;
a resume after a restart may read them from the disk. Writes results/bench/checkpoint_<host>.json
(default name ``checkpoint_cpu.json``): each median in seconds per GB, and the manifest against the
save in the same run.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from bench.common import provenance, write_result  # noqa: E402
from dstrain.loop import manifest  # noqa: E402

GB = 1e9


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=4.0, help="checkpoint size in GB (1e9 bytes)")
    ap.add_argument("--files", type=int, default=8, help="how many files it is split into")
    ap.add_argument("--dir", default="", help="where to write it (default: a temporary folder)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(REPO / "results/bench/checkpoint_cpu.json"))
    args = ap.parse_args()
    if args.gb <= 0 or args.files < 1 or args.repeats < 1:
        ap.error("--gb must be > 0, --files and --repeats >= 1")
    values = int(args.gb * GB / 4 / args.files)  # float32
    tensors = [torch.randn(values) for _ in range(args.files)]
    size_gb = sum(t.numel() * 4 for t in tensors) / GB
    times: dict[str, list[float]] = {"save": [], "manifest": [], "check": []}
    with tempfile.TemporaryDirectory(dir=args.dir or None, prefix="dstrain-ckpt-bench-") as tmp:
        for repeat in range(args.repeats):
            folder = Path(tmp) / f"r{repeat}"
            folder.mkdir()
            t0 = time.perf_counter()
            for i, t in enumerate(tensors):
                torch.save({"t": t}, folder / f"part{i:03d}.pt")
            t1 = time.perf_counter()
            files = manifest.gather_entries(folder)
            manifest.write(folder, files)
            t3 = time.perf_counter()
            found = manifest.problems(folder)
            t4 = time.perf_counter()
            if found:
                raise SystemExit(f"bench/checkpoint.py: the check found damage: {found}")
            for key, seconds in (("save", t1 - t0), ("manifest", t3 - t1), ("check", t4 - t3)):
                times[key].append(seconds)
            shutil.rmtree(folder)
    per_gb = {k: round(statistics.median(v) / size_gb, 4) for k, v in times.items()}
    result = {
        **provenance("checkpoint.py"),
        "checkpoint_gb": round(size_gb, 4),
        "files": args.files,
        "repeats": args.repeats,
        "dir": args.dir or tempfile.gettempdir(),
        "seconds": {k: [round(x, 6) for x in v] for k, v in times.items()},
        "seconds_per_gb": per_gb,
        "manifest_vs_save": round(
            statistics.median(times["manifest"]) / statistics.median(times["save"]), 3
        ),
    }
    headline = (
        f"manifest {per_gb['manifest']:.2f} s/GB ({result['manifest_vs_save']:.2f}x the save's "
        f"{per_gb['save']:.2f} s/GB), resume's check {per_gb['check']:.2f} s/GB, one process"
    )
    title = f"Checkpoint manifest cost, {size_gb:.2f} GB in {args.files} files"
    out = write_result(Path(args.out), result, title=title, headline=headline)
    print(headline)
    print("->", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
