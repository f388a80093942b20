"""MLPerf logs (log.mlperf) judged by MLPerf's own compliance checker, the MLPerf evaluation rules
(eval_offset_epochs, target_top1) and an exact end LR (optim.end_lr)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from dstrain.core.errors import ConfigError
from dstrain.loop import mlperf
from dstrain.loop.mlperf import events
from dstrain.loop.trainer import evaluates_after
from dstrain.run import plan
from dstrain.settings.config import load_config, validate
from tests.conftest import REPO, TINY, run_cli


def values(log: list[dict]) -> dict:
    return {e["key"]: e["value"] for e in log if e["event_type"] == "POINT_IN_TIME"}


def test_evaluation_every_n_epochs_after_an_offset():
    """Epochs (1-based) offset+N, offset+2N, ...: offset 0 is the old every-N rule."""
    every = [e + 1 for e in range(12) if evaluates_after(e, 4)]
    assert every == [4, 8, 12]
    assert [e + 1 for e in range(12) if evaluates_after(e, 4, offset=2)] == [6, 10]
    assert [e + 1 for e in range(4) if evaluates_after(e, 1)] == [1, 2, 3, 4]


@pytest.mark.parametrize(
    "override, words",
    [
        ("eval_offset_epochs=3", "eval_offset_epochs=3: must be >= 0 and below epochs=3"),
        ("target_top1=1.0", "target_top1=1.0: must be a fraction in [0, 1)"),
        ("optim.end_lr=-1", "optim.end_lr=-1.0: must be >= 0"),
        ("optim.end_lr_factor=0.01", "only one of end_lr and end_lr_factor"),
        ("log.mlperf_org=''", "log.mlperf_org: must not be empty"),
    ],
)
def test_the_mlperf_settings_refuse_what_cannot_run(override, words):
    extra = ["optim.end_lr=0.0001"] if "end_lr_factor" in override else []
    cfg = load_config(TINY[1], [*TINY[2:], *extra, override])
    with pytest.raises(ConfigError, match=None) as err:
        plan.prepare(cfg, str(REPO / "ds_configs/fp32.json"))
    assert words in str(err.value)


def test_log_mlperf_without_the_package_says_how_to_get_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "mlperf_logging", None)  # import fails, as when not installed
    monkeypatch.setitem(sys.modules, "mlperf_logging.mllog", None)
    cfg = load_config(TINY[1], [*TINY[2:], "log.mlperf=true"])
    with pytest.raises(ConfigError) as err:
        plan.prepare(cfg, str(REPO / "ds_configs/fp32.json"))
    assert "log.mlperf=true" in str(err.value) and "pip install mlperf-logging==4.1.68" in str(
        err.value
    )


def test_a_closed_run_evaluates_on_resnets_grid_or_is_refused():
    """MLPerf's ResNet rule (every 4 epochs, offset 0-3): every MLPerf recipe's last epoch is on
    its grid; a closed run whose last epoch falls off it, or another period, is refused naming
    the offset that fixes it; an open run may (its last epochs are trained, not evaluated)."""
    for batch in (3264, 8192, 32768, 49152, 65536, 67840):
        cfg = load_config(f"imagenet_resnet50_mlperf_b{batch}")
        assert cfg.log.mlperf_division == "closed" and cfg.eval_every_epochs == 4
        assert (cfg.epochs - cfg.eval_offset_epochs) % 4 == 0 and cfg.eval_offset_epochs < 4
    cfg = load_config("imagenet_resnet50_mlperf_b8192", ["eval_offset_epochs=0"])
    with pytest.raises(
        ConfigError,
        match=r"epochs=45 ends off the evaluation grid .* set "
        r"eval_offset_epochs=1, or epochs=48",
    ):
        validate(cfg, 64)
    cfg = load_config("imagenet_resnet50_mlperf_b8192", ["eval_every_epochs=1"])
    with pytest.raises(ConfigError, match="evaluate every 4 epochs with offset 0-3"):
        validate(cfg, 64)
    validate(
        load_config(
            "imagenet_resnet50_mlperf_b8192", ["eval_offset_epochs=0", "log.mlperf_division=open"]
        ),
        64,
    )


def test_an_exact_end_lr_replaces_the_factor():
    from dstrain.techniques.schedule import LRSchedule

    cfg = load_config(
        TINY[1], [*TINY[2:], "optim.decay=poly", "optim.end_lr=0.0001", "optim.base_lr=10.5"]
    )
    schedule = LRSchedule.from_config(cfg.optim, cfg.epochs)
    assert schedule.at(cfg.epochs, 32)[0] == 0.0001  # exactly: MLPerf's rule compares with ==


# ---------------------------------------------------------------- MLPerf's checker on real runs
def test_run_stop_says_success_only_where_the_target_stop_saw_the_target(tmp_path):
    """MLPerfMarks asks the run's TargetStop (its own state, not the loop's) for run_stop's
    status: success once it saw the target, aborted before or without one; the log's init_start
    carries the time the run began, given when the one log object is built."""
    from types import SimpleNamespace

    from dstrain.loop.target import TargetStop

    pytest.importorskip("mlperf_logging", reason="log.mlperf needs mlperf-logging")
    trainer = SimpleNamespace()
    for reached, status in ((2, "success"), (0, "aborted"), (None, "aborted")):
        run_dir = tmp_path / f"r{reached}"
        run_dir.mkdir()
        target = None if reached is None else TargetStop(0.5)
        log = mlperf.MLPerfLog(True, init_start_ms=1234)
        marks = mlperf.MLPerfMarks(log, target)
        log.open(run_dir, resumed_epoch=0)
        marks.fit_start(trainer)
        if target is not None:
            target.reached = reached
        marks.fit_end(trainer, completed=True)
        marks.close()
        got = events(run_dir / "mlperf.log")
        assert got[0]["key"] == "init_start" and got[0]["time_ms"] == 1234
        assert got[-1]["key"] == "run_stop" and got[-1]["metadata"]["status"] == status


def test_the_rcp_judging_lives_in_its_tool_not_in_the_loop():
    """RCP judging is for tools only: tools/rcp_check.py holds it (tools/mlperf_package.py reads
    it there); the loop's module writes the log and judges nothing of a set of runs."""
    rcp = tool("rcp_check")
    assert callable(rcp.check_rcp) and callable(rcp.convergence)
    assert not {"check_rcp", "convergence", "RCPVerdict", "refuse_repeated_seeds"} & set(
        vars(mlperf)
    )


