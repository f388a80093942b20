"""dstrain's DALI loader (CPU pipelines, device_id=None): one kept pipeline per loader, exact passes.

The loader feeds one pipeline, built at its first pass, with every later pass's files; DALI runs
ahead into the pass it predicts next. These tests check from pixels that every pass (after a ramp
step, a resume, a pass broken off, an evaluation repeated) holds exactly the files the sharding
rule gives, that no pass builds a new pipeline, that the crops are a function of (seed, epoch,
rank, batch) so a resumed epoch draws exactly the uninterrupted crops, and that the pipeline's
crop geometry is the NumPy rule :func:`dstrain.data.dali.crop_window` (torchvision's).
"""

import os
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

from dstrain.data import Shard, build_data, index_lists
from dstrain.data.dali import crop_draws, crop_window
from dstrain.data.images import IMAGENET_MEAN, IMAGENET_STD
from dstrain.settings.config import DataConfig
from tests.conftest import decode_colour, make_noise_folder

pytest.importorskip("nvidia.dali")


def cfg_for(root, **kw):
    base = dict(
        dataset="imagefolder",
        root=str(root),
        loader="dali",
        image_size=16,
        val_resize=20,
        num_workers=1,
    )
    return DataConfig(**{**base, **kw})


def files_of(loader) -> list[tuple[int, int]]:
    """(class, file) of every image of one pass, from pixels; labels checked against the pixels."""
    out = []
    for x, y in loader:
        ids = decode_colour(x)
        assert [c for c, _ in ids] == y.tolist()
        out += ids
    return out


def expected(loader, epoch: int, start: int = 0) -> list[tuple[int, int]]:
    """(class, file) the sharding rule gives this loader's pass (jpeg_folder: 8 files a class)."""
    lists = index_lists(loader.n, loader.shard, loader.mode, epoch, loader.limit)[start:]
    files = loader.images.files
    names = [files[i].split("/")[-2:] for i in torch.cat(lists).tolist()]
    classes = sorted({c for c, _ in names})
    return [(classes.index(c), int(f.split(".")[0])) for c, f in names]


def test_one_pipeline_serves_every_epoch_ramp_step_resume_and_evaluation(jpeg_folder):
    data = build_data(cfg_for(jpeg_folder), Shard(0, 1, 2, 1, eval_batch=4, seed=3), 3, 3)
    train, val = data.train, data.val
    passes = [  # (epoch, accumulation, start): the loop's calls, a ramp step, a resume
        (0, 1, 0),
        (1, 1, 0),
        (2, 3, 0),  # ramp: global batch 2 -> 6, the order is cut again
        (3, 3, 0),
        (3, 3, 5),  # the same epoch again from micro batch 5 (a resume)
        (5, 1, 0),  # an epoch skipped: the prediction (epoch 4) is dropped
    ]
    for epoch, accumulation, start in passes:
        train.start_epoch(epoch, accumulation=accumulation, start=start)
        assert files_of(train) == expected(train, epoch, start)
        assert sorted(files_of(val)) == [(c, i) for c in range(3) for i in range(3)]
    assert (train.builds, val.builds) == (1, 1)


def test_paths_of_any_length_and_script_reach_the_pipeline_intact(jpeg_folder, tmp_path):
    """The feed hands a batch's paths as one NUL-padded array (path_rows): short, long, non-ASCII
    and non-UTF-8 names in one batch each open their own file, in training and evaluation."""
    root = tmp_path / "names"
    shutil.copytree(jpeg_folder, root)
    files = sorted(root.glob("*/*/*.JPEG"))
    assert len(files) == 33
    for k, path in enumerate(files):
        stem = path.name.split(".")[0]  # the file index decode_colour reads back
        if k % 4 == 0:  # bytes that are not UTF-8, as a Linux file system may hold them
            os.rename(path, os.fsencode(path.parent) + f"/{stem}.".encode() + b"\xff\xfe.JPEG")
        else:
            path.rename(path.with_name(f"{stem}.{'ü' * (k * 7 % 23)}{'n' * (k % 5)}.JPEG"))
    data = build_data(cfg_for(root), Shard(0, 1, 4, 1, eval_batch=4, seed=2), 3, 3)
    data.train.start_epoch(0)
    assert files_of(data.train) == expected(data.train, 0)
    assert sorted(files_of(data.val)) == [(c, i) for c in range(3) for i in range(3)]


