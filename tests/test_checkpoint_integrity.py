"""A damaged checkpoint costs one checkpoint, not the run (dstrain/loop/manifest.py).

A finished run's newest checkpoint damaged after it was written, the one before it whole, as a
shared cluster file system leaves it: its model-states file gone (a partial copy, a scratch purge),
the same file cut short, a rank's RNG file emptied. ``resume=auto`` and ``--check`` take the newest
intact checkpoint, say which one they passed over and why, and a resume from it ends bit for bit
where the uninterrupted run ended; with none intact left, one line names each damaged file.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from dstrain.core.errors import ConfigError
from dstrain.core.safe_load import FIX, DamagedFile, load_data
from dstrain.loop import checkpoint, manifest
from tests.conftest import TINY, deepspeed_launcher, run_cli, spawn_ranks
from tests.test_cli_errors import tree_digest

JSON = "--deepspeed_config"
MODEL = checkpoint.MODEL_FILE
# (file in the newest checkpoint, how it is damaged, what the skip says)
DAMAGE = {
    "model states gone": (MODEL, "remove", f"{MODEL} is missing"),
    "model states cut short": (MODEL, "truncate", f"{MODEL} has "),
    "RNG file empty": ("rng_rank00000.pt", "empty", "rng_rank00000.pt has 0 bytes"),
}


def damage(path: Path, how: str) -> None:
    if how == "remove":
        path.unlink()
    elif how == "truncate":
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "flip":  # one byte in the middle: the size holds, the checksum does not
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))


def weights(ckpt: Path) -> dict:
    return torch.load(ckpt / MODEL, map_location="cpu", weights_only=True)["module"]


# the tests that read three_epochs, on one pytest-xdist worker: handed out one at a time, they
# trained it on both workers
SHARES_RUN = pytest.mark.xdist_group("three_epochs")


@pytest.fixture(scope="module")
def three_epochs(fake_fmnist, tmp_path_factory) -> Path:
    """TINY's 3 epochs on one rank, a checkpoint each (keep_last 2: epoch0002 and epoch0003 stay)."""
    run_dir = tmp_path_factory.mktemp("three") / "run"
    args = [JSON, "ds_configs/fp32.json", *TINY, f"data.root={fake_fmnist}", f"run_dir={run_dir}"]
    proc = run_cli(args)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return run_dir


def copy_run(source: Path, dest: Path) -> Path:
    shutil.copytree(source, dest)
    return dest


# ---------------------------------------------------------------- the manifest and the choice
@SHARES_RUN
def test_each_checkpoint_carries_a_manifest_of_every_file_as_written(three_epochs):
    root = three_epochs / "checkpoints"
    assert checkpoint.complete_tags(root) == ["epoch0002", "epoch0003"]
    for tag in ("epoch0002", "epoch0003"):
        files = manifest.read(root / tag)
        on_disk = {p.name for p in (root / tag).iterdir()} - {manifest.NAME}
        assert set(files) == on_disk == {MODEL, "rng_rank00000.pt", checkpoint.STATE_FILE}
        for name, want in files.items():
            assert want == manifest.entry(root / tag / name), name
    assert checkpoint.newest_intact(root) == ("epoch0003", [])


@SHARES_RUN
@pytest.mark.parametrize("case", [*DAMAGE, "model states corrupted"])
def test_a_damaged_newest_checkpoint_is_passed_over_for_the_one_before(
    case, three_epochs, tmp_path
):
    name, how, said = DAMAGE.get(case, (MODEL, "flip", f"{MODEL} does not match its checksum"))
    root = copy_run(three_epochs, tmp_path / "run") / "checkpoints"
    damage(root / "epoch0003" / name, how)
    tag, skipped = checkpoint.newest_intact(root)
    assert tag == "epoch0002"
    assert [t for t, _ in skipped] == ["epoch0003"] and said in skipped[0][1], skipped


def _choose_on_two_ranks(rank: int, port: int, root: Path, out: Path) -> None:
    import torch.distributed as tdist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    tdist.init_process_group("gloo", rank=rank, world_size=2)
    # each rank reads half of each checkpoint's files: the damaged one is read by one rank only
    share = manifest.my_share(list(manifest.read(root / "epoch0003")))
    tag, skipped = checkpoint.newest_intact(root)
    (out / f"rank{rank}.json").write_text(json.dumps([tag, skipped, share]))
    tdist.destroy_process_group()


