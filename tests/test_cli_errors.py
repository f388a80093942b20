"""Bad input through the real command line: one clear line, exit 2, no traceback, nothing written.

A new case is one line in CASES: (kind, name, extra arguments, text the error line must contain). Extra
arguments may use {data} (a small Fashion-MNIST), {tmp} (an empty scratch directory) and the names of the
files ``case_files`` writes. Every case also lands in the evidence table (``./run.sh evidence``).
"""

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.conftest import CPU_ONLY, REPO, TINY, deepspeed_launcher, gpu_count, run_cli
from tests.refusals import fence_breaches, refusal_checks

BAD_JSON = '{\n  "gradient_clipping": 0.0,\n  "optimizer": {"type": "SGD" "params": {}}\n}\n'
JSON_FILES = {
    "bf16_cast": '{"bf16": {"enabled": true}, "gradient_clipping": 0.0}',
    "grid": '{"gradient_clipping": 0.0, "dstrain_communication": {"mode": "torus2d", "grid": [2, 2]}}',
    "onebit": '{"optimizer": {"type": "OneBitAdam", "params": {"momentum": 0.9}}}',
    "shampoo": '{"optimizer": {"type": "Shampoo", "params": {}}}',
    "json_lr": '{"optimizer": {"type": "Lamb", "params": {"lr": 0.002, "weight_decay": 0.01}}}',
    "momentum": '{"optimizer": {"type": "LARS", "params": {"momentum": 1.5}}}',
    "nesterov": '{"optimizer": {"type": "SGD", "params": {"nesterov": true}}}',
    "zero_comm": '{"zero_optimization": {"stage": 1}, "dstrain_communication": {"compression": "sign"}}',
    "typo_key": '{"gradient_cliping": 1.0}',
    "clip_auto": '{"gradient_clipping": "auto"}',
    "momentum_string": '{"gradient_clipping": 0.0, "optimizer": {"type": "LARS", "params": {"momentum": "0.9"}}}',
    "autocast_typo": '{"gradient_clipping": 0.0, "torch_autocast": {"enabeld": true}}',
    "zero1": '{"gradient_clipping": 0.0, "zero_optimization": {"stage": 1}}',
    "zero_typo": '{"gradient_clipping": 0.0, "zero_optimization": {"stage": 0, "reduce_bucket_sise": 5}}',
    "fp16_typo": '{"gradient_clipping": 0.0, "fp16": {"enabled": false, "loss_scale_windw": 100}}',
}


def case_files(tmp_path: Path) -> dict:
    files = {"bad_json": tmp_path / "bad.json", "bad_yaml": tmp_path / "bad.yaml"}
    files["bad_json"].write_text(BAD_JSON)
    files["bad_yaml"].write_text("epochs: 3\noptim:\n  base_lr: [0.1\n")
    for name, text in JSON_FILES.items():
        files[name] = tmp_path / f"{name}.json"
        files[name].write_text(text)
    (tmp_path / "empty").mkdir()
    for split in ("train", "val"):  # an image folder whose splits hold no class folders
        (tmp_path / "no_classes" / split).mkdir(parents=True)
    (tmp_path / "not_a_run").mkdir()
    (tmp_path / "not_a_run" / "notes.txt").write_text("my notes")
    files["a_file"] = tmp_path / "a_file"
    files["a_file"].write_text("not a directory")
    files["not_a_run"] = tmp_path / "not_a_run"
    # a run whose checkpoint a newer dstrain wrote: a train-state key this one does not know
    newer = tmp_path / "newer_run" / "checkpoints"
    (newer / "epoch0001").mkdir(parents=True)
    state = {"epoch": 1, "step": 16, "lr_sched": {"last": 16}}
    (newer / "epoch0001" / "trainer_state.json").write_text(json.dumps(state))
    (newer / "latest").write_text("epoch0001\n")
    # its manifest (dstrain/loop/manifest.py), of the one file made here: its files are as written,
    # so what refuses it is what this dstrain cannot continue
    from dstrain.loop import manifest

    state_file = newer / "epoch0001" / "trainer_state.json"
    manifest.write(state_file.parent, {state_file.name: manifest.entry(state_file)})
    files["newer_run"] = newer.parent
    # init.weights: a file that is not weights, and TINY's own weights less its head's bias
    import torch

    from dstrain.techniques.models import build_model

    files["not_weights"] = tmp_path / "not_weights.pt"
    torch.save({"epoch": 3, "note": "no tensors"}, files["not_weights"])
    state = build_model("resnet_small", 10, in_channels=1, width=8).state_dict()
    files["headless_weights"] = tmp_path / "headless.pt"
    torch.save({k: v for k, v in state.items() if k != "fc.bias"}, files["headless_weights"])
    return {k: str(v) for k, v in files.items()}


JSON = "--deepspeed_config"


def case_args(extra: list[str], data: Path, tmp: Path) -> list[str]:
    """A case's full command line: the tiny run in ``tmp/run`` with the case's arguments, its files
    written to ``tmp`` (``case_files``) and ``{data}``, ``{tmp}``, ``{<file>}`` filled in."""
    subs = {"data": str(data), "tmp": str(tmp), **case_files(tmp)}
    args = [JSON, "ds_configs/fp32.json", *TINY, f"data.root={data}", f"run_dir={tmp / 'run'}"]
    return args + [a.format(**subs) for a in extra]


