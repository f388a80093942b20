"""Loader throughput: DALI vs the torchvision DataLoader on the same generated JPEG folder.

    .venv/bin/python bench/loader.py                       # -> bench/results/loader_cpu.json
    .venv/bin/python bench/loader.py --images 2000 --threads 2 --batch 64 --epochs 3

Both loaders are dstrain's own (dstrain.data.dali.DaliLoader and
dstrain.data.folder.TorchvisionLoader), fed the same file list and the same
sharding, with the same work per image: decode, random-resized-crop to 224
(area 0.08-1, aspect 3/4-4/3), horizontal flip, normalise, float32 NCHW.
DALI gets ``--threads`` CPU threads; torchvision gets ``--threads`` DataLoader
worker processes. The folder holds ImageNet-like 500x375 JPEGs (quality 90,
smooth random content plus pixel noise, ~100 KB each like ImageNet's). One warm-up epoch per loader
(page cache, worker start-up), then the two loaders alternate for ``--epochs``
timed epochs each; the ratio is DALI images/s over torchvision images/s in
this one run.

With a GPU (torch.cuda.is_available()), a second result file records the GPU
variant: DALI with ``mixed`` (nvJPEG) decode and outputs on the GPU, against the
same torchvision loader copying batches to the GPU -> loader_gpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
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


def time_epoch(loader, epoch: int) -> tuple[float, int]:
    loader.start_epoch(epoch)
    t0, n = time.perf_counter(), 0
    for x, _ in loader:
        n += len(x)
    if x.is_cuda:
        import torch

        torch.cuda.synchronize()
    return time.perf_counter() - t0, n


def build_loaders(root: Path, batch: int, threads: int, device: str):
    from dstrain.config import DataConfig
    from dstrain.data import Shard
    from dstrain.data.dali import DaliLoader
    from dstrain.data.folder import TorchvisionLoader, scan_split

    cfg = DataConfig(dataset="imagefolder", root=str(root), num_workers=threads, pin_memory=True)
    images = scan_split(root, "train")
    shard = Shard(0, 1, batch, 1, eval_batch=batch, seed=0)
    dali = DaliLoader(images, shard, "train", cfg, augment=True, channels=3, device=device)
    tv = TorchvisionLoader(images, shard, "train", cfg, augment=True, channels=3, device=device)
    return {"dali": dali, "torchvision": tv}, len(images)


def measure(root: Path, batch: int, threads: int, epochs: int, device: str) -> dict:
    loaders, n = build_loaders(root, batch, threads, device)
    for loader in loaders.values():
        time_epoch(loader, 0)  # warm-up: page cache, worker processes, DALI start-up
    times = {name: [] for name in loaders}
    for epoch in range(1, epochs + 1):
        for name, loader in loaders.items():
            times[name].append(time_epoch(loader, epoch))
    out = {}
    for name, runs in times.items():
        seconds, images = sum(t for t, _ in runs), sum(k for _, k in runs)
        out[name] = {
            "images_per_sec": round(images / seconds, 1),
            "epoch_s": [round(t, 3) for t, _ in runs],
            "images_per_epoch": runs[0][1],
        }
    dali = loaders["dali"]
    build_t0 = time.perf_counter()  # what each training epoch pays for its own pipeline
    dali._build(dali.images.files, dali.images.labels.tolist(), batch, seed=1)
    out["dali"]["pipeline_build_s"] = round(time.perf_counter() - build_t0, 3)
    out["ratio_dali_over_torchvision"] = round(
        out["dali"]["images_per_sec"] / out["torchvision"]["images_per_sec"], 2
    )
    out["files_in_folder"] = n
    return out


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


def machine() -> dict:
    import torch

    from bench.default_recipe import cpu_model

    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "dali": __import__("nvidia.dali").dali.__version__,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=1536, help="JPEGs in the generated folder")
    parser.add_argument("--classes", type=int, default=16)
    parser.add_argument(
        "--threads", type=int, default=os.cpu_count(), help="DALI threads = DataLoader workers"
    )
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument(
        "--epochs", type=int, default=3, help="timed epochs per loader (after one warm-up)"
    )
    parser.add_argument(
        "--root", default="", help="reuse this generated folder (made when missing)"
    )
    args = parser.parse_args()

    import torch

    from dstrain.provenance import git_sha

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.root or Path(tmp) / "jpegs")
        if not (root / "train").is_dir():
            t0 = time.perf_counter()
            make_folder(root, args.images, args.classes)
            print(
                f"generated {args.images} JPEGs in {time.perf_counter() - t0:.0f} s under {root}",
                flush=True,
            )
        sizes = [p.stat().st_size for p in (root / "train").rglob("*.JPEG")]
        common = {
            "command": "python bench/loader.py " + " ".join(sys.argv[1:]),
            "git_sha": git_sha(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "machine": machine(),
            "setup": {
                "images": len(sizes),
                "image_size": "500x375",
                "mean_jpeg_kb": round(np.mean(sizes) / 1024, 1),
                "batch": args.batch,
                "threads_or_workers": args.threads,
                "timed_epochs": args.epochs,
                "transform": "decode + random-resized-crop 224 (0.08-1, 3/4-4/3) + flip + normalize, fp32 NCHW",
            },
        }
        results = {"cpu": measure(root, args.batch, args.threads, args.epochs, "cpu")}
        results["cpu"]["stage_profile"] = stage_profile(
            sorted(str(p) for p in (root / "train").rglob("*.JPEG"))
        )
        if torch.cuda.is_available():
            results["gpu"] = measure(root, args.batch, args.threads, args.epochs, "cuda")
    out_dir = REPO / "bench" / "results"
    for kind, res in results.items():
        path = out_dir / f"loader_{kind}.json"
        path.write_text(json.dumps({**common, "device": kind, **res}, indent=2) + "\n")
        print(
            f"{kind}: DALI {res['dali']['images_per_sec']} img/s, torchvision {res['torchvision']['images_per_sec']} "
            f"img/s, ratio {res['ratio_dali_over_torchvision']}x -> {path}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
