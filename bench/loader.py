"""Loader throughput: dstrain's DaliLoader against a plain DALI pipeline (the ceiling) and torchvision.

    .venv/bin/python bench/loader.py                      # CPU (and GPU when there is one)
    .venv/bin/python bench/loader.py --batch 64 --batches-per-epoch 25 100 --threads 2 \
        --out results/bench/loader_cpu.json

Rows, on the same generated JPEG folder, files, threads, prefetch depth, batch and output (float16
HWC by default, what dstrain's DaliLoader gives FP16/BF16 training with channels_last):

  plain        the ceiling: a plain DALI training pipeline built once (DALI's file reader and
               shuffle, ``decoders.image_random_crop``, resize, flip, normalise,
               ``DALIGenericIterator``), see :func:`plain_pipeline`
  dali         dstrain.data.dali.DaliLoader: our global batches, per-epoch reshuffle, exact-resume
               crops, the ramp; one kept pipeline fed each epoch's order
  torchvision  dstrain.data.folder.TorchvisionLoader, ``--threads`` worker processes (fp32 NCHW)
  dali@wds, dali@recordio, torchvision@wds, ...  the same loader over the same files converted to
               WebDataset / RecordIO shards (data.format), 500 images a shard

Each is timed over whole epochs (start_epoch to the last batch on the device) at each
``--batches-per-epoch``: short passes show per-pass costs (a pipeline build, a prefetch ramp),
long ones the steady state. A first pass per loader is recorded apart (build, page cache,
workers), then the loaders take turns for ``--epochs`` timed epochs; ratios are from this one run.
``--threads`` and ``--prefetch`` take several values: every combination is measured.
With a GPU, the same rows run with ``mixed`` (nvJPEG / hardware) decode, once per
``--hw-decoder-load``.

The folder holds ImageNet-like 500x375 JPEGs (quality 90, smooth random content plus pixel noise,
~100 KB each like ImageNet's).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def make_folder(
    root: Path, n: int, classes: int, size=(375, 500), seed: int = 0, start: int = 0
) -> Path:
    """ImageNet-like JPEGs: smooth random fields at three scales plus pixel noise (files start..n-1)."""
    from PIL import Image

    rng = np.random.default_rng(
        seed if not start else [seed, start]
    )  # start > 0: one chunk of a parallel build
    h, w = size
    for i in range(start, n):
        cls = root / "train" / f"n{i % classes:08d}"
        cls.mkdir(parents=True, exist_ok=True)
        img = np.zeros((h, w, 3), np.float32)
        for cells, amp in ((4, 80), (16, 40), (64, 20)):
            grid = rng.uniform(-1, 1, (cells * h // w + 1, cells + 1, 3)).astype(np.float32)
            img += (
                amp
                * np.asarray(Image.fromarray(grid[..., 0]).resize((w, h), Image.BICUBIC))[..., None]
                * np.array([1.0, 0.8, 0.6], np.float32)
            )
        img += 128 + rng.normal(0, 20, img.shape)  # detail: ~100 KB files, like ImageNet's
        Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(
            cls / f"img{i:06d}.JPEG", quality=90
        )
    (root / "val").mkdir(exist_ok=True)
    for cls in sorted((root / "train").iterdir()):
        (root / "val" / cls.name).mkdir(exist_ok=True)
    return root


def _folder_chunk(root: Path, start: int, stop: int, classes: int, size=(375, 500)) -> None:
    make_folder(root, stop, classes, size=size, start=start)


def make_folder_parallel(
    root: Path,
    n: int,
    classes: int,
    start: int = 0,
    workers: int | None = None,
    size=(375, 500),
) -> Path:
    """:func:`make_folder` for files start..n-1, one chunk per core (a 6,400-file folder: ~13 min in
    one process); val/ gets each class's first training image, so a DALI or torchvision run can
    evaluate on it."""
    from concurrent.futures import ProcessPoolExecutor

    count = n - start
    workers = max(1, min(workers or os.cpu_count() or 1, count // 50 or 1))
    bounds = [start + count * k // workers for k in range(workers + 1)]
    if count > 0:
        with ProcessPoolExecutor(workers) as pool:
            list(
                pool.map(
                    _folder_chunk,
                    [root] * workers,
                    bounds[:-1],
                    bounds[1:],
                    [classes] * workers,
                    [size] * workers,
                )
            )
    (root / "val").mkdir(parents=True, exist_ok=True)
    for cls in sorted((root / "train").iterdir()):
        (root / "val" / cls.name).mkdir(exist_ok=True)
        first = sorted(cls.iterdir())[0]
        if not (root / "val" / cls.name / first.name).exists():
            shutil.copy(first, root / "val" / cls.name / first.name)
    return root


def plain_pipeline(
    files: list[str], batch: int, threads: int, prefetch: int, device: str, opts: dict
):
    """The ceiling: a plain DALI training pipeline as DALI's own examples write one, built once, with
    DALI's file reader and its shuffle, the random-resized crop drawn by the decoder, the same
    resize / flip / normalise / output as dstrain's, and ``DALIGenericIterator`` (zero-copy under
    DALI's dynamic executor, as dstrain's batches are). It keeps none of dstrain's guarantees (our
    global batches, resume, ramp): it is what the hardware gives when nothing else is asked."""
    from nvidia.dali import fn, pipeline_def, types
    from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

    gpu = device == "cuda"
    decode = dict(device="mixed" if gpu else "cpu", output_type=types.RGB)
    if gpu:
        from dstrain.data.dali import DEVICE_MEMORY_PADDING, HOST_MEMORY_PADDING

        decode.update(
            hw_decoder_load=opts["hw_decoder_load"],
            device_memory_padding=DEVICE_MEMORY_PADDING,
            host_memory_padding=HOST_MEMORY_PADDING,
        )

    @pipeline_def(
        batch_size=batch,
        num_threads=threads,
        prefetch_queue_depth=prefetch,
        device_id=0 if gpu else None,
        seed=1,
    )
    def pipe():
        encoded, labels = fn.readers.file(
            files=files, labels=list(range(len(files))), random_shuffle=True, name="Reader"
        )
        images = fn.decoders.image_random_crop(
            encoded, random_area=[0.08, 1.0], random_aspect_ratio=[0.75, 4 / 3], **decode
        )
        images = fn.resize(images, size=[opts["out_size"]] * 2)
        images = fn.crop_mirror_normalize(
            images,
            mirror=fn.random.coin_flip(),
            mean=[0.485 * 255, 0.456 * 255, 0.406 * 255],
            std=[0.229 * 255, 0.224 * 255, 0.225 * 255],
            dtype=types.FLOAT16 if opts["dtype"] == "float16" else types.FLOAT,
            output_layout="HWC" if opts["channels_last"] else "CHW",
        )
        return images, labels.gpu() if gpu else labels

    it = DALIGenericIterator(
        pipe(),
        ["x", "y"],
        reader_name="Reader",
        last_batch_policy=LastBatchPolicy.DROP,
        auto_reset=True,
    )
    return PlainEpochs(it)


class PlainEpochs:
    """The plain pipeline behind the loaders' interface (``start_epoch``, iteration)."""

    def __init__(self, iterator):
        self.iterator = iterator

    def start_epoch(self, epoch: int) -> None:
        pass  # DALI's reader reshuffles by itself

    def __iter__(self):
        for (out,) in self.iterator:
            yield out["x"], out["y"]


