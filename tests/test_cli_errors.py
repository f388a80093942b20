"""Bad input through the real command line: one clear line, exit 2, no traceback, nothing written."""
import sys

import pytest

from tests.conftest import TINY, run_cli

BAD_JSON = '{\n  "gradient_clipping": 0.0,\n  "optimizer": {"type": "SGD" "params": {}}\n}\n'


def case_files(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(BAD_JSON)
    bf16 = tmp_path / "bf16_cast.json"
    bf16.write_text('{"bf16": {"enabled": true}, "gradient_clipping": 0.0}')
    grid = tmp_path / "grid.json"
    grid.write_text('{"gradient_clipping": 0.0, "dstrain_communication": {"mode": "torus2d", "grid": [2, 2]}}')
    return {"bad_json": str(bad), "bf16_cast": str(bf16), "grid": str(grid)}


CASES = [
    # id, extra args (formatted with {data}, {bad_json}, {tmp}), text the error line must contain
    ("missing data directory", ["data.root={tmp}/no-such-dir", "data.download=false"],
     "apt-get install dataset-fashion-mnist"),
    ("malformed JSON", ["--deepspeed_config", "{bad_json}"], "bad.json:3:"),
    ("missing JSON", ["--deepspeed_config", "ds_configs/nope.json"], "ds_configs/nope.json: no such file"),
    ("unknown key", ["optim.warmup_epoch=5"], "unknown config key 'optim.warmup_epoch'"),
    ("wrong type", ["epochs=three"], "bad value for 'epochs'"),
    ("fp16 without GPU", ["--deepspeed_config", "ds_configs/fp16.json"], "ds_configs/fp32.json"),
    ("batch not divisible", ["batch.global_size=32", "batch.micro_per_rank=12"],
     "batch.micro_per_rank=12 does not divide"),
    ("bf16 cast with BatchNorm on CPU", ["--deepspeed_config", "{bf16_cast}"], "Use ds_configs/bf16.json"),
    ("unknown recipe", ["--config", "nope"], "no such file or recipe"),
    ("unknown model", ["model.name=resnet_tiny"], "model.name='resnet_tiny'"),
    ("image folder without a root", ["data.dataset=imagefolder", "data.root=''"], "needs data.root=DIR"),
    ("image folder without val/", ["data.dataset=imagefolder", "data.root={tmp}"], "missing"),
    ("DALI for Fashion-MNIST", ["data.loader=dali"], "served from memory"),
    ("unknown loader", ["data.loader=ffcv"], "data.loader='ffcv'"),
    ("impossible crop area", ["data.random_area=[0.5,0.1]"], "data.random_area=[0.5, 0.1]"),
    ("synthetic as a data set", ["data.dataset=synthetic"], "data.loader=synthetic"),
    ("torus grid larger than the world", ["--deepspeed_config", "{grid}"],
     "grid=[2, 2] needs 4 ranks but the world size is 1"),
]


@pytest.mark.parametrize("name, extra, expected", CASES, ids=[c[0] for c in CASES])
def test_bad_input_gives_one_clear_line(name, extra, expected, fake_fmnist, tmp_path):
    subs = {"data": str(fake_fmnist), "tmp": str(tmp_path), **case_files(tmp_path)}
    run_dir = tmp_path / "run"
    args = ["--deepspeed_config", "ds_configs/fp32.json", *TINY, f"data.root={fake_fmnist}", f"run_dir={run_dir}"]
    args += [a.format(**subs) for a in extra]
    proc = run_cli(args, timeout=120)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("dstrain: error:")]
    assert len(errors) == 1 and expected in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert not run_dir.exists(), "a failed start must not create the run directory"


def test_existing_run_dir_is_not_overwritten(fake_fmnist, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "summary.json").write_text("precious")
    proc = run_cli(["--deepspeed_config", "ds_configs/fp32.json", *TINY, f"data.root={fake_fmnist}",
                    f"run_dir={run_dir}"], timeout=120)
    assert proc.returncode == 2 and "resume=auto" in proc.stderr
    assert (run_dir / "summary.json").read_text() == "precious"


@pytest.mark.parametrize("entry", ["python -m dstrain", "python dstrain/main.py"])
def test_help_config_lists_keys_with_units(entry):
    launcher = [sys.executable] if entry.endswith("main.py") else None
    proc = run_cli(["--help-config"], launcher=launcher, timeout=120)
    assert proc.returncode == 0
    assert "optim.warmup_epochs (float, default 0.0): warmup length (epochs, fractions allowed)" in proc.stdout