@SHARES_RUN
@pytest.mark.parametrize("case", DAMAGE)
def test_two_ranks_reading_half_the_files_each_choose_the_same_checkpoint(
    case, three_epochs, tmp_path
):
    from dstrain.core.dist import free_port

    name, how, said = DAMAGE[case]
    root = copy_run(three_epochs, tmp_path / "run") / "checkpoints"
    damage(root / "epoch0003" / name, how)
    spawn_ranks(_choose_on_two_ranks, 2, free_port(), root, tmp_path)
    answers = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    # the damaged file was read by one of the two ranks alone
    assert sum(name in share for _, _, share in answers) == 1
    assert [a[:2] for a in answers] == [["epoch0002", [["epoch0003", answers[0][1][0][1]]]]] * 2
    assert said in answers[0][1][0][1]


@SHARES_RUN
def test_with_none_intact_one_message_names_each_damaged_checkpoint(three_epochs, tmp_path):
    root = copy_run(three_epochs, tmp_path / "run") / "checkpoints"
    damage(root / "epoch0003" / MODEL, "remove")
    damage(root / "epoch0002" / "rng_rank00000.pt", "empty")
    tag, skipped = checkpoint.newest_intact(root)
    assert tag is None and [t for t, _ in skipped] == ["epoch0003", "epoch0002"]
    message = str(checkpoint.damaged_error(root, skipped, "resume=auto"))
    assert f"epoch0003: {MODEL} is missing" in message
    assert "epoch0002: rng_rank00000.pt has 0 bytes" in message and FIX not in message


@SHARES_RUN
def test_a_checkpoint_from_before_manifests_is_checked_by_loading_its_files(three_epochs, tmp_path):
    root = copy_run(three_epochs, tmp_path / "run") / "checkpoints"
    for tag in ("epoch0002", "epoch0003"):
        (root / tag / manifest.NAME).unlink()
    assert checkpoint.newest_intact(root) == ("epoch0003", [])
    damage(root / "epoch0003" / MODEL, "truncate")
    damage(root / "epoch0002" / MODEL, "remove")
    tag, skipped = checkpoint.newest_intact(root)
    assert tag is None
    assert f"{MODEL} is cut short or corrupted" in skipped[0][1], skipped
    assert f"{MODEL} is missing" in skipped[1][1], skipped


@SHARES_RUN
def test_damage_and_distrust_get_different_messages(three_epochs, tmp_path):
    """A file of ours cut short or emptied says so; the re-save advice is for a file whose pickle
    names code or that is no torch.save zip, and such a file is refused, not passed over."""
    ckpt = copy_run(three_epochs, tmp_path / "run") / "checkpoints" / "epoch0003"
    damage(ckpt / MODEL, "truncate")
    with pytest.raises(DamagedFile) as cut:
        load_data(ckpt / MODEL)
    assert "is cut short or corrupted" in str(cut.value) and FIX not in str(cut.value)
    damage(ckpt / "rng_rank00000.pt", "empty")
    with pytest.raises(DamagedFile, match=r"is empty \(0 bytes\)"):
        load_data(ckpt / "rng_rank00000.pt")
    (ckpt / MODEL).write_bytes(pickle.dumps({"module": {}}))  # a raw pickle: cannot be read as data
    with pytest.raises(ConfigError) as foreign:
        checkpoint.newest_intact(ckpt.parent)
    assert not isinstance(foreign.value, DamagedFile) and FIX in str(foreign.value)


@SHARES_RUN
def test_keep_last_never_deletes_the_newest_intact_checkpoint(three_epochs, tmp_path, caplog):
    root = copy_run(three_epochs, tmp_path / "run") / "checkpoints"
    shutil.copytree(root / "epoch0002", root / "epoch0001")  # an older one to delete
    # a resume from epoch0002 (epoch0003 damaged) saved epoch0002 again: epoch0003 is neither
    # counted nor deleted, and epoch0001 goes
    damage(root / "epoch0003" / MODEL, "remove")
    checkpoint._prune(root, 1, "epoch0002")
    assert checkpoint.complete_tags(root) == ["epoch0002", "epoch0003"]
    # the newly written one lost a file: nothing older is deleted
    shutil.copytree(root / "epoch0002", root / "epoch0001")
    damage(root / "epoch0002" / "rng_rank00000.pt", "remove")
    with caplog.at_level(logging.WARNING):
        checkpoint._prune(root, 1, "epoch0002")
    assert checkpoint.complete_tags(root) == ["epoch0001", "epoch0002", "epoch0003"]
    assert "no older checkpoint deleted" in caplog.text


