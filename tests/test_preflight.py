"""``python -m dstrain ... --check``: the run's start-up checks and its plan, nothing written.

Three kinds of tests: the plan's numbers against arithmetic done here by hand; every bad input the
real run refuses at start-up (tests/test_cli_errors.py's CASES) refused by ``--check`` with the same
line; and every ``python -m dstrain`` command docs/ tells a user to run on a GPU passes ``--check
--device cuda``, so a documented command that cannot start fails CI.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import torch

from dstrain.main import main
from tests.conftest import REPO, TINY, run_cli
from tests.test_cli_errors import CASES, JSON, case_args, check_one_clear_line, tree_digest

# CASES the run finds only after it started (none today): --check cannot see them
RUNTIME_ONLY: set[str] = set()


def check(capfd, args: list[str]) -> tuple[int, str, str]:
    code = main([*args, "--check"])
    out = capfd.readouterr()
    return code, out.out, out.err


def test_check_prints_the_plan_and_writes_nothing(fake_fmnist, tmp_path, capfd, monkeypatch):
    from dstrain.core.files import RUN_DIR_FILE_ENV

    monkeypatch.setenv(RUN_DIR_FILE_ENV, str(tmp_path / "pointer"))  # as under launch.sh
    run_dir = tmp_path / "run"
    before = tree_digest(tmp_path)
    args = [JSON, "ds_configs/fp32.json", *TINY, f"data.root={fake_fmnist}", f"run_dir={run_dir}"]
    code, out, err = check(capfd, [*args, "--world", "2", "--device", "cpu"])
    assert code == 0, err
    assert "dstrain --check: the run would start; nothing was written" in out
    # TINY: 512 images / global 32 = 16 steps per epoch x 3 epochs; lr 0.2 with no scaling;
    # two ranks: 16 images each, one micro batch
    assert "global 32 = 16 micro x 1 accumulation x 2 ranks, 16 steps/epoch, peak lr 0.2" in out
    assert "48 optimizer steps; warmup 0.25 epochs" in out
    assert "512 train / 301 val images" in out
    assert "precision fp32" in out and "2 rank(s) on cpu" in out
    assert f"{run_dir} (new)" in out
    assert not run_dir.exists() and tree_digest(tmp_path) == before


def test_the_plan_follows_the_ramp_and_the_lr_scaling(fake_fmnist, tmp_path, capfd):
    # 512 images; ramp 64 then 128 from epoch index 2 (the third), by accumulation: the micro batch
    # stays 16; linear scaling from 0.1 per 256:
    # peak 0.025 at 64, 0.05 at 128; steps 8 + 8 + 4 = 20
    args = [
        JSON,
        "ds_configs/fp32.json",
        *TINY,
        f"data.root={fake_fmnist}",
        f"run_dir={tmp_path / 'run'}",
        "batch.global_size=64",
        "batch.ramp=[[2,128]]",
        "optim.base_lr=0.1",
        "optim.lr_scaling=linear",
        "optim.lr_reference_batch=256",
    ]
    code, out, err = check(capfd, [*args, "--world", "4", "--device", "cpu"])
    assert code == 0, err
    assert "from epoch 1: global 64 = 16 micro x 1 accumulation x 4 ranks, 8 steps/epoch" in out
    assert "peak lr 0.025" in out
    assert "from epoch 3: global 128 = 16 micro x 2 accumulation x 4 ranks, 4 steps/epoch" in out
    assert "peak lr 0.05" in out
    assert "20 optimizer steps" in out


def test_a_world_the_batch_does_not_split_over_is_refused(fake_fmnist, tmp_path, capfd):
    args = [JSON, "ds_configs/fp32.json", *TINY, f"data.root={fake_fmnist}"]
    code, _, err = check(capfd, [*args, f"run_dir={tmp_path / 'r'}", "--world", "3"])
    assert code == 2
    assert "batch.global_size=32 is not divisible by the world size 3" in err


def test_the_device_decides_what_the_precision_needs(fake_fmnist, tmp_path, capfd):
    args = [*TINY, f"data.root={fake_fmnist}", f"run_dir={tmp_path / 'r'}"]
    code, _, err = check(capfd, [JSON, "ds_configs/fp16_native.json", *args, "--device", "cpu"])
    assert code == 2 and "ds_configs/fp32.json" in err  # the native engine needs a GPU
    code, out, err = check(capfd, [JSON, "ds_configs/fp16_native.json", *args, "--device", "cuda"])
    assert code == 0, err
    assert "precision fp16" in out and "on cuda" in out


def test_a_used_run_dir_is_reported_as_the_run_would_use_it(fake_fmnist, tmp_path, capfd):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "notes.txt").write_text("mine")
    args = [JSON, "ds_configs/fp32.json", *TINY, f"data.root={fake_fmnist}", f"run_dir={run_dir}"]
    code, _, err = check(capfd, args)
    assert code == 2 and "resume=auto" in err
    assert (run_dir / "notes.txt").read_text() == "mine" and len(list(run_dir.iterdir())) == 1


def test_an_unwritable_run_dir_parent_is_refused(fake_fmnist, tmp_path, capfd):
    import os

    if os.geteuid() == 0:
        pytest.skip("root writes anywhere: an unwritable directory cannot be made")
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    args = [JSON, "ds_configs/fp32.json", *TINY, f"data.root={fake_fmnist}"]
    code, _, err = check(capfd, [*args, f"run_dir={locked / 'run'}"])
    assert code == 2 and "not writable (Permission denied)" in err


@pytest.mark.parametrize("kind, name, extra, expected", CASES, ids=[c[1] for c in CASES])
def test_check_refuses_what_the_run_refuses(
    kind, name, extra, expected, fake_fmnist, tmp_path, capfd
):
    """The same inputs as tests/test_cli_errors.py, the same line, with --check (in-process)."""
    if name in RUNTIME_ONLY:
        pytest.skip("found only once the run has started")
    args = case_args(extra, fake_fmnist, tmp_path)
    before = tree_digest(tmp_path)
    code, out, err = check(capfd, [*args, "--device", "cpu"])
    assert code == 2, out[-2000:] + err[-2000:]
    lines = [line for line in err.splitlines() if line.startswith("dstrain: error:")]
    assert len(lines) == 1 and expected in lines[0], err[-2000:]
    assert tree_digest(tmp_path) == before


@pytest.mark.slow  # over ~5 s on 2 cores: the full suite only (issue 42: quick loop < 3 min)
def test_check_through_the_real_command_line(fake_fmnist, tmp_path):
    """As a user types it: one process, exit 2 with one line; exit 0 with the plan."""
    run_dir = tmp_path / "run"
    base = [JSON, "ds_configs/fp32.json", *TINY, f"data.root={fake_fmnist}", f"run_dir={run_dir}"]
    proc = run_cli([*base, "optim.warmup_epochs=5", "--check"], timeout=120)
    assert proc.returncode == 2
    check_one_clear_line(proc, "shorter than epochs=3")
    proc = run_cli([*base, "--check"], timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "nothing was written" in proc.stdout and not run_dir.exists()


# ---------------------------------------------------------------- documented commands


def documented_commands() -> list[tuple[str, str]]:
    """(page, command) for each ``python -m dstrain`` and ``deepspeed --num_gpus N dstrain/main.py``
    line in a bash block of docs/ or README.md, ``\\`` continuations joined, comments dropped."""
    found = []
    for page in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for block in re.findall(r"```(?:bash|sh|console)\n(.*?)```", page.read_text(), re.S):
            joined = re.sub(r"\\\n\s*", " ", block)
            for line in joined.splitlines():
                line = line.split(" #", 1)[0].strip()
                if re.match(r"^\S*python3? -m dstrain( |$)", line) or re.match(
                    r"^\S*deepspeed --num_gpus \d+ dstrain/main\.py ", line
                ):
                    found.append((str(page.relative_to(REPO)), line))
    return found


DOCUMENTED = documented_commands()


def test_the_docs_document_gpu_commands():
    assert any("docs/gpu.md" == page for page, _ in DOCUMENTED), DOCUMENTED


def stand_in_weights(arg: str, argv: list[str], tmp_path: Path) -> str:
    """``init.weights=FILE`` as ``python -m dstrain.export`` would have written FILE: the state
    dict of the model the command's recipe and overrides describe, in scratch."""
    if not arg.startswith("init.weights="):
        return arg
    from dstrain.settings.config import load_config
    from dstrain.techniques.models import plain_model

    recipe = argv[argv.index("--config") + 1] if "--config" in argv else None
    overrides = [a for a in argv if "=" in a and not a.startswith(("--", "init.", "run_dir="))]
    path = tmp_path / "weights.pt"
    torch.save(plain_model(load_config(recipe, overrides).model).state_dict(), path)
    return f"init.weights={path}"


