"""The GPU pass's tests: on the GPU node ``python -m pytest -m gpu -n 8`` runs the tests marked ``gpu``
(pyproject.toml), those whose path differs where a CUDA device is visible, and nothing else of the
suite (CI runs the rest, on CPUs). The marked set is the table below, each test with what it took
here when it was marked; LEFT_OUT names the tests whose path also differs on a GPU and which are
not marked, each with why.

The pass's time is not checked here: the seconds below are typed, so a sum of them could fail only
when someone edits the table. tools/gpu_run.py keeps the pass to its budget as it runs (a test cut
by it runs again in the next job, tests/test_gpu_run.py), and the node's own times are in its
result file (results/bench/suite_gpu_h100.json)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

# Every test marked `gpu`, with its seconds on this CPU when it was marked (2 cores, one pytest
# process, --durations): for whoever weighs the next mark, not checked. tests/test_gpu.py's are
# skipped on a CPU: theirs are the H100's (./run.sh gpu tests at 9a9aaeb, one process).
GPU_PASS: dict[str, float] = {
    # tests/test_gpu.py: what only a GPU shows (H100 seconds)
    "tests/test_gpu.py::test_fp16_trains_with_dynamic_loss_scaling"
    "[ds_configs/fp16.json-autocast-float16]": 16.9,
    "tests/test_gpu.py::test_fp16_trains_with_dynamic_loss_scaling"
    "[ds_configs/fp16_native.json-fp16]": 18.0,
    "tests/test_gpu.py::test_the_shipped_lamb_json_runs_dstrains_lamb_on_the_gpu": 15.5,
    "tests/test_gpu.py::test_fused_lamb_builds_on_the_gpu_or_says_why": 6.2,
    # skipped at 9a9aaeb (no DALI there): an allowance of one short run
    "tests/test_gpu.py::test_dali_mixed_decode_gives_gpu_batches_with_the_right_labels": 10.0,
    "tests/test_gpu.py::test_torus_all_reduce_over_nccl_equals_all_reduce": 0.0,  # needs 2 GPUs
    # the trainer built in pytest's process: on cuda:0 where there is one (dist.device())
    "tests/test_trainer.py::test_fit_follows_the_batch_plan_in_process": 2.0,
    "tests/test_trainer.py::test_a_stop_signal_ends_the_epoch_after_the_step_in_flight": 0.1,
    "tests/test_trainer.py::test_fp16_autocast_skips_overflowing_steps_counts_them_and_halves_the_scale": 6.2,
    "tests/test_trainer.py::test_a_training_step_makes_no_host_synchronisation[fp32]": 0.2,
    "tests/test_trainer.py::test_a_training_step_makes_no_host_synchronisation[bf16]": 0.2,
    "tests/test_trainer.py::test_a_training_step_makes_no_host_synchronisation[fp16]": 1.7,
    "tests/test_trainer.py::test_a_training_step_makes_no_host_synchronisation[lars_bf16]": 0.1,
    "tests/test_trainer.py::test_a_training_step_makes_no_host_synchronisation[lamb_bf16]": 0.1,
    "tests/test_trainer.py::test_the_sync_counter_sees_reads_and_waits": 0.0,
    "tests/test_trainer.py::test_native_fp16_engine_updates_as_fp32_does_and_reports_its_scale": 6.5,
    "tests/test_trainer.py::test_engines_that_scale_the_loss_themselves_get_no_second_multiply": 0.2,
    "tests/test_trainer.py::test_gradient_communication_dtype_is_what_the_json_says[bf16-wire0]": 0.1,
    "tests/test_trainer.py::test_gradient_communication_dtype_is_what_the_json_says"
    "[bf16_comm_bf16-wire1]": 0.1,
    "tests/test_trainer.py::test_training_runs_on_a_torch_without_the_public_set_timeout": 0.3,
    "tests/test_trainer.py::test_compiled_training_composes_with_channels_last_precision_optimizers"
    "_and_comm[lamb-bf16-sign]": 26.7,
    "tests/test_trainer.py::test_compiled_training_composes_with_channels_last_precision_optimizers"
    "_and_comm[lars-fp16autocast]": 34.9,
    "tests/test_trainer.py::test_the_trainers_first_step_after_a_ramp_switch_averages_exactly_the"
    "_new_batch": 1.3,
    "tests/test_trainer.py::test_target_top1_ends_training_and_a_resume_trains_no_more": 0.8,
    "tests/test_trainer.py::test_the_mlperf_log_holds_the_values_the_run_uses": 1.0,
    # one rank through the command line: on cuda:0 where there is one (conftest.rank_env)
    "tests/test_e2e.py::test_single_process_bf16_lamb_run_logs_every_scalar": 4.2,
    "tests/test_e2e.py::test_kill_and_resume_reaches_the_same_weights"
    "[lars-ramp-channels-last-bn-span]": 23.7,
    "tests/test_e2e.py::test_image_folder_run[torchvision-1]": 4.8,
    # the EMA on cuda:0 (FP32 copy, foreach lerp, its evaluation, ema.pt bit for bit, its refit)
    "tests/test_ema.py::test_a_run_evaluates_checkpoints_resumes_and_polishes_its_ema": 40.0,
    # the EMA's arithmetic with the model on cuda:0, the average there or on the CPU (skipped here)
    "tests/test_ema.py::test_the_average_matches_an_fp64_reference[model-cuda]": 0.0,
    "tests/test_ema.py::test_the_average_matches_an_fp64_reference[cpu-cuda]": 0.0,
    "tests/test_e2e.py::test_corrupt_image_stops_the_run_with_one_line": 11.5,
    "tests/test_faults.py::test_sigint_checkpoints_mid_epoch_and_resume_is_exact": 13.7,
    "tests/test_faults.py::test_a_nonfinite_loss_stops_with_the_step_and_the_last_good_checkpoint"
    "[fp32]": 7.6,
    "tests/test_polish.py::test_trainer_polishes_after_the_last_epoch_and_keeps_the_checkpoint": 4.6,
    "tests/test_polish.py::test_standalone_polish_two_ranks_equals_one": 15.9,
    # a branch on torch.cuda.is_available() in the test itself
    "tests/test_optim.py::test_fused_lamb_without_its_op_falls_back_and_says_why": 1.2,
}
# Tests that also take another path on a GPU node, not marked: the difference is covered by a marked
# test, or is only the device a refusal or a log names, at a cost the pass cannot carry.
LEFT_OUT: dict[str, str] = {
    "tests/test_e2e.py::test_kill_and_resume_reaches_the_same_weights[sgd]": "42 s; the lars case "
    "(marked) takes the same GPU path: cuda:0, deterministic cuDNN, the CUDA RNG in the checkpoint",
    "tests/test_faults.py::test_a_nonfinite_loss_stops_with_the_step_and_the_last_good_checkpoint"
    "[bf16]": "18 s; the fp32 case (marked) runs the same non-finite check on the GPU",
    "tests/test_trainer.py::test_compiled_training_composes_with_ramp_eval_checkpoints_and_resume": (
        "78 s; inductor's GPU code is compiled by the two marked compile tests, what this one adds "
        "(ramp, evaluation, checkpoint, resume under compile) is the same on any device"
    ),
    "tests/test_lars_lamb.py::test_a_run_with_lars_tensors_logs_every_tensor_by_name": "22 s; "
    "LARS on the GPU is trained by the marked kill-and-resume lars case, the tensor log reads it",
    "tests/test_mlperf.py::test_an_open_division_fashion_mnist_log_passes_the_checker": "24 s; "
    "the MLPerf log is the same on any device",
    "tests/test_watchdog.py::test_a_forward_backward_stall_exits_6_naming_the_phase": "7 s; the "
    "injected stall is a sleep in Python, the same on any device",
    "tests/test_faults.py::test_kill_9_during_a_checkpoint_write_keeps_the_previous_one"
    "[written-after every rank wrote its files, before the checkpoint is marked complete]": "8 s; "
    "the checkpoint files are written alike from any device (resume on a GPU: marked tests)",
    "tests/test_preflight.py::test_check_through_the_real_command_line": "--check plans for "
    "cuda instead of cpu; what the test reads (the refusal, nothing written) is the same",
}

COLLECTOR = """
import json, os

