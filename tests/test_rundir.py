"""The failed-start rule (dstrain/run/rundir.py): a run with no checkpoint is marked failed and started over."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dstrain.core.errors import ConfigError
from dstrain.run import rundir
from dstrain.settings.config import load_config
from tests.conftest import REPO


def test_a_run_without_a_checkpoint_is_marked_failed_and_reused(tmp_path):
    run = tmp_path / "run"
    (run / "ranks").mkdir(parents=True)
    (run / "config.yaml").write_text("epochs: 1\n")
    cfg = load_config("fashion_mnist", [f"run_dir={run}"])
    with pytest.raises(ConfigError, match="already holds a run"):
        rundir.choose(cfg)  # unmarked: looks like a run
    assert rundir.mark_failed(run, "bad_input", 2, "corrupt image: x.JPEG")
    assert json.loads((run / rundir.FAILED).read_text())["message"] == "corrupt image: x.JPEG"
    assert rundir.choose(cfg) == run  # marked: nothing to continue, a new run may start there
    rundir.create(run)
    # emptied: no stale records or TensorBoard events; its lock, held by this run, kept
    assert [p.name for p in run.iterdir()] == [rundir.LOCK]


def test_a_run_with_a_checkpoint_is_never_marked_failed(tmp_path):
    run = tmp_path / "run"
    ckpt = run / rundir.CHECKPOINTS / "epoch0001"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text("{}")
    assert not rundir.mark_failed(run, "error", 1, "later failure")
    assert not (run / rundir.FAILED).exists()
    (run / rundir.FAILED).write_text("{}")  # even a stray marker does not hide the checkpoint
    assert rundir.failed_start(run) is None


def test_meta_json_keeps_every_start_and_the_diff_of_an_uncommitted_tree(tmp_path, monkeypatch):
    """Issue 52: a run records the SHA it started at and each restart's (meta.json's git_sha alone
    was rewritten at every restart), with the diff of an uncommitted tree saved beside it."""
    from omegaconf import OmegaConf

    from dstrain.run import rundir
    from dstrain.settings.config import TrainConfig

    cfg = OmegaConf.structured(TrainConfig)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "meta.json").write_text(json.dumps({"git_sha": "0ld"}))  # before starts existed
    write = lambda epoch: rundir.write_run_files(  # noqa: E731
        run_dir, cfg, {}, "ds_configs/fp32.json", 1, {}, epoch=epoch
    )
    monkeypatch.setattr(rundir, "git_sha", lambda: "abc")
    monkeypatch.setattr(rundir, "uncommitted_diff", lambda: "")
    write(3)
    monkeypatch.setattr(rundir, "git_sha", lambda: "def-dirty")
    monkeypatch.setattr(rundir, "uncommitted_diff", lambda: "--- a/x\n+++ b/x\n")
    write(5)
    meta = json.loads((run_dir / "meta.json").read_text())
    assert meta["git_sha"] == "def-dirty"
    starts = [(s["git_sha"], s["epoch"], s["diff"]) for s in meta["starts"]]
    assert starts == [("0ld", None, None), ("abc", 3, None), ("def-dirty", 5, "code-2.diff")]
    assert (run_dir / "code-2.diff").read_text() == "--- a/x\n+++ b/x\n"


def _git(repo: Path, *args: str) -> str:
    cmd = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args]
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip()


def test_uncommitted_diff_is_the_code_a_dirty_sha_ran(tmp_path, monkeypatch):
    """In a checkout of its own: clean, the SHA is HEAD's and there is no diff; a result file
    rewritten (results/bench, results/studies) or an untracked file leaves it clean; tracked code
    changed makes it ``-dirty`` and the diff is that change; a tree without .git gives
    $DSTRAIN_GIT_SHA and no diff."""
    from dstrain.core import provenance

    repo = tmp_path / "repo"
    for name in ("dstrain/x.py", "results/bench/r.json", "results/studies/f.md"):
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text("old\n")
    _git(repo.parent, "init", "-q", str(repo))
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "start")
    head = _git(repo, "rev-parse", "HEAD")
    monkeypatch.setattr(provenance, "REPO_ROOT", repo)
    assert (provenance.git_sha(), provenance.uncommitted_diff()) == (head, "")
    (repo / "results/bench/r.json").write_text("new result\n")
    (repo / "results/studies/f.md").write_text("new table\n")
    (repo / "dstrain/untracked.py").write_text("x = 1\n")
    assert (provenance.git_sha(), provenance.uncommitted_diff()) == (head, "")  # outputs only
    (repo / "dstrain/x.py").write_text("new code\n")
    assert provenance.git_sha() == f"{head}-dirty"
    diff = provenance.uncommitted_diff()
    files = [line.split(" b/")[-1] for line in diff.splitlines() if line.startswith("diff --git")]
    assert files == ["dstrain/x.py"]
    assert "-old\n+new code\n" in diff
    copied = tmp_path / "copied"  # a tree copied to a node without .git
    copied.mkdir()
    monkeypatch.setattr(provenance, "REPO_ROOT", copied)
    monkeypatch.setenv("DSTRAIN_GIT_SHA", "abc123")
    assert (provenance.git_sha(), provenance.uncommitted_diff()) == ("abc123", "")
    monkeypatch.delenv("DSTRAIN_GIT_SHA")
    assert provenance.git_sha() == "unknown"


def test_every_record_names_the_cpu_it_ran_on(tmp_path, monkeypatch):
    """The same run trains to other floats on another CPU (results/harness/replay.py), so meta.json and
    every result file name the CPU: the model /proc/cpuinfo gives and the ISA torch's CPU kernels
    dispatch on (both faked here, so the test sees they are read, not what this machine has)."""
    import io

    import torch
    from omegaconf import OmegaConf

    from dstrain.core import provenance
    from dstrain.settings.config import TrainConfig

    cpuinfo = "processor\t: 0\nvendor_id\t: Made Up\nmodel name\t: Made-Up CPU 9000 @ 1.00GHz\n"

    def fake_open(path, *args, **kwargs):
        assert path == "/proc/cpuinfo"
        return io.StringIO(cpuinfo)

    monkeypatch.setattr(provenance, "open", fake_open, raising=False)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "MADE_UP_ISA")
    expected = {"model": "Made-Up CPU 9000 @ 1.00GHz", "cpu_capability": "MADE_UP_ISA"}
    assert provenance.record("x")["cpu"] == expected
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cfg = OmegaConf.structured(TrainConfig)
    rundir.write_run_files(run_dir, cfg, {}, "ds_configs/fp32.json", 1, {})
    assert json.loads((run_dir / "meta.json").read_text())["cpu"] == expected
    cpuinfo = "processor\t: 0\nFeatures\t: fp asimd\n"  # no model name (some ARM kernels)
    assert provenance.cpu()["model"] is None

    def no_proc(path, *args, **kwargs):
        raise FileNotFoundError(path)

    monkeypatch.setattr(provenance, "open", no_proc, raising=False)  # no /proc (macOS)
    assert provenance.cpu() == {"model": None, "cpu_capability": "MADE_UP_ISA"}


HOLDER = (
    "import sys, time; from pathlib import Path; from dstrain.run import rundir; "
    "rundir.hold(Path(sys.argv[1])); print('held', flush=True); time.sleep(120)"
)


def _held_elsewhere(run: Path) -> subprocess.Popen:
    """A process holding ``run`` as a live run's rank 0 does, until it is killed."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(run)], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "held"
    return proc


