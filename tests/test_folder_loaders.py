"""Image-folder loaders: DALI (CPU-only pipelines, device_id=None) and torchvision on generated JPEGs.

Every JPEG is a flat colour that encodes (class, file index) (tests/conftest.py),
so these tests check from pixels alone that labels match the class folders and
that each rank reads the files the sharding rule gives it.
"""

import logging
import shutil

import pytest
import torch

from dstrain.core.errors import ConfigError
from dstrain.data import CorruptImageError, Shard, build_data, resolve_loader
from dstrain.data.images import scan_folder
from dstrain.settings.config import DataConfig
from tests.conftest import decode_colour, make_jpeg_folder, make_noise_folder

LOADERS = ["dali", "torchvision"]
N_TRAIN, N_VAL = 24, 9  # 3 classes x 8 train / 3 val files


def cfg_for(root, loader, **kw):
    base = dict(
        dataset="imagefolder",
        root=str(root),
        loader=loader,
        image_size=16,
        val_resize=20,
        num_workers=1,
    )
    return DataConfig(**{**base, **kw})


def samples(loader):
    """[(class, file), ...] decoded from pixels, checked against the labels the loader returned."""
    out = []
    for x, y in loader:
        ids = decode_colour(x)
        assert [c for c, _ in ids] == y.tolist(), "label does not match the image's class folder"
        out += ids
    return out


@pytest.mark.parametrize("loader", LOADERS)
def test_shapes_dtype_and_labels_follow_sorted_class_folders(jpeg_folder, loader):
    data = build_data(cfg_for(jpeg_folder, loader), Shard(0, 1, 4, 1, eval_batch=5), 3, 3)
    assert (data.n_train, data.n_val, data.kind) == (N_TRAIN, N_VAL, loader)
    x, y = next(iter(data.train))
    assert x.shape == (4, 3, 16, 16) and x.dtype == torch.float32 and y.dtype == torch.int64
    assert sorted(samples(data.val)) == [(c, i) for c in range(3) for i in range(3)]
    assert sorted(samples(data.train)) == [(c, i) for c in range(3) for i in range(8)]


def test_dali_and_torchvision_agree_on_the_file_list_and_torchvision_imagefolder(jpeg_folder):
    import torchvision

    train, val = scan_folder(str(jpeg_folder))
    reference = torchvision.datasets.ImageFolder(str(jpeg_folder / "train"))
    assert [(p, int(label)) for p, label in zip(train.files, train.labels)] == reference.samples
    assert (
        train.classes == reference.classes == ["ant", "bee", "cat"] and val.classes == train.classes
    )


@pytest.mark.parametrize("loader", LOADERS)
def test_two_ranks_cover_every_file_exactly_once(jpeg_folder, loader):
    """Train: 24 files = 2 global batches of 12; each epoch every file once over 2 ranks. Val: 9 = 4 + 5."""
    cfg = cfg_for(jpeg_folder, loader)
    for epoch in (0, 1):
        seen_train, seen_val = [], []
        for rank in range(2):
            data = build_data(cfg, Shard(rank, 2, 3, 2, eval_batch=2, seed=1), 3, 3)
            data.train.start_epoch(epoch)
            seen_train += samples(data.train)
            seen_val.append(samples(data.val))
        assert sorted(seen_train) == [(c, i) for c in range(3) for i in range(8)]
        assert sorted(seen_val[0] + seen_val[1]) == [(c, i) for c in range(3) for i in range(3)]
        assert len(seen_val[0]) == 4 and len(seen_val[1]) == 5


@pytest.fixture(scope="module")
def noise_folder(tmp_path_factory):
    return make_noise_folder(tmp_path_factory.mktemp("noise"), {"train": 8, "val": 2})