def pytest_collection_finish(session):
    marks = {item.nodeid: sorted({m.name for m in item.iter_markers()}) for item in session.items}
    with open(os.environ["DSTRAIN_MARKS_OUT"], "w") as fh:
        json.dump(marks, fh)
"""


def collected_marks(tmp_path) -> dict[str, list[str]]:
    """Every test of tests/ as pytest collects it, with the names of its marks (one collection in a
    subprocess, with --strict-markers: a mark pyproject.toml does not declare is an error)."""
    (tmp_path / "marks_collector.py").write_text(COLLECTOR)
    out = tmp_path / "marks.json"
    env = {**os.environ, "DSTRAIN_MARKS_OUT": str(out)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp_path), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"]
        + ["--strict-markers", "-p", "marks_collector", "tests"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.slow  # over ~5 s on 2 cores: the full suite only (issue 53: the quick loop under 1 minute)
def test_the_gpu_pass_runs_the_marked_tests(tmp_path):
    marks = collected_marks(tmp_path)
    gpu = {test for test, names in marks.items() if "gpu" in names}
    in_test_gpu = {test for test in marks if test.startswith("tests/test_gpu.py::")}
    assert in_test_gpu and in_test_gpu <= gpu, sorted(in_test_gpu - gpu)  # all of test_gpu.py
    # marked and not in the table (measure it: --durations), or in the table and no longer marked
    assert gpu == set(GPU_PASS), {
        "marked, not in GPU_PASS": sorted(gpu - set(GPU_PASS)),
        "in GPU_PASS, not marked": sorted(set(GPU_PASS) - gpu),
    }
    left_out = set(LEFT_OUT)
    assert left_out <= set(marks) and not left_out & gpu, {
        "not collected": sorted(left_out - set(marks)),
        "marked after all (move it to GPU_PASS)": sorted(left_out & gpu),
    }