CASES = [
    # kind, name, extra args, text the error line must contain
    ("config", "malformed JSON", [JSON, "{bad_json}"], "bad.json:3:"),
    ("config", "malformed YAML recipe", ["--config", "{bad_yaml}"], "bad.yaml: malformed YAML"),
    (
        "config",
        "missing JSON",
        [JSON, "ds_configs/nope.json"],
        "ds_configs/nope.json: no such file",
    ),
    ("config", "unknown recipe", ["--config", "nope"], "no such file or recipe"),
    (
        "config",
        "unknown trainer key",
        ["optim.warmup_epoch=5"],
        "unknown config key 'optim.warmup_epoch'",
    ),
    (
        "config",
        "unknown JSON key (a typo)",
        [JSON, "{typo_key}"],
        "Did you mean 'gradient_clipping'",
    ),
    ("config", "wrong type", ["epochs=three"], "bad value for 'epochs'"),
    (
        "config",
        "a string where the JSON needs a number",
        [JSON, "{clip_auto}"],
        'clip_auto.json: gradient_clipping must be a number, got "auto"',
    ),
    (
        "config",
        "an optimizer parameter as a string",
        [JSON, "{momentum_string}"],
        'momentum_string.json: optimizer.params.momentum must be a number, got "0.9"',
    ),
    (
        "config",
        "a typo inside torch_autocast (was: silently FP32)",
        [JSON, "{autocast_typo}"],
        "unknown key 'torch_autocast.enabeld' (DeepSpeed would silently ignore it). Did you mean 'enabled'?",
    ),
    (
        "config",
        "a typo inside zero_optimization (was: a pydantic traceback)",
        [JSON, "{zero_typo}"],
        "unknown key 'zero_optimization.reduce_bucket_sise' (DeepSpeed refuses it). Did you mean",
    ),
    (
        "config",
        "a typo inside the fp16 block",
        [JSON, "{fp16_typo}"],
        "unknown key 'fp16.loss_scale_windw'",
    ),
    ("config", "negative LR", ["optim.base_lr=-0.1"], "optim.base_lr=-0.1: must be > 0"),
    (
        "config",
        "compile mode without inductor",
        [
            "model.compile=true",
            "model.compile_backend=aot_eager",
            "model.compile_mode=max-autotune",
        ],
        "with model.compile_backend=aot_eager set model.compile_mode=default",
    ),
    (
        "config",
        "a BN group larger than the ranks",
        ["model.bn_group=2"],
        "model.bn_group=2 does not divide the 1 rank(s): BN groups are 2 consecutive ranks",
    ),
    (
        "config",
        "an EMA decay of 1",
        ["optim.ema.decay=1"],
        "optim.ema.decay=1.0: must be in [0, 1)",
    ),
    ("config", "a negative seed", ["seed=-3"], "seed=-3: must be an integer >= 0, or auto"),
    (  # was: DeepSpeed's view(-1) failed on NHWC gradients in the first backward
        "config",
        "ZeRO with channels_last",
        [JSON, "{zero1}", "model.channels_last=true"],
        "zero1.json: zero_optimization.stage 1 flattens gradients with .view(-1)",
    ),
    (  # was: passed --check, refused once the run built the optimizer (issue 53)
        "config",
        "nesterov without momentum",
        [JSON, "{nesterov}"],
        "nesterov.json: optimizer.params for SGD: Nesterov momentum requires a momentum",
    ),
    (  # was: passed --check, trained every epoch, then a ValueError traceback (issue 53)
        "config",
        "a polish set of one image",
        ["polish.enabled=true", "polish.images=1"],
        "polish.images=1: the polish set holds 1 training image(s); the BN refit needs at least 2",
    ),
    (  # was: the JSON's lr and optim.base_lr both set, the recipe's silently won (issue 53)
        "config",
        "the LR set in the JSON too",
        [JSON, "{json_lr}"],
        "json_lr.json: optimizer.params.lr=0.002: the LR has one home, the trainer config's "
        "optim.base_lr",
    ),
    (
        "config",
        "momentum out of range",
        [JSON, "{momentum}"],
        "optimizer.params.momentum=1.5: must be in [0, 1)",
    ),
    (
        "config",
        "label smoothing 1.0",
        ["optim.label_smoothing=1.0"],
        "optim.label_smoothing=1.0: must be in [0, 1)",
    ),
    ("config", "warmup longer than training", ["optim.warmup_epochs=5"], "shorter than epochs=3"),
    (
        "config",
        "ramp steps out of order",
        ["batch.ramp=[[2,64],[1,128]]"],
        "epochs must increase strictly",
    ),
    ("config", "unknown model", ["model.name=resnet_tiny"], "model.name='resnet_tiny'"),
    ("config", "unknown loader", ["data.loader=ffcv"], "data.loader='ffcv'"),
    (
        "config",
        "impossible crop area",
        ["data.random_area=[0.5,0.1]"],
        "data.random_area=[0.5, 0.1]",
    ),
    ("config", "synthetic as a data set", ["data.dataset=synthetic"], "data.loader=synthetic"),
    (
        "config",
        "negative collective timeout",
        ["fault.collective_timeout_s=-1"],
        "fault.collective_timeout_s=-1",
    ),
    (
        "optimizer",
        "optimizer neither DeepSpeed nor dstrain has",
        [JSON, "{shampoo}"],
        "optimizer type 'Shampoo' is not supported",
    ),
    (
        "optimizer",
        "1-bit Adam (removed in DeepSpeed 0.19)",
        [JSON, "{onebit}"],
        "removed in DeepSpeed 0.19",
    ),
    (
        "precision",
        "native fp16 engine without a GPU",
        [JSON, "ds_configs/fp16_native.json"],
        "ds_configs/fp32.json",
    ),
    (
        "precision",
        "bf16 weight cast with BatchNorm on CPU",
        [JSON, "{bf16_cast}"],
        "Use ds_configs/bf16.json",
    ),
    (
        "communication",
        "compressed all-reduce with ZeRO stage 1",
        [JSON, "{zero_comm}"],
        "ZeRO stages > 0",
    ),
    (
        "communication",
        "torus grid larger than the world",
        [JSON, "{grid}"],
        "grid=[2, 2] needs 4 ranks but the world size is 1",
    ),
    (
        "data",
        "data directory missing",
        ["data.root={tmp}/no-such-dir", "data.download=false"],
        "apt-get install dataset-fashion-mnist",
    ),
    (
        "data",
        "data directory empty",
        ["data.root={tmp}/empty", "data.download=false"],
        "no Fashion-MNIST idx files",
    ),
    (
        "data",
        "image folder without a root",
        ["data.dataset=imagefolder", "data.root=''"],
        "needs data.root=DIR",
    ),
    (
        "data",
        "image folder without train/ and val/",
        ["data.dataset=imagefolder", "data.root={tmp}/empty"],
        "missing",
    ),
    (
        "data",
        "image folder with no class folders",
        ["data.dataset=imagefolder", "data.root={tmp}/no_classes"],
        "no class folders",
    ),
    ("data", "DALI for Fashion-MNIST", ["data.loader=dali"], "served from memory"),
    (
        "batch",
        "micro batch does not divide the per-rank batch",
        ["batch.global_size=32", "batch.micro_per_rank=12"],
        "batch.micro_per_rank=12 does not divide",
    ),
    (
        "batch",
        "global batch larger than the data set",
        ["batch.global_size=1024"],
        "less than one global batch",
    ),
    (
        "batch",
        "batch-size ramp larger than the data set",
        ["batch.ramp=[[1,1024]]"],
        "(batch.ramp reaches 1024 at epoch 2); lower batch.ramp",
    ),
    (
        "weights",
        "init.weights not weights",
        ["init.weights={not_weights}"],
        "not_weights.pt: holds no state dict of tensors",
    ),
    ("weights", "init.weights missing", ["init.weights={tmp}/none.pt"], "none.pt: no such file"),
    (
        "weights",
        "init.strict and a tensor the file lacks",
        ["init.weights={headless_weights}", "init.strict=true"],
        "not in the file: fc.bias",
    ),
    (
        "batch",
        "a batch that follows the noise without a cap",
        ["batch.micro_per_rank=16", "batch.follow_noise=true"],
        "batch.noise_cap=0: batch.follow_noise needs a cap above batch.global_size=32",
    ),
    (
        "batch",
        "a batch that follows a noise one rank cannot measure",
        ["batch.follow_noise=true", "batch.noise_cap=64"],
        "batch.follow_noise needs B_noise measured from the first batch: one rank and one micro",
    ),
    ("run dir", "run_dir is a file", ["run_dir={a_file}"], "is a file"),
    (
        "run dir",
        "resume=auto on a directory that is not a run",
        ["run_dir={not_a_run}", "resume=auto"],
        "is not a dstrain run",
    ),
    (
        "run dir",
        "resume=auto on a checkpoint a newer dstrain wrote",
        ["run_dir={newer_run}", "resume=auto"],
        "train state has keys this dstrain does not know (['lr_sched']): a newer dstrain wrote it",
    ),
]