def test_an_error_in_the_feeds_own_code_closes_the_pipelines_and_the_next_pass_is_exact(
    jpeg_folder, monkeypatch
):
    """An exception raised by the host side of the feed (not by DALI) leaves the loader closed,
    not with its in-flight batches out of step with their labels; the next pass rebuilds."""
    from dstrain.data import dali

    data = build_data(cfg_for(jpeg_folder), Shard(0, 1, 2, 1, seed=4), 3, 3)
    train = data.train
    train.start_epoch(0)
    assert files_of(train) == expected(train, 0)
    real, calls = dali.crop_window, []

    def failing(*args):
        calls.append(1)
        if len(calls) == 3:
            raise ValueError("planted")
        return real(*args)

    monkeypatch.setattr(dali, "crop_window", failing)
    train.start_epoch(1)
    with pytest.raises(ValueError, match="planted"):
        list(train)
    assert train._pipe is None  # closed: its threads stopped, nothing in flight kept
    monkeypatch.setattr(dali, "crop_window", real)
    train.start_epoch(1)
    assert files_of(train) == expected(train, 1)
    assert train.builds == 2


def test_a_pass_broken_off_leaves_the_next_pass_exact(jpeg_folder):
    data = build_data(cfg_for(jpeg_folder), Shard(0, 1, 2, 1, eval_batch=2, seed=1), 3, 3)
    train = data.train
    for epoch in (0, 1):
        train.start_epoch(epoch)
        for k, _ in enumerate(train):
            if k == 1:
                break  # DALI has batches of this epoch in flight
    train.start_epoch(2)
    assert files_of(train) == expected(train, 2)
    first = next(iter(data.val))[0]  # evaluation broken off after one batch, twice
    assert torch.equal(first, next(iter(data.val))[0])
    assert len(files_of(data.val)) == 9 and train.builds == 1


def test_two_ranks_read_the_global_batches_of_one_rank(jpeg_folder):
    cfg = cfg_for(jpeg_folder)
    one = build_data(cfg, Shard(0, 1, 4, 1, seed=5), 3, 3).train
    ranks = [build_data(cfg, Shard(r, 2, 2, 1, seed=5), 3, 3).train for r in range(2)]
    for epoch in (0, 1):
        for loader in (one, *ranks):
            loader.start_epoch(epoch)
        per_rank = [files_of(loader) for loader in ranks]
        interleaved = [
            f for pair in zip(*(np.split(np.array(p), 6) for p in per_rank)) for f in pair
        ]
        assert [tuple(f) for f in np.concatenate(interleaved)] == files_of(one)


@pytest.fixture(scope="module")
def textured(tmp_path_factory):
    return make_noise_folder(tmp_path_factory.mktemp("textured"), {"train": 12, "val": 2}, (48, 64))


def test_a_resumed_epoch_draws_exactly_the_uninterrupted_crops(textured):
    cfg = cfg_for(textured)
    shard = Shard(0, 1, 3, 1, seed=7)
    straight = build_data(cfg, shard, 3, 1).train
    for epoch in (0, 1):  # the uninterrupted run has already run epoch 0 through the pipeline
        straight.start_epoch(epoch)
        batches = [x.clone() for x, _ in straight]
    resumed = build_data(cfg, shard, 3, 1).train
    resumed.start_epoch(1, start=2)  # a new process resumes epoch 1 at micro batch 2
    again = [x for x, _ in resumed]
    assert len(again) == 2 and all(torch.equal(a, b) for a, b in zip(again, batches[2:]))
    straight.start_epoch(2)
    assert not torch.equal(next(iter(straight))[0], batches[0])  # new crops every epoch


def geometry_image(root, width: int, height: int):
    """An image whose red channel is x and green channel y (scaled to 0-255), one file."""
    (root / "train" / "a").mkdir(parents=True)
    (root / "val" / "a").mkdir(parents=True)
    xs = np.linspace(0, 255, width)[None, :].repeat(height, 0)
    ys = np.linspace(0, 255, height)[:, None].repeat(width, 1)
    pixels = np.stack([xs, ys, np.zeros_like(xs)], -1).round().astype(np.uint8)
    for i in range(4):
        Image.fromarray(pixels).save(root / "train" / "a" / f"{i}.png")
    Image.fromarray(pixels).save(root / "val" / "a" / "0.png")
    return root


