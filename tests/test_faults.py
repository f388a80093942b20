"""Faults on real runs: stop signals, kill -9 during a checkpoint write, divergence, dead and stuck ranks,
full or read-only disks. Each test records what it observed in the evidence table (./run.sh evidence)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dstrain.core.dist import free_port
from tests.conftest import REPO, TINY, injected, rank_env, run_cli

pytestmark = pytest.mark.slow
FP32 = ["--deepspeed_config", "ds_configs/fp32.json"]


def common(data: Path, *extra: str) -> list[str]:
    return [*FP32, *TINY, f"data.root={data}", "data.augment=true", *extra]


def clean_env(**extra) -> dict:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    return injected({**env, **extra})


def launch_sh(args: list[str]) -> list[str]:
    return [str(REPO / "launch.sh"), *args]


def launch_env(ranks: int = 2) -> dict:
    return clean_env(DSTRAIN_CPU_RANKS=str(ranks), MASTER_PORT=str(free_port()))


class Running:
    """A command whose output is watched line by line, so a fault can be injected at a known point."""

    def __init__(self, cmd: list[str], env: dict):
        self.proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.lines: list[str] = []

    def wait_for(self, text: str, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        for line in self.proc.stdout:
            self.lines.append(line)
            if text in line:
                return
            assert time.monotonic() < deadline, f"no {text!r} within {timeout} s"
        raise AssertionError(f"exited before {text!r}:\n" + "".join(self.lines[-40:]))

    def finish(self, timeout: float = 240) -> int:
        try:
            rest, _ = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            raise
        self.lines.append(rest)
        return self.proc.returncode

    @property
    def output(self) -> str:
        return "".join(self.lines)


def final_state(run_dir: Path) -> dict:
    """Every tensor of the newest checkpoint's model: parameters and BN buffers (running statistics,
    counters)."""
    ckpt = run_dir / "checkpoints"
    tag = (ckpt / "latest").read_text().strip()
    return torch.load(ckpt / tag / "mp_rank_00_model_states.pt", weights_only=True)["module"]


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def records(run_dir: Path) -> dict[int, dict]:
    return {
        json.loads(p.read_text())["rank"]: json.loads(p.read_text())
        for p in (run_dir / "ranks").glob("*.json")
    }


def user_lines(text: str) -> str:
    keep = ("dstrain: ", "dstrain[rank", "launch.sh: the job", "launch.sh: every", "  rank ")
    return "\n".join(line.strip() for line in text.splitlines() if line.startswith(keep))


# ---------------------------------------------------------------- stop signals
@pytest.mark.gpu  # 1 rank: on cuda:0 on a GPU node, the signal lands with a step queued on it
def test_sigint_checkpoints_mid_epoch_and_resume_is_exact(fake_fmnist, tmp_path, evidence):
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    assert run_cli(common(fake_fmnist, f"run_dir={straight}")).returncode == 0
    run = Running(
        [sys.executable, "-m", "dstrain", *common(fake_fmnist, f"run_dir={stopped}")], clean_env()
    )
    run.wait_for("epoch 2/3 step 4/16")
    t0 = time.monotonic()
    run.proc.send_signal(signal.SIGINT)
    assert run.finish() == 75, run.output[-3000:]
    seconds = time.monotonic() - t0
    tag = (stopped / "checkpoints" / "latest").read_text().strip()
    assert (
        tag.startswith("epoch0001-step000000")
        and (stopped / "checkpoints" / tag / "trainer_state.json").is_file()
    )
    assert records(stopped)[0]["state"] == "preempted"
    lines = user_lines(run.output)
    assert "dstrain: stopped: stopped by SIGINT" in lines and "resume=auto" in lines
    evidence(
        "fault: signal",
        "SIGINT (Ctrl-C) in epoch 2, one process",
        exit=75,
        seen=lines,
        disk=f"checkpoint {tag} written, `latest` -> it",
        seconds=seconds,
    )

    resumed = run_cli(common(fake_fmnist, f"run_dir={stopped}", "resume=auto"))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"resumed from {stopped / 'checkpoints' / tag}" in resumed.stdout
    diff = max_diff(final_state(straight), final_state(stopped))
    assert diff == 0.0
    h1 = json.loads((straight / "summary.json").read_text())["history"]
    h2 = json.loads((stopped / "summary.json").read_text())["history"]
    assert [h["train_loss"] for h in h1] == [
        h["train_loss"] for h in h2
    ]  # even the interrupted epoch's mean
    evidence(
        "fault: signal",
        "resume=auto after the SIGINT stop",
        exit=0,
        seen=f"resumed from {tag}; final weights equal the uninterrupted run's (max diff {diff:g})",
        disk="run completed",
    )


def test_sigterm_to_a_two_rank_job_checkpoints_and_resumes(fake_fmnist, tmp_path, evidence):
    """The scheduler's SIGTERM reaches every process of the job (launch.sh, DeepSpeed's launcher, the ranks)."""
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    done = subprocess.run(
        launch_sh(common(fake_fmnist, f"run_dir={straight}")),
        cwd=REPO,
        env=launch_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run = Running(launch_sh(common(fake_fmnist, f"run_dir={stopped}")), launch_env())
    run.wait_for("epoch 2/3 step 4/16")
    t0 = time.monotonic()
    os.killpg(run.proc.pid, signal.SIGTERM)
    assert run.finish() == 75, run.output[-4000:]
    seconds = time.monotonic() - t0
    tag = (stopped / "checkpoints" / "latest").read_text().strip()
    assert tag.startswith("epoch0001-step000000")
    assert {r["state"] for r in records(stopped).values()} == {"preempted"} and len(
        records(stopped)
    ) == 2
    lines = user_lines(run.output)
    assert "launch.sh: every rank stopped with a checkpoint" in lines
    evidence(
        "fault: signal",
        "SIGTERM to every process of a 2-rank job (launch.sh)",
        exit=75,
        seen=lines,
        disk=f"checkpoint {tag} written by both ranks, `latest` -> it",
        seconds=seconds,
    )

    resumed = subprocess.run(
        launch_sh(common(fake_fmnist, f"run_dir={stopped}", "resume=auto")),
        cwd=REPO,
        env=launch_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    a, b = final_state(straight), final_state(stopped)
    diff = max_diff(a, b)
    stats = [k for k in a if "running_" in k]
    for k in a:  # parameters and counters: bit for bit
        if k not in stats:
            assert torch.equal(a[k], b[k]), k
    # BN running statistics: the ranks average them at the stop, before saving, where the
    # uninterrupted run averages them only at the epoch's end; the updates are affine, so the two
    # agree exactly in real arithmetic and to rounding in float (seen: 1.2e-7)
    for k in stats:
        torch.testing.assert_close(a[k], b[k], rtol=1e-6, atol=1e-6, msg=k)
    evidence(
        "fault: signal",
        "resume=auto after the 2-rank SIGTERM stop",
        exit=0,
        seen=f"final weights equal the uninterrupted 2-rank run's (max diff {diff:g})",
        disk="run completed",
    )


# ---------------------------------------------------------------- kill -9 while a checkpoint is written
@pytest.mark.parametrize(
    "phase, what",
    [
        ("written", "after every rank wrote its files, before the checkpoint is marked complete"),
        ("renamed", "after the rename, before `latest` is updated"),
    ],
)
def test_kill_9_during_a_checkpoint_write_keeps_the_previous_one(
    phase, what, fake_fmnist, tmp_path, evidence
):
    run_dir = tmp_path / "run"
    args = common(fake_fmnist, f"run_dir={run_dir}", "checkpoint.every_epochs=1")
    killed = run_cli(args, env={"DSTRAIN_FAULT_KILL_IN_CHECKPOINT": f"epoch0002:{phase}"})
    assert killed.returncode == -9, killed.stderr[-2000:]
    ckpt = run_dir / "checkpoints"
    assert (ckpt / "latest").read_text().strip() == "epoch0001"
    left = sorted(p.name for p in ckpt.iterdir())
    resumed = run_cli(args + ["resume=auto"])
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"resumed from {ckpt / 'epoch0001'}: 1 epochs" in resumed.stdout
    assert (ckpt / "latest").read_text().strip() == "epoch0003"
    evidence(
        "fault: kill -9",
        f"SIGKILL while writing epoch 2's checkpoint, {what}",
        exit=-9,
        seen="(killed) then resume=auto: `resumed from .../epoch0001`, run completes",
        disk=f"left: {', '.join(left)}; `latest` = epoch0001",
    )


# ---------------------------------------------------------------- divergence
@pytest.mark.parametrize(
    "json_file",
    [
        # 1 rank: on cuda:0 on a GPU node, the non-finite check reads a loss computed there (bf16's
        # GPU path is the same check, 18 s on 2 cores against fp32's 8 s)
        pytest.param("ds_configs/fp32.json", id="fp32", marks=pytest.mark.gpu),
        pytest.param("ds_configs/bf16.json", id="bf16"),
    ],
)
def test_a_nonfinite_loss_stops_with_the_step_and_the_last_good_checkpoint(
    json_file, fake_fmnist, tmp_path, evidence
):
    run_dir = tmp_path / "run"
    base = [
        "--deepspeed_config",
        json_file,
        *TINY,
        f"data.root={fake_fmnist}",
        f"run_dir={run_dir}",
    ]
    assert run_cli(base + ["epochs=1"]).returncode == 0
    # continue the run with a learning rate a million times too large: the loss overflows in epoch 2
    proc = run_cli(base + ["epochs=3", "resume=auto", "optim.base_lr=2e5"])
    assert proc.returncode == 3, proc.stdout[-2000:] + proc.stderr[-2000:]
    line = user_lines(proc.stderr)
    assert "non-finite loss (NaN/inf) at step" in line and "(epoch 2)" in line
    assert f"the last good checkpoint is {run_dir / 'checkpoints' / 'epoch0001'}" in line
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "epoch0001"
    assert (
        json.loads((run_dir / "summary.json").read_text())["epochs"] == 1
    )  # the first run's, untouched
    evidence(
        "fault: divergence",
        f"LR x 1e6 from epoch 2 ({Path(json_file).name})",
        exit=3,
        seen=line,
        disk="no checkpoint of the diverged model; `latest` = epoch0001",
    )


# ---------------------------------------------------------------- dead and stuck ranks
def test_a_rank_killed_under_the_launcher_is_named(fake_fmnist, tmp_path, evidence):
    run_dir = tmp_path / "run"
    run = Running(launch_sh(common(fake_fmnist, f"run_dir={run_dir}", "epochs=6")), launch_env())
    run.wait_for("epoch 2/6 step 4/16")
    pid = records(run_dir)[1]["pid"]
    t0 = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    code = run.finish(timeout=120)
    seconds = time.monotonic() - t0
    assert code == 4, run.output[-3000:]
    lines = user_lines(run.output)
    assert (
        f"rank 1 (pid {pid}" in lines
        and "process gone without a word" in lines
        and "<- failed first" in lines
    )
    assert records(run_dir)[0]["state"] in (
        "lost_peer",
        "preempted",
    )  # DeepSpeed's launcher SIGTERMs survivors
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "epoch0001"
    evidence(
        "fault: dead rank",
        "kill -9 of rank 1 in a 2-rank job (launch.sh)",
        exit=code,
        seen=lines,
        disk="`latest` = epoch0001 (complete)",
        seconds=seconds,
    )


def start_ranks(args: list[str], world: int) -> list[subprocess.Popen]:
    """Ranks started by hand, as a multi-node job's ranks are: no launcher watches over them."""
    port = str(free_port())
    procs = []
    for r in range(world):
        env = clean_env(
            **rank_env(world),  # a GPU per rank where the node has them, else CPU ranks
            RANK=str(r),
            LOCAL_RANK=str(r),
            WORLD_SIZE=str(world),
            LOCAL_WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, "dstrain/main.py", *args],
                cwd=REPO,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    return procs