def _tree(path: Path) -> dict:
    return {str(p.relative_to(path)): p.read_bytes() for p in path.rglob("*") if p.is_file()}


def test_a_run_dir_another_live_run_holds_is_refused_and_left_as_it_was(tmp_path):
    """A second run started in a directory a live run holds (a resume launched twice; a bench
    started again beside its own runs) is refused, naming the holder, before it changes anything:
    here even a failed start's files, which a run alone would clear. Once the holder is gone (killed:
    the lock goes with the process), the directory is free."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("epochs: 1\n")
    assert rundir.mark_failed(run, "bad_input", 2, "corrupt image: x.JPEG")
    holder = _held_elsewhere(run)
    try:
        before = _tree(run)
        why = rundir.in_use(run)
        assert why and f"pid {holder.pid}" in why and "another dstrain process" in why
        assert "run_dir=" in why and "choose another run_dir" in why
        with pytest.raises(ConfigError, match="is in use"):
            rundir.create(run)
        assert _tree(run) == before
    finally:
        holder.kill()
        holder.wait()
    assert rundir.in_use(run) is None
    rundir.create(run)  # now this process holds it, and the failed start is cleared
    assert [p.name for p in run.iterdir()] == [rundir.LOCK]
    assert rundir.in_use(run) is None  # this process's own hold is no refusal
    rundir.create(run)  # nor is holding it again
    rundir.release_all()


@pytest.mark.slow  # two trainer processes (~6 s beside load)
def test_check_and_the_run_refuse_a_held_run_dir_in_one_line(fake_fmnist, tmp_path):
    """``--check`` and the run say the same line and exit 2, and the directory keeps its files."""
    from tests.conftest import TINY, run_cli
    from tests.test_cli_errors import check_one_clear_line

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("epochs: 1\n")
    (run / "meta.json").write_text("{}\n")
    holder = _held_elsewhere(run)
    try:
        before = _tree(run)
        args = ["--deepspeed_config", "ds_configs/fp32.json", *TINY, f"data.root={fake_fmnist}"]
        args += [f"run_dir={run}", "resume=auto"]
        for extra in (["--check"], []):
            proc = run_cli([*args, *extra], timeout=120)
            assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
            line = check_one_clear_line(proc, "is in use")
            assert f"pid {holder.pid}" in line
            assert _tree(run) == before
    finally:
        holder.kill()
        holder.wait()