def tree_digest(path: Path) -> str:
    """Names and contents of every file under path: equal digests = nothing written or overwritten."""
    h = hashlib.sha256()
    for p in sorted(path.rglob("*")) if path.exists() else []:
        h.update(str(p.relative_to(path)).encode())
        if p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


def check_one_clear_line(proc, expected: str, ranks: int = 1) -> str:
    """The refusal's line, from one process or from each of ``ranks`` launched ranks that got to
    say it: DeepSpeed's launcher kills the other ranks as soon as one exits, so a rank slower to
    its check may be ended before it prints (one line at least, each the same)."""
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    prefix = "dstrain: error:" if ranks == 1 else "dstrain[rank "
    errors = [line for line in proc.stderr.splitlines() if line.startswith(prefix)]
    assert 1 <= len(errors) <= ranks and all(expected in e for e in errors), (
        proc.stdout[-2000:] + proc.stderr[-3000:]
    )
    assert len({e.split(":", 1)[1] for e in errors}) == 1  # every rank says the same
    return errors[0]


@pytest.fixture(scope="session")  # once per pytest-xdist worker, whatever runs between its tests
def refused(fake_fmnist, tmp_path_factory) -> dict:
    """Every case of CASES run by the real run, ``python -m dstrain``'s ``main``, in one process per
    environment (tests/refusals.py): name -> (its scratch directory, its arguments, the digest of
    that directory before, what the run showed). One process start instead of 51 (3-8 s each)."""
    cases, groups = {}, {}
    for kind, name, extra, _ in CASES:
        tmp = tmp_path_factory.mktemp("case")
        args = case_args(extra, fake_fmnist, tmp)
        cases[name] = (tmp, args, tree_digest(tmp))
        # the CPU's refusals are tested on every node: with the GPUs hidden where there are some
        # (one process for all where there are none: hiding nothing changes nothing)
        groups.setdefault(kind == "precision" and gpu_count() > 0, []).append(name)
    for cpu_only, names in groups.items():
        spec = tmp_path_factory.mktemp("refusals")
        (spec / "cases.json").write_text(json.dumps([cases[n][1] for n in names]))
        proc = run_cli(
            [str(spec / "cases.json"), str(spec / "results.json")],
            env=CPU_ONLY if cpu_only else None,
            timeout=600,
            module="tests.refusals",
        )
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        for name, shown in zip(names, json.loads((spec / "results.json").read_text()), strict=True):
            cases[name] = (*cases[name], SimpleNamespace(**shown))
    return cases


@pytest.mark.slow  # the real run of every case (one process); the quick loop has --check's (test_preflight)
# on one pytest-xdist worker: `refused` runs once, not once per worker
@pytest.mark.xdist_group("refusals")
@pytest.mark.parametrize("kind, name, extra, expected", CASES, ids=[c[1] for c in CASES])
def test_bad_input_gives_one_clear_line(kind, name, extra, expected, refused, evidence, capfd):
    """The run refuses with one line, exit 2, nothing written, and ``--check`` with the same
    arguments gives that very line (the same check functions in the same order: dstrain/run/startup.py)."""
    from dstrain.main import main

    tmp, args, before, proc = refused[name]
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    line = check_one_clear_line(proc, expected)
    assert not (tmp / "run").exists(), "a failed start must not create the run directory"
    assert tree_digest(tmp) == before, "a failed start must not write anything"
    # the fence: refused inside the start-up list, never once it has passed (the run's build)
    assert fence_breaches(vars(proc)) == [], name
    capfd.readouterr()
    assert main([*args, "--check", "--device", "cpu"]) == 2
    checked = [e for e in capfd.readouterr().err.splitlines() if e.startswith("dstrain: error:")]
    assert checked == [line], (checked, line)  # --check's refusal is the run's own line
    assert tree_digest(tmp) == before
    evidence(f"bad input: {kind}", name, exit=proc.returncode, seen=line, disk="nothing written")


