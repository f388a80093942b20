"""``./run.sh gpu`` (tools/gpu_run.py): the orchestration of the GPU acceptance run, tested on a CPU.

What only a GPU measures is not measured here; what is tested is what makes one short GPU slot
count: every part ends in its file, budgets skip what does not fit and stop what overruns (a
training run gets SIGTERM and checkpoints), a second call continues instead of redoing, a part's
crash does not cost the next part, missing packages are named with where the wheels go.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO
from tools import gpu_run


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


def test_the_budget_fits_the_slowest_item_seen():
    budget = gpu_run.Budget(100)
    assert budget.fits(60)
    budget.took(120)
    assert not budget.fits(60)  # the next item would overrun
    assert not gpu_run.Budget(30).fits(60)


def test_missing_packages_are_named_with_where_the_wheels_go(monkeypatch, capfd):
    monkeypatch.setattr(gpu_run, "NEEDED", ("torch", "no_such_package_dstrain"))
    assert gpu_run.main(["smoke"]) == 2
    err = capfd.readouterr().err
    assert "no_such_package_dstrain" in err and ".whl/" in err and "pip --no-index" in err


def test_bad_arguments_are_refused(capfd):
    with pytest.raises(SystemExit) as stop:
        gpu_run.main(["smok"])
    assert stop.value.code == 2 and "unknown part 'smok'" in capfd.readouterr().err
    with pytest.raises(SystemExit):
        gpu_run.main(["--budget", "smoke:5"])
    assert "PART=SECONDS" in capfd.readouterr().err


def test_a_result_from_other_code_is_started_over(tmp_path):
    (tmp_path / "gpu_run_cpu.json").write_text(
        json.dumps({"environment": {"git_sha": "old"}, "parts": {"smoke": {"complete": True}}})
    )
    ns = type("A", (), {"fresh": False, "slug": "cpu", "results": str(tmp_path)})()
    run = gpu_run.Run(ns, {"device": "CPU", "gpus": 0, "git_sha": "new"})
    assert run.record["parts"] == {}  # the old SHA's record is not trusted
    same = gpu_run.Run(ns, {"device": "CPU", "gpus": 0, "git_sha": "old"})
    assert same.record["parts"]["smoke"]["complete"]


def gpu(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "tools/gpu_run.py", "--tiny", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.slow
def test_every_part_ends_in_its_file_and_a_second_call_continues(tmp_path):
    results = tmp_path / "results"
    common = ["--results", str(results), "--test-files", "tests/test_gpu.py", "tests/test_ramp.py"]
    # a budget nothing fits: every smoke row is listed as not run, the part incomplete, exit 1
    proc = gpu("smoke", "--budget", "smoke=1", *common)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    smoke = json.loads((results / "smoke_cpu.json").read_text())
    assert smoke["rows"] == {}
    assert sum("did not fit the budget" in why for why in smoke["not_run"].values()) == 4
    assert "CUDA-only" in smoke["not_run"]["fp16_native.json channels_last=false"]

    proc = gpu(*common)  # every part
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    record = json.loads((results / "gpu_run_cpu.json").read_text())
    assert set(record["parts"]) == set(gpu_run.PARTS)
    assert all(part["complete"] for part in record["parts"].values()), record["parts"]
    assert record["environment"]["git_sha"] and record["environment"]["torch"]
    smoke = json.loads((results / "smoke_cpu.json").read_text())
    assert set(smoke["rows"]) == {
        "fp16.json channels_last=true",
        "bf16.json channels_last=true",
        "lamb_fp16.json channels_last=true",
        "lars_bf16.json channels_last=true",
    }
    assert all(r["exit"] == 0 and r["images_per_s"] > 0 for r in smoke["rows"].values())
    throughput = json.loads((results / "throughput_cpu.json").read_text())
    assert throughput["complete"] and {r["loop"] for r in throughput["rows"]} == {
        "bare PyTorch",
        "dstrain",
    }
    fed = json.loads((results / "throughput_dali_cpu.json").read_text())
    assert {r["data"] for r in fed["rows"] if r["loop"] == "dstrain"} == {"synthetic", "dali"}
    assert json.loads((results / "loader_cpu.json").read_text())["rows"]
    suite = json.loads((results / "suite_cpu.json").read_text())
    assert suite["counts"]["passed"] > 0 and suite["counts"]["failed"] == 0
    gpu_only = json.loads((results / "suite_gpu_only_cpu.json").read_text())
    assert gpu_only["counts"]["passed"] == 0 and "needs a CUDA GPU" in gpu_only["skipped"]
    study = json.loads((results / "accuracy_study_2ep_cpu.json").read_text())
    assert study

    proc = gpu(*common)  # again: nothing rerun
    assert proc.returncode == 0
    assert proc.stdout.count("complete in an earlier call") == len(gpu_run.PARTS)
    proc = gpu("--status", *common)
    assert proc.returncode == 0 and proc.stdout.count(" complete") == len(gpu_run.PARTS)


def test_run_sh_gpu_runs_offline_with_the_interpreter_present(tmp_path):
    """`./run.sh gpu` installs nothing from the network: the venv's (or this) interpreter, --status
    reads the record and runs nothing."""
    import os
    from pathlib import Path

    env = {**os.environ, "DSTRAIN_VENV": str(Path(sys.executable).parent.parent)}
    proc = subprocess.run(
        [str(REPO / "run.sh"), "gpu", "--status", "--results", str(tmp_path)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "installing" not in proc.stdout and "smoke      not run" in proc.stdout
    assert list(tmp_path.iterdir()) == []  # --status writes nothing