# ---------------------------------------------------------------- as a user meets it
@SHARES_RUN
@pytest.mark.slow
def test_resume_check_and_polish_continue_from_the_newest_intact_checkpoint(
    three_epochs, fake_fmnist, tmp_path
):
    """The model states of the newest checkpoint gone: --check names the choice, the resume says it
    in its log and in meta.json's starts and ends bit for bit as the uninterrupted run did, and
    polish --checkpoint chooses the same way; with nothing intact, one line and exit 2."""
    reference = weights(three_epochs / "checkpoints" / "epoch0003")
    run_dir = copy_run(three_epochs, tmp_path / "run")
    damage(run_dir / "checkpoints" / "epoch0003" / MODEL, "remove")
    polished = copy_run(run_dir, tmp_path / "polished")
    args = [JSON, "ds_configs/fp32.json", *TINY, f"data.root={fake_fmnist}", f"run_dir={run_dir}"]
    args.append("resume=auto")
    said = f"continues from epoch0002; epoch0003 skipped, damaged: {MODEL} is missing"

    before = tree_digest(run_dir)
    check = run_cli([*args, "--check"])
    assert check.returncode == 0 and said in check.stdout, check.stdout[-2000:] + check.stderr
    assert tree_digest(run_dir) == before

    resumed = run_cli(args)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    log = resumed.stdout + resumed.stderr
    assert said in log and "skipped, damaged" in log
    start = json.loads((run_dir / "meta.json").read_text())["starts"][-1]
    assert start["resumed_from"] == "epoch0002" and start["epoch"] == 2
    assert [s["tag"] for s in start["skipped_damaged"]] == ["epoch0003"]
    after = weights(run_dir / "checkpoints" / "epoch0003")
    for key in reference:
        assert torch.equal(reference[key], after[key]), key

    polish = run_cli(
        ["--checkpoint", str(polished), "--images", "64", f"data.root={fake_fmnist}"],
        module="dstrain.polish",
    )
    assert polish.returncode == 0, polish.stdout[-2000:] + polish.stderr[-2000:]
    info = json.loads((polished / "polished" / "polish.json").read_text())
    assert info["checkpoint"].endswith("epoch0002")
    assert "epoch0003 skipped, damaged" in polish.stdout + polish.stderr

    none_left = copy_run(polished, tmp_path / "none")
    damage(none_left / "checkpoints" / "epoch0002" / "rng_rank00000.pt", "empty")
    before = tree_digest(none_left)
    refused = run_cli([*args[:-2], f"run_dir={none_left}", "resume=auto", "--check"])
    errors = [line for line in refused.stderr.splitlines() if line.startswith("dstrain: error:")]
    assert refused.returncode == 2 and len(errors) == 1, refused.stderr[-2000:]
    assert f"epoch0003: {MODEL} is missing" in errors[0]
    assert "epoch0002: rng_rank00000.pt has 0 bytes" in errors[0]
    assert tree_digest(none_left) == before


@pytest.mark.slow
@pytest.mark.xdist_group("hosts")  # the worker that trains tiny_on_two_ranks (conftest) for others
def test_two_ranks_resume_from_the_checkpoint_before_one_ranks_damaged_file(
    tiny_on_two_ranks, fake_fmnist, tmp_path
):
    """Rank 1's RNG file of the newest checkpoint emptied: both ranks continue from the one before
    and end bit for bit as the uninterrupted 2-rank run did."""
    from tests.conftest import CPU_ONLY, ONE_THREAD

    source = tiny_on_two_ranks.run_dir
    reference = weights(source / "checkpoints" / "epoch0003")
    run_dir = copy_run(source, tmp_path / "run")
    damage(run_dir / "checkpoints" / "epoch0003" / "rng_rank00001.pt", "empty")
    args = [JSON, "ds_configs/fp32.json", *TINY, f"data.root={fake_fmnist}", f"run_dir={run_dir}"]
    proc = run_cli(
        [*args, "resume=auto"], launcher=deepspeed_launcher(2), env={**CPU_ONLY, **ONE_THREAD}
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "rng_rank00001.pt has 0 bytes" in proc.stdout + proc.stderr
    assert "resumed from" in proc.stdout + proc.stderr
    after = weights(run_dir / "checkpoints" / "epoch0003")
    for key in reference:
        assert torch.equal(reference[key], after[key]), key
