import numpy as np
import pytest
import torch

from dstrain.core.errors import ConfigError
from dstrain.data import Shard, build_data, epoch_order, sharding, val_range
from dstrain.data.fashion_mnist import TensorLoader, load_fashion_mnist, read_idx
from dstrain.settings.config import DataConfig
from tests.conftest import write_idx


@pytest.mark.parametrize("n, world", [(10000, 1), (10000, 2), (301, 2), (301, 3), (7, 8), (1, 4)])
def test_val_shards_cover_every_image_exactly_once(n, world):
    seen = [i for r in range(world) for i in val_range(n, r, world)]
    assert sorted(seen) == list(range(n))


@pytest.mark.parametrize("world, micro, acc", [(2, 8, 2), (4, 4, 2), (1, 32, 1)])
def test_global_batches_do_not_depend_on_world_size(world, micro, acc):
    """Every rank's share of step s, put together, is the same set of images as in a 1-rank run."""
    n, epoch = 200, 3
    one = epoch_order(n, Shard(0, 1, micro * acc * world, 1, seed=5), epoch)
    per_rank = [epoch_order(n, Shard(r, world, micro, acc, seed=5), epoch) for r in range(world)]
    steps = n // (micro * acc * world)
    assert len(one) == steps
    for s in range(steps):
        together = torch.cat(
            [torch.cat(per_rank[r][s * acc : (s + 1) * acc]) for r in range(world)]
        )
        assert sorted(together.tolist()) == sorted(one[s].tolist())
    flat = torch.cat([torch.cat(b) for b in per_rank])
    assert len(set(flat.tolist())) == len(flat)  # no image twice in an epoch


