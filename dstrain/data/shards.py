"""ImageNet as shards: WebDataset tar files and MXNet RecordIO files, read by byte offset.

``data.format=wds``: ``root/{train,val}/*.tar``, each sample a ``<key>.jpg`` (or another image
extension) and a ``<key>.cls`` member (the class index as text), each tar with its index beside it
(``<name>.idx``, DALI's ``wds2idx`` format v1.2: ``v1.2 N`` then one line per sample of
``ext offset size name`` groups). ``data.format=recordio``: ``root/{train,val}/*.rec`` with
``<name>.idx`` beside each (``rec2idx``'s format: ``key<TAB>offset`` per record); a record is
MXNet's (magic ``0xced7230a``, a length word whose top 3 bits say whether the record is split, the
payload padded to 4 bytes); its payload is a 24-byte header (flag, label, id, id2) then the JPEG.

The shards are not read in their own order: :class:`ShardStore` gives the bytes of sample ``i``
from its (shard, offset, size), so the loaders keep dstrain's sharding (the same global batches on
any number of ranks, crops drawn from (seed, epoch, rank, batch), exact mid-epoch resume) and only
the source of the bytes changes. Samples are numbered shard by shard in sorted shard-name order,
in each shard's index order: ``python -m dstrain.data.convert`` writes them in the folder scan's
order, so a converted copy gives the same batches and crops as the folder.

Everything is checked when the shards are scanned, before training: a shard shorter than its
index says (truncated, or an index of another file), a member whose tar header does not name the
member the index names, a sample without its ``.cls``, a label outside ``model.num_classes``, a
record without RecordIO's magic at its offset. Each is one line naming the file and the offset or
index line, and the fix.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dstrain.core.errors import ConfigError

SHARD_SUFFIX = {"wds": ".tar", "recordio": ".rec"}
WDS_INDEX_VERSION = "v1.2"
RECORDIO_MAGIC = 0xCED7230A
RECORD_HEADER = struct.Struct("<IfQQ")  # MXNet's IRHeader: flag, label, id, id2 (24 bytes)
LENGTH_MASK = (1 << 29) - 1
IMAGE_EXTS = ("jpg", "jpeg", "png", "bmp", "webp")
INDEX_FIX = {
    # not DALI's wds2idx: it writes wrong offsets after GNU tar's long-name headers (--format=gnu)
    "wds": "rebuild it: python -m dstrain.data.convert --index {shard}",
    "recordio": "rebuild it: python -m dstrain.data.convert --index {shard} (or DALI's rec2idx)",
}


def index_path(shard: Path) -> Path:
    return shard.with_suffix(".idx")


@dataclass
class ShardStore:
    """The bytes of every sample: shard number, offset and size (RecordIO: the record's offset;
    its payload is found, and a split record joined, when read). Picklable: each process maps the
    shards it reads on first use."""

    format: str
    shards: list[str]
    shard_of: np.ndarray  # int32 per sample
    offset: np.ndarray  # int64 per sample
    size: np.ndarray  # int64 per sample (wds: the image member's size; recordio: unused)
    _maps: dict = field(default_factory=dict, repr=False, compare=False)

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_maps"] = {}
        return state

    def _map(self, k: int) -> mmap.mmap:
        m = self._maps.get(k)
        if m is None:
            with open(self.shards[k], "rb") as fh:
                m = self._maps[k] = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        return m

    def read(self, i: int) -> bytes:
        m, start = self._map(int(self.shard_of[i])), int(self.offset[i])
        if self.format == "wds":
            return m[start : start + int(self.size[i])]
        payload = read_record(m, start, self.shards[int(self.shard_of[i])])
        flag = RECORD_HEADER.unpack_from(payload)[0]
        return payload[RECORD_HEADER.size + 4 * flag :]

    def take(self, idx) -> ShardStore:
        idx = np.asarray(idx, dtype=np.int64)
        return ShardStore(
            self.format, self.shards, self.shard_of[idx], self.offset[idx], self.size[idx]
        )


def read_record(m, start: int, shard: str) -> bytes:
    """The payload of the RecordIO record at ``start``, its parts joined (a writer splits a payload
    where the magic number appears at a 4-byte boundary and drops it; the reader puts it back)."""
    parts, pos = [], start
    while True:
        if pos + 8 > len(m):
            raise ConfigError(
                f"{shard}: truncated at offset {pos} (a record header runs past the end of "
                f"the file, {len(m)} bytes); convert the images again"
            )
        magic, lrec = struct.unpack_from("<II", m, pos)
        if magic != RECORDIO_MAGIC:
            raise ConfigError(
                f"{shard}: no RecordIO record at offset {pos} (magic {magic:#010x}, expected "
                f"{RECORDIO_MAGIC:#010x}): the index does not match this file; "
                + INDEX_FIX["recordio"].format(shard=shard)
            )
        cflag, length = lrec >> 29, lrec & LENGTH_MASK
        end = pos + 8 + length
        if end > len(m):
            raise ConfigError(
                f"{shard}: truncated at offset {pos} (the record needs {length} bytes, the file "
                f"ends after {len(m) - pos - 8}); convert the images again"
            )
        parts.append(m[pos + 8 : end])
        if cflag in (0, 3):
            break
        parts.append(struct.pack("<I", RECORDIO_MAGIC))  # the magic the writer dropped
        pos = end + (-length % 4)
    return b"".join(parts)


# ---------------------------------------------------------------- scanning a split
@dataclass
class ScannedSplit:
    names: list[str]  # per sample, for messages: shard:member or shard:offset
    labels: np.ndarray
    store: ShardStore


def split_shards(folder: Path, fmt: str) -> list[Path]:
    """The shards of one split: ``ROOT/<split>/*.tar|.rec``, or NVIDIA's MXNet layout, one
    ``ROOT/<split>.rec`` with its ``ROOT/<split>.idx`` (im2rec's names: train.rec, val.rec)."""
    suffix = SHARD_SUFFIX[fmt]
    if folder.is_dir():
        return sorted(p for p in folder.glob(f"*{suffix}") if p.is_file())
    single = folder.with_name(folder.name + suffix)
    return [single] if fmt == "recordio" and single.is_file() else []


def scan_shards(folder: Path, fmt: str, num_classes: int | None) -> ScannedSplit:
    """Every sample of the ``fmt`` shards of split ``folder`` (:func:`split_shards`), checked
    against their indexes."""
    suffix = SHARD_SUFFIX[fmt]
    shards = split_shards(folder, fmt)
    if not shards:
        nvidia = (
            f", or {folder.name}{suffix} with its .idx in {folder.parent}/"
            if fmt == "recordio"
            else ""
        )
        raise ConfigError(
            f"data.format={fmt}: no {suffix} shards in {folder}/ (expected {folder}/*{suffix}, "
            f"each with its .idx{nvidia}); convert a folder with python -m dstrain.data.convert"
        )
    names, labels, shard_of, offsets, sizes = [], [], [], [], []
    for k, shard in enumerate(shards):
        idx = index_path(shard)
        if not idx.is_file():
            raise ConfigError(
                f"{shard}: no index {idx.name} beside it; " + INDEX_FIX[fmt].format(shard=shard)
            )
        with open(shard, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            m = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
        reader = _wds_samples if fmt == "wds" else _recordio_samples
        for name, label, offset, length in reader(shard, idx, m, num_classes):
            names.append(name)
            labels.append(label)
            shard_of.append(k)
            offsets.append(offset)
            sizes.append(length)
    store = ShardStore(
        fmt,
        [str(s) for s in shards],
        np.asarray(shard_of, np.int32),
        np.asarray(offsets, np.int64),
        np.asarray(sizes, np.int64),
    )
    return ScannedSplit(names, np.asarray(labels, np.int64), store)


def _label(value: int, where: str, num_classes: int | None) -> int:
    """``value`` as a label of ``num_classes`` classes (None: any class index, as
    ``python -m dstrain.data.check`` reads shards that come without a classes.txt)."""
    if num_classes is None and value < 0:
        raise ConfigError(f"{where}: label {value} is negative, not a class index")
    if num_classes is not None and not 0 <= value < num_classes:
        raise ConfigError(
            f"{where}: label {value} is outside the {num_classes} classes (0..{num_classes - 1}) of "
            f"model.num_classes; fix the label or set model.num_classes"
        )
    return value


def _wds_samples(shard: Path, idx: Path, m, num_classes: int | None):
    lines = idx.read_text().splitlines()
    head = lines[0].split() if lines else []
    if len(head) != 2 or head[0] != WDS_INDEX_VERSION or not head[1].isdigit():
        raise ConfigError(
            f"{idx}: line 1 is {lines[0] if lines else 'missing'!r}, not '{WDS_INDEX_VERSION} N' "
            f"(DALI's WebDataset index); " + INDEX_FIX["wds"].format(shard=shard)
        )
    if int(head[1]) != len(lines) - 1:
        raise ConfigError(
            f"{idx}: line 1 promises {head[1]} samples, the file has {len(lines) - 1}; "
            + INDEX_FIX["wds"].format(shard=shard)
        )
    names = _TarNames(shard)
    for line_no, line in enumerate(lines[1:], start=2):
        fields = line.split(" ")
        if len(fields) % 4:
            raise ConfigError(
                f"{idx}:{line_no}: not groups of 'ext offset size name'; "
                + INDEX_FIX["wds"].format(shard=shard)
            )
        members = {}
        for g in range(0, len(fields), 4):
            ext, offset, size, name = fields[g : g + 4]
            offset, size = int(offset), int(size)
            _check_member(shard, idx, line_no, m, name, offset, size, names)
            members[ext.lower()] = (offset, size, name)
        image = next((members[e] for e in IMAGE_EXTS if e in members), None)
        first = next(iter(members.values()))[2]
        if image is None:
            raise ConfigError(
                f"{shard}: sample {first.rsplit('.', 1)[0]} (index line {line_no}) has no image "
                f"member ({', '.join('.' + e for e in IMAGE_EXTS)}); every sample needs one"
            )
        if "cls" not in members:
            raise ConfigError(
                f"{shard}: member {image[2]} has no .cls label beside it (index line {line_no}); "
                "every sample needs <key>.cls holding its class index"
            )
        offset, size, name = members["cls"]
        text = bytes(m[offset : offset + size]).decode("ascii", "replace").strip()
        if not text.lstrip("-").isdigit():
            raise ConfigError(f"{shard}: {name} holds {text[:20]!r}, not a class index")
        label = _label(int(text), f"{shard}: {name}", num_classes)
        yield f"{shard}:{image[2]}", label, image[0], image[1]


class _TarNames:
    """Member names by data offset, as Python's tarfile reads them (GNU long names, pax headers,
    UTF-8): read once, and only for a shard whose plain ustar headers do not name a member (the
    fast check reads 512 bytes a member)."""

    def __init__(self, shard: Path) -> None:
        self.shard, self.names = shard, None

    def at(self, offset: int) -> str | None:
        if self.names is None:
            import tarfile

            try:
                with tarfile.open(self.shard) as tar:
                    self.names = {t.offset_data: t.name for t in tar if t.isfile()}
            except tarfile.TarError:
                self.names = {}
        return self.names.get(offset)


def _ustar_name(m, offset: int) -> str:
    """The name the ustar header before ``offset`` holds: its prefix field (bytes 345-500, POSIX
    ustar, where a long path is split) joined to its name field (bytes 0-100)."""
    if offset < 512:
        return ""
    header = bytes(m[offset - 512 : offset])
    name = header[:100].split(b"\0", 1)[0].decode("utf-8", "replace")
    if header[257:262] == b"ustar":
        prefix = header[345:500].split(b"\0", 1)[0].decode("utf-8", "replace")
        if prefix:
            name = f"{prefix}/{name}"
    return name


def _check_member(shard, idx, line_no, m, name, offset, size, names: _TarNames) -> None:
    if offset + size > len(m):
        raise ConfigError(
            f"{shard}: truncated: member {name} (index line {line_no}) needs bytes {offset}.."
            f"{offset + size}, the file has {len(m)}; copy the shard again, or "
            + INDEX_FIX["wds"].format(shard=shard)
        )
    stored = _ustar_name(m, offset)
    if stored == name or name.endswith("/" + stored):
        return
    # a name over 100 bytes or with non-ASCII characters lives in a GNU or pax header before it
    real = names.at(offset)
    if real is not None and (real == name or name.endswith("/" + real)):
        return
    raise ConfigError(
        f"{idx}:{line_no}: names member {name} at offset {offset}, but the tar header there "
        f"names {real or stored or 'nothing'!r}: the index does not match {shard}; "
        + INDEX_FIX["wds"].format(shard=shard)
    )


def _recordio_samples(shard: Path, idx: Path, m, num_classes: int | None):
    for line_no, line in enumerate(idx.read_text().splitlines(), start=1):
        fields = line.split("\t")
        if len(fields) != 2 or not fields[1].strip().isdigit():
            raise ConfigError(
                f"{idx}:{line_no}: {line[:40]!r} is not 'key<TAB>offset' (rec2idx's format); "
                + INDEX_FIX["recordio"].format(shard=shard)
            )
        offset = int(fields[1])
        payload = read_record(m, offset, str(shard))
        if len(payload) < RECORD_HEADER.size:
            raise ConfigError(
                f"{shard}: record at offset {offset} (index line {line_no}) is {len(payload)} "
                "bytes, shorter than its 24-byte header"
            )
        flag, label, _, _ = RECORD_HEADER.unpack_from(payload)
        if flag:  # a label array follows the header; the first is the class
            label = struct.unpack_from("<f", payload, RECORD_HEADER.size)[0]
        where = f"{shard}: record at offset {offset} (index line {line_no})"
        if label != int(label):
            raise ConfigError(f"{where}: label {label} is not a class index")
        yield f"{shard}:{offset}", _label(int(label), where, num_classes), offset, 0


# ---------------------------------------------------------------- writing (dstrain.data.convert)
class TarWriter:
    """A WebDataset shard: members written with fixed metadata (mtime 0, uid 0, mode 0644), so the
    same images give the same bytes; the index (DALI's v1.2) is collected as members are written."""

    def __init__(self, path: Path):
        import tarfile

        self.path, self.samples = path, []
        # pax: a long or non-ASCII key gets a pax header, as webdataset's writer gives it (plain
        # ustar headers, byte for byte as before, for every other member)
        self.tar = tarfile.open(path, "w", format=tarfile.PAX_FORMAT)

    def add(self, key: str, members: list[tuple[str, bytes]]) -> None:
        import io
        import tarfile

        group = []
        for ext, data in members:
            info = tarfile.TarInfo(f"{key}.{ext}")
            info.size, info.mtime, info.mode = len(data), 0, 0o644
            info.uname = info.gname = ""
            self.tar.addfile(info, io.BytesIO(data))
            offset = self.tar.offset - len(data) - (-len(data) % 512)
            group.append(f"{ext} {offset} {len(data)} {info.name}")
        self.samples.append(" ".join(group))

    def close(self) -> str:
        """Finish the tar; the index text."""
        self.tar.close()
        return f"{WDS_INDEX_VERSION} {len(self.samples)}\n" + "".join(
            s + "\n" for s in self.samples
        )


class RecordWriter:
    """An MXNet RecordIO shard: one record per image (24-byte header, then the bytes), split where
    the magic number appears at a 4-byte boundary as MXNet's writer does; the index is rec2idx's."""

    def __init__(self, path: Path):
        self.path, self.fh, self.lines = path, open(path, "wb"), []

    def add(self, label: int, image: bytes) -> None:
        payload = RECORD_HEADER.pack(0, float(label), len(self.lines), 0) + image
        self.lines.append(f"{len(self.lines)}\t{self.fh.tell()}\n")
        magic = struct.pack("<I", RECORDIO_MAGIC)
        cuts = [
            p for p in range(0, len(payload) - 3, 4) if payload[p : p + 4] == magic
        ]  # aligned occurrences
        pieces, start = [], 0
        for p in cuts:
            pieces.append(payload[start:p])
            start = p + 4
        pieces.append(payload[start:])
        for n, piece in enumerate(pieces):
            if len(pieces) == 1:
                cflag = 0
            else:
                cflag = 1 if n == 0 else (3 if n == len(pieces) - 1 else 2)
            self.fh.write(struct.pack("<II", RECORDIO_MAGIC, (cflag << 29) | len(piece)))
            self.fh.write(piece + b"\0" * (-len(piece) % 4))

    def close(self) -> str:
        self.fh.close()
        return "".join(self.lines)
