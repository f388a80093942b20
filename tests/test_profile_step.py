"""bench/profile_step.py: the CPU smoke through the real Trainer, its refusals, and its reading of a
CUDA trace (hand-made here: this machine has no GPU, and the H100 run must not be the first to
read one)."""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import CPU_ONLY
from tests.test_bench import described

REPO = Path(__file__).resolve().parent.parent
SMOKE = [
    "--model",
    "resnet18",
    "--batch",
    "8",
    "--image-size",
    "32",
    "--steps",
    "3",
    "--warmup",
    "1",
    "--precision",
    "fp32",
    "--compile",
    "off",
]


def profile_step(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "bench/profile_step.py", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1", **CPU_ONLY},
    )


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location(
        "bench_profile_step", REPO / "bench/profile_step.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # ~7 s on 2 cores (one torch thread): two loops of ResNet-18, DeepSpeed
def test_cpu_smoke_profiles_both_loops_and_finds_the_log_window_reads(tmp_path):
    """--log-every 2: of the 3 profiled steps (epoch steps 3-5, after 1 warm-up step and the
    profiler's own), step 4 ends with the log window. FP32 on one rank: a dstrain step reads
    nothing on the host; the window reads the NaN/inf flag and the window's loss (no loss scale)."""
    out, traces = tmp_path / "profile.json", tmp_path / "traces"
    proc = profile_step(*SMOKE, "--log-every", "2", "--out", str(out), "--trace", str(traces))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = described(out)
    assert result["settings"]["log_window_steps"] == [1]
    assert result["environment"]["git_sha"] and result["environment"]["deepspeed"]
    for name, loop in result["loops"].items():
        assert loop["steps"] == len(loop["steps_detail"]) == 3, name
        assert all(row["host_ms"] > 0 for row in loop["steps_detail"]), name
        assert loop["per_step"]["wall_ms"] > 0 and loop["per_step"]["period_ms"] > 0, name
        assert loop["per_step"]["kernels"] is None, name  # no device: no kernels, no device time
        top = loop["top_operators"]
        assert top["by_self_cpu"] and all(op["calls_per_step"] > 0 for op in top["by_self_cpu"])
        assert top["by_self_device"] == [] and top["kernels"] == []
        groups = loop["groups"]
        assert groups["autograd.backward"]["calls"] == groups["torch.optimizer.step"]["calls"] == 1
        assert Path(loop["trace"]["path"]).stat().st_size == loop["trace"]["bytes"] < 2**20
    bare, ours = result["loops"]["bare"], result["loops"]["dstrain"]
    assert bare["sync_sites"] == {} and bare["log_windows"] == 0
    assert ours["log_windows"] == 1 and ours["steps_detail"][1]["log_window"]
    assert ours["per_step"]["host_syncs_outside_log_window"] == 0
    assert ours["sync_sites"] == {
        "dstrain.log_window > dstrain.check_finite > aten::item > aten::_local_scalar_dense": 1,
        "dstrain.log_window > dstrain.take_window > aten::item > aten::_local_scalar_dense": 1,
    }
    assert result["dstrain_minus_bare"]["per_step"]["host_reads"] == pytest.approx(2 / 3)
    for label in ("deepspeed.forward", "deepspeed.backward", "deepspeed.step", "dstrain.metrics"):
        assert ours["groups"][label]["calls"] == 1, label
    assert ours["groups"]["dstrain.progress_line"]["calls"] == pytest.approx(1 / 3)
    assert "epoch 1/1 step 4/5  loss" in proc.stdout  # the window's progress line was written
    with gzip.open(ours["trace"]["path"]) as fh:
        names = [e.get("name") for e in json.load(fh)["traceEvents"]]
    assert names.count("dstrain.step") == 3 and names.count("dstrain.log_window") == 1


@pytest.mark.parametrize(
    "args, says",
    [
        (["--precision", "fp16_native"], "native fp16 engine has no bare twin"),
        (["--steps", "0"], "--steps 0: must be >= 1"),
        (["--compile", "maybe"], "argument --compile: invalid choice"),
    ],
)
def test_bad_arguments_are_refused_in_one_line(args, says):
    proc = profile_step(*args)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and says in proc.stderr, proc.stderr


def cuda_trace() -> list[dict]:
    """Two dstrain steps as the CUDA profiler writes them: the forward launched from the main
    thread (runtime API) and by inductor (driver API), the backward from autograd's device thread,
    and a log window whose .item() copies device-to-host and waits."""
    main, autograd, stream = {"pid": 1, "tid": 1}, {"pid": 1, "tid": 2}, {"pid": 0, "tid": 7}

    def span(cat, name, ts, dur, where, corr=None):
        args = {} if corr is None else {"correlation": corr, "External id": 99}
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, **where, "args": args}

    return [
        span("user_annotation", "dstrain.step", 0, 100, main),
        span("user_annotation", "deepspeed.forward", 5, 10, main),
        span("cuda_runtime", "cudaLaunchKernel", 6, 1, main, corr=1),
        span("cuda_driver", "cuLaunchKernel", 8, 1, main, corr=2),
        span("user_annotation", "deepspeed.backward", 20, 40, main),
        span("cuda_runtime", "cudaLaunchKernel", 25, 1, autograd, corr=3),
        span("user_annotation", "dstrain.step", 100, 100, main),
        span("user_annotation", "dstrain.log_window", 150, 40, main),
        span("cpu_op", "aten::item", 155, 30, main),
        span("cpu_op", "aten::_local_scalar_dense", 156, 28, main),
        span("cuda_runtime", "cudaMemcpyAsync", 157, 2, main, corr=4),
        span("cuda_runtime", "cudaStreamSynchronize", 160, 20, main, corr=5),
        span("cuda_runtime", "cudaDeviceSynchronize", 250, 5, main, corr=6),  # after the steps
        span("kernel", "fwd_kernel", 10, 30, stream, corr=1),
        span("kernel", "triton_fused", 40, 5, stream, corr=2),
        span("kernel", "bwd_kernel", 45, 50, stream, corr=3),
        span("gpu_memcpy", "Memcpy DtoH (Device -> Pageable)", 170, 1, stream, corr=4),
        span("gpu_user_annotation", "dstrain.step", 10, 85, stream),
        {"ph": "s", "cat": "ac2g", "id": 1, "ts": 6, **main},
        {"ph": "s", "cat": "ac2g", "id": 4, "ts": 157, **main},
    ]