LOADERS = ("plain", "dali", "torchvision") + tuple(
    f"{name}@{fmt}" for name in ("dali", "torchvision") for fmt in ("wds", "recordio")
)


def build_loader(
    name: str, root: Path, n: int, batch: int, threads: int, prefetch: int, device: str, opts: dict
):
    """One loader over the first ``n`` files of the folder (same files for every loader)."""
    import torch

    from dstrain.data import Shard
    from dstrain.data.images import limited, scan_split
    from dstrain.settings.config import DataConfig

    images = limited(scan_split(root, "train"), n)
    if name == "plain":
        return plain_pipeline(images.files, batch, threads, prefetch, device, opts)
    name, _, fmt = name.partition("@")  # dali@wds: the same files converted to shards
    if fmt:
        images = shard_copy(root, images, fmt)
    cfg = DataConfig(
        dataset="imagefolder",
        root=str(root),
        num_workers=threads,
        prefetch=prefetch,
        hw_decoder_load=opts["hw_decoder_load"] or 0.0,
        pin_memory=True,
        image_size=opts["out_size"],
        val_resize=max(opts["out_size"], round(opts["out_size"] * 256 / 224)),
    )
    shard = Shard(0, 1, batch, 1, eval_batch=batch, seed=0)
    from dstrain.data.sharding import Output

    if name == "dali":
        from dstrain.data.dali import DaliLoader

        dtype = torch.float16 if opts["dtype"] == "float16" else torch.float32
        out = Output(3, device, dtype, opts["channels_last"])
        return DaliLoader(images, shard, "train", cfg, augment=True, out=out)
    from dstrain.data.folder import TorchvisionLoader

    return TorchvisionLoader(images, shard, "train", cfg, augment=True, out=Output(3, device))


