"""Convert an image folder to shards, or index existing shards (``python -m dstrain.data.convert``).

    python -m dstrain.data.convert SRC DST --format wds       # SRC/{train,val}/<class>/* -> DST
    python -m dstrain.data.convert SRC DST --format recordio --shard-size 5000
    python -m dstrain.data.convert SRC DST --val-labels LOC_val_solution.csv  # val/ holds files
    python -m dstrain.data.convert --index DST/train/*.tar    # indexes for shards made elsewhere

SRC is an ImageNet-style folder (``train/<class>/*``, ``val/<class>/*``; or ``val/*`` directly, as
image-net.org ships it, with ``--val-labels FILE``: the labels file ``data.val_labels`` takes,
whose labels the shards then carry). DST gets
``{train,val}/<split>-NNNNN.tar`` (WebDataset: ``<key>.jpg`` + ``<key>.cls`` per image) or
``.rec`` (MXNet RecordIO, a 24-byte header with the label, then the image), each with its ``.idx``
in the format of DALI's ``wds2idx`` / ``rec2idx``, and ``classes.txt`` (the class folder names,
line k = class k). The images' bytes are copied, not re-encoded, in the folder scan's order: the
converted copy trains on the same global batches and crops as the folder. Train with
``data.format=wds`` (or ``recordio``) and ``data.root=DST``.

It refuses a DST that exists and is not empty, writes into ``DST.partial`` and renames it at the
end: a stopped conversion leaves no DST that looks complete. ``--index`` refuses an existing
``.idx``. Exit 0 done, 2 bad input (one line naming the file and the fix).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

from dstrain.core.errors import ConfigError
from dstrain.core.files import atomic_write_text
from dstrain.data import shards
from dstrain.data.images import scan_folder


class Progress:
    """``split: done/total images (p%), rate img/s, ETA`` on stderr: redrawn in place on a
    terminal, every 10% otherwise (a log file)."""

    def __init__(self, what: str, total: int):
        self.what, self.total, self.done = what, total, 0
        self.t0 = self.shown = time.perf_counter()
        self.tty, self.next_tenth = sys.stderr.isatty(), 1

    def step(self, n: int = 1) -> None:
        self.done += n
        now = time.perf_counter()
        tenth = self.done * 10 // max(1, self.total)
        if (self.tty and now - self.shown > 0.5) or tenth >= self.next_tenth:
            self.shown, self.next_tenth = now, tenth + 1
            self.show(now)

    def show(self, now: float, end: str = "") -> None:
        rate = self.done / max(now - self.t0, 1e-9)
        eta = (self.total - self.done) / rate if rate else 0
        line = (
            f"{self.what}: {self.done}/{self.total} images ({100 * self.done / self.total:.0f}%), "
            f"{rate:.0f} img/s, ETA {eta:.0f} s"
        )
        print(
            ("\r" + line) if self.tty else line,
            end=end or ("" if self.tty else "\n"),
            file=sys.stderr,
            flush=True,
        )

    def close(self) -> None:
        self.show(time.perf_counter(), end="\n")


def image_ext(path: str) -> str:
    ext = Path(path).suffix.lower().lstrip(".")
    return "jpg" if ext in ("jpeg", "jpg") else ext


def convert(
    src: Path, dst: Path, fmt: str, shard_size: int, val_labels: str = ""
) -> dict[str, int]:
    """Write ``src``'s splits as ``fmt`` shards under ``dst``; images per split. ``val_labels``:
    ``src/val`` holds its images directly, labelled by this file (dstrain/data/images.py)."""
    if shard_size < 1:
        raise ConfigError(f"--shard-size {shard_size}: must be >= 1 image per shard")
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise ConfigError(
            f"{dst}: exists and is not empty; refusing to overwrite it: choose a new DST"
        )
    # every class folder, file and label listed before anything is written
    train, val = scan_folder(str(src), val_labels)
    partial = dst.with_name(dst.name + ".partial")
    if partial.exists():
        shutil.rmtree(partial)
    counts = {}
    for split, images in (("train", train), ("val", val)):
        write_split(images, partial / split, split, fmt, shard_size)
        counts[split] = len(images)
    (partial / "classes.txt").write_text("".join(c + "\n" for c in train.classes))
    if dst.exists():
        dst.rmdir()  # empty, checked above
    partial.rename(dst)
    return counts


def write_split(images, folder: Path, split: str, fmt: str, shard_size: int) -> list[Path]:
    """``images`` (an ImageList of files) as ``fmt`` shards ``folder/<split>-NNNNN`` with their
    indexes, in list order; the shards written."""
    folder.mkdir(parents=True)
    progress, written = Progress(f"{split} -> {fmt}", len(images)), []
    for start in range(0, len(images), shard_size):
        shard = folder / f"{split}-{start // shard_size:05d}{shards.SHARD_SUFFIX[fmt]}"
        writer = shards.TarWriter(shard) if fmt == "wds" else shards.RecordWriter(shard)
        for i in range(start, min(start + shard_size, len(images))):
            data = Path(images.files[i]).read_bytes()
            label = int(images.labels[i])
            if fmt == "wds":
                members = [(image_ext(images.files[i]), data), ("cls", str(label).encode())]
                writer.add(f"{i:08d}", members)
            else:
                writer.add(label, data)
            progress.step()
        shards.index_path(shard).write_text(writer.close())
        written.append(shard)
    progress.close()
    return written


def index_shard(shard: Path) -> Path:
    """Write the index of an existing shard (a .tar or a .rec) beside it; refuses an existing one."""
    idx = shards.index_path(shard)
    if not shard.is_file():
        raise ConfigError(f"{shard}: no such shard")
    if idx.exists():
        raise ConfigError(f"{idx}: exists; remove it to index {shard} again")
    if shard.suffix == ".tar":
        text = _tar_index(shard)
    elif shard.suffix == ".rec":
        text = _rec_index(shard)
    else:
        raise ConfigError(f"{shard}: not a .tar (WebDataset) nor a .rec (RecordIO) shard")
    atomic_write_text(
        idx, text
    )  # a fresh temporary name beside the shard: nothing planted is followed
    return idx


def _tar_index(shard: Path) -> str:
    import tarfile

    groups: list[list[str]] = []
    last = None
    try:
        with tarfile.open(shard) as tar:
            for member in tar:
                if not member.isfile():
                    continue
                base = member.name.rsplit("/", 1)[-1]
                if "." not in base:
                    continue
                key = member.name[: len(member.name) - len(base) + base.index(".")]
                ext = base[base.index(".") + 1 :]
                entry = f"{ext} {member.offset_data} {member.size} {member.name}"
                if key != last:
                    groups.append([entry])
                    last = key
                else:
                    groups[-1].append(entry)
    except tarfile.TarError as err:
        raise ConfigError(f"{shard}: not a readable tar file ({err}); copy it again") from None
    if not groups:
        raise ConfigError(f"{shard}: holds no files")
    return f"{shards.WDS_INDEX_VERSION} {len(groups)}\n" + "".join(
        " ".join(g) + "\n" for g in groups
    )


def _rec_index(shard: Path) -> str:
    import mmap

    lines, pos = [], 0
    with open(shard, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as m:
        while pos < len(m):
            start = pos
            while True:  # one logical record: its parts up to cflag 0 or 3
                shards.read_record(m, pos, str(shard))  # checks magic and length
                lrec = int.from_bytes(m[pos + 4 : pos + 8], "little")
                length, cflag = lrec & shards.LENGTH_MASK, lrec >> 29
                pos += 8 + length + (-length % 4)
                if cflag in (0, 3):
                    break
            lines.append(f"{len(lines)}\t{start}\n")
    return "".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m dstrain.data.convert", description=__doc__.split("\n\n")[0]
    )
    p.add_argument(
        "src", nargs="?", type=Path, help="an image folder: train/<class>/*, val/<class>/*"
    )
    p.add_argument(
        "dst", nargs="?", type=Path, help="where the shards go (must not exist, or be empty)"
    )
    p.add_argument("--format", choices=("wds", "recordio"), default="wds")
    p.add_argument("--shard-size", type=int, default=5000, help="images per shard (default 5000)")
    p.add_argument(
        "--val-labels",
        default="",
        metavar="FILE",
        help="SRC/val holds the images directly (image-net.org's layout), labelled by FILE: "
        "LOC_val_solution.csv or one label per line (as data.val_labels)",
    )
    p.add_argument("--index", nargs="+", type=Path, metavar="SHARD", help="only index these shards")
    args = p.parse_args(argv)
    try:
        if args.index:
            for shard in args.index:
                print(f"{index_shard(shard)}")
            return 0
        if args.src is None or args.dst is None:
            p.error("give SRC and DST (or --index SHARD ...)")
        counts = convert(args.src, args.dst, args.format, args.shard_size, args.val_labels)
    except ConfigError as err:
        print(f"convert: {err}", file=sys.stderr)
        return 2
    print(
        f"{args.dst}: {counts['train']} train / {counts['val']} val images as {args.format} shards; "
        f"train with data.format={args.format} data.root={args.dst}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
