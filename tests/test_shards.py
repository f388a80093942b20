"""ImageNet as users keep it: WebDataset and RecordIO shards (dstrain/data/shards.py), the
converter (python -m dstrain.data.convert) and the flat validation folder (data.val_labels)."""

from __future__ import annotations

import glob
import re
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from dstrain.core.errors import ConfigError
from dstrain.data import Shard, build_data, convert, shards
from dstrain.data.images import scan_folder, scan_images
from tests.conftest import run_cli
from tests.test_folder_loaders import cfg_for

FORMATS = ("wds", "recordio")


def noise_jpegs(root: Path, per_class: dict, classes=("ant", "bee", "cat")) -> Path:
    """Random-noise JPEGs in root/<split>/<class>/NNN.JPEG, as ImageNet names them: every crop
    window and flip gives other pixels."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for split, n in per_class.items():
        for name in classes:
            (root / split / name).mkdir(parents=True)
            for i in range(n):
                pixels = rng.integers(0, 256, (40, 48, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(root / split / name / f"{i:03d}.JPEG", quality=95)
    return root


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """A noise-image folder of 3 classes and its two converted copies, shards of 5 images (so
    batches cross shard boundaries)."""
    base = tmp_path_factory.mktemp("shards")
    src = noise_jpegs(base / "src", {"train": 4, "val": 2})
    for fmt in FORMATS:
        assert convert.main([str(src), str(base / fmt), "--format", fmt, "--shard-size", "5"]) == 0
    return base


def test_the_converted_shards_hold_the_folder_s_bytes_and_labels(converted):
    train, val = scan_folder(str(converted / "src"))
    for fmt in FORMATS:
        st, sv = scan_images(str(converted / fmt), fmt, len(train.classes))
        assert st.labels.tolist() == train.labels.tolist()
        assert sv.labels.tolist() == val.labels.tolist()
        assert [st.store.read(i) for i in range(len(st))] == [
            Path(f).read_bytes() for f in train.files
        ]
        assert (converted / fmt / "classes.txt").read_text().split() == train.classes


def test_dali_s_own_readers_read_the_converted_shards(converted):
    """DALI's fn.readers.webdataset and fn.readers.mxnet (with the .idx files we wrote) give the
    same image bytes and labels, in the same order."""
    pytest.importorskip("nvidia.dali")
    from nvidia.dali import fn, pipeline_def

    train, _ = scan_folder(str(converted / "src"))
    want = [Path(f).read_bytes() for f in train.files]
    tars = sorted(glob.glob(str(converted / "wds" / "train" / "*.tar")))

    @pipeline_def(batch_size=len(want), num_threads=1, device_id=None)
    def wds():
        image, cls = fn.readers.webdataset(
            paths=tars,
            index_paths=[t[:-4] + ".idx" for t in tars],
            ext=["jpg", "cls"],
            random_shuffle=False,
        )
        return image, cls

    pipe = wds()
    pipe.build()
    images, classes = pipe.run()
    assert [np.array(images.at(i)).tobytes() for i in range(len(want))] == want
    assert [
        int(np.array(classes.at(i)).tobytes()) for i in range(len(want))
    ] == train.labels.tolist()
    got, labels = [], []
    for rec in sorted(glob.glob(str(converted / "recordio" / "train" / "*.rec"))):
        n = len(Path(rec[:-4] + ".idx").read_text().splitlines())

        @pipeline_def(batch_size=n, num_threads=1, device_id=None)
        def mxnet(rec=rec):
            image, label = fn.readers.mxnet(
                path=[rec], index_path=[rec[:-4] + ".idx"], random_shuffle=False
            )
            return image, label

        pipe = mxnet()
        pipe.build()
        images, label = pipe.run()
        got += [np.array(images.at(i)).tobytes() for i in range(n)]
        labels += [int(np.array(label.at(i))[0]) for i in range(n)]
    assert got == want and labels == train.labels.tolist()


def test_the_index_tool_writes_what_the_converter_wrote(converted, tmp_path):
    for fmt, suffix in (("wds", ".tar"), ("recordio", ".rec")):
        shard = sorted((converted / fmt / "train").glob(f"*{suffix}"))[1]
        copy = tmp_path / fmt / shard.name
        copy.parent.mkdir()
        shutil.copyfile(shard, copy)
        assert convert.main(["--index", str(copy)]) == 0
        assert shards.index_path(copy).read_text() == shards.index_path(shard).read_text()
        assert convert.main(["--index", str(copy)]) == 2  # refuses an existing index


@pytest.mark.parametrize("tar_format", ["pax", "gnu"])
def test_long_and_non_ascii_member_names_are_read_as_tarfile_reads_them(tmp_path, tar_format):
    """A key over 100 bytes and one with non-ASCII characters (a pax header, webdataset's writer;
    a GNU long name, GNU tar's): indexed by the index tool, read with their labels and bytes."""
    import io
    import tarfile

    fmt = {"pax": tarfile.PAX_FORMAT, "gnu": tarfile.GNU_FORMAT}[tar_format]
    keys = ["bébé_2", "x" * 120, "plain"]
    images = {key: f"image bytes of {key}".encode() for key in keys}
    for split in ("train", "val"):
        (tmp_path / split).mkdir()
        shard = tmp_path / split / "shard-000000.tar"
        with tarfile.open(shard, "w", format=fmt) as tar:
            for label, key in enumerate(keys):
                for ext, data in (("jpg", images[key]), ("cls", str(label).encode())):
                    info = tarfile.TarInfo(f"{key}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
        assert convert.main(["--index", str(shard)]) == 0
    train, val = scan_images(str(tmp_path), "wds", 3)
    assert train.labels.tolist() == [0, 1, 2] and len(val) == 3
    assert [train.store.read(i) for i in range(3)] == [images[k] for k in keys]
    assert train.files[0].endswith(":bébé_2.jpg") and train.files[1].endswith("x" * 120 + ".jpg")
    # an index of another shard still fails the check, named with the name tarfile reads there
    idx = shards.index_path(tmp_path / "train" / "shard-000000.tar")
    lines = idx.read_text().splitlines()
    lines[1], lines[2] = (
        lines[2].replace("x" * 120, "bébé_2"),
        lines[1].replace("bébé_2", "x" * 120),
    )
    idx.write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError, match="but the tar header there names 'x") as wrong:
        scan_images(str(tmp_path), "wds", 3)
    # the fix named is dstrain's own index: DALI's wds2idx gets GNU long-name offsets wrong
    assert "python -m dstrain.data.convert --index" in str(wrong.value)
    assert "wds2idx" not in str(wrong.value)


def test_the_converter_writes_long_and_non_ascii_names(tmp_path):
    src = noise_jpegs(tmp_path / "src", {"train": 1, "val": 1}, classes=("ünïcode", "c" * 110))
    assert convert.main([str(src), str(tmp_path / "wds"), "--format", "wds"]) == 0
    train, _ = scan_folder(str(src))
    st, _ = scan_images(str(tmp_path / "wds"), "wds", 2)
    assert [st.store.read(i) for i in range(len(st))] == [Path(f).read_bytes() for f in train.files]


def test_nvidias_single_file_recordio_layout_reads_as_it_is(converted, tmp_path):
    """NVIDIA's MXNet layout (train.rec/train.idx, val.rec/val.idx in one folder, as im2rec
    writes them) is read where it lies: the same samples as the converter's one-shard split."""
    one = tmp_path / "one"
    src = str(converted / "src")
    assert convert.main([src, str(one), "--format", "recordio", "--shard-size", "1000"]) == 0
    nvidia = tmp_path / "nvidia"
    nvidia.mkdir()
    for split in ("train", "val"):
        for suffix in (".rec", ".idx"):
            shutil.copyfile(one / split / f"{split}-00000{suffix}", nvidia / f"{split}{suffix}")
    want, got = scan_images(str(one), "recordio", 3), scan_images(str(nvidia), "recordio", 3)
    for a, b in zip(want, got, strict=True):
        assert a.labels.tolist() == b.labels.tolist()
        assert [a.store.read(i) for i in range(len(a))] == [b.store.read(i) for i in range(len(b))]
    assert got[0].store.shards == [str(nvidia / "train.rec")]
    (nvidia / "val.rec").unlink()
    with pytest.raises(ConfigError, match=r"or val.rec with its .idx in .*nvidia/"):
        scan_images(str(nvidia), "recordio", 3)


def test_the_check_tool_reads_every_format(converted, flat, tmp_path, capsys):
    """python -m dstrain.data.check on shards (the format found, a corrupt sample named by its
    shard and member), NVIDIA's layout, and the flat val folder with its labels file."""
    from dstrain.data.check import main as check

    for fmt in FORMATS:
        root = tmp_path / fmt
        shutil.copytree(converted / fmt, root)
        assert check([str(root), "--workers", "1"]) == 0
        assert f"18 images checked under {root} ({fmt})" in capsys.readouterr().out
    # a wds sample whose JPEG bytes are garbage, in place (the index still matches)
    shard = sorted((tmp_path / "wds" / "train").glob("*.tar"))[0]
    ext, offset, size, name = shards.index_path(shard).read_text().splitlines()[1].split(" ")[:4]
    data = bytearray(shard.read_bytes())
    data[int(offset) + 20 : int(offset) + int(size)] = b"\0" * (int(size) - 20)
    shard.write_bytes(bytes(data))
    assert check([str(tmp_path / "wds"), "--workers", "1"]) == 1
    out = capsys.readouterr().out
    assert f"corrupt image: {shard}:{name} (" in out and "1 do not decode" in out
    root, names, classes = flat
    loc = root / "LOC_val_solution.csv"
    rows = [f"{n},{c} 1 2 3 4" for n, c in zip(names, classes, strict=True)]
    loc.write_text("ImageId,PredictionString\n" + "\n".join(rows) + "\n")
    assert check([str(root), "--workers", "1", "--val-labels", str(loc)]) == 0
    assert check([str(root), "--workers", "1"]) == 2  # the flat folder without its labels
    assert "--val-labels FILE" in capsys.readouterr().err


def test_the_check_tool_reads_shards_without_a_classes_txt_in_memory_of_their_size(
    converted, tmp_path, capsys
):
    """Shards as webdataset or timm make them come without dstrain's classes.txt: the check takes
    any label and names the classes it finds (it once sized a list by a guess of 2**31-1 classes,
    ~24 GB)."""
    from dstrain.data.check import main as check
    from dstrain.data.check import shard_classes

    for fmt in FORMATS:
        root = tmp_path / fmt
        shutil.copytree(converted / fmt, root)
        (root / "classes.txt").unlink()
        assert shard_classes(root) is None
        train, val = scan_images(str(root), fmt, None)
        assert train.classes == val.classes == ["0", "1", "2"]
        assert check([str(root), "--workers", "1"]) == 0
        captured = capsys.readouterr()
        assert f"18 images checked under {root} ({fmt})" in captured.out
        # progress as it goes, on stderr, as the converter shows it
        assert f"check {root}: 18/18 images (100%)" in captured.err and "ETA" in captured.err
    # a label beyond the 3 classes: the classes are those found, not a range up to a guess
    shard = sorted((tmp_path / "wds" / "train").glob("*.tar"))[0]
    ext, offset, size, name = shards.index_path(shard).read_text().splitlines()[1].split(" ")[4:8]
    assert ext == "cls" and size == "1"
    data = bytearray(shard.read_bytes())
    data[int(offset)] = ord("9")
    shard.write_bytes(bytes(data))
    train, _ = scan_images(str(tmp_path / "wds"), "wds", None)
    assert train.classes == ["0", "1", "2", "9"] and train.labels[0] == 9


def test_a_record_holding_the_magic_number_is_split_and_joined(tmp_path):
    """MXNet's writer splits a payload where RecordIO's magic appears at a 4-byte boundary (the
    reader puts it back): an image with the magic in it reads back whole, here and in DALI."""
    magic = struct.pack("<I", shards.RECORDIO_MAGIC)
    image = b"\xff\xd8" + b"ab" + magic + b"cdef" + magic + b"\xff\xd9"  # magic at 4 and 12
    rec = tmp_path / "x.rec"
    writer = shards.RecordWriter(rec)
    writer.add(2, image)
    writer.add(1, b"plain")
    shards.index_path(rec).write_text(writer.close())
    # the record headers only: 3 parts for the first record (its two magics dropped), 1 for the next
    assert rec.read_bytes().count(magic) == 4
    store = shards.scan_shards(tmp_path, "recordio", 3)
    assert store.labels.tolist() == [2, 1]
    assert store.store.read(0) == image and store.store.read(1) == b"plain"
    pytest.importorskip("nvidia.dali")
    from nvidia.dali import fn, pipeline_def

    @pipeline_def(batch_size=2, num_threads=1, device_id=None)
    def mxnet():
        data, label = fn.readers.mxnet(
            path=[str(rec)], index_path=[str(shards.index_path(rec))], random_shuffle=False
        )
        return data, label

    pipe = mxnet()
    pipe.build()
    data, label = pipe.run()
    assert np.array(data.at(0)).tobytes() == image  # DALI joins the parts the same way
    assert [float(np.array(label.at(i))[0]) for i in range(2)] == [2.0, 1.0]


def loader_batches(root, fmt, loader, rank=0, world=1, epoch=0, start=0, seed=3):
    """Every (images, labels) batch of one training epoch and of the validation pass."""
    cfg = cfg_for(root, loader, format=fmt, random_area=[0.1, 0.5])
    data = build_data(cfg, Shard(rank, world, 2, 1, eval_batch=2, seed=seed), 3, 3)
    data.train.start_epoch(epoch, start=start)
    return [b for b in data.train], [b for b in data.val]


@pytest.mark.parametrize("loader", ["torchvision", "dali"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_shards_give_the_folder_s_batches_and_crops_bit_for_bit(converted, loader, fmt):
    """The same global batches, crops and flips from the shards as from the folder, on 1 and 2
    ranks, and from a mid-epoch start (a resume) the same rest of the epoch."""
    if loader == "dali":
        pytest.importorskip("nvidia.dali")
    for world in (1, 2):
        for rank in range(world):
            want = loader_batches(converted / "src", "folder", loader, rank, world, epoch=1)
            got = loader_batches(converted / fmt, fmt, loader, rank, world, epoch=1)
            for (xa, ya), (xb, yb) in zip(want[0] + want[1], got[0] + got[1], strict=True):
                assert torch.equal(xa, xb) and torch.equal(ya, yb)
    rest = loader_batches(converted / fmt, fmt, loader, epoch=1, start=2)[0]
    full = loader_batches(converted / fmt, fmt, loader, epoch=1)[0]
    assert len(rest) == len(full) - 2
    assert all(torch.equal(a[0], b[0]) for a, b in zip(rest, full[2:], strict=True))


# ---------------------------------------------------------------- bad input
def damaged(converted, tmp_path, fmt):
    copy = tmp_path / fmt
    shutil.copytree(converted / fmt, copy)
    return copy, sorted((copy / "train").glob(f"*{shards.SHARD_SUFFIX[fmt]}"))[0]


def refusal(root, fmt, num_classes=3) -> str:
    with pytest.raises(ConfigError) as err:
        scan_images(str(root), fmt, num_classes)
    return str(err.value)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_truncated_shard_is_named_with_its_offset(converted, tmp_path, fmt):
    root, shard = damaged(converted, tmp_path, fmt)
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) * 2 // 3])
    line = refusal(root, fmt)
    # where the file ends short: a RecordIO record's offset, a tar member's byte range (issue 53:
    # `A and B or C` passed any line with "bytes" in it, whatever file it named)
    where = re.search(
        r"truncated(?: at offset \d+|: member \S+ \(index line \d+\) needs bytes)", line
    )
    assert line.startswith(f"{shard}: truncated") and where, line


@pytest.mark.parametrize("fmt", FORMATS)
def test_an_index_of_another_shard_is_refused(converted, tmp_path, fmt):
    root, shard = damaged(converted, tmp_path, fmt)
    other = sorted((root / "train").glob("*.idx"))[1]
    shards.index_path(shard).write_text(other.read_text())
    line = refusal(root, fmt)
    assert "does not match" in line and "python -m dstrain.data.convert --index" in line


def test_a_member_without_its_label_and_a_label_outside_the_classes(converted, tmp_path):
    root, shard = damaged(converted, tmp_path, "wds")
    idx = shards.index_path(shard)
    lines = idx.read_text().splitlines()
    lines[2] = " ".join(lines[2].split(" ")[:4])  # the second sample loses its .cls
    idx.write_text("\n".join(lines) + "\n")
    line = refusal(root, "wds")
    assert line.startswith(f"{shard}: member 00000001.") and "no .cls label" in line
    root, shard = damaged(converted, tmp_path / "b", "wds")
    line = refusal(root, "wds", num_classes=2)  # class 2 exists in the data
    assert ".cls: label 2 is outside the 2 classes" in line and "model.num_classes" in line


@pytest.mark.slow  # over ~5 s on 2 cores: the full suite only (issue 42: quick loop < 3 min)
def test_the_cli_refuses_a_damaged_shard_before_writing_anything(converted, tmp_path):
    root, shard = damaged(converted, tmp_path, "recordio")
    shard.write_bytes(shard.read_bytes()[:100])
    run_dir = tmp_path / "run"
    args = ["--config", "fashion_mnist", "data.dataset=imagefolder", "data.format=recordio"]
    args += [f"data.root={root}", "model.num_classes=3", f"run_dir={run_dir}"]
    args += ["batch.global_size=4", "data.image_size=16", "data.val_resize=20"]
    for extra in (["--check"], []):
        proc = run_cli(args + extra)
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert f"{shard}: truncated" in proc.stderr
    assert not run_dir.exists()


def test_the_converter_refuses_to_overwrite(converted, tmp_path):
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    assert convert.main([str(converted / "src"), str(dst), "--format", "wds"]) == 2
    assert [p.name for p in dst.iterdir()] == ["keep.txt"]


# ---------------------------------------------------------------- the flat validation folder
@pytest.fixture
def flat(converted, tmp_path):
    """The noise folder with val/ flattened as image-net.org ships it, and its class-folder twin."""
    src = converted / "src"
    root = tmp_path / "flat"
    shutil.copytree(src / "train", root / "train")
    (root / "val").mkdir()
    names, classes = [], []
    for k, path in enumerate(sorted(p for p in (src / "val").rglob("*") if p.is_file())):
        name = f"ILSVRC2012_val_{k + 1:08d}{path.suffix}"
        shutil.copyfile(path, root / "val" / name)
        names.append(Path(name).stem)
        classes.append(path.parent.name)
    return root, names, classes


def test_a_flat_val_folder_converts_to_shards_with_its_labels(flat, tmp_path):
    root, names, classes = flat
    loc = root / "LOC_val_solution.csv"
    rows = [f"{n},{c} 1 2 3 4" for n, c in zip(names, classes, strict=True)]
    loc.write_text("ImageId,PredictionString\n" + "\n".join(rows) + "\n")
    _, val = scan_folder(str(root), val_labels=str(loc))
    for fmt in FORMATS:
        dst = tmp_path / f"flat-{fmt}"
        args = [str(root), str(dst), "--format", fmt, "--val-labels", str(loc)]
        assert convert.main(args) == 0
        _, sv = scan_images(str(dst), fmt, 3)
        assert sv.labels.tolist() == val.labels.tolist()
        assert [sv.store.read(i) for i in range(len(sv))] == [
            Path(f).read_bytes() for f in val.files
        ]
    # without the labels file the flat folder has no class folders: the message says what to give
    with pytest.raises(ConfigError, match="it holds images directly .* --val-labels FILE"):
        convert.convert(root, tmp_path / "none", "wds", 5)
    assert convert.main([str(root), str(tmp_path / "none")]) == 2
    assert not (tmp_path / "none").exists()


def test_flat_val_labels_by_name_index_or_loc_csv(flat):
    root, names, classes = flat
    order = sorted(set(classes))
    by_name = root / "names.txt"
    by_name.write_text("".join(c + "\n" for c in classes))
    by_index = root / "index.txt"
    by_index.write_text("".join(f"{order.index(c)}\n" for c in classes))
    loc = root / "LOC_val_solution.csv"
    rows = [f"{n},{c} 10 20 30 40" for n, c in zip(names, classes, strict=True)]
    loc.write_text("ImageId,PredictionString\n" + "\n".join(reversed(rows)) + "\n")
    expected = [order.index(c) for c in classes]
    for labels in (by_name, by_index, loc):
        _, val = scan_folder(str(root), val_labels=str(labels))
        assert val.labels.tolist() == expected and len(val) == len(names)
    by_name.write_text("".join(c + "\n" for c in classes[:-1]))
    with pytest.raises(
        ConfigError, match=rf"{by_name}: {len(names) - 1} labels for the {len(names)}"
    ):
        scan_folder(str(root), val_labels=str(by_name))
    by_name.write_text("".join(c + "\n" for c in [*classes[:-1], "zebra"]))
    with pytest.raises(ConfigError, match=rf"{by_name}:{len(names)}: 'zebra' is neither"):
        scan_folder(str(root), val_labels=str(by_name))
    # the CSV's count both ways: a val/ folder that lost an image is refused, not evaluated on less
    for path in (root / "val").glob(f"{names[-1]}.*"):
        path.unlink()
    with pytest.raises(
        ConfigError,
        match=rf"{loc}:2: ImageId {names[-1]} has no image file in {root / 'val'}/ \(1 of its "
        rf"{len(names)} rows have none; the folder holds {len(names) - 1} images\)",
    ):
        scan_folder(str(root), val_labels=str(loc))