def shard_copy(root: Path, images, fmt: str):
    """``images`` as ``fmt`` shards (written once beside the folder, 500 images a shard, as
    python -m dstrain.data.convert writes them), read back as the loaders read them."""
    from dstrain.data import convert
    from dstrain.data.images import ImageList
    from dstrain.data.shards import scan_shards

    folder = root.parent / f"{root.name}-{fmt}-{len(images)}" / "train"
    if not folder.is_dir():
        convert.write_split(images, folder, "train", fmt, 500)
    scanned = scan_shards(folder, fmt, len(images.classes))
    return ImageList(scanned.names, scanned.labels, images.classes, scanned.store)


def time_epoch(loader, epoch: int) -> tuple[float, int]:
    """Seconds from the start of an epoch to its last batch on the device, and its images."""
    import torch

    t0, n = time.perf_counter(), 0
    loader.start_epoch(epoch)
    for x, _ in loader:
        n += len(x)
    if x.is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t0, n


def measure(root: Path, device: str, args, opts: dict) -> list[dict]:
    """Every loader at every epoch length, thread count and prefetch depth: a first (untimed,
    recorded) pass, then ``--epochs`` timed epochs, the loaders taking turns epoch by epoch."""
    rows = []
    for batches in args.batches_per_epoch:
        for threads in args.threads:
            for prefetch in args.prefetch:
                n = batches * args.batch
                loaders = {
                    name: build_loader(name, root, n, args.batch, threads, prefetch, device, opts)
                    for name in args.loaders
                }
                first = {name: time_epoch(loader, 0)[0] for name, loader in loaders.items()}
                times = {name: [] for name in loaders}
                for epoch in range(1, args.epochs + 1):
                    for name, loader in loaders.items():
                        times[name].append(time_epoch(loader, epoch))
                row = {
                    "batches_per_epoch": batches,
                    "images_per_epoch": n,
                    "threads": threads,
                    "prefetch": prefetch,
                    **opts,
                }
                for name, runs in times.items():
                    seconds, images = sum(t for t, _ in runs), sum(k for _, k in runs)
                    row[name] = {
                        "images_per_sec": round(images / seconds, 1),
                        "epoch_s": [round(t, 3) for t, _ in runs],
                        "first_pass_s": round(first[name], 3),
                    }
                    if name == "dali":
                        row[name]["pipelines_built"] = loaders[name].builds
                for name in loaders:
                    if name != "plain" and "plain" in loaders:
                        row[f"ratio_{name}_over_plain"] = round(
                            row[name]["images_per_sec"] / row["plain"]["images_per_sec"], 3
                        )
                    base, _, fmt = name.partition("@")
                    if fmt and base in loaders:  # shards against the folder, same loader
                        row[f"ratio_{base}_{fmt}_over_folder"] = round(
                            row[name]["images_per_sec"] / row[base]["images_per_sec"], 3
                        )
                rows.append(row)
                print(f"{device}: " + format_row(row), flush=True)
                del loaders
    return rows


def format_row(row: dict) -> str:
    speeds = ", ".join(
        f"{name} {row[name]['images_per_sec']}"
        for name in row
        if isinstance(row[name], dict) and "images_per_sec" in row[name]
    )
    ratio = (
        f", dali/plain {row['ratio_dali_over_plain']}x" if "ratio_dali_over_plain" in row else ""
    )
    return (
        f"{row['batches_per_epoch']} batches/epoch, {row['threads']} threads, prefetch "
        f"{row['prefetch']}, hw_decoder_load {row['hw_decoder_load']}: {speeds} img/s{ratio}"
    )