@pytest.mark.parametrize("loader", LOADERS)
def test_val_is_deterministic_and_train_is_reproducible_per_epoch(noise_folder, loader):
    """Val: same tensors on every pass. Train: a function of (seed, epoch): a resumed run sees the
    same crops. On noise images, where every crop window and flip gives other pixels: another
    epoch (or seed) must give other tensors, so an augmentation that ignored them would fail."""
    cfg = cfg_for(noise_folder, loader, random_area=[0.1, 0.5])

    def train_epoch(epoch: int, seed: int = 0) -> list[torch.Tensor]:
        data = build_data(cfg, Shard(0, 1, 4, 1, eval_batch=2, seed=seed), 3, 1)
        data.train.start_epoch(epoch)
        return [x for x, _ in data.train]

    data = build_data(cfg, Shard(0, 1, 4, 1, eval_batch=2), 3, 1)
    first = [x for x, _ in data.val]
    assert all(torch.equal(a, b) for a, b in zip(first, [x for x, _ in data.val], strict=True))
    ref = train_epoch(3)
    assert len(ref) == 2 and all(
        torch.equal(a, b) for a, b in zip(ref, train_epoch(3), strict=True)
    )
    # another epoch or seed: the same 8 images, in another order, each cropped anew: no image's
    # tensor equals any tensor of the reference epoch (a crop that ignored the epoch would repeat)
    ref_images = [x for batch in ref for x in batch]
    for other in (train_epoch(4), train_epoch(3, seed=1)):
        images = [x for batch in other for x in batch]
        assert len(images) == len(ref_images) == 8
        assert not any(torch.equal(a, b) for a in images for b in ref_images)


def crops(root, seed, epoch, *, workers=0, rank=0, world=1, start=0, micro=2):
    """{image index: its training tensor} for one epoch of the torchvision loader."""
    data = build_data(
        cfg_for(root, "torchvision", num_workers=workers, random_area=[0.1, 0.5]),
        Shard(rank, world, micro, 1, seed=seed),
        3,
        1,
    )
    data.train.start_epoch(epoch, start=start)
    keys = [k for batch in list(data.train.sampler) for k, _ in batch]
    images = torch.cat([x for x, _ in data.train])
    return dict(zip(keys, images))


def test_torchvision_augmentation_is_a_function_of_seed_epoch_and_image(noise_folder):
    """What docs/faults.md promises for a resumed run: the same crops for (seed, epoch, image),
    in the main process or in workers, on one rank or two, from the start of an epoch or part-way;
    another seed or epoch gives other crops (the images are noise, so any other window differs)."""
    ref = crops(noise_folder, seed=3, epoch=1)
    assert sorted(ref) == list(range(8))

    def same(other):
        return all(torch.equal(other[k], ref[k]) for k in other)

    assert same(crops(noise_folder, seed=3, epoch=1, workers=2))
    two_ranks = {
        **crops(noise_folder, 3, 1, rank=0, world=2),
        **crops(noise_folder, 3, 1, rank=1, world=2),
    }
    assert sorted(two_ranks) == list(range(8)) and same(two_ranks)
    resumed = crops(noise_folder, seed=3, epoch=1, start=2)  # micro batches 2 and 3 of 4
    assert len(resumed) == 4 and same(resumed)
    torch.manual_seed(123)  # the caller's generator neither matters nor moves
    state = torch.get_rng_state()
    assert same(crops(noise_folder, seed=3, epoch=1))
    assert torch.equal(torch.get_rng_state(), state)
    for other in (crops(noise_folder, seed=4, epoch=1), crops(noise_folder, seed=3, epoch=2)):
        assert all(not torch.equal(other[k], ref[k]) for k in ref)


def test_dali_train_crops_are_random_and_val_is_the_center_crop(tmp_path):
    """A left-right split image: val keeps both halves; random-resized crops sometimes show one side only."""
    import numpy as np
    from PIL import Image

    for split in ("train", "val"):
        (tmp_path / split / "a").mkdir(parents=True)
        img = np.zeros((64, 64, 3), np.uint8)
        img[:, 32:] = 255
        for i in range(8):
            Image.fromarray(img).save(tmp_path / split / "a" / f"{i}.png")
    cfg = cfg_for(tmp_path, "dali", random_area=[0.05, 0.2])
    data = build_data(cfg, Shard(0, 1, 8, 1, eval_batch=8), 3, 2)
    val = next(iter(data.val))[0]
    assert torch.allclose(val[0], val[1]) and float(val[:, :, :, :8].mean()) < float(
        val[:, :, :, -8:].mean()
    )
    train = next(iter(data.train))[0]
    means = train.mean(dim=(1, 2, 3))
    assert float(means.max() - means.min()) > 1.0  # some crops all dark, some all bright


