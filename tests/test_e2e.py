"""End-to-end runs through the real entry points (slow: tens of seconds each)."""

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import CPU_ONLY, TINY, deepspeed_launcher, run_cli

pytestmark = pytest.mark.slow


def final_module_state(run_dir: Path) -> dict:
    ckpt = run_dir / "checkpoints"
    tag = (ckpt / "latest").read_text().strip()
    return torch.load(ckpt / tag / "mp_rank_00_model_states.pt", weights_only=True)["module"]


@pytest.mark.oldest
@pytest.mark.xdist_group("hosts")  # the worker that trains tiny_on_two_ranks (conftest) for others
def test_two_rank_cpu_run_through_the_deepspeed_launcher(tiny_on_two_ranks):
    proc, run_dir = tiny_on_two_ranks, tiny_on_two_ranks.run_dir
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    hist = summary["history"]
    assert (
        summary["world_size"] == 2
        and summary["epochs"] == 3
        and summary["steps"] == 3 * (512 // 32)
    )
    assert hist[-1]["train_loss"] < 0.7 * hist[0]["train_loss"], hist
    assert summary["final_top1"] > 0.4
    # distributed eval: each of the 301 val images counted exactly once across the two ranks
    assert all(h["val_images"] == 301 for h in hist)
    assert summary["gpu_time_s"] == pytest.approx(2 * summary["wall_time_s"])
    for name in ("config.yaml", "ds_config.json", "meta.json"):
        assert (run_dir / name).is_file(), name
    meta = json.loads((run_dir / "meta.json").read_text())
    assert meta["world_size"] == 2 and meta["git_sha"]
    used = json.loads((run_dir / "ds_config.json").read_text())
    assert used["train_batch_size"] == 32 and used["train_micro_batch_size_per_gpu"] == 16
    assert list((run_dir / "tb").glob("events.out.tfevents.*"))
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "epoch0003"
    assert (run_dir / "checkpoints" / "epoch0003" / "rng_rank00001.pt").is_file()
    assert "epoch 3/3 done" in proc.stdout
    # the plan's lines, as --check prints them: the LR's one home, optim.base_lr
    assert "optim.base_lr 0.2 per 256 images, none scaling" in proc.stdout
    assert "job          2 rank(s) on cpu" in proc.stdout


@pytest.mark.xdist_group("hosts")  # the worker that trains tiny_on_two_ranks (conftest) for others
def test_the_noise_scale_of_two_ranks_is_that_of_one_rank_accumulating(
    tiny_on_two_ranks, fake_fmnist, tmp_path
):
    """The gradient noise scale measured on 2 gloo ranks of 16 images each (each rank's micro
    batch against the all-reduced gradient) equals one rank's over the same images in 2
    accumulated micro batches of 16 (each micro batch's gradient against the step's): the same
    estimates, window by window, in TensorBoard, the history and summary.json."""
    from tests.conftest import ONE_THREAD

    run_dir = tmp_path / "one"
    args = ["--deepspeed_config", "ds_configs/fp32.json", *TINY, f"data.root={fake_fmnist}"]
    proc = run_cli(
        [*args, "batch.micro_per_rank=16", f"run_dir={run_dir}"], env={**CPU_ONLY, **ONE_THREAD}
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    two = json.loads((tiny_on_two_ranks.run_dir / "summary.json").read_text())
    one = json.loads((run_dir / "summary.json").read_text())
    assert one["noise_scale"]["noise_b_small"] == two["noise_scale"]["noise_b_small"] == 16
    assert one["noise_scale"]["noise_b_big"] == two["noise_scale"]["noise_b_big"] == 32
    assert one["noise_scale"]["steps_measured"] == 12  # every 4th of 48 steps
    for key in ("noise_scale", "noise_grad_sq", "noise_trace"):
        assert one["noise_scale"][key] == pytest.approx(two["noise_scale"][key], rel=1e-6), key
    per_epoch = [[h["noise_scale"] for h in s["history"]] for s in (one, two)]
    assert per_epoch[0] == pytest.approx(per_epoch[1], rel=1e-6)
    windows = [tb_scalars(r)["train/noise_scale"] for r in (run_dir, tiny_on_two_ranks.run_dir)]
    assert [s for s, _ in windows[0]] == [s for s, _ in windows[1]] == list(range(4, 49, 4))
    assert [v for _, v in windows[0]] == pytest.approx([v for _, v in windows[1]], rel=1e-5)
    lines = [line for line in proc.stdout.splitlines() if "img/s  B_noise " in line]
    assert len(lines) == 12 and "noise scale  B_noise every 4 step(s)" in proc.stdout


def tb_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of the run's TensorBoard files: tag -> [(step, value), ...]."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.mark.gpu  # 1 rank: on cuda:0 on a GPU node (bf16 autocast, LAMB, DeepSpeed's CUDA start)
def test_single_process_bf16_lamb_run_logs_every_scalar(fake_fmnist, tmp_path):
    run_dir = tmp_path / "run"
    proc = run_cli(
        [
            "--deepspeed_config",
            "ds_configs/lamb_bf16.json",
            *TINY,
            "epochs=2",
            "optim.base_lr=0.01",
            "model.bn_span=8",  # BN span under bf16 autocast
            f"data.root={fake_fmnist}",
            f"run_dir={run_dir}",
        ],
        env={"DS_ACCELERATOR": None},  # as a user starts it: DeepSpeed left to find the device
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # a quiet start: none of DeepSpeed's op-build chatter or CPU/CUDA warnings (dist.quiet_deepspeed)
    console = proc.stdout + proc.stderr
    for noise in ("built successfully", "CUDA_HOME", "Setting accelerator", "gcc ", "-laio"):
        assert noise not in console, (noise, console[-3000:])
    assert f"TensorBoard: tensorboard --logdir {run_dir / 'tb'}" in console  # how to watch it
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (
        summary["final_top1_epoch"] == 2
        and summary["final_top1"] == summary["history"][-1]["val_top1"]
    )
    scalars = tb_scalars(run_dir)
    # every epoch scalar holds, per epoch, the value summary.json records for that epoch
    for key in ("train_loss", "train_top1", "train_top5", "val_top1", "val_top5", "val_loss"):
        logged = scalars[f"epoch/{key}"]
        assert [step for step, _ in logged] == [1, 2], key
        want = [h[key] for h in summary["history"]]
        assert [v for _, v in logged] == pytest.approx(want, rel=1e-6), key
    assert [s for s, _ in scalars["epoch/epoch_time_s"]] == [1, 2]
    # step scalars every log.every_steps=4 optimizer steps (512 images / 32 = 16 steps per epoch)
    for key in ("train/loss", "train/lr", "train/global_batch", "train/images_per_sec"):
        assert [s for s, _ in scalars[key]] == list(range(4, 33, 4)), key
    assert {v for _, v in scalars["train/global_batch"]} == {32}
    assert all(v > 0 for _, v in scalars["train/images_per_sec"])
    lrs = [v for _, v in scalars["train/lr"]]  # peak 0.01 after 4 warmup steps, then decaying to 0
    assert lrs[0] == pytest.approx(0.01) and lrs == sorted(lrs, reverse=True) and lrs[-1] < 1e-3
    assert summary["precision"] == "autocast-bfloat16"
    assert "Lamb: dstrain's multi-tensor LAMB" in proc.stdout
    assert "normalise over groups of 8 images" in proc.stdout
    assert summary["history"][-1]["train_loss"] < summary["history"][0]["train_loss"]


@pytest.mark.parametrize(
    "extra",
    [
        # 2 micro batches a step: the gradient noise scale is measured, and the batch follows it
        # (32 -> 64 after epoch 1: killed in epoch 2, steps 17-24), resumed
        pytest.param(
            ["--deepspeed_config", "ds_configs/fp32.json", "batch.micro_per_rank=16"]
            + ["batch.follow_noise=true", "batch.noise_cap=64"],
            id="sgd",
        ),
        pytest.param(
            [
                "--deepspeed_config",
                "ds_configs/lars_fp32.json",
                "optim.base_lr=20",
                "batch.micro_per_rank=16",
                "batch.ramp=[[1,64]]",
                "optim.wd_follows_lr=true",
                "model.channels_last=true",
                "model.bn_span=8",
            ],
            id="lars-ramp-channels-last-bn-span",
            # bit for bit on cuda:0 (deterministic cuDNN, NHWC, the CUDA RNG in the checkpoint); the
            # sgd case's GPU path is the same, in 42 s on 2 cores against this one's 24 s
            marks=pytest.mark.gpu,
        ),
    ],
)
@pytest.mark.oldest
def test_kill_and_resume_reaches_the_same_weights(fake_fmnist, tmp_path, extra):
    """Killed at step 21: in epoch 2 (batch 64 from epoch 2, steps 17-24: sgd's following the
    noise scale, lars-ramp's fixed)."""
    common = [*TINY, f"data.root={fake_fmnist}", "checkpoint.every_epochs=1", *extra]
    straight, broken = tmp_path / "straight", tmp_path / "broken"
    assert run_cli(common + [f"run_dir={straight}"]).returncode == 0
    killed = run_cli(common + [f"run_dir={broken}"], env={"DSTRAIN_FAULT_KILL_AT_STEP": "21"})
    assert killed.returncode == -9, killed.stdout[-2000:] + killed.stderr[-2000:]
    assert (broken / "checkpoints" / "latest").read_text().strip() == "epoch0001"
    refused = run_cli(common + [f"run_dir={broken}"])
    assert refused.returncode == 2 and "resume=auto" in refused.stderr
    resumed = run_cli(common + [f"run_dir={broken}", "resume=auto"])
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout
    a, b = final_module_state(straight), final_module_state(broken)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    sa = json.loads((straight / "summary.json").read_text())
    sb = json.loads((broken / "summary.json").read_text())
    assert sa["final_top1"] == sb["final_top1"] and sb["steps"] == sa["steps"]
    # the noise scale's moving averages, and the batch that follows them, continue exactly
    assert sa["noise_scale"] == sb["noise_scale"]
    assert [h.get("noise_scale") for h in sa["history"]] == [
        h.get("noise_scale") for h in sb["history"]
    ]
    if "batch.follow_noise=true" in extra:
        assert [h["global_batch"] for h in sb["history"]] == [32, 64, 64]
        assert "batch.follow_noise: B_noise" in killed.stdout  # decided before the kill
        assert "epoch 2: global batch -> 64" in resumed.stdout  # rebuilt from the train state


def test_zero_stage_1_with_dstrains_sgd_trains_and_resumes_bit_for_bit(fake_fmnist, tmp_path):
    """ZeRO stage 1 with dstrain's (element-wise) SGD: DeepSpeed refused it as an untested
    optimizer, and dstrain's foreign-code check refused its optimizer-state file at resume (it
    pickles three DeepSpeed records). Killed at step 21 and resumed, it ends where a straight run
    does."""
    zero1 = tmp_path / "zero1.json"
    zero1.write_text(
        '{"optimizer": {"type": "SGD", "params": {"momentum": 0.9}}, "gradient_clipping": 0.0, '
        '"zero_optimization": {"stage": 1}}'
    )
    common = [*TINY, f"data.root={fake_fmnist}", "checkpoint.every_epochs=1"]
    common += ["--deepspeed_config", str(zero1)]
    straight, broken = tmp_path / "straight", tmp_path / "broken"
    done = run_cli(common + [f"run_dir={straight}"])
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    killed = run_cli(common + [f"run_dir={broken}"], env={"DSTRAIN_FAULT_KILL_AT_STEP": "21"})
    assert killed.returncode == -9
    resumed = run_cli(common + [f"run_dir={broken}", "resume=auto"])
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    a, b = final_module_state(straight), final_module_state(broken)
    for key in a:
        assert torch.equal(a[key], b[key]), key
    tag = (broken / "checkpoints" / "latest").read_text().strip()
    assert list((broken / "checkpoints" / tag).glob("zero_pp_rank_0_*optim_states.pt"))


def test_lars_warmup_smoothing_and_ramp_follow_the_plan_on_two_ranks(fake_fmnist, tmp_path):
    """LARS + hybrid warmup + label smoothing + a two-step ramp through `deepspeed --num_gpus 2`,
    with BN over both ranks' spans (model.bn_group=2, bn_span=8: 16 images) in NHWC, refit after."""
    from omegaconf import OmegaConf
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = tmp_path / "run"
    proc = run_cli(
        [
            "--deepspeed_config",
            "ds_configs/lars_fp32.json",
            *TINY,
            f"data.root={fake_fmnist}",
            f"run_dir={run_dir}",
            "optim.base_lr=40",
            "optim.lr_scaling=linear",
            "optim.warmup=hybrid",
            "optim.warmup_epochs=1.5",
            "optim.decay=poly",
            "optim.label_smoothing=0.1",
            "batch.micro_per_rank=16",
            "batch.ramp=[[2,64]]",
            "log.every_steps=1",
            "model.channels_last=true",
            "model.bn_span=8",
            "model.bn_group=2",
            "polish.enabled=true",
            "polish.images=128",
        ],
        launcher=deepspeed_launcher(2),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "epoch 3: global batch -> 64 (2 accumulation steps)" in proc.stdout
    assert "normalise over ranks 0-1 (groups of 2 consecutive ranks)" in proc.stdout
    o = OmegaConf.load(run_dir / "config.yaml").optim  # the shape settings left at their defaults
    sf, f, end_factor, power = (
        o.warmup_start_factor,
        o.hybrid_exp_fraction,
        o.end_lr_factor,
        o.poly_power,
    )

    def expected_lr(t: float, batch: int) -> float:
        """The schedule written out from its definition (docs/usage.md's techniques table), not
        through dstrain.techniques.schedule: the step ending at progress t (epochs) with global batch B."""
        peak = 40 * batch / 256  # optim.base_lr=40 per 256 images (it wins over the JSON's lr)
        if t <= 1.5:  # hybrid warmup: exponential from sf x peak to the base LR, then linear
            x, start, low = t / 1.5, min(40, peak), peak * sf
            if x < f:
                return low * (start / low) ** (x / f)
            return start + (peak - start) * (x - f) / (1 - f)
        p = (t - 1.5) / (3 - 1.5)  # poly decay over the remaining 1.5 epochs
        return peak * end_factor + (peak - peak * end_factor) * (1 - p) ** power

    assert expected_lr(1.5, 32) == pytest.approx(5.0) and expected_lr(3, 64) == pytest.approx(
        10 * end_factor
    )
    acc = EventAccumulator(str(run_dir / "tb"))
    acc.Reload()
    batches = {e.step: e.value for e in acc.Scalars("train/global_batch")}
    lrs = {e.step: e.value for e in acc.Scalars("train/lr")}
    plan = [(0, 32, 16), (1, 32, 16), (2, 64, 8)]  # (epoch, global batch, steps): 512 images
    step = 0
    for epoch, batch, steps in plan:
        for k in range(steps):
            step += 1
            assert batches[step] == batch, (step, batches[step])
            assert lrs[step] == pytest.approx(
                expected_lr(epoch + (k + 1) / steps, batch), rel=1e-5
            ), step
    assert max(batches) == step == 40
    # LARS's per-tensor trust ratios, every logged step: min <= median <= max, all positive
    trust = {
        key: {e.step: e.value for e in acc.Scalars(f"train/trust_{key}")}
        for key in ("min", "median", "max")
    }
    assert sorted(trust["median"]) == list(range(1, 41))
    assert all(0 < trust["min"][k] <= trust["median"][k] <= trust["max"][k] for k in range(1, 41))
    assert "  trust " in proc.stdout  # and on the console line
    summary = json.loads((run_dir / "summary.json").read_text())
    assert [h["global_batch"] for h in summary["history"]] == [32, 32, 64]
    assert [h["steps_per_epoch"] for h in summary["history"]] == [16, 16, 8]
    assert summary["history"][-1]["train_loss"] < summary["history"][0]["train_loss"]
    # the refit: one group's batch per forward (16 x 2 ranks' worth of images on each rank)
    assert summary["polish"]["images"] == 128 and summary["polish"]["batch_per_rank"] == 32


FOLDER = [
    "--config",
    "fashion_mnist",
    "data.dataset=imagefolder",
    "model.in_channels=3",
    "model.num_classes=3",
    "model.width=8",
    "data.image_size=16",
    "data.val_resize=20",
    "data.num_workers=1",
    "batch.global_size=12",
    "batch.eval_per_rank=4",
    "optim.base_lr=0.1",
    "epochs=2",
    "log.every_steps=1",
]


@pytest.mark.parametrize(
    "loader, ranks",
    [
        ("dali", 2),  # 2 ranks: CPU ranks on a 1-GPU node (rank_env), as here
        # 1 rank: on cuda:0 on a GPU node, the batches pinned and copied without blocking
        pytest.param("torchvision", 1, marks=pytest.mark.gpu),
    ],
)
def test_image_folder_run(loader, ranks, jpeg_folder, tmp_path):
    run_dir = tmp_path / "run"
    proc = run_cli(
        [
            "--deepspeed_config",
            "ds_configs/fp32.json",
            *FOLDER,
            f"data.loader={loader}",
            f"data.root={jpeg_folder}",
            f"run_dir={run_dir}",
            "model.channels_last=true",
        ],
        launcher=deepspeed_launcher(ranks) if ranks > 1 else None,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"{loader} loader, 24 train / 9 val images" in proc.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 2 * 2 and summary["world_size"] == ranks
    assert all(h["val_images"] == 9 for h in summary["history"])  # each val image once across ranks


@pytest.mark.gpu  # one rank: DALI decodes on the GPU (mixed, nvJPEG) on a GPU node
def test_corrupt_image_stops_the_run_with_one_line(tmp_path, evidence):
    from tests.conftest import make_jpeg_folder

    pytest.importorskip("nvidia.dali", reason="needs DALI (on a GPU node: all of .gpu/dali-N)")

    root = make_jpeg_folder(tmp_path / "data", per_class=4, val_per_class=1)
    bad = root / "train" / "cat" / "002.JPEG"
    bad.write_bytes(b"\xff\xd8\xff\xe0 truncated")
    proc = run_cli(
        [
            "--deepspeed_config",
            "ds_configs/fp32.json",
            *FOLDER,
            "data.loader=dali",
            f"data.root={root}",
            f"run_dir={tmp_path / 'run'}",
        ]
    )
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("dstrain: error:")]
    from PIL import Image

    try:  # the decode error itself, found here independently of dstrain
        with Image.open(bad) as img:
            img.load()
        raise AssertionError("the truncated file decodes")
    except OSError as err:
        reason = str(err)
    assert len(errors) == 1 and errors[0].startswith(
        f"dstrain: error: corrupt image: {bad} ({reason}"
    ), errors
    assert "no longer valid" not in errors[0] and "more nearby" not in errors[0]
    assert "Replace or delete the file" in errors[0] and "Traceback" not in proc.stderr
    run_dir = tmp_path / "run"
    assert not (run_dir / "checkpoints").exists()
    assert json.loads((run_dir / "ranks" / "rank00000.json").read_text())["state"] == "bad_input"
    # no checkpoint: the run directory is marked failed, with the error, and read as "no run here"
    failed = json.loads((run_dir / "failed.json").read_text())
    assert failed["exit_code"] == 2 and str(bad) in failed["message"]
    polish = run_cli(["--checkpoint", str(run_dir)], module="dstrain.polish", timeout=120)
    assert polish.returncode == 2 and "failed before its first checkpoint" in polish.stderr
    evidence(
        "bad input: data",
        "a truncated JPEG in the training set (found when decoded)",
        exit=2,
        seen=errors[0],
        disk="run directory marked failed (failed.json with the error), no checkpoint",
    )
    # the image mended, the same command with resume=auto starts over in the marked directory
    bad.write_bytes((root / "train" / "cat" / "001.JPEG").read_bytes())
    again = run_cli(
        [
            "--deepspeed_config",
            "ds_configs/fp32.json",
            *FOLDER,
            "data.loader=dali",
            f"data.root={root}",
            f"run_dir={run_dir}",
            "resume=auto",
        ]
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert "failed before its first checkpoint" in again.stdout + again.stderr
    assert not (run_dir / "failed.json").exists() and (run_dir / "summary.json").is_file()


def test_cpu_channels_last_hazard_is_detected_by_shape():
    from dstrain.techniques.models import build_model, cpu_channels_last_hazards

    narrow = build_model("resnet_small", 10, in_channels=1, width=4)
    assert cpu_channels_last_hazards(narrow) == [
        "layers.1.shortcut.0"
    ]  # the 4 -> 8 strided 1x1 conv
    assert cpu_channels_last_hazards(build_model("resnet_small", 10, in_channels=1, width=8)) == []
    assert cpu_channels_last_hazards(build_model("resnet18", 10)) == []


def test_a_narrow_channels_last_model_trains_on_cpu_instead_of_crashing(fake_fmnist, tmp_path):
    """width 4 + channels_last made oneDNN's NHWC backward corrupt memory (segfault, abort, hang) with
    torch 2.15.0 on 1 thread; the trainer trains such a model in NCHW and says why."""
    proc = run_cli(
        [
            "--deepspeed_config",
            "ds_configs/fp32.json",
            *TINY,
            "epochs=1",
            "model.width=4",
            "model.channels_last=true",
            f"data.root={fake_fmnist}",
            f"run_dir={tmp_path / 'run'}",
        ],
        env={"OMP_NUM_THREADS": "1", **CPU_ONLY},  # the hazard is the CPU's: tested on every node
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "training in NCHW instead" in proc.stdout and "layers.1.shortcut.0" in proc.stdout


@pytest.mark.parametrize("loader", ["dali", "torchvision"])
def test_corrupt_image_under_two_ranks_is_one_error_line(tmp_path, loader):
    """The rank that decodes the file prints the error; its peer loses contact and reports that on
    stdout, not as a second error line on stderr (the user would read the same bad input twice)."""
    from tests.conftest import make_jpeg_folder

    root = make_jpeg_folder(tmp_path / "data", per_class=4, val_per_class=1)
    bad = root / "train" / "cat" / "002.JPEG"
    bad.write_bytes(b"\xff\xd8\xff\xe0 truncated")
    proc = run_cli(
        [*FOLDER, f"data.loader={loader}", f"data.root={root}", f"run_dir={tmp_path / 'run'}"],
        launcher=deepspeed_launcher(2),
    )
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if ": error:" in line]
    assert len(errors) == 1 and f"error: corrupt image: {bad}" in errors[0], proc.stderr[-3000:]
    # the other rank still says why it stopped, naming the rank and the file, where logs go
    assert "stopped: lost contact with another rank" in proc.stdout and str(bad) in proc.stdout