@pytest.mark.parametrize("page, command", DOCUMENTED, ids=[f"{p}:{c[:60]}" for p, c in DOCUMENTED])
def test_every_documented_command_would_start(page, command, tmp_path, capfd):
    """Each command as written, with only the run directory moved to scratch and the data root, when
    the command names none, pointed at the embedded Fashion-MNIST or left to the synthetic loader."""
    argv = shlex.split(command)
    if "dstrain/main.py" in argv:  # deepspeed --num_gpus N dstrain/main.py ...: N ranks
        world = argv[argv.index("--num_gpus") + 1]
        argv = [*argv[argv.index("dstrain/main.py") + 1 :], "--world", world]
    else:
        argv = argv[argv.index("dstrain") + 1 :]
    if not any(a.startswith("run_dir=") for a in argv):
        argv.append(f"run_dir={tmp_path / 'run'}")
    if any(a.startswith("init.weights=") for a in argv):  # a file an earlier command exported:
        argv = [stand_in_weights(a, argv, tmp_path) for a in argv]  # the recipe's model's own
    if "--device" not in argv:  # the GPU page's commands are for a GPU
        argv += ["--device", "cuda" if page == "docs/gpu.md" else "cpu"]
    code, out, err = check(capfd, argv)
    assert code == 0, f"{page}: `{command}` would not start:\n{err[-1500:]}"
    assert not Path(tmp_path / "run").exists()