@pytest.mark.parametrize("loader", LOADERS)
def test_start_epoch_without_augment_gives_the_val_transform_on_training_images(tmp_path, loader):
    """val/ holds copies of train/'s noise images: un-augmented training batches must be pixel for
    pixel what the validation loader makes of the same files (resize + centre crop, no flip)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(1)
    for split in ("train", "val"):
        (tmp_path / split / "a").mkdir(parents=True)
    for i in range(8):
        img = Image.fromarray(rng.integers(0, 256, (40, 48, 3), dtype=np.uint8))
        for split in ("train", "val"):
            img.save(tmp_path / split / "a" / f"{i:03d}.png")
    data = build_data(cfg_for(tmp_path, loader), Shard(0, 1, 4, 1, eval_batch=8), 3, 1)
    val = torch.cat([x for x, _ in data.val])  # the 8 files in order
    data.train.start_epoch(0, augment=False)
    plain = torch.cat([x for x, _ in data.train])
    matched = [min(range(8), key=lambda j, x=x: float((val[j] - x).abs().max())) for x in plain]
    assert sorted(matched) == list(range(8))  # every training image once...
    for x, j in zip(plain, matched):
        torch.testing.assert_close(x, val[j])  # ...exactly as the val transform makes it
    data.train.start_epoch(0, augment=True)
    augmented = torch.cat([x for x, _ in data.train])
    assert not torch.allclose(augmented, plain)  # the switch back to random crops is real


@pytest.mark.parametrize("loader", LOADERS)
def test_polish_set_is_fixed_balanced_and_split_exactly_across_ranks(jpeg_folder, loader):
    """12 images = 3 batches of 4, dealt 1 + 2 to two ranks: the same batches as one rank reads."""
    cfg = cfg_for(jpeg_folder, loader)
    per_rank = [
        samples(build_data(cfg, Shard(r, 2, 3, 1, seed=2), 3, 3).polish(12, 4)) for r in range(2)
    ]
    assert (len(per_rank[0]), len(per_rank[1])) == (4, 8)
    together = per_rank[0] + per_rank[1]
    assert len(together) == len(set(together)) == 12
    assert (
        len({c for c, _ in together}) == 3
    )  # a permutation, not the first 12 files (= classes 0 and 1 only)
    single = samples(build_data(cfg, Shard(0, 1, 3, 1, seed=2), 3, 3).polish(12, 4))
    assert single == together  # same batches, same order, however many ranks
    assert (
        len(samples(build_data(cfg, Shard(0, 1, 3, 1, seed=2), 3, 3).polish(14, 4))) == 12
    )  # whole batches


@pytest.mark.parametrize("loader", LOADERS)
def test_batch_size_ramp_recuts_batches_without_a_new_loader(jpeg_folder, loader):
    shard = Shard(0, 1, 4, 1, eval_batch=4)
    data = build_data(cfg_for(jpeg_folder, loader), shard, 3, 3)
    assert len(data.train) == 6
    data.train.start_epoch(0, accumulation=3)  # global batch 4 -> 12: 2 steps of 3 micro batches
    assert len(data.train) == 6 and len(list(data.train)) == 6
    data.train.start_epoch(
        0, accumulation=5
    )  # global batch 20: 1 step of 5 micro batches, 4 images dropped
    assert len(samples(data.train)) == 20


@pytest.mark.parametrize("loader", LOADERS)
def test_fill_completes_the_last_batch_from_the_next_epochs_order(jpeg_folder, loader):
    """data.last_batch=fill: 24 files at global batch 20 give 2 steps, the second taking 16 files
    from epoch 2's order; epoch 2 (offset 16) reads its other 8 and 12 of epoch 3's. Both epochs
    are read through one kept pipeline (DALI feeds the next epoch ahead, offset included)."""
    shard = Shard(0, 1, 4, 5, eval_batch=4, fill=True)
    data = build_data(cfg_for(jpeg_folder, loader), shard, 3, 3)
    data.train.start_epoch(0, augment=False)
    first = samples(data.train)
    data.train.start_epoch(1, offset=16, augment=False)
    second = samples(data.train)
    assert len(first) == 40 and len(second) == 20
    everything = sorted({*first})
    assert len(everything) == N_TRAIN and sorted(first[:24]) == everything
    assert sorted(first[24:] + second[:8]) == everything  # epoch 2's order, once


def test_fill_draws_the_carried_images_crops_from_their_own_epoch():
    """torchvision's crops are keyed by (seed, epoch, image): an image in an epoch's own part and
    again in the part its last batch takes from the next epoch's order gets that epoch's key
    there, so the two crops differ, on any number of ranks."""
    from dstrain.data.folder import ShardBatchSampler

    def keys(world: int, micro: int) -> list[tuple[int, int]]:
        out = []
        for r in range(world):
            sampler = ShardBatchSampler(
                24, Shard(r, world, micro, 20 // (micro * world), fill=True), "train"
            )
            sampler.start_epoch(0)
            out.append([k for batch in sampler for k in batch])
        per_rank = len(out[0]) // 2  # two steps
        return [
            k for s in range(2) for mine in out for k in mine[s * per_rank : (s + 1) * per_rank]
        ]

    one = keys(1, 4)
    assert keys(2, 2) == one and len(one) == 40
    epoch = [seed // 2**24 for _, seed in one]  # seed 0: (0 * 1_000_003 + epoch) * 2^24 + image
    assert epoch == [0] * 24 + [1] * 16
    twice = {i for i, _ in one[:24]} & {i for i, _ in one[24:]}
    assert len(twice) == 16 and len({seed for _, seed in one}) == 40


def test_dali_fp16_channels_last_output(jpeg_folder):
    data = build_data(
        cfg_for(jpeg_folder, "dali"),
        Shard(0, 1, 4, 1, eval_batch=4),
        3,
        3,
        dtype=torch.float16,
        channels_last=True,
    )
    x, _ = next(iter(data.train))
    assert x.shape == (4, 3, 16, 16) and x.dtype == torch.float16
    assert x.is_contiguous(memory_format=torch.channels_last)
    xv, _ = next(iter(data.val))
    ref, _ = next(
        iter(build_data(cfg_for(jpeg_folder, "dali"), Shard(0, 1, 4, 1, eval_batch=4), 3, 3).val)
    )
    assert torch.allclose(xv.float(), ref, atol=1e-2)


def test_grayscale_models_get_one_channel(jpeg_folder):
    for loader in LOADERS:
        x, _ = next(
            iter(
                build_data(cfg_for(jpeg_folder, loader), Shard(0, 1, 4, 1, eval_batch=4), 1, 3).val
            )
        )
        assert x.shape == (4, 1, 16, 16)


@pytest.mark.parametrize("loader", LOADERS)
def test_corrupt_jpeg_names_the_file(tmp_path, loader):
    root = make_jpeg_folder(tmp_path / "data", per_class=2, val_per_class=1)
    bad = root / "train" / "bee" / "001.JPEG"
    bad.write_bytes(bad.read_bytes()[:150])  # truncated inside the header
    data = build_data(cfg_for(root, loader), Shard(0, 1, 6, 1, eval_batch=3), 3, 3)
    with pytest.raises(CorruptImageError) as err:
        list(data.train)
    message = str(err.value)
    assert message.startswith(f"corrupt image: {bad}") and "\n" not in message


@pytest.mark.slow  # over ~5 s on 2 cores: the full suite only (issue 53: the quick loop under 1 minute)
def test_corrupt_jpeg_in_a_dataloader_worker_is_one_line(tmp_path):
    root = make_jpeg_folder(tmp_path / "data", per_class=2, val_per_class=1)
    bad = root / "val" / "ant" / "000.JPEG"
    bad.write_bytes(b"this is not a jpeg")
    data = build_data(
        cfg_for(root, "torchvision", num_workers=1), Shard(0, 1, 6, 1, eval_batch=3), 3, 3
    )
    with pytest.raises(CorruptImageError, match=f"^corrupt image: {bad}") as err:
        list(data.val)
    assert "Traceback" not in str(err.value)


def test_non_image_files_are_skipped_and_counted(tmp_path, caplog):
    root = make_jpeg_folder(tmp_path / "data", per_class=2, val_per_class=1)
    (root / "train" / "ant" / "notes.txt").write_text("not an image")
    (root / "train" / "ant" / ".DS_Store").write_bytes(b"\0")
    with caplog.at_level(logging.WARNING, logger="dstrain"):
        data = build_data(cfg_for(root, "dali"), Shard(0, 1, 6, 1, eval_batch=3), 3, 3)
    assert data.n_train == 6 and "skipped 2 files without an image extension" in caplog.text


@pytest.mark.parametrize(
    "layout, match",
    [
        ("no_val", r"missing .*val/"),
        ("no_classes", r"train: no class folders"),
        ("empty_classes", r"train: no image files"),
        ("class_mismatch", r"class folders differ from train/"),
    ],
)
def test_bad_folder_layouts_are_clear_errors(tmp_path, layout, match):
    root = tmp_path / "data"
    if layout == "no_val":
        make_jpeg_folder(root, per_class=1, val_per_class=1)
        shutil.rmtree(root / "val")
    elif layout == "no_classes":
        (root / "train").mkdir(parents=True)
        (root / "val").mkdir()
    elif layout == "empty_classes":
        (root / "train" / "a").mkdir(parents=True)
        (root / "val" / "a").mkdir(parents=True)
    else:
        make_jpeg_folder(root, per_class=1, val_per_class=1)
        shutil.rmtree(root / "val" / "cat")
    with pytest.raises(ConfigError, match=match):
        build_data(cfg_for(root, "torchvision"), Shard(0, 1, 1, 1), 3, 3)


def test_too_few_classes_in_the_model_is_a_clear_error(jpeg_folder):
    with pytest.raises(ConfigError, match="set model.num_classes=3"):
        build_data(cfg_for(jpeg_folder, "dali"), Shard(0, 1, 4, 1), 3, 2)


def test_loader_resolution():
    assert (
        resolve_loader(DataConfig(dataset="imagefolder", loader="auto")) == "dali"
    )  # DALI is installed here
    assert resolve_loader(DataConfig(dataset="fashion_mnist", loader="auto")) == "tensor"
    assert resolve_loader(DataConfig(dataset="fashion_mnist", loader="torchvision")) == "tensor"
    with pytest.raises(ConfigError, match="Fashion-MNIST is served from memory"):
        resolve_loader(DataConfig(dataset="fashion_mnist", loader="dali"))


@pytest.mark.parametrize("dataset, side", [("fashion_mnist", 28), ("imagefolder", 16)])
def test_synthetic_batches_live_on_the_device_with_the_data_set_shape(dataset, side):
    cfg = DataConfig(
        dataset=dataset,
        loader="synthetic",
        image_size=16,
        synthetic_train_size=64,
        synthetic_val_size=10,
    )
    data = build_data(cfg, Shard(0, 1, 8, 2), 3, 5)
    assert len(data.train) == 64 // 16 * 2 and data.n_val == 10 and data.kind == "synthetic"
    x, y = next(iter(data.train))
    assert x.shape == (8, 3, side, side) and int(y.max()) < 5
    # on the device asked for ("meta": no CPU tensor can pass for it), in the engine's dtype and
    # layout, made once: every batch is the same tensor, no copy per step
    meta = build_data(cfg, Shard(0, 1, 8, 2), 3, 5, "meta", torch.bfloat16, True).train
    batches = list(meta)
    x, y = batches[0]
    assert x.device.type == y.device.type == "meta" and x.dtype == torch.bfloat16
    assert x.is_contiguous(memory_format=torch.channels_last)
    assert all(b[0] is x for b in batches)


def test_check_tool_lists_undecodable_files(tmp_path, capsys):
    from dstrain.data.check import main as check

    root = make_jpeg_folder(tmp_path / "data", per_class=2, val_per_class=1)
    assert check([str(root), "--workers", "1"]) == 0
    bad = root / "val" / "bee" / "000.JPEG"
    bad.write_bytes(bad.read_bytes()[:100])
    assert check([str(root), "--workers", "1"]) == 1
    out = capsys.readouterr().out
    assert f"corrupt image: {bad}" in out and "9 images checked" in out and "1 do not decode" in out
    assert check([str(tmp_path / "nothing")]) == 2


@pytest.mark.parametrize("loader", [*LOADERS, "synthetic"])
def test_every_loader_implements_the_loader_protocol(jpeg_folder, loader):
    """The trainer's view of a loader (dstrain.data.sharding.Loader), for the train, val and polish
    loaders of each kind; the tensor loader: tests/test_data.py."""
    from dstrain.data.sharding import Loader

    data = build_data(cfg_for(jpeg_folder, loader), Shard(0, 1, 4, 1, eval_batch=4), 3, 3)
    for each in (data.train, data.val, data.polish(8, 4)):
        assert isinstance(each, Loader), type(each)
        each.start_epoch(1, accumulation=1, start=0, augment=False)
        x, y = next(iter(each))
        assert x.shape[1] == 3 and len(x) == len(y) and len(each) >= 1