@pytest.mark.parametrize(
    "world, micro, batches",
    [(1, 16, [48, 48, 48, 48]), (2, 8, [48, 48, 32, 64]), (3, 4, [24, 60, 60, 36])],
)
def test_fill_reads_the_permutations_as_one_stream(world, micro, batches):
    """data.last_batch=fill (issue 74, item 1): an epoch's last batch is completed from the next
    epoch's permutation, which starts after those images, on any number of ranks and across a
    batch ramp: the global batches of E epochs are the permutations, end to end, cut into batches
    (every image once an epoch; E x N images to within one batch), where drop leaves N mod B an
    epoch unseen."""
    n, seed = 100, 7
    stream, seen, offsets = [], 0, []
    for epoch, batch in enumerate(batches):
        offset = sharding.epoch_offset(n, batches[:epoch])
        offsets.append(offset)
        acc = batch // (micro * world)
        lists = [
            epoch_order(n, Shard(r, world, micro, acc, seed=seed, fill=True), epoch, offset=offset)
            for r in range(world)
        ]
        steps = sharding.epoch_steps(n, batch, True, offset)
        assert all(len(mine) == steps * acc for mine in lists)
        for s in range(steps):
            stream += [
                i
                for r in range(world)
                for b in lists[r][s * acc : (s + 1) * acc]
                for i in b.tolist()
            ]
        seen += steps * batch
    perms = [sharding.permutation(n, Shard(seed=seed), e) for e in range(len(batches) + 1)]
    assert stream == torch.cat(perms).tolist()[:seen]
    assert len(batches) * n <= seen < len(batches) * n + max(batches)
    assert offsets[0] == 0 and offsets[1] == -n % batches[0]  # 100 = 2 x 48 + 4: 44 carried over
    assert sharding.steps_per_epoch(n, batches, True) == [
        sharding.epoch_steps(n, b, True, o) for b, o in zip(batches, offsets)
    ]
    assert sharding.steps_per_epoch(n, batches, False) == [n // b for b in batches]
    with pytest.raises(ValueError, match="data.last_batch=fill"):
        epoch_order(n, Shard(0, 1, micro, 1, seed=seed), 1, offset=4)  # drop: each epoch from 0
    # the synthetic loader (no images) counts the same steps
    from dstrain.data.synthetic import SyntheticLoader

    synthetic = SyntheticLoader(n, (1, 4, 4), 10, Shard(0, 1, 16, 3, fill=True), "train")
    synthetic.start_epoch(1, offset=44)
    assert len(synthetic) == sharding.epoch_steps(n, 48, True, 44) * 3 == 6


def test_epochs_reshuffle_and_are_reproducible():
    shard = Shard(0, 1, 10, 1, seed=1)
    assert torch.equal(torch.cat(epoch_order(100, shard, 0)), torch.cat(epoch_order(100, shard, 0)))
    assert not torch.equal(
        torch.cat(epoch_order(100, shard, 0)), torch.cat(epoch_order(100, shard, 1))
    )


def test_idx_roundtrip(tmp_path):
    arr = np.arange(2 * 3 * 4).reshape(2, 3, 4) % 256
    write_idx(tmp_path / "a.gz", arr)
    assert (read_idx(tmp_path / "a.gz") == arr).all()


def test_corrupt_idx_names_the_file(tmp_path):
    (tmp_path / "train-images-idx3-ubyte").write_bytes(b"\x01\x02garbage")
    (tmp_path / "train-labels-idx1-ubyte").write_bytes(b"\x00")
    with pytest.raises(ConfigError, match="train-images-idx3-ubyte: unreadable idx file"):
        load_fashion_mnist(str(tmp_path), download=False)


def test_missing_data_directory_says_how_to_fix(tmp_path):
    with pytest.raises(ConfigError, match="apt-get install dataset-fashion-mnist"):
        load_fashion_mnist(str(tmp_path / "nope"), download=False)


def test_fashion_mnist_loader_shapes_and_normalisation(fake_fmnist):
    shard = Shard(0, 1, 32, 2, eval_batch=100, seed=0)
    cfg = DataConfig(root=str(fake_fmnist), download=False)
    data = build_data(cfg, shard, channels=1, num_classes=10)
    train, val = data.train, data.val
    assert (data.n_train, data.n_val, data.kind) == (512, 301, "tensor")
    batches = list(train)
    assert len(batches) == len(train) == (512 // 64) * 2
    x, y = batches[0]
    assert x.shape == (32, 1, 28, 28) and x.dtype == torch.float32 and y.dtype == torch.int64
    assert sum(len(y) for _, y in val) == 301
    train3 = build_data(cfg, shard, channels=3, num_classes=10).train
    assert next(iter(train3))[0].shape == (32, 3, 28, 28)
    # the values: (pixel / 255 - mean) / std, the test images in file order
    from dstrain.data.fashion_mnist import FASHION_MNIST_MEAN, FASHION_MNIST_STD, load_fashion_mnist

    raw = load_fashion_mnist(str(fake_fmnist), download=False)["val"][0]
    expected = (raw.float() / 255 - FASHION_MNIST_MEAN) / FASHION_MNIST_STD
    got = torch.cat([x for x, _ in val])
    torch.testing.assert_close(got, expected.view_as(got))
    assert abs(FASHION_MNIST_MEAN - 0.286) < 0.01 and abs(FASHION_MNIST_STD - 0.353) < 0.01
    on_meta = build_data(cfg, shard, channels=1, num_classes=10, device="meta").train
    x, y = next(iter(on_meta))
    assert x.device.type == y.device.type == "meta"  # batches live on the device asked for


def test_augmentation_is_a_function_of_seed_epoch_and_rank(fake_fmnist):
    cfg = DataConfig(root=str(fake_fmnist), download=False)
    a = build_data(cfg, Shard(0, 1, 64, 1, seed=0), 1, 10).train
    b = build_data(cfg, Shard(0, 1, 64, 1, seed=0), 1, 10).train
    a.start_epoch(2)
    b.start_epoch(2)
    assert all(torch.equal(xa, xb) for (xa, _), (xb, _) in zip(a, b))
    # and each of the three changes the crops: 64 copies of one textured image, so any difference
    # between two loaders' batches is augmentation (image order cannot show)
    image = (torch.arange(28 * 28) * 37 % 251).to(torch.uint8).view(1, 1, 28, 28)

    def first_batch(seed, epoch, rank):
        loader = TensorLoader(
            image.repeat(128, 1, 1, 1),
            torch.zeros(128, dtype=torch.long),
            Shard(rank, 2, 32, 1, seed=seed),
            "train",
            augment=True,
            norm=(0.0, 1.0),
        )
        loader.start_epoch(epoch)
        return next(iter(loader))[0]

    ref = first_batch(0, 2, 0)
    assert torch.equal(ref, first_batch(0, 2, 0))
    for other in (first_batch(1, 2, 0), first_batch(0, 3, 0), first_batch(0, 2, 1)):
        differ = [not torch.equal(a, b) for a, b in zip(ref, other)]
        assert sum(differ) > 16, sum(differ)  # most of the 32 crops change (1 in 50 may repeat)


def test_a_resumed_epoch_yields_the_rest_of_the_uninterrupted_one(fake_fmnist):
    """set_epoch(e, start=k) skips k micro batches but keeps drawing their augmentation: batches k.. are
    identical to an uninterrupted pass (a run stopped part-way through an epoch resumes exactly)."""
    cfg = DataConfig(root=str(fake_fmnist), download=False, augment=True)
    full = build_data(cfg, Shard(0, 1, 32, 1, seed=3), 1, 10).train
    rest = build_data(cfg, Shard(0, 1, 32, 1, seed=3), 1, 10).train
    full.start_epoch(1)
    rest.start_epoch(1, start=5)
    expected = list(full)[5:]
    got = list(rest)
    assert len(rest) == len(full) == 16 and len(got) == 11
    assert all(
        torch.equal(xa, xb) and torch.equal(ya, yb) for (xa, ya), (xb, yb) in zip(expected, got)
    )


def test_augmentation_pads_crops_and_flips():
    loader = TensorLoader(
        torch.zeros(1, 1, 4, 4, dtype=torch.uint8),
        torch.zeros(1, dtype=torch.long),
        Shard(),
        "train",
        augment=True,
        norm=(0.0, 1.0),
    )
    x = torch.arange(16.0).reshape(1, 1, 4, 4).repeat(64, 1, 1, 1)
    out = loader._augment(x, loader._draw(64, torch.Generator().manual_seed(0)))
    assert out.shape == x.shape
    # every output is a shifted (and maybe mirrored) window of the zero-padded input
    padded = torch.nn.functional.pad(x[0, 0], (2, 2, 2, 2))
    windows = [padded[dy : dy + 4, dx : dx + 4] for dy in range(5) for dx in range(5)]
    windows += [w.flip(1) for w in windows]
    assert all(any(torch.equal(o[0], w) for w in windows) for o in out)
    assert len({tuple(o.flatten().tolist()) for o in out}) > 10


def test_batch_larger_than_data_set_is_a_clear_error():
    """One rule for the run and --check (dstrain/run/startup.py): every stage of the ramp needs one
    global batch of training images, named by the setting that asks for it."""
    from types import SimpleNamespace

    from dstrain.run import startup
    from dstrain.settings.config import load_config
    from dstrain.settings.ramp import batch_plan

    cfg = load_config(None, [])
    plan = SimpleNamespace(stages=batch_plan(256, 64, [[2, 1024]], 1, 3), cfg=cfg)
    startup.check_images(plan, 1024)
    with pytest.raises(ConfigError, match=r"\(batch.global_size=256\); lower batch.global_size"):
        startup.check_images(plan, 255)
    with pytest.raises(
        ConfigError, match=r"batch.ramp reaches 1024 at epoch 3\); lower batch.ramp"
    ):
        startup.check_images(plan, 1000)
    # batch.follow_noise may grow the batch to its cap: the cap must fit the data too
    noisy = load_config(None, ["batch.follow_noise=true", "batch.noise_cap=2048"])
    plan = SimpleNamespace(stages=batch_plan(256, 64, [], 1, 3), cfg=noisy)
    startup.check_images(plan, 2048)
    with pytest.raises(ConfigError, match=r"\(batch.noise_cap=2048\); lower batch.noise_cap"):
        startup.check_images(plan, 2047)


def test_holdout_evaluates_on_a_fixed_part_of_the_training_set(fake_fmnist):
    """data.holdout=N: N training images (the same ones for every seed) become the evaluation set,
    with the validation transform; none of them is trained on; the test set is not read."""
    from dstrain.data.fashion_mnist import FASHION_MNIST_MEAN, FASHION_MNIST_STD, load_fashion_mnist
    from dstrain.data.holdout import holdout_split

    raw = load_fashion_mnist(str(fake_fmnist), download=False)["train"][0]
    _, held_idx = holdout_split(len(raw), 100)
    expected = (raw[held_idx].float().div(255) - FASHION_MNIST_MEAN) / FASHION_MNIST_STD
    cfg = DataConfig(root=str(fake_fmnist), download=False, augment=False, holdout=100)
    for seed in (0, 1):
        data = build_data(cfg, Shard(0, 1, 32, 1, eval_batch=50, seed=seed), 1, 10)
        assert (data.n_train, data.n_val) == (412, 100)
        held = torch.cat([x for x, _ in data.val])
        torch.testing.assert_close(held, expected.view_as(held))  # same images whatever the seed
        trained = []
        for epoch in range(3):  # drop-last batches: three shuffles cover every kept image
            data.train.start_epoch(epoch)
            trained += [x for x, _ in data.train]
        trained = torch.cat(trained)
        distance = torch.cdist(held.flatten(1), trained.flatten(1))
        assert distance.min() > 1.0  # no held-out image among the training batches


def test_holdout_larger_than_the_training_set_is_refused(fake_fmnist):
    cfg = DataConfig(root=str(fake_fmnist), download=False, holdout=512)
    with pytest.raises(ConfigError, match=r"data.holdout=512 leaves no training images out of 512"):
        build_data(cfg, Shard(0, 1, 32, 1), 1, 10)


def test_the_tensor_loader_implements_the_loader_protocol(fake_fmnist):
    from dstrain.data.sharding import Loader
    from dstrain.settings.config import DataConfig

    data = build_data(DataConfig(root=str(fake_fmnist)), Shard(0, 1, 32, 1, eval_batch=64), 1, 10)
    for each in (data.train, data.val, data.polish(64, 32)):
        assert isinstance(each, Loader), type(each)
        each.start_epoch(0, accumulation=1, start=0, augment=False)
        x, y = next(iter(each))
        assert x.shape[1:] == (1, 28, 28) and len(x) == len(y)