@pytest.mark.parametrize("how", ["SIGKILL", "SIGSTOP"])
def test_a_lost_rank_ends_the_others_within_the_collective_timeout(
    how, fake_fmnist, tmp_path, evidence
):
    run_dir, timeout = tmp_path / "run", 15
    rank0, rank1 = start_ranks(
        common(
            fake_fmnist, f"run_dir={run_dir}", "epochs=20", f"fault.collective_timeout_s={timeout}"
        ),
        2,
    )
    try:
        seen = []
        for line in rank0.stdout:
            seen.append(line)
            if "epoch 2/20 step 4/16" in line:
                break
        t0 = time.monotonic()
        os.kill(rank1.pid, getattr(signal, how))
        out, _ = rank0.communicate(timeout=timeout + 90)
        seconds = time.monotonic() - t0
    finally:
        rank1.kill()
        rank1.wait()
        rank0.kill()
    assert rank0.returncode == 4, "".join(seen)[-2000:] + out[-3000:]
    lines = user_lines(out)
    verdict = (
        "process gone without a word" if how == "SIGKILL" else "process alive but stopped (SIGSTOP"
    )
    assert f"rank 1 (pid {rank1.pid}" in lines and verdict in lines and "resume=auto" in lines, (
        lines
    )
    # bounded by the configured timeout, with a margin for a loaded machine (no tight constant:
    # a dead peer usually ends the collective at once, a stopped one after the timeout)
    assert seconds < timeout + 60
    if how == "SIGSTOP":
        assert seconds >= timeout - 1  # it waited for the timeout, not less
    assert records(run_dir)[0]["state"] == "lost_peer"
    evidence(
        "fault: dead rank",
        f"{how} to rank 1 of 2 ranks started without a launcher "
        f"(fault.collective_timeout_s={timeout})",
        exit=4,
        seen=lines,
        disk="`latest` = epoch0001 (complete)",
        seconds=seconds,
    )