@pytest.mark.parametrize(
    "area, aspect",
    [([0.08, 1.0], [0.75, 4 / 3]), ([0.9, 1.0], [3.0, 4.0])],  # the second never fits a 1.5:1 image
    ids=["imagenet_ranges", "fallback"],
)
def test_the_pipeline_crops_the_window_the_numpy_rule_gives(tmp_path, area, aspect):
    root = geometry_image(tmp_path, 240, 160)
    side = 32
    cfg = cfg_for(
        root, image_size=side, val_resize=side, random_area=area, random_aspect_ratio=aspect
    )
    loader = build_data(cfg, Shard(0, 1, 4, 1, seed=11), 3, 1).train
    loader.start_epoch(2)
    ((x, _),) = list(loader)
    pixels = x.double() * torch.tensor(IMAGENET_STD)[:, None, None] * 255
    pixels += torch.tensor(IMAGENET_MEAN)[:, None, None] * 255
    draws = crop_draws(loader.augment_seed(2) * 1_000_003 + 0, 4, area, aspect)
    windows = crop_window(np.full(4, 1.5), draws, aspect)
    for img, (x0, y0, w, h), flip in zip(pixels, windows, draws["flip"]):
        red = img[0].mean(0).numpy()[:: -1 if flip else 1] / 255  # x across the output, 0-1
        green = img[1].mean(1).numpy() / 255
        half_x, half_y = w / side / 2, h / side / 2  # output pixels sample their centres
        assert red[0] == pytest.approx(x0 + half_x, abs=0.03) and red[-1] == pytest.approx(
            x0 + w - half_x, abs=0.03
        )
        assert green[0] == pytest.approx(y0 + half_y, abs=0.03) and green[-1] == pytest.approx(
            y0 + h - half_y, abs=0.03
        )
    if (
        aspect[0] > 1.5
    ):  # nothing fits: the centred full-width crop of aspect 3 (w/h), torchvision's
        assert np.allclose(windows, [[0.0, 0.25, 1.0, 0.5]] * 4)


def test_crop_draws_fit_the_image_or_fall_back_like_torchvision():
    """The rule itself: fitted windows lie inside the image with the drawn area and aspect ratio."""
    q = np.full(2000, 0.75)  # portrait 3:4 images
    draws = crop_draws(0, 2000, (0.08, 1.0), (0.75, 4 / 3))
    x, y, w, h = crop_window(q, draws, (0.75, 4 / 3)).T
    assert (
        (x >= 0).all()
        and (y >= 0).all()
        and (x + w <= 1 + 1e-6).all()
        and (y + h <= 1 + 1e-6).all()
    )
    ratio = w * q / h  # width / height in pixels
    assert (ratio > 0.75 - 1e-4).all() and (ratio < 4 / 3 + 1e-4).all()
    assert 0.08 - 1e-6 <= (w * h).min() and (w * h).max() <= 1 + 1e-6
    assert (w * h).mean() == pytest.approx(0.45, abs=0.05)  # large areas fit less often


def test_half_precision_training_gets_float16_batches(jpeg_folder):
    for dtype, wanted in ((torch.bfloat16, torch.float16), (torch.float32, torch.float32)):
        data = build_data(cfg_for(jpeg_folder), Shard(0, 1, 4, 1, eval_batch=4), 3, 3, dtype=dtype)
        assert next(iter(data.train))[0].dtype == wanted and next(iter(data.val))[0].dtype == wanted


def test_without_the_dynamic_executor_batches_are_copies_that_stay_valid(jpeg_folder, monkeypatch):
    from dstrain.data.dali import DaliLoader

    monkeypatch.setattr(DaliLoader, "exec_dynamic", False)  # DALI reuses its output buffers then
    data = build_data(cfg_for(jpeg_folder), Shard(0, 1, 2, 1, eval_batch=2, seed=4), 3, 3)
    for epoch in (0, 1):
        data.train.start_epoch(epoch)
        batches = list(data.train)  # all held at once: a reused buffer would change them
        assert [f for x, _ in batches for f in decode_colour(x)] == expected(data.train, epoch)


def test_closing_stops_the_pipeline_and_keeps_the_batches_handed_out(jpeg_folder):
    loader = build_data(cfg_for(jpeg_folder), Shard(0, 1, 4, 1, eval_batch=4), 3, 3).val
    batches = [x for x, _ in loader]
    before = [x.clone() for x in batches]
    loader.close()
    assert all(torch.equal(a, b) for a, b in zip(batches, before))
    assert len(files_of(loader)) == 9 and loader.builds == 2
