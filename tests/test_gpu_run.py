"""``./run.sh gpu`` (tools/gpu_run.py, gpu_node.py, gpu_pack.py, gpu_prepare.py), piece by piece.

What makes a short GPU slot count, each checked here on a CPU: budgets and the job's own deadline,
a command stopped with its whole process group (at the budget and on SIGTERM to the job), what
comes home through ``$OUT`` within its limits, an import that never goes back to older state,
wheels for the wrong Python refused before pip, DALI joined only from all of its parts. The whole
pass, job after job as the node runs it: tests/test_gpu_node_play.py.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

import pytest

from tests.conftest import REPO
from tools import gpu_node, gpu_pack, gpu_prepare, gpu_run
from tools.suite import progress_outcomes, summarise_progress


def test_result_files_are_named_after_the_gpu():
    assert gpu_run.gpu_slug("NVIDIA H100 80GB HBM3") == "h100"
    assert gpu_run.gpu_slug("NVIDIA H200") == "h200"
    assert gpu_run.gpu_slug("NVIDIA A100-SXM4-80GB") == "a100_sxm4_80gb"
    assert gpu_run.gpu_slug(None) == "cpu"


def test_a_command_past_its_budget_is_stopped_with_sigterm_and_recorded(tmp_path):
    script = "trap 'echo checkpointed; exit 5' TERM; echo started; sleep 30 & wait"
    row = gpu_run.run_bounded(["bash", "-c", script], 1, tmp_path / "x.log")
    assert row["stopped_at_budget"] and row["exit"] == 5 and row["seconds"] < 10
    log = (tmp_path / "x.log").read_text()
    assert "started" in log and "checkpointed" in log


def test_a_command_that_ignores_sigterm_is_killed_with_its_children(tmp_path):
    marker = tmp_path / "child.pid"
    script = f"trap '' TERM; sleep 60 & echo $! > {marker}; wait"
    row = gpu_run.run_bounded(["bash", "-c", script], 1, tmp_path / "x.log", grace=1)
    assert row["stopped_at_budget"] and row["exit"] == -signal.SIGKILL and row["seconds"] < 10
    child = int(marker.read_text())
    time.sleep(0.2)
    assert not Path(f"/proc/{child}").exists() or "Z" in Path(f"/proc/{child}/stat").read_text()


def test_the_budget_fits_the_slowest_item_seen():
    budget = gpu_run.Budget(100)
    assert budget.fits(60)
    budget.took(120)
    assert not budget.fits(60)  # the next item would overrun
    assert not gpu_run.Budget(30).fits(60)


def _run(tmp_path, monkeypatch, deadline=560, start=None, **env) -> gpu_run.Run:
    monkeypatch.setenv("DSTRAIN_GPU_JOB_START", str(start or time.time()))
    monkeypatch.delenv("OUT", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    args = gpu_run.parse_args(
        ["--state", str(tmp_path / "state"), "--work", str(tmp_path / "work"), "--slug", "cpu"]
        + ["--deadline", str(deadline)]
    )
    return gpu_run.Run(args, {"device": "CPU", "gpus": 0, "git_sha": "new"})


def test_a_part_gets_the_smaller_of_its_budget_and_the_jobs_time_left(tmp_path, monkeypatch):
    start = time.time() - 400
    run = _run(tmp_path, monkeypatch, deadline=560, start=start)
    # 560 - 400 s gone, less the SIGTERM grace and the last pack, less what setting up took (bounded
    # by the clock, not a fixed slack: on a loaded machine it took over 2 s)
    seconds = run.budget(480).seconds
    since = time.time() - start - 400
    left = 560 - 400 - gpu_run.GRACE_S - gpu_run.PACK_S
    assert left - since - 0.01 <= seconds <= left + 0.01
    assert run.budget(60).seconds == 60
    late = _run(tmp_path, monkeypatch, deadline=560, start=time.time() - 600)
    assert late.budget(480).seconds == 0
    assert gpu_run.run_part(late, "smoke") == 1  # nothing started, the next job continues
    assert "no time left" in late.record["parts"]["smoke"]["not_run"]


def test_items_of_another_commit_are_kept_with_their_sha(tmp_path, monkeypatch, capsys):
    state = tmp_path / "state"
    state.mkdir()
    (state / "gpu_run_cpu.json").write_text(
        json.dumps(
            {
                "environment": {"git_sha": "old"},
                "jobs": 3,
                "parts": {
                    "smoke": {"complete": True, "git_sha": "old", "rows": [{"git_sha": "old"}]}
                },
            }
        )
    )
    run = _run(tmp_path, monkeypatch)
    assert run.record["parts"]["smoke"]["complete"] and run.record["jobs"] == 4
    assert "kept, each with its SHA" in capsys.readouterr().out
    assert gpu_run.run_part(run, "smoke") == 0  # not rerun
    run.save()
    # the kept part and its rows still name the commit they ran at, not this job's (issue 53)
    saved = json.loads((state / "gpu_run_cpu.json").read_text())
    assert saved["environment"]["git_sha"] == "new" and saved["jobs"] == 4
    assert saved["parts"]["smoke"]["git_sha"] == "old"
    assert saved["parts"]["smoke"]["rows"] == [{"git_sha": "old"}]


def test_missing_packages_are_named_with_what_to_bring(monkeypatch, capfd):
    monkeypatch.setattr(gpu_run, "NEEDED", ("torch", "no_such_package_dstrain"))
    assert gpu_run.main(["smoke"]) == 2
    err = capfd.readouterr().err
    assert "no_such_package_dstrain" in err and ".gpu/wheels" in err and "gpu-prepare" in err


def test_bad_arguments_are_refused(capfd):
    with pytest.raises(SystemExit) as stop:
        gpu_run.main(["smok"])
    assert stop.value.code == 2 and "unknown part 'smok'" in capfd.readouterr().err
    with pytest.raises(SystemExit):
        gpu_run.main(["--budget", "smoke:5"])
    assert "PART=SECONDS" in capfd.readouterr().err


def test_sigterm_to_the_job_stops_the_running_command_and_saves(tmp_path):
    """The job gets SIGTERM while a part's command runs: the command's process group is stopped,
    the record saved and packed into $OUT, exit 143, and no process of it is left."""
    out, state = tmp_path / "out", tmp_path / "state"
    code = f"""