# ---------------------------------------------------------------- disks
def in_private_mount(options: str, mountpoint: Path, cmd: list[str], env: dict | None = None):
    """Run cmd with a fresh tmpfs mounted on mountpoint, visible to cmd only (a mount namespace)."""
    if shutil.which("unshare") is None:
        pytest.skip("unshare (util-linux) is needed to mount a private tmpfs")
    mountpoint.mkdir(parents=True, exist_ok=True)
    # exit 32 = the mount failed; after cmd, list what is left on the tmpfs (it vanishes with the namespace)
    script = (
        'mnt=$1; mount -t tmpfs -o "$0" dstrain-test "$mnt" || exit 32; shift; "$@"; rc=$?; '
        'echo "--- left on the tmpfs:"; find "$mnt" -mindepth 1 | sort; exit $rc'
    )
    return subprocess.run(
        [
            "unshare",
            "-m",
            "--propagation",
            "private",
            "sh",
            "-c",
            script,
            options,
            str(mountpoint),
            *cmd,
        ],
        cwd=REPO,
        env=clean_env(**(env or {})),
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize(
    "case, options, expected",
    [
        ("full disk (1 MiB free)", "size=1m", "MiB free on its file system"),
        ("read-only file system", "ro", "not writable (Read-only file system)"),
    ],
)
def test_an_unusable_run_dir_is_refused_before_training(
    case, options, expected, fake_fmnist, tmp_path, evidence
):
    mnt = tmp_path / "mnt"
    proc = in_private_mount(
        options, mnt, [sys.executable, "-m", "dstrain", *common(fake_fmnist, f"run_dir={mnt}/run")]
    )
    if proc.returncode == 32:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    line = user_lines(proc.stderr)
    assert expected in line and "Traceback" not in proc.stderr
    assert "epoch 1/3 step" not in proc.stdout  # before training
    assert left_on_tmpfs(proc.stdout) == []
    # --check refuses with the run's own line (issue 53: the disk check was the run's only)
    checked = in_private_mount(
        options,
        mnt,
        [sys.executable, "-m", "dstrain", *common(fake_fmnist, f"run_dir={mnt}/run"), "--check"],
    )
    assert checked.returncode == 2 and user_lines(checked.stderr) == line, checked.stderr[-2000:]
    evidence("fault: disk", f"run_dir on a {case}", exit=2, seen=line, disk="nothing written")


def left_on_tmpfs(stdout: str) -> list[str]:
    return [
        line.strip()
        for line in stdout.split("--- left on the tmpfs:", 1)[1].splitlines()
        if line.strip()
    ]


def test_a_full_disk_during_a_checkpoint_write_fails_cleanly(fake_fmnist, tmp_path, evidence):
    mnt = tmp_path / "mnt"
    proc = in_private_mount(
        "size=160k",
        mnt,
        [
            sys.executable,
            "-m",
            "dstrain",
            *common(
                fake_fmnist, f"run_dir={mnt}/run", "fault.check_disk=false", "log.tensorboard=false"
            ),
        ],
    )
    if proc.returncode == 32:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    assert proc.returncode == 5, proc.stdout[-2000:] + proc.stderr[-2000:]
    line = user_lines(proc.stderr)
    assert "could not write a checkpoint" in line and "Traceback" not in proc.stderr
    left = [Path(p).relative_to(mnt).as_posix() for p in left_on_tmpfs(proc.stdout)]
    assert not any(".partial" in p or p.endswith("latest") for p in left), left
    evidence(
        "fault: disk",
        "disk fills up during the first checkpoint write (fault.check_disk=false)",
        exit=5,
        seen=line,
        disk=f"partial checkpoint removed, no `latest`; left: {', '.join(left)}",
    )