def test_the_fence_finds_refusal_checks_and_reports_one_made_after_startup(tmp_path):
    """The fence's own parts on stand-ins: refusal_checks finds every function whose body raises
    ConfigError (nested functions apart) in a package; fence_breaches reports a case refused
    after start-up, and a refusal check entered after start-up that start-up did not make first
    (item 6's old shape: the resume refused a newer train state that --check let through)."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "mod.py").write_text(
        "from errors import ConfigError\n"
        "def refuses(x):\n"
        "    if x:\n"
        "        raise ConfigError('bad')\n"
        "def wraps():\n"
        "    def inner():\n"
        "        raise ConfigError('bad')\n"
        "    return inner\n"
        "class State:\n"
        "    @staticmethod\n"
        "    def load(saved):\n"
        "        raise ConfigError('newer')\n"
        "def quiet():\n"
        "    raise ValueError('not a refusal')\n"
    )
    found = refusal_checks(package)
    path = str((package / "mod.py").resolve())
    assert found == {
        (path, 2): "pkg.mod:refuses",
        (path, 6): "pkg.mod:wraps.inner",
        (path, 10): "pkg.mod:State.load",  # a decorated function's code starts at its decorator
    }
    clean = {
        "returncode": 0,
        "after_startup": True,
        "checks_in_startup": ["dstrain.run.compat:check"],
        "checks_after_startup": ["dstrain.run.compat:check", "dstrain.loop.checkpoint:load"],
    }
    assert fence_breaches(clean) == []  # made first at start-up, or after it by design
    planted = {
        **clean,
        "returncode": 2,
        "checks_after_startup": ["dstrain.loop.trainer:TrainState.load_state_dict"],
    }
    assert fence_breaches(planted) == [
        "refused after the start-up checks passed",
        "dstrain.loop.trainer:TrainState.load_state_dict can refuse after the start-up checks, "
        "which do not make it first (call it from dstrain/run/startup.py too, as the run's own check)",
    ]


PLANT = """
import json, sys
from dstrain.core.errors import ConfigError
from dstrain.run import train
from tests import refusals

def planted(*args, **kwargs):  # a refusal the run makes once the start-up checks have passed
    raise ConfigError("planted: refused after the start-up checks")

train.resume = planted
code = planted.__code__
checks = {**refusals.refusal_checks(), (code.co_filename, code.co_firstlineno): "planted"}
print(json.dumps(refusals.refuse(json.loads(sys.argv[1]), checks)))
"""


@pytest.mark.slow  # one process start and a run's start-up (~10 s on 2 cores)
def test_a_refusal_planted_after_startup_breaks_the_fence(fake_fmnist, tmp_path):
    """The positive control on a real run: a refusal planted in the run's build (its resume)
    makes the fence fail, naming the check, and the run has written its directory by then."""
    args = case_args([], fake_fmnist, tmp_path)
    proc = subprocess.run(
        [sys.executable, "-c", PLANT, json.dumps(args)],
        cwd=REPO,
        env={**os.environ, **CPU_ONLY},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    shown = json.loads(proc.stdout.strip().splitlines()[-1])
    assert shown["returncode"] == 2 and "planted: refused" in shown["stderr"]
    assert fence_breaches(shown) == [
        "refused after the start-up checks passed",
        "planted can refuse after the start-up checks, which do not make it first (call it from "
        "dstrain/run/startup.py too, as the run's own check)",
    ]
    assert (tmp_path / "run").exists()  # what the fence keeps a refusal from doing


@pytest.mark.slow  # a fresh run and its resume, each in its own process (~30 s on 2 cores)
def test_no_refusal_check_runs_after_startup_unless_startup_made_it_first(fake_fmnist, tmp_path):
    """The fence found, not listed: a fresh run and its resume (Final Polishing and a quality
    target on, so their paths run too) enter every refusal check of dstrain/ they would make;
    each one entered after the start-up checks returned was made by them first, or is one of
    tests/refusals.py's AFTER_STARTUP_BY_DESIGN (each with its reason)."""
    extra = ["polish.enabled=true", "target_top1=0.99"]
    for epochs, resume in (("epochs=1", []), ("epochs=2", ["resume=auto"])):
        spec = tmp_path / f"spec-{epochs}"
        spec.mkdir()
        args = [JSON, "ds_configs/fp32.json", *TINY, f"data.root={fake_fmnist}", *extra]
        args += [f"run_dir={tmp_path / 'run'}", epochs, *resume]
        (spec / "cases.json").write_text(json.dumps([args]))
        proc = run_cli(
            [str(spec / "cases.json"), str(spec / "results.json")],
            env=CPU_ONLY,
            timeout=600,
            module="tests.refusals",
        )
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        (shown,) = json.loads((spec / "results.json").read_text())
        assert shown["returncode"] == 0, shown["stderr"][-3000:]
        assert "dstrain.run.startup:check" in shown["checks_in_startup"]
        assert fence_breaches(shown) == [], (epochs, resume)
    assert "dstrain.loop.trainer:refuse_newer_state" in shown["checks_after_startup"]


@pytest.mark.slow  # over ~5 s on 2 cores: the full suite only (issue 42: quick loop < 3 min)
def test_batch_that_does_not_split_over_the_world_size(fake_fmnist, tmp_path, evidence):
    run_dir = tmp_path / "run"
    proc = run_cli(
        [
            JSON,
            "ds_configs/fp32.json",
            *TINY,
            f"data.root={fake_fmnist}",
            f"run_dir={run_dir}",
            "batch.global_size=33",
        ],
        launcher=deepspeed_launcher(2),
        timeout=240,
    )
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    line = check_one_clear_line(
        proc, "batch.global_size=33 is not divisible by the world size 2", ranks=2
    )
    assert not run_dir.exists()
    evidence(
        "bad input: batch",
        "global batch 33 on 2 ranks",
        exit=proc.returncode,
        seen=line,
        disk="nothing written",
    )