import sys, time
sys.path.insert(0, {str(REPO)!r})
from tools import gpu_run
def smoke(self, budget):
    self.bounded(["bash", "-c", "sleep 120 & echo $! > {tmp_path}/child.pid; wait"], budget, "s.log")
    return {{"complete": True}}
gpu_run.Run.smoke = smoke
gpu_run.environment = lambda: {{"device": "CPU", "gpus": 0, "git_sha": "x", "torch": "t",
    "cuda_runtime": None, "deepspeed": None, "dali": None}}
sys.exit(gpu_run.main(["smoke", "--tiny", "--state", {str(state)!r}, "--slug", "cpu"]))
"""
    env = {**os.environ, "OUT": str(out), "DSTRAIN_GPU_HOME": str(tmp_path / "home")}
    env["DSTRAIN_GPU_JOB_START"] = str(time.time())  # not the clock of a job this suite runs in
    env.pop("DSTRAIN_GPU_DEADLINE_S", None)
    proc = subprocess.Popen(
        [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True
    )
    pid_file = tmp_path / "child.pid"
    deadline = time.monotonic() + 120  # the job's start imports torch: slow on a loaded machine
    while not (pid_file.is_file() and pid_file.read_text().strip()):
        assert proc.poll() is None and time.monotonic() < deadline, "the part's command never ran"
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    stdout, _ = proc.communicate(timeout=60)
    assert proc.returncode == 143, stdout
    child = int(pid_file.read_text())
    assert not Path(f"/proc/{child}").exists() or "Z" in Path(f"/proc/{child}/stat").read_text()
    record = json.loads((state / "gpu_run_cpu.json").read_text())
    assert record["parts"]["smoke"]["not_run"] == "stopped by SIGTERM"
    with tarfile.open(out / "gpu_state.tar.gz") as tar:
        assert "gpu_run_cpu.json" in tar.getnames()


def test_the_pack_fits_out_and_keeps_the_state_small(tmp_path):
    state = tmp_path / "state"
    (state / "logs").mkdir(parents=True)
    (state / "results").mkdir()
    (state / "gpu_run_h100.json").write_text(json.dumps({"jobs": 2, "parts": {}}))
    (state / "results" / "smoke_h100.json").write_text("{}")
    for n in range(40):  # 40 logs of 200 KiB: cut to 64 KiB each, then the largest dropped
        (state / "logs" / f"run{n}.log").write_bytes(os.urandom(100 << 10).hex().encode())
    (state / "work" / "checkpoints").mkdir(parents=True)
    (state / "work" / "checkpoints" / "model.pt").write_bytes(b"x" * 1000)
    out = tmp_path / "out"
    gpu_pack.pack(state, out, "status line\n")
    assert sorted(p.name for p in out.iterdir()) == ["gpu_state.tar.gz", "gpu_status.txt"]
    with tarfile.open(out / "gpu_state.tar.gz") as tar:
        names = tar.getnames()
        sizes = sum(m.size for m in tar.getmembers())
        logs = [m.size for m in tar.getmembers() if m.name.endswith(".log")]
        note = json.load(tar.extractfile("PACK.json"))
    assert "gpu_run_h100.json" in names and "results/smoke_h100.json" in names
    assert not any(n.endswith(".pt") for n in names)
    assert sizes <= gpu_pack.STATE_LIMIT + 4096 and note["dropped"]
    assert logs and all(size <= gpu_pack.LOG_TAIL + 100 for size in logs)


def test_import_copies_complete_parts_and_never_goes_back(tmp_path):
    def pack_of(jobs: int, complete: bool) -> Path:
        state = tmp_path / f"state{jobs}-{complete}"
        (state / "results").mkdir(parents=True, exist_ok=True)
        (state / "results" / "smoke_h100.json").write_text(json.dumps({"rows": {}, "jobs": jobs}))
        record = {
            "jobs": jobs,
            "parts": {"smoke": {"complete": complete, "files": ["results/smoke_h100.json"]}},
        }
        (state / "gpu_run_h100.json").write_text(json.dumps(record))
        return gpu_pack.pack(state, tmp_path / f"out{jobs}-{complete}")

    repo = tmp_path / "repo"
    (repo / "results/bench").mkdir(parents=True)
    assert gpu_pack.import_pack(pack_of(1, False), repo, index=False) == []  # not finished
    assert (repo / "runs/gpu/gpu_run_h100.json").is_file()
    copied = gpu_pack.import_pack(pack_of(2, True), repo, index=False)
    assert copied == ["results/bench/smoke_h100.json"]
    registry = json.loads((repo / "results/gpu_imports.json").read_text())
    assert registry["results"][0]["file"] == "results/bench/smoke_h100.json"
    smoke = json.loads((repo / "results/bench/smoke_h100.json").read_text())  # describes itself
    assert smoke["title"] == "GPU `smoke` part", smoke
    assert all(smoke[k] for k in ("headline", "command", "git_sha", "date", "machine")), smoke
    gpu_pack.import_pack(pack_of(1, False), repo, index=False)  # an older pack, imported late
    assert json.loads((repo / "runs/gpu/gpu_run_h100.json").read_text())["jobs"] == 2


def test_progress_lines_continue_a_cut_run_and_count_a_skipped_file(tmp_path):
    progress = tmp_path / "p.jsonl"
    lines = [
        {"event": "start", "nodeid": "t.py::a"},
        {
            "event": "report",
            "nodeid": "t.py::a",
            "when": "call",
            "outcome": "passed",
            "duration": 1,
        },
        {"event": "finish", "nodeid": "t.py::a"},
        {"event": "collect", "nodeid": "d.py", "outcome": "skipped", "message": "no nvidia.dali"},
        {"event": "start", "nodeid": "t.py::b"},  # the job's limit came here
    ]
    progress.write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"event": "rep')
    finished, running = progress_outcomes([progress])
    assert finished["t.py::a"]["outcome"] == "passed" and running == ["t.py::b"]
    summary = summarise_progress([progress], cut=["t.py::b"])
    assert summary["counts"] == {
        "passed": 1,
        "failed": 0,
        "error": 0,
        "skipped": 1,
        "cut": 1,
        "total": 3,
    }
    assert summary["skipped"] == {"no nvidia.dali": ["d.py"]}
    assert summary["by_file"] == [["t.py", 1.0, 1], ["d.py", 0.0, 1]]  # the cut test is not timed


def _wheel(folder: Path, name: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("x.txt", "x")
    return path


def test_a_wheel_for_another_python_is_refused_before_pip(tmp_path, monkeypatch):
    other = "cp39" if sys.version_info[:2] != (3, 9) else "cp310"
    wheel = _wheel(tmp_path, f"pydantic_core-2.50.5-{other}-{other}-manylinux_2_17_x86_64.whl")
    with pytest.raises(gpu_node.NodeError, match="--python-version"):
        gpu_node.check_wheels([wheel])
    gpu_node.check_wheels([_wheel(tmp_path, "hjson-3.1.0-py3-none-any.whl")])  # any Python
    # through the install itself (issue 53: the order was never exercised): refused before a venv
    # is made or pip runs, also when the wrong wheel comes after good ones
    folder = tmp_path / "wheels"
    wheels = [_wheel(folder, "hjson-3.1.0-py3-none-any.whl"), _wheel(folder, wheel.name)]
    entries = [
        {"file": w.name, "bytes": w.stat().st_size, "sha256": gpu_node.sha256(w)} for w in wheels
    ]
    (folder / "MANIFEST.json").write_text(json.dumps({"wheels": entries}))
    calls = []

    def make_venv(venv: Path) -> Path:
        calls.append("venv")
        venv.mkdir(parents=True, exist_ok=True)
        return venv / "bin" / "python"

    monkeypatch.setattr(gpu_node, "make_venv", make_venv)
    monkeypatch.setattr(gpu_node, "pip_install", lambda python, ws: calls.append("pip"))
    with pytest.raises(gpu_node.NodeError, match="--python-version"):
        gpu_node.install_small(tmp_path / "venv", folder)
    assert calls == []
    (folder / wheel.name).unlink()
    (folder / "MANIFEST.json").write_text(json.dumps({"wheels": entries[:1]}))
    gpu_node.install_small(tmp_path / "venv", folder)
    assert calls == ["venv", "pip"]  # a good set installs (the two fakes called, in order)


def dali_named_wheel(folder: Path, init: str, padding: int) -> Path:
    """A valid wheel named as DALI's: ``nvidia/dali/__init__.py`` holding ``init`` and ``padding``
    random bytes (which xz cannot shrink, so its pack splits into as many parts as wanted)."""
    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / "nvidia_dali_cuda130-2.4.0-py3-none-any.whl"
    info = "nvidia_dali_cuda130-2.4.0.dist-info"
    files = {
        "nvidia/dali/__init__.py": init,
        "nvidia/dali/padding.bin": os.urandom(padding),
        f"{info}/METADATA": "Metadata-Version: 2.1\nName: nvidia-dali-cuda130\nVersion: 2.4.0\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: dstrain-test\nRoot-Is-Purelib: true\n"
        "Tag: py3-none-any\n",
    }
    with zipfile.ZipFile(wheel, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
        z.writestr(f"{info}/RECORD", "".join(f"{n},,\n" for n in [*files, f"{info}/RECORD"]))
    return wheel


def test_dali_is_installed_only_from_all_its_parts(tmp_path, monkeypatch):
    monkeypatch.setenv("DSTRAIN_GPU_HOME", str(tmp_path / "home"))
    wheel = dali_named_wheel(tmp_path / "wheels", "", 300)  # parts of 100 bytes
    made = tmp_path / "made"
    made.mkdir()
    gpu_prepare.repack_dali([wheel], made, 100, "3.12")
    parts = sorted(made.glob("dali-*"))
    assert len(parts) >= 2
    gpu_prepare.verify(made, "3.12")  # joined, checked and pip-installed as the node will
    meta = json.loads((parts[0] / "PART.json").read_text())
    assert meta["parts"] == len(parts) and meta["whole"]["sha256"]
    installed = []
    monkeypatch.setattr(gpu_node, "pip_install", lambda python, wheels: installed.extend(wheels))
    monkeypatch.setattr(gpu_node, "check_wheels", lambda wheels: None)
    venv = tmp_path / "home" / "venv"
    venv.mkdir(parents=True)
    job = tmp_path / "job" / ".gpu"
    job.mkdir(parents=True)
    # the first part only: kept, the rest named
    (job / parts[0].name).symlink_to(parts[0])
    line = gpu_node.install_dali(Path(sys.executable), venv, job)
    assert "missing 2" in line and not installed
    # a damaged part is not kept
    (job / parts[0].name).unlink()
    bad = job / parts[1].name
    bad.mkdir()
    (bad / "PART.json").write_text((parts[1] / "PART.json").read_text())
    (bad / meta["file"].replace("part1", "part2")).write_bytes(b"garbage")
    assert "missing 2" in gpu_node.install_dali(Path(sys.executable), venv, job)
    # then every part, over later jobs: joined, checked, installed once
    for p in parts[1:]:
        for f in job.iterdir():
            subprocess.run(["rm", "-rf", str(f)], check=True)
        (job / p.name).symlink_to(p)
        line = gpu_node.install_dali(Path(sys.executable), venv, job)
    assert line == "DALI: installed from its parts"
    assert [w.name for w in installed] == [wheel.name]
    assert gpu_node.install_dali(Path(sys.executable), venv, job) == "DALI: installed"


def test_without_git_the_sha_comes_from_source_json(tmp_path):
    (tmp_path / ".gpu" / "wheels").mkdir(parents=True)
    (tmp_path / "a.py").write_text("print(1)\n")
    digest = gpu_node.sha256(tmp_path / "a.py")
    source = {"git_sha": "abc123", "files": {"a.py": digest}}
    (tmp_path / ".gpu" / "wheels" / "SOURCE.json").write_text(json.dumps(source))
    assert gpu_node.source_sha(tmp_path) == "abc123"
    (tmp_path / "a.py").write_text("print(2)\n")
    assert gpu_node.source_sha(tmp_path) == "abc123-modified"
    (tmp_path / ".git").mkdir()
    assert gpu_node.source_sha(tmp_path) is None  # git answers


def test_the_pins_file_is_read_by_section(tmp_path):
    pins = gpu_prepare.read_pins()
    names = {n for n, _ in pins["small"]}
    assert {"deepspeed", "omegaconf", "timm", "typing-extensions"} <= names
    assert "nvidia-dali-cuda130" in {n for n, _ in pins["dali"]}
    assert "nvidia-libnvcomp-cu13" not in {n for n, _ in pins["dali"]}
    bad = tmp_path / "pins.txt"
    bad.write_text("# [small]\ndeepspeed>=0.19\n# [dali]\n")
    with pytest.raises(gpu_prepare.PrepareError, match="pins.txt:2.*NAME==VERSION"):
        gpu_prepare.read_pins(bad)


def test_throughput_rows_are_chosen_by_name():
    sys.path.insert(0, str(REPO / "bench"))
    import argparse

    from bench.throughput import parse_row

    parser = argparse.ArgumentParser()
    assert parse_row("bf16:nhwc:on", parser) == ("bf16", True, True)
    assert parse_row("fp16_native:nchw:off", parser) == ("fp16_native", False, False)
    with pytest.raises(SystemExit):
        parse_row("bf16:nhwc", parser)


def test_the_gpu_plan_measures_every_precisions_pairs_alike(tmp_path, monkeypatch):
    """Issue item 3: on a GPU the bf16 pairs, the fp16 autocast and native fp16 pairs and the
    host-bound pair (resnet18, batch 64) run REPEATS times each (the bench alternates their order),
    with one warm-up count both loops use; every command is one the bench accepts."""
    from bench.throughput import parse_args

    commands = []

    def finished(self, cmd, budget, log, **kw):
        commands.append(cmd)
        out = Path(cmd[cmd.index("--out") + 1])
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"complete": True, "failed": []}))
        return {"exit": 0, "stopped_at_budget": False, "seconds": 1.0, "command": " ".join(cmd)}

    monkeypatch.setattr(gpu_run.Run, "bounded", finished)
    run = _run(tmp_path, monkeypatch)
    run.cuda = True
    run.throughput(run.budget(300))
    run.fp16(run.budget(300))
    benches = [
        (Path(cmd[cmd.index("--out") + 1]).stem, parse_args(cmd[2:]))
        for cmd in commands
        if cmd[1] == "bench/throughput.py"
    ]
    # the bf16 pairs, then into the same file the fp16 ones; the host-bound pair; CUDA graphs
    assert [name for name, _ in benches] == [
        "throughput_cpu",
        "throughput_cpu",
        "throughput_host_cpu",
        "throughput_cudagraphs_cpu",
    ]
    pairs = [args for _, args in benches[:3]]
    assert [args.rows for args in pairs] == [
        ["bf16:nhwc:on", "bf16:nhwc:off", "bf16:nchw:on"],
        ["fp16:nhwc:on", "fp16:nhwc:off", "fp16_native:nhwc:off"],
        ["bf16:nhwc:off"],
    ]
    assert [args.repeats for args in pairs] == [gpu_run.REPEATS] * 3
    host = pairs[2]
    assert (host.model, host.batch, host.image_size) == ("resnet18", 64, 224)
    for _, args in benches:  # one warm-up count for both loops; as many timed steps at least
        assert args.timed_steps == (args.epochs - 1) * args.warmup_steps >= args.warmup_steps


def run_sh_gpu(*args: str, **env: str) -> subprocess.CompletedProcess:
    """``./run.sh gpu ARGS`` from the repository, with this venv as the node's environment."""
    return subprocess.run(
        [str(REPO / "run.sh"), "gpu", *args],
        cwd=REPO,
        env={**os.environ, "DSTRAIN_VENV": str(Path(sys.executable).parent.parent), **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_run_sh_gpu_status_runs_offline_and_writes_nothing(tmp_path):
    """`./run.sh gpu --status` installs nothing and runs nothing: it reads the record."""
    proc = run_sh_gpu("--status", "--state", str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "installing" not in proc.stderr and "smoke      not run" in proc.stdout
    assert list(tmp_path.iterdir()) == []  # --status writes nothing


@pytest.mark.slow  # over ~5 s on 2 cores: the full suite only (issue 42: quick loop < 3 min)
def test_tests_skipped_for_want_of_dali_run_again_once_it_arrives(tmp_path, monkeypatch):
    """The tests part is complete without DALI, but its DALI tests were skipped: once DALI's parts
    have all arrived, a later job runs those again (and only those)."""
    fake = tmp_path / "test_fake_dali.py"
    fake.write_text(
        "import os, pytest\n"
        "@pytest.mark.gpu\n"
        "def test_plain():\n    pass\n"
        "def test_cpu_only():  # no gpu marker: CI's, never run by the GPU pass\n    pass\n"
        "@pytest.mark.gpu\n"
        "def test_needs_dali():\n"
        "    if os.environ.get('FAKE_DALI') != '1':\n"
        "        pytest.skip('needs nvidia.dali')\n"
    )
    run = _run(tmp_path, monkeypatch)
    run.args.test_files = [str(fake)]
    run.args.tiny = True
    monkeypatch.setattr(gpu_run, "dali_installed", lambda: False)
    assert gpu_run.run_part(run, "tests") == 0
    part = run.record["parts"]["tests"]
    assert part["complete"] and part["dali_pending"]
    suite = json.loads(run.path("suite_gpu").read_text())
    assert suite["counts"]["passed"] == 1 and suite["counts"]["skipped"] == 1
    assert list(suite["skipped"]) == ["needs nvidia.dali"]
    monkeypatch.setattr(gpu_run, "dali_installed", lambda: True)
    monkeypatch.setenv("FAKE_DALI", "1")
    assert gpu_run.run_part(run, "tests") == 0
    suite = json.loads(run.path("suite_gpu").read_text())
    assert suite["counts"]["passed"] == 2 and suite["counts"]["skipped"] == 0
    assert not run.record["parts"]["tests"]["dali_pending"]
    log = (run.logs / "tests" / "gpu.log").read_text()
    assert "-m gpu" in log and " -n " in log  # the marked tests only, on xdist workers
    assert "--deselect" in log and "test_plain" in log.split("--deselect", 1)[1]  # not rerun
    assert gpu_run.run_part(run, "tests") == 0  # and then nothing more to do


def test_a_smoke_run_whose_loss_does_not_fall_fails():
    """The H100 pass at 9a9aaeb: fp16_native.json ran to the end with exit 0 and did not learn."""
    drop = gpu_run.SMOKE_LOSS_DROP
    assert gpu_run.loss_stalled([5.1683, 4.0837], drop) == ""  # fp16.json there
    stalled = gpu_run.loss_stalled([6.9231, 6.9232], drop)  # fp16_native.json there
    assert "did not fall (6.9231 -> 6.9232" in stalled
    assert gpu_run.loss_stalled([6.9, 6.89], drop)  # falling, but by less than a learning run
    assert gpu_run.loss_stalled([2.0, 2.0], 0.0)  # --tiny: it must fall at all


def test_a_ferry_job_keeps_its_part_and_the_job_with_the_wheels_installs_dali(
    tmp_path, monkeypatch
):
    """The slot plan's ferry jobs bring one DALI part and nothing else: on a node where the small
    wheels are not installed yet the part is kept (no package check: the node's Python lacks
    DeepSpeed), and on one where they are, the last part installs DALI."""
    monkeypatch.setenv("DSTRAIN_GPU_HOME", str(tmp_path / "home"))
    made = tmp_path / "made"
    made.mkdir()
    wheel = dali_named_wheel(tmp_path / "wheels", "", 300)
    gpu_prepare.repack_dali([wheel], made, 200, "3.12")
    parts = sorted(made.glob("dali-*"), key=lambda p: int(p.name.split("-")[1]))
    assert len(parts) >= 2
    installed = []
    monkeypatch.setattr(gpu_node, "pip_install", lambda python, wheels: installed.extend(wheels))
    monkeypatch.setattr(gpu_node, "check_wheels", lambda wheels: None)
    job = tmp_path / "job" / ".gpu"
    job.mkdir(parents=True)
    assert "no part brought" in gpu_node.receive(job)
    for n, part in enumerate(parts[:-1], 1):  # one part a job
        (job / part.name).symlink_to(part)
        assert f"{n} of {len(parts)} parts kept" in gpu_node.receive(job) and not installed
        (job / part.name).unlink()
    venv = tmp_path / "home" / "venv"  # a measuring job installed the small wheels meanwhile
    venv.mkdir(parents=True)
    (venv / ".dstrain-wheels").write_text("stamp\n")
    (job / parts[-1].name).symlink_to(parts[-1])
    assert gpu_node.receive(job) == "DALI: installed from its parts"
    assert [w.name for w in installed] == [wheel.name]


def test_run_sh_gpu_receive_runs_nothing_but_the_ferry(tmp_path):
    proc = run_sh_gpu("--receive", DSTRAIN_GPU_HOME=str(tmp_path / "home"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "receive: DALI:" in proc.stdout and "s on the node" in proc.stdout
    assert "[gpu] job" not in proc.stdout  # no part ran


def test_the_slot_plan_fits_13_minutes_starts_and_waits_included(tmp_path):
    """Issue 50: a measuring job, the DALI parts ferried one a job, a second measuring job; every
    job's payload within 64 MiB and the device seconds, start and idle waits included, <= 13 min.
    With the parts the 9a9aaeb pass's DALI makes (156 MiB packed, 3 ferries), at the assumed rate."""
    gpu = tmp_path / "gpu"
    (gpu / "wheels").mkdir(parents=True)
    (gpu / "wheels" / "w.whl").write_bytes(b"0" * int(7.7 * gpu_prepare.MIB))
    room = gpu_prepare.part_size(gpu)  # 64 MiB less this checkout's tree: less as the tree grows
    # DALI's 156 MiB in 3 parts while the tree is under 9 MiB; past it, 3 full parts (the plan with
    # a fourth ferry is the same rule, and the result files committed each session grow the tree)
    whole = min(156 * gpu_prepare.MIB, 3 * room)
    for n in range(1, -(-whole // room) + 1):
        (gpu / f"dali-{n}").mkdir()
        size = min(room, whole - (n - 1) * room)
        (gpu / f"dali-{n}" / "part").write_bytes(b"0" * size)
    state = tmp_path / "runs-gpu"  # a new pass: nothing measured yet, nothing imported
    nothing = tmp_path / "gpu_imports.json"
    jobs = gpu_prepare.plan(gpu, state=state, registry=nothing)
    assert [j["command"].split()[2] for j in jobs] == [
        "--deadline",
        *["--receive"] * (len(jobs) - 2),
        "--deadline",
    ]
    assert len(jobs) == 5  # 3 ferries: each brings the tree and one part only
    assert all(j["fits"] for j in jobs)
    assert [j["carry"] for j in jobs[1:-1]] == [[f".gpu/dali-{n}"] for n in (1, 2, 3)]
    assert jobs[-1]["device_s"] <= gpu_prepare.PLAN_S and jobs[-1]["enough_time"]
    assert jobs[0]["device_s"] >= gpu_prepare.START_S + gpu_prepare.FIRST_DEADLINE_S
    # a slower transfer leaves the last job less time, never more than the plan
    slow = gpu_prepare.plan(gpu, transfer_mib_s=2.0, state=state, registry=nothing)
    assert slow[-1]["device_s"] <= gpu_prepare.PLAN_S
    assert slow[-1]["node_s"] < jobs[-1]["node_s"]
    # the printed plan names the rate it was made with (it printed the default whatever was given)
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        gpu_prepare.print_plan(slow, 2.0)
    assert "transfer at 2 MiB/s" in printed.getvalue()
    # the pairs measured (an imported job's state): the ferries come first, then one long job
    record = {"parts": {"throughput": {"complete": True}}}
    gpu_node.write_json(state / "gpu_run_h100.json", record)
    jobs = gpu_prepare.plan(gpu, state=state, registry=nothing)
    assert [j["command"] for j in jobs] == ["./run.sh gpu --receive"] * 3 + [
        f"./run.sh gpu --deadline {gpu_prepare.DEADLINE_CAP_S}"
    ]
    # so on a machine whose runs/gpu is gone, from the committed imports of this GPU's results
    imports = tmp_path / "imports.json"
    entry = {"file": "results/bench/throughput_h100.json", "part": "throughput", "complete": True}
    gpu_node.write_json(imports, {"results": [entry]})
    bare = gpu_prepare.plan(gpu, state=tmp_path / "gone", registry=imports)
    assert [j["command"] for j in bare] == [j["command"] for j in jobs]
    assert gpu_prepare.plan(gpu, state=tmp_path / "gone", registry=imports, slug="h200")[0][
        "command"
    ].startswith("./run.sh gpu --deadline")  # another GPU's pairs are not this one's
    # no wheels installed before the ferries: the measuring job, not the last ferry, installs DALI
    assert "install DALI" not in jobs[2]["what"] and jobs[2]["node_s"] == gpu_prepare.RECEIVE_S
    assert "installs DALI from the kept parts" in jobs[3]["what"]
    assert jobs[-1]["device_s"] <= gpu_prepare.PLAN_S
    # DALI's part done (no test waits for it): nothing to ferry, the slot measures
    record["parts"]["dali"] = {"complete": True}
    gpu_node.write_json(state / "gpu_run_h100.json", record)
    jobs = gpu_prepare.plan(gpu, state=state)
    assert all("--receive" not in j["command"] for j in jobs) and len(jobs) == 2
    assert jobs[-1]["device_s"] <= gpu_prepare.PLAN_S
    record["parts"]["tests"] = {"complete": True, "dali_pending": True}
    gpu_node.write_json(state / "gpu_run_h100.json", record)
    assert any("--receive" in j["command"] for j in gpu_prepare.plan(gpu, state=state))


def test_a_part_imported_complete_for_this_gpu_is_not_run_again(tmp_path, monkeypatch, capsys):
    """A machine that imported a pass keeps its state in runs/gpu, which is not committed: on the
    next (bare) machine the committed results/gpu_imports.json says what is done. A part is
    done for a GPU when each of its files for that GPU was imported complete."""
    registry = tmp_path / "gpu_imports.json"
    entries = [
        {"file": "results/bench/smoke_cpu.json", "part": "smoke", "complete": True},
        {"file": "results/bench/suite_gpu_cpu.json", "part": "tests", "complete": True},
        {"file": "results/bench/suite_cpu.json", "part": "tests", "complete": False},
        {"file": "results/bench/micro_h100.json", "part": "micro", "complete": True},
    ]
    gpu_node.write_json(registry, {"results": entries})
    assert gpu_pack.imported_complete("cpu", registry) == {"smoke"}
    assert gpu_pack.imported_complete("h100", registry) == {"micro"}
    assert gpu_pack.imported_complete("cpu", tmp_path / "none.json") == set()
    monkeypatch.setattr(gpu_pack, "REGISTRY", registry)
    run = _run(tmp_path, monkeypatch)
    assert run.imported == {"smoke"}
    monkeypatch.setattr(gpu_run.Run, "smoke", lambda self, budget: pytest.fail("smoke ran again"))
    assert gpu_run.run_part(run, "smoke") == 0
    assert "imported complete for this GPU" in capsys.readouterr().out
    # --fresh measures it again
    args = gpu_run.parse_args(["--state", str(tmp_path / "state"), "--slug", "cpu", "--fresh"])
    assert gpu_run.Run(args, {"device": "CPU", "gpus": 0, "git_sha": "new"}).imported == set()


def test_the_parts_ask_only_gpu_questions_in_the_issues_order():
    """Issue 50: throughput pairs, DALI, the GPU tests, micro, then the fp16 rows (smoke first),
    CUDA graphs and the profile. No CPU work: the accuracy study and the whole suite are CI's."""
    assert gpu_run.PARTS == ("throughput", "dali", "tests", "micro", "smoke", "fp16")
    assert set(gpu_run.BUDGET_S) == set(gpu_run.PARTS)
    assert gpu_run.REPEATS >= 3


@pytest.mark.parametrize("part", ["micro", "fp16"])
def test_an_item_the_budget_stops_runs_once_more_then_is_given_up(tmp_path, monkeypatch, part):
    """Nothing is retried forever (docs/gpu.md): an item stopped at the budget is tried in the next
    job, and recorded as given up when the budget stops it again; the part then continues."""
    calls = []

    def stopped(self, cmd, budget, log, **kw):
        calls.append(log)
        return {"exit": -15, "stopped_at_budget": True, "seconds": 1.0, "command": " ".join(cmd)}

    monkeypatch.setattr(gpu_run.Run, "bounded", stopped)
    first = None
    for job in (1, 2):
        run = _run(tmp_path, monkeypatch)
        record = getattr(run, part)(run.budget(300))
        run.record["parts"][part] = record
        run.save()
        first = first or calls[0]
        assert calls.count(first) == job  # the same first item, once a job
    assert first.removesuffix(".log") in record["items"]  # given up: recorded with its exit
    assert record["items"][first.removesuffix(".log")]["exit"] == -15
    assert len(calls) > 2  # the part went on to its next item in the second job


@pytest.mark.parametrize("seconds, given_up", [(50.0, False), (None, True)])
def test_a_test_is_given_up_only_when_the_parts_whole_budget_stopped_it_twice(
    tmp_path, monkeypatch, seconds, given_up
):
    """A GPU test cut twice by the tests part's whole budget is given up; one cut because the job's
    end left the part less (the H100 pass at 7332174: 50 s and 104 s) runs again in the next job."""
    long = "tests/test_ema.py::test_a_long_one"

    def cut(self, cmd, budget, log, env=None, **kw):
        with Path(env["DSTRAIN_PYTEST_PROGRESS"]).open("a") as f:
            f.write(json.dumps({"event": "start", "nodeid": long, "t": 0.0}) + "\n")
        return {"exit": -15, "stopped_at_budget": True, "seconds": 1.0, "command": " ".join(cmd)}

    monkeypatch.setattr(gpu_run.Run, "bounded", cut)
    monkeypatch.setattr(gpu_run.Run, "_left_to_run", lambda self, targets, skip: long not in skip)
    for _ in range(2):
        run = _run(tmp_path, monkeypatch)
        part = run.tests(gpu_run.Budget(seconds or run.args.budgets["tests"]))
        run.record["parts"]["tests"] = part
        run.save()
    assert (long in part["gpu"]["given_up"]) is given_up
    assert part["not_run"] == "stopped at the budget; the next job continues"


def test_tests_that_failed_at_another_commit_run_again_on_new_code(tmp_path, monkeypatch):
    """A pass continues test by test, but a test that failed (or was given up) at the last job's
    commit runs again when the node brings new code; one that passed does not."""
    ran = []

    def bounded(self, cmd, budget, log, **kw):
        ran.append(cmd)
        return {"exit": 0, "stopped_at_budget": False, "seconds": 1.0, "command": " ".join(cmd)}

    monkeypatch.setattr(gpu_run.Run, "bounded", bounded)
    monkeypatch.setattr(gpu_run.Run, "_left_to_run", lambda self, targets, skip: True)
    run = _run(tmp_path, monkeypatch)  # its code: git "new"
    progress = run.state / "tests" / "gpu.jsonl"
    progress.parent.mkdir(parents=True)
    lines = []
    for test, outcome in (("tests/a.py::failed", "failed"), ("tests/a.py::passed", "passed")):
        lines += [
            {"event": "start", "nodeid": test, "t": 0.0},
            {
                "event": "report",
                "nodeid": test,
                "when": "call",
                "outcome": outcome,
                "duration": 1.0,
                "message": "",
                "properties": {},
            },
            {"event": "finish", "nodeid": test, "t": 1.0},
        ]
    progress.write_text("".join(json.dumps(line) + "\n" for line in lines))
    given_up = "tests/a.py::long"
    run.record["parts"]["tests"] = {
        "gpu": {"cut": {given_up: 2}, "given_up": [given_up], "runs": 1, "last": {"git_sha": "old"}}
    }
    part = run.tests(run.budget(300))
    deselected = {ran[0][i + 1] for i, a in enumerate(ran[0]) if a == "--deselect"}
    assert deselected == {"tests/a.py::passed"}
    assert part["gpu"]["given_up"] == [] and part["gpu"]["last"]["git_sha"] == "new"
    ran.clear()
    run.tests(run.budget(300))  # the same code again: nothing that finished reruns
    assert "tests/a.py::passed" in ran[0]
