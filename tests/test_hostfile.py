"""Hostfiles (dstrain/run/hostfile.py): read as DeepSpeed's launcher reads them, refused in one line
``FILE:LINE: ...``; ``python -m dstrain --check --hostfile FILE`` plans for their slots, and
launch.sh checks the hostfile it makes from the scheduler's node list."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from deepspeed.launcher.runner import fetch_hostfile

from dstrain.core.errors import ConfigError
from dstrain.main import main
from dstrain.run import hostfile
from dstrain.run.launch import LaunchError, build
from tests.conftest import REPO, TINY
from tests.test_cli_errors import JSON
from tools.code_shape import import_graph

GOOD = {
    "plain": "node1 slots=4\nnode2 slots=8\n",
    "comments and blank lines": "# two nodes\n\nnode1 slots=4\n   # indented comment\n\nnode2 slots=4",
    "spacing, tabs, CRLF": "  node1\tslots=2  \r\nnode2    slots=16\r\n",
    "words after the count (mpirun's)": "node1 slots=8 max_slots=8\nnode2 slots=8 # spare\n",
    "a comment right after the count": "node1 slots=8#gpu\n",
    "leading zeros": "node1 slots=08\n",
    "one host, no newline": "localhost slots=1",
}


@pytest.mark.parametrize("text", GOOD.values(), ids=GOOD.keys())
def test_good_files_read_as_deepspeed_reads_them(text, tmp_path):
    path = tmp_path / "hostfile"
    path.write_bytes(text.encode())
    hosts = hostfile.read(path)
    assert [(h.name, h.slots) for h in hosts] == list(fetch_hostfile(str(path)).items())
    lines = text.replace("\r\n", "\n").split("\n")
    assert all(lines[h.line - 1].split()[0] == h.name for h in hosts)  # each host's own line


def test_the_shipped_hostfile_reads_as_deepspeed_reads_it():
    path = REPO / "hostfiles" / "abci"
    hosts = hostfile.read(path)
    assert [(h.name, h.slots) for h in hosts] == list(fetch_hostfile(str(path)).items())
    assert hostfile.slot_total(hosts) == sum(h.slots for h in hosts) > 1


# (name, text, the line of the error after "FILE", what DeepSpeed 0.19.8 does with the file)
REFUSED = [
    (
        "malformed line",
        "# nodes\nnode1 slots=4\nnode2 4\n",
        ":3: 'node2 4' is not a hostfile line; write 'HOST slots=N' (one host and its number of "
        "ranks) or start a comment with #",
        "refuses",
    ),
    (
        "spaces around =",
        "node1 slots = 4\n",
        ":1: 'node1 slots = 4' is not a hostfile line",
        "refuses",
    ),
    (
        "slots=0",
        "node1 slots=4\nnode2 slots=0\n",
        ":2: node2 slots=0: the slot count must be a whole number >= 1 (the ranks to start on the "
        "host, e.g. its GPUs); fix it or drop the line",
        {"node1": 4, "node2": 0},
    ),
    (
        "slots=abc",
        "node1 slots=abc\n",
        ":1: node1 slots=abc: the slot count must be a whole number >= 1",
        "refuses",
    ),
    ("slots=8x", "node1 slots=8x\n", ":1: node1 slots=8x: the slot count must be", {"node1": 8}),
    ("slots=-1", "node1 slots=-1\n", ":1: node1 slots=-1: the slot count must be", "refuses"),
    (
        "duplicate host",
        "node1 slots=4\nnode2 slots=4\n\nnode1 slots=4\n",
        ":4: node1 is listed again (first on line 1); DeepSpeed refuses a host listed twice: keep "
        "one 'HOST slots=N' line per host",
        "refuses",
    ),
    (
        "empty file",
        "",
        ": the hostfile is empty; write one 'HOST slots=N' line per host",
        "refuses",
    ),
    (
        "comments only",
        "# node1 slots=8\n\n   \n",
        ": the hostfile holds only comments and blank lines; write one 'HOST slots=N' line per host",
        "refuses",
    ),
]


@pytest.mark.parametrize("name, text, expected, deepspeed", REFUSED, ids=[r[0] for r in REFUSED])
def test_each_refusal_is_one_line_naming_the_file_and_line(
    name, text, expected, deepspeed, tmp_path
):
    path = tmp_path / "hostfile"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        hostfile.read(path)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(str(path) + expected), message
    if deepspeed == "refuses":  # DeepSpeed stops too, with a traceback
        with pytest.raises(ValueError):
            fetch_hostfile(str(path))
    else:  # DeepSpeed takes it and reads what is written here
        assert dict(fetch_hostfile(str(path))) == deepspeed


def test_a_missing_or_unreadable_file_is_one_line(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(ConfigError) as err:
        hostfile.read(missing)
    assert str(err.value) == (
        f"{missing}: cannot read the hostfile (No such file or directory); pass a readable file"
    )
    assert fetch_hostfile(str(missing)) is None  # DeepSpeed: a warning, then this machine alone
    with pytest.raises(ConfigError, match=r": cannot read the hostfile \(Is a directory\)"):
        hostfile.read(tmp_path)
    binary = tmp_path / "binary"
    binary.write_bytes(b"\xff\xfe\x00node1")
    with pytest.raises(ConfigError, match=r"binary: not a text file"):
        hostfile.read(binary)


def test_the_reader_sits_on_the_ground_floor():
    """launch.sh runs it in whatever Python it finds (no torch needed): the standard library and
    dstrain.core.errors only."""
    assert import_graph()["dstrain.run.hostfile"] == {"dstrain.core.errors"}


# ---------------------------------------------------------------- python -m dstrain --check


def check(capfd, args: list[str]) -> tuple[int, str, str]:
    code = main([JSON, "ds_configs/fp32.json", *TINY, *args])
    out = capfd.readouterr()
    return code, out.out, out.err


def one_error_line(err: str) -> str:
    assert "Traceback" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("dstrain: error:")]
    assert len(lines) == 1, err[-3000:]
    return lines[0]


@pytest.fixture
def tiny_run(fake_fmnist, tmp_path) -> list[str]:
    return [f"data.root={fake_fmnist}", f"run_dir={tmp_path / 'run'}", "--device", "cpu"]


def test_check_plans_for_the_slots_of_a_good_hostfile(tiny_run, tmp_path, capfd):
    path = tmp_path / "hostfile"
    path.write_text("# two hosts, two ranks each\nnode1 slots=2\nnode2 slots=2\n")
    code, out, err = check(capfd, [*tiny_run, "--check", "--hostfile", str(path)])
    assert code == 0, err
    assert f"job          4 rank(s) on cpu: the slots of {path} (2 host(s), 2 each)" in out
    # TINY: global 32 over 4 ranks = 8 images a rank, one micro batch
    assert "global 32 = 8 micro x 1 accumulation x 4 ranks" in out
    code, out, err = check(capfd, [*tiny_run, "--check", "--hostfile", str(path), "--world", "4"])
    assert code == 0, err  # --world may repeat what the hostfile says


def test_check_refuses_a_bad_hostfile_in_one_line(tiny_run, tmp_path, capfd):
    path = tmp_path / "hostfile"
    path.write_text("node1 slots=2\nnode1 slots=2\n")
    code, out, err = check(capfd, [*tiny_run, "--check", "--hostfile", str(path)])
    assert code == 2 and "would start" not in out
    assert one_error_line(err) == (
        f"dstrain: error: {path}:2: node1 is listed again (first on line 1); DeepSpeed refuses a "
        "host listed twice: keep one 'HOST slots=N' line per host"
    )
    code, _, err = check(capfd, [*tiny_run, "--check", "--hostfile", str(tmp_path / "none")])
    assert code == 2 and "none: cannot read the hostfile" in one_error_line(err)


def test_check_refuses_slots_the_batch_does_not_split_over(tiny_run, tmp_path, capfd):
    path = tmp_path / "hostfile"
    path.write_text("node1 slots=2\nnode2 slots=1\n")
    code, _, err = check(capfd, [*tiny_run, "--check", "--hostfile", str(path)])
    assert code == 2
    assert one_error_line(err) == (
        "dstrain: error: invalid config: batch.global_size=32 is not divisible by the world size 3; "
        f"use a multiple of 3 (e.g. 30); world size 3 = the slots in {path}"
    )
    # micro 16 a rank (TINY's global 32 on 2 ranks) does not divide 8 a rank on 4: the same note
    path.write_text("node1 slots=4\n")
    code, _, err = check(
        capfd, [*tiny_run, "batch.micro_per_rank=16", "--check", "--hostfile", str(path)]
    )
    assert code == 2
    line = one_error_line(err)
    assert "batch.micro_per_rank=16 does not divide the per-rank batch 8" in line
    assert line.endswith(f"; world size 4 = the slots in {path}")


def test_a_bn_group_that_would_straddle_two_hosts_is_refused_unless_asked(
    tiny_run, tmp_path, capfd
):
    path = tmp_path / "hostfile"
    path.write_text("node1 slots=2\nnode2 slots=2\n")
    code, _, err = check(capfd, [*tiny_run, "model.bn_group=4", "--check", "--hostfile", str(path)])
    assert code == 2
    assert one_error_line(err).startswith(
        "dstrain: error: invalid config: model.bn_group=4 would split a BN group across nodes 0 "
        "and 1 (ranks per node: [2, 2]): every BN layer would then wait on the network"
    )
    asked = [*tiny_run, "model.bn_group=4", "model.bn_group_across_nodes=true"]
    code, out, err = check(capfd, [*asked, "--check", "--hostfile", str(path)])
    assert code == 0, err
    # TINY: 8 images a rank on 4 ranks
    assert "BN over the micro batch of 8 images x 4 ranks = 32 images" in out
    code, out, err = check(
        capfd, [*tiny_run, "model.bn_group=2", "--check", "--hostfile", str(path)]
    )
    assert code == 0 and "BN over the micro batch of 8 images x 2 ranks = 16 images" in out
    code, _, err = check(capfd, [*tiny_run, "model.bn_group=3", "--check", "--hostfile", str(path)])
    assert code == 2
    assert "model.bn_group=3 does not divide the 4 rank(s)" in one_error_line(err)


def test_a_refusal_the_slots_do_not_cause_does_not_blame_them(tiny_run, tmp_path, capfd):
    path = tmp_path / "hostfile"
    path.write_text("node1 slots=2\n")
    code, _, err = check(
        capfd, [*tiny_run, "optim.warmup_epochs=5", "--check", "--hostfile", str(path)]
    )
    assert code == 2
    line = one_error_line(err)
    assert "shorter than epochs=3" in line and str(path) not in line


def test_world_and_hostfile_that_disagree_are_refused(tiny_run, capfd):
    abci = "hostfiles/abci"
    slots = hostfile.slot_total(hostfile.read(REPO / abci))
    code, _, err = check(capfd, [*tiny_run, "--check", "--hostfile", abci, "--world", "2"])
    assert code == 2
    assert one_error_line(err) == (
        f"dstrain: error: --world 2 disagrees with --hostfile {abci}, whose 2 host(s) have {slots} "
        "slots in all; drop --world (the hostfile's slots are the ranks) or fix the slots"
    )


def test_hostfile_without_check_is_refused_before_anything_starts(tiny_run, tmp_path, capfd):
    code, _, err = check(capfd, [*tiny_run, "--hostfile", "hostfiles/abci"])
    assert code == 2 and not (tmp_path / "run").exists()
    assert one_error_line(err) == (
        "dstrain: error: --hostfile hostfiles/abci belongs to --check; to run on its hosts, give "
        "it to DeepSpeed's launcher: deepspeed --hostfile hostfiles/abci dstrain/main.py ..."
    )


# ---------------------------------------------------------------- launch.sh


def launch_args(tmp_path: Path) -> argparse.Namespace:
    return argparse.Namespace(
        gpus_per_node=0,
        iface="",
        launcher="auto",
        hostfile=str(tmp_path / "hostfile"),
        trainer_args=["--config", "fashion_mnist"],
    )


def test_a_uge_host_with_slots_in_two_queues_is_one_hostfile_line(tmp_path):
    """UGE lists a host once per queue it has slots in; DeepSpeed refuses a hostfile that lists a
    host twice, so launch.sh writes it once with the slots summed (it refused the job before)."""
    pe = tmp_path / "pe"
    pe.write_text("g0001 4 gpu.q@g0001 UNDEFINED\ng0001 4 cpu.q@g0001 UNDEFINED\ng0002 8 x\n")
    _, text, _ = build(launch_args(tmp_path), {"PE_HOSTFILE": str(pe)}, "deepspeed")
    assert text == "g0001 slots=8\ng0002 slots=8\n"
    assert [h.name for h in hostfile.parse(text, "hostfile")] == ["g0001", "g0002"]


def test_launch_refuses_a_host_deepspeed_would_take_for_a_comment(tmp_path):
    env = {"SLURM_JOB_NODELIST": "#n1,n2", "GPUS_PER_NODE": "8"}
    with pytest.raises(LaunchError) as err:
        build(launch_args(tmp_path), env, "deepspeed")
    assert str(err.value) == (
        "the slurm node list made the hostfile line '#n1 slots=8', which DeepSpeed would not read "
        "as written"
    )