TINY_RUN = [*TINY, "log.tensorboard=false", "data.download=false", "log.mlperf=true"]


@pytest.mark.slow
def test_an_open_division_fashion_mnist_log_passes_the_checker(fake_fmnist, tmp_path):
    run_dir = tmp_path / "run"
    proc = run_cli(
        ["--deepspeed_config", "ds_configs/fp32.json", *TINY_RUN]
        + [f"data.root={fake_fmnist}", f"run_dir={run_dir}"]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    verdict = mlperf.check_log(run_dir / "mlperf.log")
    assert verdict.passed, verdict.output[-3000:]
    # nobody flushed the page cache before this run: the log says so
    assert values(events(run_dir / "mlperf.log"))["cache_clear"] is False


@pytest.mark.slow
def test_two_ranks_write_one_log(fake_fmnist, tmp_path):
    """Rank 0 alone writes the MLPerf log: one init_start, one run_stop, each evaluation once."""
    from tests.conftest import deepspeed_launcher

    run_dir = tmp_path / "run"
    proc = run_cli(
        ["--deepspeed_config", "ds_configs/fp32.json", *TINY_RUN]
        + [f"data.root={fake_fmnist}", f"run_dir={run_dir}"],
        launcher=deepspeed_launcher(2),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in run_dir.glob("mlperf*.log")) == ["mlperf.log"]
    keys = [e["key"] for e in events(run_dir / "mlperf.log")]
    assert keys.count("init_start") == keys.count("run_stop") == 1
    assert keys.count("eval_accuracy") == 3 and values(events(run_dir / "mlperf.log"))[
        "submission_platform"
    ].startswith("2x")


# an MLPerf LARS recipe, shrunk to run on a CPU in seconds: synthetic ImageNet-shaped batches
MLPERF_SMALL = [
    "--config",
    "imagenet_resnet50_mlperf_b3264",
    "data.loader=synthetic",
    "data.image_size=32",
    "data.val_resize=32",
    "data.synthetic_train_size=128",
    "data.synthetic_val_size=64",
    "batch.global_size=64",
    "batch.micro_per_rank=32",
    "batch.eval_per_rank=32",
    "epochs=4",  # the first epoch on MLPerf's evaluation grid (every 4 epochs, offset 0)
    "eval_offset_epochs=0",
    "optim.warmup_epochs=1",
    "optim.decay_epochs=0",
    "model.channels_last=false",
    "log.tensorboard=false",
    "log.mlperf=true",
    "log.mlperf_division=closed",
]


def lars_json(tmp_path: Path, **params) -> str:
    """The recipe's own JSON with ``params`` changed, in FP32: MLPerf's rules read the optimizer,
    not the precision, and BF16 autocast of ResNet-50 on this CPU took 276 s for 2 steps of 32
    images (FP32: seconds)."""
    raw = json.loads((REPO / "ds_configs/lars_mlperf_b3264_bf16.json").read_text())
    raw["optimizer"]["params"].update(params)
    del raw["torch_autocast"]
    path = tmp_path / "lars.json"
    path.write_text(json.dumps(raw))
    return str(path)


EXACT_END: list[str] = []  # the recipe's own: optim.end_lr 0.0001


@pytest.mark.slow
@pytest.mark.parametrize(
    "eps, end, failed",
    [
        (0.0, EXACT_END, ["eval_accuracy"]),  # an untrained model: the accuracy rule alone
        (  # both broken at once: each adds its own rule and nothing else
            1e-9,
            ["optim.end_lr=0", "optim.end_lr_factor=1e-5"],
            ["eval_accuracy", "lars_epsilon", "lars_opt_end_learning_rate"],
        ),
    ],
)
def test_a_closed_lars_log_fails_only_on_what_breaks_the_rules(tmp_path, eps, end, failed):
    """The b3264 recipe with its own JSON, logged as closed (its default), fails on the 0.759
    accuracy rule alone (four epochs of random data); epsilon 1e-9 (the shared lars_*.json's) and
    an end LR of 10.5 x 1e-5 (not 0.0001 exactly) add the rule each breaks (one run for both: the
    checker names each broken rule; epsilon alone: test_check_says_whether_the_log_would_meet_the_
    closed_rules, without training)."""
    run_dir = tmp_path / "run"
    proc = run_cli(
        ["--deepspeed_config", lars_json(tmp_path, eps=eps), *MLPERF_SMALL, *end]
        + [f"run_dir={run_dir}"],
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    verdict = mlperf.check_log(run_dir / "mlperf.log")
    assert not verdict.passed and verdict.failed == failed, verdict.output[-3000:]


# ---------------------------------------------------------------- the RCP checker on five runs
def fake_run(
    run_dir: Path, batch: int, converged_at: int | None, top1: float = 0.7601, seed: int = 0
) -> Path:
    """A run's mlperf.log written by dstrain's own writer, as a run of ``batch`` with ``seed`` that
    evaluated every 4 epochs and reached the target at ``converged_at`` (None: never, top-1 0.70)."""
    run_dir.mkdir(parents=True)
    log = mlperf.MLPerfLog(True)
    log.open(run_dir, resumed_epoch=0)
    log.submission("closed", "dstrain", "8xTEST", "research")
    log.hyperparameters({"global_batch_size": batch, "seed": seed})
    log.run_start()
    last = converged_at or 40
    for epoch in range(3, last, 4):  # 0-based: epochs 4, 8, ...
        log.eval_start(epoch)
        log.eval_stop(epoch, top1 if converged_at and epoch + 1 == last else 0.70)
    log.run_stop(success=converged_at is not None)
    log.close()
    return run_dir


def tool(name: str):
    """tools/<name>.py, imported as tools.<name> (as tools/mlperf_package.py imports rcp_check):
    a module of its own in sys.modules, which its dataclasses need."""
    import importlib

    return importlib.import_module(f"tools.{name}")


def rcp_tool():
    pytest.importorskip("scipy", reason="MLPerf's RCP checker needs scipy (requirements.txt)")
    return tool("rcp_check")


def test_the_rcp_check_passes_runs_as_slow_as_the_reference_and_fails_faster_ones(tmp_path, capsys):
    """At batch 3,264 MLCommons' reference runs took 35.2 epochs on average: five runs at 36
    epochs pass; five at 20 converge faster than the reference allows and fail; the table shows
    each run's epochs and status. One run that never converged is tolerated, two are not."""
    tool = rcp_tool()
    slow = [fake_run(tmp_path / "slow" / f"seed{i}", 3264, 36, seed=i) for i in range(5)]
    assert tool.main([str(tmp_path / "slow"), "--json", str(tmp_path / "v.json")]) == 0
    out = capsys.readouterr().out
    assert "PASSED: RCP found" in out and out.count("| 3264 | 36 | 0.7601 | success |") == 5
    verdict = json.loads((tmp_path / "v.json").read_text())
    assert verdict["passed"] and [r["epochs"] for r in verdict["runs"]] == [36] * 5
    assert verdict["command"].startswith("./run.sh rcp-check ") and verdict["git_sha"]

    for i in range(5):
        fake_run(tmp_path / "fast" / f"seed{i}", 3264, 20, seed=i)
    assert tool.main([str(tmp_path / "fast")]) == 1
    assert "FAILED" in capsys.readouterr().out

    for i, at in enumerate((36, 36, 36, None, None)):
        fake_run(tmp_path / "lost" / f"seed{i}", 3264, at, seed=i)
    assert tool.main([str(tmp_path / "lost")]) == 1
    assert "Insufficient convergence" in capsys.readouterr().out
    assert slow  # the directories named one by one work too
    assert tool.main([str(d) for d in slow]) == 0


def test_the_rcp_check_refuses_too_few_runs_and_a_resumed_one(tmp_path, capsys):
    tool = rcp_tool()
    runs = [fake_run(tmp_path / f"seed{i}", 3264, 36, seed=i) for i in range(5)]
    assert tool.main([str(d) for d in runs[:4]]) == 2
    assert "4 run(s) given" in capsys.readouterr().err
    # five copies of one seed are one run, whatever the checker would say of them
    copies = [fake_run(tmp_path / "copies" / f"run{i}", 3264, 36, seed=7) for i in range(5)]
    assert tool.main([str(tmp_path / "copies")]) == 2
    err = capsys.readouterr().err
    assert f"{copies[0]} and {copies[1]} both log seed 7" in err
    (runs[2] / "mlperf-2.log").write_text("")
    assert tool.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert str(runs[2]) in err and "one uninterrupted run" in err
    assert tool.main([str(tmp_path / "nothing")]) == 2


@pytest.mark.slow  # over ~5 s on 2 cores: the full suite only (issue 42: quick loop < 3 min)
def test_check_says_whether_the_log_would_meet_the_closed_rules(tmp_path):
    """--check judges the log the run would write with MLPerf's own checker: the b3264 recipe with
    its JSON meets the closed rules (once top-1 reaches 0.759); with the shared lars_fp16.json
    (epsilon 1e-9) it names the value that breaks them."""
    base = ["--config", "imagenet_resnet50_mlperf_b3264", "--check", "--world", "16"]
    base += ["--device", "cuda", "data.loader=synthetic", f"run_dir={tmp_path / 'run'}"]
    ok = run_cli(base)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "closed division: meets MLPerf's rules (ruleset 4.0.0) once top-1 reaches 0.759" in (
        ok.stdout
    )
    bad = run_cli([*base, "--deepspeed_config", "ds_configs/lars_fp16.json"])
    assert "closed division: would fail MLPerf's rules (ruleset 4.0.0) on lars_epsilon=1e-09" in (
        bad.stdout
    )
    assert not (tmp_path / "run").exists()  # --check writes nothing


def package_tool():
    return tool("mlperf_package")


def test_the_package_refuses_a_system_description_naming_each_missing_field(tmp_path):
    tool = package_tool()
    system = tool.template()
    assert len(system) == 33 and system["status"] in tool.SYSTEM_STATUS
    for key in ("cooling", "accelerator_on-chip_memories"):
        del system[key]
    path = tmp_path / "system.json"
    path.write_text(json.dumps(system))
    with pytest.raises(
        ConfigError, match="missing 2 of the fields .*: accelerator_on-chip_memories, cooling"
    ):
        tool.read_system(path, "closed")
    path.write_text(json.dumps({**tool.template(), "status": "onprem"}))
    with pytest.raises(ConfigError, match="status 'onprem' is not one of"):
        tool.read_system(path, "closed")
    path.write_text(json.dumps(tool.template()))
    with pytest.raises(
        ConfigError, match="division 'closed', but the runs log submission_division 'open'"
    ):
        tool.read_system(path, "open")


@pytest.mark.slow
def test_five_cpu_runs_make_a_package_mlperfs_checker_accepts(fake_fmnist, tmp_path, capsys):
    """Five short Fashion-MNIST runs (open division) with seed=auto, from a committed tree -> the
    package: systems/, results/<system>/resnet/result_{0..4}.txt, the implementation; MLPerf's
    package checker finds no errors and the summarizer writes its CSV. seed=auto drew each run its
    own seed (recorded in config.yaml and the log; a resume keeps it). A repeated seed or a sixth
    run is refused before anything is written."""
    import subprocess

    from omegaconf import OmegaConf

    pytest.importorskip("scipy", reason="MLPerf's checkers need scipy (requirements.txt)")
    tool = package_tool()
    runs = tmp_path / "runs"
    args = ["--deepspeed_config", "ds_configs/fp32.json", *TINY_RUN, "epochs=1", "seed=auto"]
    seeds = []
    for k in range(5):
        proc = run_cli(args + [f"data.root={fake_fmnist}", f"run_dir={runs / f's{k}'}"])
        assert proc.returncode == 0, proc.stderr[-3000:]
        seed = OmegaConf.load(runs / f"s{k}" / "config.yaml").seed
        assert isinstance(seed, int) and f"seed=auto: drew {seed}" in proc.stdout
        assert values(events(runs / f"s{k}" / "mlperf.log"))["seed"] == seed
        seeds.append(seed)
    assert len(set(seeds)) == 5
    again = run_cli(args + [f"data.root={fake_fmnist}", f"run_dir={runs / 's4'}", "resume=auto"])
    assert again.returncode == 0 and f"seed=auto: {seeds[4]}, as" in again.stdout
    (runs / "s4" / "mlperf-2.log").unlink()  # the resumed attempt's log: the run stays one result
    sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True)
    for meta in runs.glob(
        "*/meta.json"
    ):  # as if trained from a committed tree (this one may not be)
        record = json.loads(meta.read_text())
        meta.write_text(json.dumps({**record, "git_sha": sha.stdout.strip()}))
    system = tmp_path / "cpu2.json"
    system.write_text(
        json.dumps({**tool.template(), "division": "open", "system_name": "2 CPU cores"})
    )
    out = tmp_path / "submission"
    code = tool.main([str(runs), "--system", str(system), "--org", "TestOrg", "--out", str(out)])
    captured = capsys.readouterr()
    assert code == 0, captured.out + captured.err
    assert "package checker (ruleset 4.0.0): no errors" in captured.out
    org = out / "TestOrg"
    results = sorted(p.name for p in (org / "results" / "cpu2" / "resnet").glob("result_*.txt"))
    assert results == [f"result_{i}.txt" for i in range(5)]
    assert (org / "systems" / "cpu2.json").is_file()
    impl = org / "benchmarks" / "resnet" / "implementations" / "dstrain"
    assert (impl / "dstrain" / "main.py").is_file()
    assert f"(seed {seeds[4]})" in (impl / "README.md").read_text()
    assert (out / "summary.csv").is_file()
    verdict = json.loads((out / "package.json").read_text())
    assert verdict["package_checker_passed"] and [r["seed"] for r in verdict["runs"]] == seeds
    assert verdict["package_checker_errors"] == []  # its SUCCESS line is no error
    # each run's command as a user types it, not the path Python gave __main__.py
    readme = (impl / "README.md").read_text()
    assert "`python -m dstrain --deepspeed_config ds_configs/fp32.json --config" in readme
    assert "__main__.py" not in readme
    # a repeated seed, or six runs: refused, nothing written
    shutil.copytree(runs / "s0", runs / "s5")  # a copy: a sixth run, and s0's seed twice
    assert tool.main([str(runs), "--system", str(system), "--out", str(tmp_path / "x")]) == 2
    assert "6 run(s) given" in capsys.readouterr().err and not (tmp_path / "x").exists()
    shutil.rmtree(runs / "s4")
    assert tool.main([str(runs), "--system", str(system), "--out", str(tmp_path / "x")]) == 2
    assert f"both log seed {seeds[0]}" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