def test_existing_run_dir_is_not_overwritten(fake_fmnist, tmp_path, evidence):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "summary.json").write_text("precious")
    proc = run_cli(
        [JSON, "ds_configs/fp32.json", *TINY, f"data.root={fake_fmnist}", f"run_dir={run_dir}"],
        timeout=120,
    )
    assert proc.returncode == 2
    line = check_one_clear_line(proc, "resume=auto")
    assert (run_dir / "summary.json").read_text() == "precious" and len(
        list(run_dir.iterdir())
    ) == 1
    evidence(
        "bad input: run dir",
        "existing run_dir without resume=auto",
        exit=2,
        seen=line,
        disk="existing files untouched",
    )


# the tests that read the module's finished runs (finished_run, finished_zero1_run), on one
# pytest-xdist worker: handed out one at a time, they trained each run on both workers
SHARES_RUNS = pytest.mark.xdist_group("refusals")


@pytest.fixture(scope="module")
def finished_run(fake_fmnist, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    proc = run_cli(
        [
            JSON,
            "ds_configs/fp32.json",
            *TINY,
            "epochs=1",
            f"data.root={fake_fmnist}",
            f"run_dir={run_dir}",
        ]
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    (run_dir.parent / "output.txt").write_text(proc.stdout + proc.stderr)
    return run_dir


@SHARES_RUNS
@pytest.mark.slow  # over ~5 s on 2 cores: the full suite only (issue 53: the quick loop under 1 minute)
def test_the_run_logs_the_plan_check_prints(finished_run, fake_fmnist, capfd):
    """One renderer (startup.plan_lines) from one LR: every line --check prints for a run is in
    that run's log (issue 53: --check printed the JSON's lr, the run optim.base_lr)."""
    from dstrain.main import main

    args = [JSON, "ds_configs/fp32.json", *TINY, "epochs=1", f"data.root={fake_fmnist}"]
    capfd.readouterr()
    assert main([*args, f"run_dir={finished_run.parent / 'fresh'}", "--check"]) == 0
    lines = [line.strip() for line in capfd.readouterr().out.splitlines()]
    plan = [
        line
        for line in lines
        if re.match(r"^(recipe|DeepSpeed|job|model|data|batch|schedule) ", line)
    ]
    assert any("optim.base_lr 0.2 per 256 images" in line for line in plan), plan
    logged = (finished_run.parent / "output.txt").read_text()
    assert len(plan) >= 6 and all(line.split(None, 1)[1] in logged for line in plan), (
        plan,
        logged[-3000:],
    )


@SHARES_RUNS
@pytest.mark.slow  # over ~5 s on 2 cores: the full suite only (issue 42: quick loop < 3 min)
def test_resume_with_a_different_model_is_refused(resumes_refused, evidence):
    case = resumes_refused["a different model"]
    line = check_refused(case, "model.width=8 there, 16 here")
    evidence(
        "bad input: checkpoint",
        "resume=auto with a different model (width 16 vs 8)",
        exit=2,
        seen=line,
        disk="run untouched",
    )


INCOMPATIBLE = [
    # what changes, extra arguments, text of the refusal
    (
        "another optimizer JSON (was: a KeyError after rewriting config.yaml and meta.json)",
        [JSON, "ds_configs/lars_fp32.json"],
        "optimizer.type 'sgd' there, 'lars' here",
    ),
    (
        "another precision",
        [JSON, "ds_configs/bf16.json"],
        "precision 'fp32' there, 'autocast-bfloat16'",
    ),
    ("another global batch", ["batch.global_size=64"], "global batch 32 there, 64 here in epoch 1"),
]


@SHARES_RUNS
@pytest.mark.slow  # over ~5 s on 2 cores: the full suite only (issue 42: quick loop < 3 min)
@pytest.mark.parametrize("case, extra, text", INCOMPATIBLE, ids=[c[0][:20] for c in INCOMPATIBLE])
def test_resume_with_an_incompatible_config_is_refused_untouched(
    case, extra, text, resumes_refused, evidence
):
    line = check_refused(resumes_refused[case], text)
    assert "cannot be resumed with this config" in line
    evidence(
        "bad input: resume", f"resume=auto with {case}", exit=2, seen=line, disk="run untouched"
    )


@SHARES_RUNS
@pytest.mark.slow  # over ~5 s on 2 cores: the full suite only (issue 42: quick loop < 3 min)
def test_resume_with_allowed_changes_continues(finished_run, fake_fmnist, tmp_path, evidence):
    """epochs, the LR, momentum, label smoothing and logging may change."""
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir)
    raw = json.loads((Path(__file__).parent.parent / "ds_configs/fp32.json").read_text())
    raw["optimizer"]["params"].update(momentum=0.8)
    (tmp_path / "momentum.json").write_text(json.dumps(raw))
    args = [JSON, str(tmp_path / "momentum.json"), *TINY, "epochs=2", "optim.base_lr=0.05"]
    args += ["optim.label_smoothing=0.05"]
    args += ["log.every_steps=8", f"data.root={fake_fmnist}", f"run_dir={run_dir}", "resume=auto"]
    proc = run_cli(args, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["epochs"] == 2 and "resumed from" in proc.stdout + proc.stderr
    evidence(
        "resume",
        "resume=auto with a new LR, momentum value, label smoothing, logging and more epochs",
        exit=0,
        seen="resumed from epoch 1 and trained epoch 2",
        disk="epoch0002 checkpoint, summary.json",
    )


@SHARES_RUNS
@pytest.mark.slow  # over ~5 s on 2 cores: the full suite only (issue 42: quick loop < 3 min)
@pytest.mark.parametrize("case", ["not a run directory", "a different model", "no EMA weights"])
def test_polish_refuses_a_checkpoint_it_cannot_use(case, finished_run, tmp_path, evidence):
    target = str(tmp_path) if case == "not a run directory" else str(finished_run)
    extra = {"a different model": ["model.width=16"], "no EMA weights": ["--weights", "ema"]}
    extra = extra.get(case, [])
    before = tree_digest(finished_run)
    proc = run_cli(["--checkpoint", target, *extra], module="dstrain.polish", timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [
        line for line in proc.stderr.splitlines() if line.startswith("dstrain.polish: error:")
    ]
    expected = {
        "not a run directory": "no config.yaml",
        "a different model": "belong to a different model",
        "no EMA weights": "has no ema.pt",  # trained without optim.ema
    }[case]
    assert len(errors) == 1 and expected in errors[0], proc.stderr[-2000:]
    assert tree_digest(finished_run) == before
    evidence(
        "bad input: checkpoint",
        f"`python -m dstrain.polish --checkpoint` {case}",
        exit=2,
        seen=errors[0],
        disk="nothing written",
    )


class _Planted:
    """What a crafted checkpoint holds: unpickling it calls open(MARKER, "w"), creating the file."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _plant(run_dir: Path, marker: Path, name: str = "mp_rank_00_model_states.pt") -> Path:
    """Replace a checkpoint file of ``run_dir`` with one whose unpickling would create ``marker``."""
    (target,) = (run_dir / "checkpoints").glob(f"epoch*/{name}")
    torch.save({"module": _Planted(marker), "dstrain": {}}, target)
    return target


@SHARES_RUNS
@pytest.mark.slow  # over ~5 s on 2 cores: the full suite only (issue 42: quick loop < 3 min)
@pytest.mark.parametrize(
    "command, planted",
    [
        ("polish", "mp_rank_00_model_states.pt"),
        ("resume", "mp_rank_00_model_states.pt"),
        ("resume", "rng_rank00000.pt"),
        ("check", "mp_rank_00_model_states.pt"),
    ],
)
def test_a_checkpoint_that_would_run_code_is_refused_unread(
    command, planted, finished_run, tmp_path, evidence, request
):
    """Issue 51: a run directory from elsewhere whose checkpoint pickle calls a function (here one
    that creates a file) is refused before anything unpickles it: by polish (which loads weights
    itself, weights_only), and by a resume and its --check (DeepSpeed's loader unpickles without
    weights_only: dstrain reads the pickle's opcodes first). The file never appears, the refusal
    names the checkpoint file and why, exit 2, the run directory unchanged."""
    import shutil

    if command == "polish":
        run_dir = tmp_path / "run"
        shutil.copytree(finished_run, run_dir)
        marker = tmp_path / "created-by-the-pickle"
        path = _plant(run_dir, marker, planted)
        before = tree_digest(run_dir)
        proc = run_cli(["--checkpoint", str(run_dir)], module="dstrain.polish", timeout=120)
        prefix = "dstrain.polish: error:"
    else:  # the run's main, with the other resumes refused (resumes_refused)
        case = request.getfixturevalue("resumes_refused")[f"{command}: {planted} would run code"]
        run_dir, marker, path, before, proc = (
            case.run_dir,
            case.marker,
            case.path,
            case.before,
            case.shown,
        )
        assert fence_breaches(vars(proc)) == []
        prefix = "dstrain: error:"
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert not marker.exists(), "the checkpoint's pickle ran"
    errors = [line for line in proc.stderr.splitlines() if line.startswith(prefix)]
    assert len(errors) == 1, proc.stderr[-2000:]
    assert str(path) in errors[0] and "refused: unpickling it would call io.open" in errors[0]
    assert tree_digest(run_dir) == before
    evidence(
        "bad input: checkpoint",
        f"a checkpoint whose pickle would run code ({planted}), given to {command}",
        exit=2,
        seen=errors[0],
        disk="nothing written; the pickle did not run",
    )


class _System:
    """A pickle that would run a shell command: unpickling it calls os.system(command)."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        import os

        return (os.system, (self.command,))


ZERO1 = (  # ZeRO stage 1 with dstrain's SGD: its checkpoint holds zero_pp_rank_*_optim_states.pt
    '{"optimizer": {"type": "SGD", "params": {"momentum": 0.9}}, "gradient_clipping": 0.0, '
    '"zero_optimization": {"stage": 1}}'
)


@pytest.fixture(scope="module")
def finished_zero1_run(fake_fmnist, tmp_path_factory) -> tuple[Path, Path]:
    """A finished one-epoch ZeRO stage 1 run: (its run directory, its DeepSpeed JSON)."""
    home = tmp_path_factory.mktemp("zero1")
    (home / "zero1.json").write_text(ZERO1)
    args = [JSON, str(home / "zero1.json"), *TINY, "epochs=1", f"data.root={fake_fmnist}"]
    proc = run_cli([*args, f"run_dir={home / 'run'}"])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return home / "run", home / "zero1.json"


def _plant_zero_state(run_dir: Path, marker: Path) -> tuple[Path, str]:
    """The run's own ZeRO optimizer-state file, with a call of os.system pickled beside its state."""
    import shlex

    (path,) = (run_dir / "checkpoints").glob("epoch*[0-9]/zero_pp_rank_0_*optim_states.pt")
    state = torch.load(path, map_location="cpu", weights_only=False)  # the run's own file
    state["planted"] = _System(f"touch {shlex.quote(str(marker))}")
    torch.save(state, path)
    return path, "refused: unpickling it would call posix.system"


def _plant_legacy_pickle(run_dir: Path, marker: Path) -> tuple[Path, str]:
    """A model-state file that is a plain pickle (torch.load would unpickle it as a legacy file)."""
    import pickle
    import shlex

    (path,) = (run_dir / "checkpoints").glob("epoch*[0-9]/mp_rank_00_model_states.pt")
    path.write_bytes(pickle.dumps({"module": _System(f"touch {shlex.quote(str(marker))}")}))
    return path, "refused: not a checkpoint torch.save wrote"


@pytest.fixture(scope="module")
def resumes_refused(finished_run, finished_zero1_run, fake_fmnist, tmp_path_factory) -> dict:
    """Every resume=auto (and its --check) the tests of this module expect refused, each on its
    own copy of a finished run (changed as its test says), run by the real run's ``main`` in one
    process (tests/refusals.py, as ``refused`` runs CASES; one process start instead of 11):
    name -> its run directory, that directory's digest before, the planted marker and file, and
    what the run showed (``shown``: exit status, stdout, stderr and the fence's record)."""
    import shutil

    zero1_run, zero1_json = finished_zero1_run
    cases = {}

    def case(name, extra=(), source=finished_run, json_file="ds_configs/fp32.json", plant=None):
        home = tmp_path_factory.mktemp("resume")
        run_dir, marker = home / "run", home / "created-by-the-pickle"
        shutil.copytree(source, run_dir)
        path, expected = plant(run_dir, marker) if plant else (None, None)
        args = [JSON, str(json_file), *TINY, "epochs=2", f"data.root={fake_fmnist}"]
        args += [f"run_dir={run_dir}", "resume=auto", *extra]
        before = tree_digest(run_dir)
        cases[name] = SimpleNamespace(
            run_dir=run_dir, marker=marker, path=path, expected=expected, args=args, before=before
        )

    case("a different model", ["model.width=16"])
    for name, extra, _ in INCOMPATIBLE:
        case(name, extra)
    for command in ("resume", "check"):
        check = ["--check"] if command == "check" else []
        for planted in ("mp_rank_00_model_states.pt", "rng_rank00000.pt"):
            if (command, planted) != ("check", "rng_rank00000.pt"):

                def plant(run_dir, marker, planted=planted):
                    return _plant(run_dir, marker, planted), None

                case(f"{command}: {planted} would run code", check, plant=plant)
        case(
            f"{command}: zero optimizer state planted",
            check,
            zero1_run,
            zero1_json,
            _plant_zero_state,
        )
        case(f"{command}: legacy pickle planted", check, plant=_plant_legacy_pickle)
    spec = tmp_path_factory.mktemp("refusals")
    (spec / "cases.json").write_text(json.dumps([c.args for c in cases.values()]))
    proc = run_cli(
        [str(spec / "cases.json"), str(spec / "results.json")],
        timeout=600,
        module="tests.refusals",
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    results = json.loads((spec / "results.json").read_text())
    for c, shown in zip(cases.values(), results, strict=True):
        c.shown = SimpleNamespace(**shown)
    return cases


def check_refused(case, expected: str) -> str:
    """A resume of ``resumes_refused``: exit 2, one clear line holding ``expected``, refused by
    the start-up checks (the fence), its run directory untouched; the line."""
    assert case.shown.returncode == 2, case.shown.stdout[-2000:] + case.shown.stderr[-2000:]
    line = check_one_clear_line(case.shown, expected)
    assert fence_breaches(vars(case.shown)) == []
    assert tree_digest(case.run_dir) == case.before
    return line


@SHARES_RUNS
@pytest.mark.slow  # over ~5 s on 2 cores: the full suite only (issue 42: quick loop < 3 min)
@pytest.mark.parametrize("command", ["resume", "check"])
@pytest.mark.parametrize("planted", ["zero optimizer state", "legacy pickle"])
def test_a_planted_file_deepspeed_would_unpickle_is_refused_unread(
    planted, command, resumes_refused, evidence
):
    """Files DeepSpeed's loader unpickles without weights_only, planted in a run from elsewhere:
    a ZeRO optimizer-state file (zero_pp_rank_0_mp_rank_00_optim_states.pt, whose check allows three
    DeepSpeed classes by name) that also pickles a call of os.system, and a model-state file that is
    a plain pickle, not torch's zip format (the opcode scan cannot read it; torch.load would unpickle
    it as a legacy file). A resume and its --check refuse each in one line naming the file, exit 2;
    the command never runs, the run directory is unchanged."""
    case = resumes_refused[f"{command}: {planted} planted"]
    marker, path, expected, proc = case.marker, case.path, case.expected, case.shown
    assert fence_breaches(vars(proc)) == []
    assert not marker.exists(), "the planted pickle ran"
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("dstrain: error:")]
    assert len(errors) == 1, proc.stderr[-2000:]
    assert f"{path}: {expected}" in errors[0], errors[0]
    assert tree_digest(case.run_dir) == case.before
    evidence(
        "bad input: checkpoint",
        f"a {planted} file that would run code ({path.name}), given to {command}",
        exit=2,
        seen=errors[0],
        disk="nothing written; the pickle did not run",
    )


@SHARES_RUNS
def test_checkpoints_dstrain_writes_load_as_data(finished_run):
    """Everything in a dstrain checkpoint loads with torch's weights_only loader (the RNG state's
    numpy part is a tensor now); refuse_foreign_code passes it."""
    from dstrain.core.safe_load import load_data
    from dstrain.loop import checkpoint

    (ckpt,) = (finished_run / "checkpoints").glob("epoch*[0-9]")
    checkpoint.refuse_foreign_code(ckpt)
    for path in ckpt.glob("*.pt"):
        torch.load(path, map_location="cpu", weights_only=True)
    rng = load_data(ckpt / "rng_rank00000.pt")
    assert isinstance(rng["numpy"][1], torch.Tensor)


def test_an_rng_file_from_before_issue_51_still_resumes(tmp_path):
    """RNG files written before hold numpy's key array: they load (numpy's array reconstruction is
    allowed for them alone) and restore the same numpy state."""
    import random

    import numpy as np

    from dstrain.core.safe_load import NUMPY_ARRAYS, load_data
    from dstrain.loop import checkpoint

    np.random.seed(7)
    old = {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }
    torch.save(old, tmp_path / "rng_rank00000.pt")  # as checkpoint.rng_state wrote it then
    expected = np.random.random(3)
    np.random.seed(0)
    checkpoint.set_rng_state(load_data(tmp_path / "rng_rank00000.pt", NUMPY_ARRAYS))
    assert np.array_equal(np.random.random(3), expected)


@pytest.mark.parametrize("entry", ["python -m dstrain", "python dstrain/main.py"])
def test_help_config_lists_keys_with_units(entry):
    launcher = [sys.executable] if entry.endswith("main.py") else None
    proc = run_cli(["--help-config"], launcher=launcher, timeout=120)
    assert proc.returncode == 0
    assert (
        "optim.warmup_epochs (float, default 0.0): warmup length (epochs, fractions allowed)"
        in proc.stdout
    )
    assert "fault.collective_timeout_s (float, default 600.0)" in proc.stdout
    # and the JSON side: each optimizer type's parameters, the dstrain_communication block
    assert "optimizer.params.trust_coefficient (float, default 0.001): eta" in proc.stdout
    keys = [line.split(" ", 1)[0] for line in proc.stdout.splitlines()]
    assert "optimizer.params.lr" not in keys  # the LR's one home is optim.base_lr
    assert "optim.base_lr (float, default 0.1)" in proc.stdout
    assert "dstrain_communication.bucket_mb (float, default 25.0)" in proc.stdout


@pytest.mark.parametrize(
    "args, expected",
    [
        (["epochs=abc"], "bad value for 'epochs'"),
        (["--config", "no_such_recipe"], "no such file or recipe"),
        (["optim.base_lrr=0.1"], "optim.base_lrr"),
    ],
)
def test_a_config_error_is_reported_without_importing_torch(args, expected):
    """A typo in the recipe or an override is refused before torch (1.6 s a process, quiet:
    results/bench/startup_cpu.json) or DeepSpeed is imported: the logging set-up is torch-free."""
    code = (
        "import sys; from dstrain.main import main; rc = main(sys.argv[1:]); "
        "print(rc, sorted({'torch', 'deepspeed'} & set(sys.modules)))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, *args], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert proc.stdout.strip().splitlines()[-1] == "2 []", proc.stdout + proc.stderr
    check_one_clear_line(proc, expected)


# run where the process ends: an object in a reference cycle whose finaliser writes a line, which
# the interpreter's teardown at exit would collect
FINALISED = (
    "import os\n"
    "class Cycle:\n"
    "    def __del__(self):\n"
    "        os.write(1, b'finalised at exit\\n')\n"
    "cycle = Cycle()\n"
    "cycle.me = cycle\n"
)


@pytest.mark.parametrize(
    "entry, args",
    [
        ("module:dstrain", ["epochs=abc"]),
        ("path:dstrain/main.py", ["epochs=abc"]),  # as DeepSpeed's launcher starts a rank
        ("module:dstrain.evaluate", ["--checkpoint", "/no/such/run"]),
        ("module:dstrain.polish", ["--checkpoint", "/no/such/run"]),
        ("module:dstrain.export", ["--checkpoint", "/no/such/run"]),
    ],
)
def test_every_command_exits_with_its_status_without_the_interpreters_teardown(entry, args):
    """dstrain/core/process.py: a command's status is the exit status, and the process ends
    without the interpreter's teardown of its heap (half a second a process holding torch and DeepSpeed:
    results/bench/startup_cpu.json)."""
    how, target = entry.split(":")
    run = f"runpy.run_module({target!r}, run_name='__main__', alter_sys=True)"
    if how == "path":
        run = f"runpy.run_path({target!r}, run_name='__main__')"
    code = f"{FINALISED}import runpy, sys\nsys.argv = ['{target}', *sys.argv[1:]]\n{run}\n"
    proc = subprocess.run(
        [sys.executable, "-c", code, *args], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count(": error: ") == 1, proc.stderr  # the command's own refusal
    assert "finalised at exit" not in proc.stdout


@pytest.mark.parametrize(
    "world, status, torn_down", [("1", 0, False), ("1", 2, False), ("2", 0, False), ("2", 2, True)]
)
def test_only_a_failing_rank_of_a_multi_rank_job_waits_for_the_teardown(world, status, torn_down):
    """A rank of a job that fails ends as Python ends it: DeepSpeed's launcher kills the other ranks
    as soon as one exits with an error, and they are then still saying why they stop."""
    code = FINALISED + f"from dstrain.core import process\nprocess.run(lambda: {status})\n"
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "WORLD_SIZE": world},
    )
    assert proc.returncode == status
    assert ("finalised at exit" in proc.stdout) == torn_down


def test_a_commands_exit_runs_its_threads_and_atexit_handlers_then_skips_the_teardown(tmp_path):
    code = FINALISED + (
        "import atexit, ctypes, logging, sys, threading, time\n"
        "from dstrain.core import process\n"
        "def main():\n"
        "    atexit.register(print, 'atexit handler ran')\n"
        "    threading.Thread(target=lambda: (time.sleep(0.5), print('thread ended'))).start()\n"
        "    logging.basicConfig(filename=sys.argv[1])\n"
        "    logging.warning('logged')\n"
        "    sys.stdout.write('unflushed ')\n"
        "    libc = ctypes.CDLL(None)\n"  # a native library's file, written through C stdio
        "    libc.fopen.restype = ctypes.c_void_p\n"
        "    libc.fputs(b'from C', ctypes.c_void_p(libc.fopen(sys.argv[2].encode(), b'w')))\n"
        "    return 3\n"
        "process.run(main)\n"
    )
    log, native = tmp_path / "log.txt", tmp_path / "native.txt"
    proc = subprocess.run(
        [sys.executable, "-c", code, str(log), str(native)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 3
    assert proc.stdout.splitlines() == ["unflushed thread ended", "atexit handler ran"]
    assert log.read_text() == "WARNING:root:logged\n"
    assert native.read_text() == "from C"  # its C buffer flushed, as exit() would
    # a command that raises ends as Python ends it: its teardown finalises the cycle
    raising = FINALISED + "from dstrain.core import process\nprocess.run(lambda: 1 / 0)\n"
    proc = subprocess.run(
        [sys.executable, "-c", raising], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 1 and "ZeroDivisionError" in proc.stderr
    assert "finalised at exit" in proc.stdout