def stage_profile(files: list[str], n: int = 256, batch: int = 32) -> dict:
    """Single-thread cost per image of each stage (ms): where the loaders spend their time.

    torchvision: timed stage by stage in this process. DALI: three 1-thread
    pipelines that stop after decode+crop, after resize, after normalize; each
    stage's cost is the difference between consecutive pipelines.
    """
    import torch
    import torchvision.transforms as T
    from nvidia.dali import fn, pipeline_def, types
    from PIL import Image

    files = files[:n]
    torch.set_num_threads(1)
    rrc, to_tensor = T.RandomResizedCrop(224), T.ToTensor()
    normalize = T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    tv = dict.fromkeys(("decode", "random_resized_crop", "to_tensor", "normalize"), 0.0)
    for path in files:
        t0 = time.perf_counter()
        img = Image.open(path).convert("RGB")
        t1 = time.perf_counter()
        img = rrc(img)
        t2 = time.perf_counter()
        x = to_tensor(img)
        t3 = time.perf_counter()
        normalize(x)
        t4 = time.perf_counter()
        for key, dt in zip(tv, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            tv[key] += dt

    def dali_ms(stop: str) -> float:
        @pipeline_def(batch_size=batch, num_threads=1, device_id=None, prefetch_queue_depth=1)
        def pipe():
            encoded, _ = fn.readers.file(files=files, labels=list(range(len(files))))
            img = fn.decoders.image_random_crop(encoded, device="cpu", output_type=types.RGB)
            if stop != "decode":
                img = fn.resize(img, size=[224, 224])
            if stop == "normalize":
                img = fn.crop_mirror_normalize(
                    img,
                    mirror=fn.random.coin_flip(),
                    mean=[124.0, 116.0, 104.0],
                    std=[58.0, 57.0, 57.0],
                    dtype=types.FLOAT,
                    output_layout="CHW",
                )
            return img

        p = pipe()
        p.build()
        p.run()  # warm-up
        steps = len(files) // batch - 1
        t0 = time.perf_counter()
        for _ in range(steps):
            p.run()
        return (time.perf_counter() - t0) / (steps * batch) * 1000

    cum = [dali_ms(stop) for stop in ("decode", "resize", "normalize")]
    ms = lambda v: round(v, 3)  # noqa: E731
    return {
        "torchvision_ms_per_image": {k: ms(v / len(files) * 1000) for k, v in tv.items()},
        "dali_ms_per_image": {
            "decode_random_crop": ms(cum[0]),
            "resize": ms(cum[1] - cum[0]),
            "crop_mirror_normalize": ms(cum[2] - cum[1]),
        },
        "images": len(files),
        "threads": 1,
    }


def title(args, device: str) -> str:
    """``Loaders on CPU: plain vs dali, batch 64`` (and the settings where several are measured)."""
    where = "GPU" if device == "cuda" else "CPU"
    text = f"Loaders on {where}: {' vs '.join(args.loaders)}, batch {args.batch}"
    if len(args.threads) > 1 or len(args.prefetch) > 1:
        text += f", threads {'/'.join(map(str, args.threads))} x prefetch "
        text += "/".join(map(str, args.prefetch))
    return text


def headline(rows: list[dict]) -> str:
    """Each row's ratios: DALI over the plain pipeline (the ceiling), or a loader over shards
    against the same loader over the folder."""
    settings = {(r["threads"], r["prefetch"], r["hw_decoder_load"]) for r in rows}
    parts = []
    for r in rows:
        where = f"{r['batches_per_epoch']} batches/epoch"
        if len(settings) > 1:
            where += f", {r['threads']} threads, prefetch {r['prefetch']}"
            if r["hw_decoder_load"] is not None:
                where += f", hw decoder {r['hw_decoder_load']}"
        if "ratio_dali_over_plain" in r:
            parts.append(f"dali/plain {r['ratio_dali_over_plain']:.2f}x at {where}")
        shards = [
            f"{k.removeprefix('ratio_').removesuffix('_over_folder').replace('_', '@')} {v:.2f}x"
            for k, v in r.items()
            if k.endswith("_over_folder")
        ]
        if shards:
            parts.append(f"over the folder's images/s at {where}: {', '.join(shards)}")
        if not parts:
            speeds = [f"{k} {v['images_per_sec']:.0f}" for k, v in r.items() if isinstance(v, dict)]
            parts.append(f"{', '.join(speeds)} img/s at {where}")
    return "; ".join(parts)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=64, help="images per batch")
    parser.add_argument(
        "--batches-per-epoch",
        type=int,
        nargs="+",
        default=[25, 100],
        help="epoch lengths (batches); the folder holds enough files for the longest",
    )
    parser.add_argument("--classes", type=int, default=16)
    parser.add_argument(
        "--threads",
        type=int,
        nargs="+",
        default=[os.cpu_count()],
        help="DALI threads = DataLoader workers (several: each is measured)",
    )
    parser.add_argument(
        "--prefetch",
        type=int,
        nargs="+",
        default=[2],
        help="DALI prefetch queue depth (several: each is measured)",
    )
    parser.add_argument(
        "--hw-decoder-load",
        type=float,
        nargs="+",
        default=[0.9],
        help="GPU only: hardware-decoder shares to measure",
    )
    parser.add_argument(
        "--jpeg-size",
        default="500x375",
        help="WxH of the generated JPEGs (ImageNet-like by default; small ones make decoding cheap, "
        "so a CPU shows the pipeline's own per-batch cost as a GPU's decoder does)",
    )
    parser.add_argument(
        "--out-size", type=int, default=224, help="the crop every loader resizes to (pixels)"
    )
    parser.add_argument("--dtype", choices=("float16", "float32"), default="float16")
    parser.add_argument(
        "--layout", choices=("HWC", "CHW"), default="HWC", help="HWC = channels_last batches"
    )
    parser.add_argument(
        "--loaders",
        nargs="+",
        default=["plain", "dali"],
        choices=LOADERS,
        help="name@wds / name@recordio: that loader over the files as shards (data.format)",
    )
    parser.add_argument("--epochs", type=int, default=3, help="timed epochs per loader")
    parser.add_argument(
        "--devices",
        nargs="+",
        default=["cpu", "cuda"],
        choices=("cpu", "cuda"),
        help="cuda is skipped without a GPU",
    )
    parser.add_argument(
        "--root", default="", help="reuse this generated folder (made when missing)"
    )
    parser.add_argument(
        "--out", default="", help="result file (default results/bench/loader_<device>.json)"
    )
    parser.add_argument(
        "--stage-profile",
        action="store_true",
        help="also time each CPU stage on one thread (torchvision vs DALI)",
    )
    args = parser.parse_args()

    import torch

    from bench.common import provenance, write_result

    width, _, height = args.jpeg_size.partition("x")
    if not (width.isdigit() and height.isdigit() and int(width) > 0 and int(height) > 0):
        parser.error(f"--jpeg-size {args.jpeg_size!r}: expected WIDTHxHEIGHT, e.g. 500x375")
    jpeg_hw = (int(height), int(width))
    needed = max(args.batches_per_epoch) * args.batch
    devices = [d for d in args.devices if d == "cpu" or torch.cuda.is_available()]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.root or Path(tmp) / "jpegs")
        have = len(list((root / "train").rglob("*.JPEG"))) if (root / "train").is_dir() else 0
        if have < needed:
            t0 = time.perf_counter()
            make_folder_parallel(root, needed, args.classes, start=have, size=jpeg_hw)
            print(
                f"generated {needed - have} JPEGs in {time.perf_counter() - t0:.0f} s under {root}",
                flush=True,
            )
        jpegs = sorted((root / "train").rglob("*.JPEG"))
        sizes = [p.stat().st_size for p in jpegs]
        from PIL import Image

        with Image.open(jpegs[0]) as first:  # a reused --root may hold another size
            jpeg_size = "{}x{}".format(*first.size)
        common = {
            **provenance("loader.py"),
            "dali": __import__("nvidia.dali").dali.__version__,
            "setup": {
                "files_in_folder": len(sizes),
                "image_size": jpeg_size,
                "mean_jpeg_kb": round(np.mean(sizes) / 1024, 1),
                "batch": args.batch,
                "timed_epochs": args.epochs,
                "transform": f"decode + random-resized-crop {args.out_size} (0.08-1, 3/4-4/3) + flip + "
                f"normalize, {args.dtype} {args.layout} (torchvision: float32 CHW)",
            },
        }
        results = {}
        for device in devices:
            loads = args.hw_decoder_load if device == "cuda" else [None]
            rows = []
            for load in loads:
                opts = {
                    "dtype": args.dtype,
                    "channels_last": args.layout == "HWC",
                    "hw_decoder_load": load,  # None: CPU decode, no hardware decoder
                    "out_size": args.out_size,
                }
                rows += measure(root, device, args, opts)
            results[device] = {"rows": rows}
        if args.stage_profile:
            results["cpu"]["stage_profile"] = stage_profile(
                sorted(str(p) for p in (root / "train").rglob("*.JPEG"))
            )
    for device, res in results.items():
        path = (
            Path(args.out)
            if args.out and len(results) == 1
            else (
                REPO / "results" / "bench" / f"loader_{'gpu' if device == 'cuda' else 'cpu'}.json"
            )
        )
        result = {**common, "device": device, **res}
        write_result(path, result, title=title(args, device), headline=headline(res["rows"]))
        print(f"{device}: {len(res['rows'])} rows -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