def test_a_cuda_trace_is_read_by_correlation_step_and_label_on_any_thread(bench, tmp_path):
    """Kernels count in the step and label of the call that launched them, the backward's too
    (launched by autograd's thread while the main thread waits in backward()); an .item() is one
    synchronisation and one device-to-host copy, at its site in the log window."""
    timeline = bench.Timeline(cuda_trace(), "dstrain.step")
    measured = {"wall_ms_per_step": 0.1, "operators": {}}
    summary = bench.summarise(timeline, "dstrain", measured, steps=2, cuda=True)
    first, second = summary["steps_detail"]
    assert (first["kernels"], first["host_syncs"]) == (3, 0)
    assert first["kernel_ms"] == pytest.approx(0.085)  # 30 + 5 + 50 us: the backward's included
    assert first["device_span_ms"] == pytest.approx(0.085) and first["period_ms"] == 0.1
    assert "device_span_ms" not in second  # no kernel in it
    assert (second["kernels"], second["host_syncs"], second["dtoh_copies"]) == (0, 1, 1)
    assert second["host_reads"] == 1 and second["log_window"] and not first["log_window"]
    assert summary["per_step"]["host_syncs"] == 0.5  # the cudaDeviceSynchronize after is no step's
    assert summary["per_step"]["host_syncs_outside_log_window"] == 0
    assert summary["per_step"]["device_idle_ms"] == pytest.approx(0.1 - 0.085 / 2)
    groups = summary["groups"]
    assert groups["deepspeed.forward"]["kernels"] == 1.0  # 2 launches in 2 steps
    assert groups["deepspeed.backward"]["kernel_ms"] == pytest.approx(0.025)  # 0.05 ms, 2 steps
    assert groups["dstrain.log_window"]["host_syncs"] == 0.5
    assert summary["sync_sites"] == {
        "dstrain.log_window > aten::_local_scalar_dense > cudaMemcpyAsync": 1,
        "dstrain.log_window > aten::_local_scalar_dense > cudaStreamSynchronize": 1,
    }
    path = tmp_path / "trace.json.gz"
    bench.write_trace({"traceEvents": cuda_trace()}, timeline, range(0, 1), path)
    with gzip.open(path) as fh:
        kept = json.load(fh)["traceEvents"]
    names = sorted(e["name"] for e in kept if e.get("ph") == "X")
    assert names == sorted(
        ["dstrain.step", "deepspeed.forward", "deepspeed.backward", "cudaLaunchKernel"]
        + ["cuLaunchKernel", "cudaLaunchKernel", "fwd_kernel", "triton_fused", "bwd_kernel"]
        + ["dstrain.step"]  # the step's device-side span
    )
    assert [e["id"] for e in kept if e.get("ph") == "s"] == [1]
    assert all(e["args"] == {"correlation": 3} for e in kept if e.get("name") == "bwd_kernel")
