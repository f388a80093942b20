"""Find every image that does not decode, in any layout dstrain reads, before a long run does.

    python -m dstrain.data.check /data/imagenet [--workers 16]
    python -m dstrain.data.check /data/imagenet-wds                  # shards: the format is found
    python -m dstrain.data.check /data/imagenet --val-labels LOC_val_solution.csv

Lists the data the way the trainer does (dstrain.data.images.scan_images: class folders, the flat
val folder with its labels file, WebDataset or RecordIO shards checked against their indexes,
NVIDIA's train.rec/val.rec), fully decodes every image with PIL in a process pool (a shard
sample from its bytes), prints one line per undecodable image (a file, or shard:member) and a
summary. ``--format`` defaults to what ROOT holds. Exit status: 0 all decode, 1 some do not, 2
the data itself is unusable.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

_SPLITS: list = []  # the scanned splits, in each decode process


def detect_format(root: Path) -> str:
    """What ROOT holds: shards (.tar: wds; .rec: recordio; NVIDIA's train.rec) or a folder."""
    train = root / "train"
    if (root / "train.rec").is_file() and not train.is_dir():
        return "recordio"
    if train.is_dir():
        names = {p.suffix for p in train.iterdir() if p.is_file()}
        if ".tar" in names:
            return "wds"
        if ".rec" in names:
            return "recordio"
    return "folder"


def shard_classes(root: Path) -> int | None:
    """Classes a shard label may take: those of the converter's classes.txt, else None: any (shards
    made by webdataset or timm come without one)."""
    listed = root / "classes.txt"
    return len(listed.read_text().split()) if listed.is_file() else None


def _init(splits: list) -> None:
    global _SPLITS
    _SPLITS = splits


def _decode(key: tuple[int, int]) -> str | None:
    from dstrain.data.images import decode_error

    split, i = key
    return decode_error(_SPLITS[split].source(i))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m dstrain.data.check", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("root", help="data.root: class folders, or train/ and val/ shards")
    p.add_argument(
        "--format",
        choices=("auto", "folder", "wds", "recordio"),
        default="auto",
        help="data.format (default: what ROOT holds)",
    )
    p.add_argument(
        "--val-labels", default="", metavar="FILE", help="data.val_labels: val/ holds its files"
    )
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="decode processes")
    args = p.parse_args(argv)
    from dstrain.data.convert import Progress
    from dstrain.data.images import scan_images
    from dstrain.settings.config import ConfigError

    root = Path(args.root)
    fmt = detect_format(root) if args.format == "auto" else args.format
    try:
        splits = list(scan_images(str(root), fmt, shard_classes(root), args.val_labels))
    except ConfigError as err:
        print(f"dstrain.data.check: error: {err}", file=sys.stderr)
        return 2
    keys = [(s, i) for s, split in enumerate(splits) for i in range(len(split))]
    t0, bad = time.perf_counter(), 0
    progress = Progress(f"check {root}", len(keys))  # on stderr, as the converter's
    with ProcessPoolExecutor(max(1, args.workers), initializer=_init, initargs=(splits,)) as pool:
        for (s, i), reason in zip(keys, pool.map(_decode, keys, chunksize=64)):
            progress.step()
            if reason is not None:
                bad += 1
                print(f"corrupt image: {splits[s].files[i]} ({reason})", flush=True)
    progress.close()
    print(
        f"{len(keys)} images checked under {root} ({fmt}) in {time.perf_counter() - t0:.1f} s: "
        f"{bad} do not decode"
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
