"""Does this machine train a recorded study run as it was trained? Its first epochs replayed.

    python results/harness/replay.py REPORT.json --row ROW --seed S [--epochs 3] [--here]
        [--out results/bench/replay_<report>_<row>_s<seed>.json]

A study report (results/harness/accuracy_study.py) records each run's trainer command, the settings of its
DeepSpeed JSON and the commit it ran at. This tool runs that command again at that commit (a
temporary git worktree; ``--here``: this tree) with the JSON written from the recorded settings,
stops it with SIGTERM once ``--epochs`` epochs are done (the schedule is the recorded one: the run
is cut, not shortened), and compares each epoch's training and held-out top-1 with the record.

Training here is deterministic on one machine (a run interrupted and resumed ends bit for bit as
an uninterrupted one), so a difference is the machine: another CPU's float paths (torch's kernels
dispatch on the vector ISA, ``cpu_capability``), not the code. ``identical`` says whether every
epoch compared is the same float; ``first_difference`` names the first epoch that is not. Runs made
on different machines are then the same run definition but not the same numbers, and a report that
reads runs from sessions on different machines pools them as draws of seed and machine together.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.common import write_result  # noqa: E402
from dstrain.core.provenance import record as provenance_record  # noqa: E402  (names the CPU)
from results.harness.commit_ab import git  # noqa: E402  (its worktrees are made the same way)

EPOCH_DONE = re.compile(r"\bepoch (\d+)/\d+ done:")


def recorded_run(report: Path, row: str, seed: int) -> dict:
    try:
        runs = json.loads(report.read_text())["runs"]
    except (OSError, ValueError, KeyError) as e:
        raise SystemExit(
            f"replay: {report}: not a study report ({type(e).__name__}: {e})"
        ) from None
    for rec in runs:
        if rec.get("row") == row and rec.get("seed") == seed and rec.get("command"):
            return rec
    have = sorted({(r.get("row"), r.get("seed")) for r in runs if r.get("command")})
    raise SystemExit(f"replay: {report} has no run of row {row} seed {seed} (it has: {have})")


def replay_command(rec: dict, json_path: Path, run_dir: Path) -> list[str]:
    """The recorded trainer command with this interpreter, the JSON written from the recorded
    settings and a fresh run directory; everything else as recorded."""
    argv = shlex.split(rec["command"])
    if "-m" not in argv or argv[argv.index("-m") + 1] != "dstrain":
        raise SystemExit(f"replay: not a trainer command: {rec['command']}")
    argv = [sys.executable, *argv[argv.index("-m") :]]
    out = []
    for i, arg in enumerate(argv):
        if i and argv[i - 1] == "--deepspeed_config":
            arg = str(json_path)
        elif arg.startswith("run_dir="):
            arg = f"run_dir={run_dir}"
        out.append(arg)
    if "--deepspeed_config" not in out:
        raise SystemExit("replay: the recorded command names no --deepspeed_config")
    if not any(a.startswith("run_dir=") for a in argv):
        out.append(f"run_dir={run_dir}")
    return out


def train_epochs(cmd: list[str], tree: Path, epochs: int, log: Path) -> int:
    """Run ``cmd`` in ``tree`` until ``epochs`` epochs are done, then SIGTERM it (it writes a
    checkpoint and exits). The number of epochs it finished."""
    done = 0
    with (
        log.open("w") as sink,
        subprocess.Popen(
            cmd, cwd=tree, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        ) as proc,
    ):
        for line in proc.stdout:
            sink.write(line)
            m = EPOCH_DONE.search(line)
            if m:
                done = int(m.group(1))
                if done >= epochs:
                    proc.send_signal(signal.SIGTERM)
                    break
        for line in proc.stdout:  # the checkpoint's lines, until it exits
            sink.write(line)
        rc = proc.wait()
    if done < epochs:
        raise SystemExit(
            f"replay: the run ended ({rc}) after {done} of {epochs} epochs; its log: {log}"
        )
    return done


def history(run_dir: Path) -> list[dict]:
    """The epochs the run finished, from its newest checkpoint (or its summary, had it ended)."""
    summary = run_dir / "summary.json"
    if summary.is_file():
        return json.loads(summary.read_text())["history"]
    states = sorted(run_dir.glob("checkpoints/*/trainer_state.json"))
    if not states:
        raise SystemExit(f"replay: {run_dir} has no checkpoint to read the epochs from")
    return json.loads(states[-1].read_text())["history"]


def compare(rec: dict, replayed: list[dict], epochs: int) -> dict:
    per_epoch, first = [], None
    for h in replayed[:epochs]:
        e = h["epoch"]
        row = {
            "epoch": e,
            "recorded_train_top1": rec["train_top1_per_epoch"][e - 1],
            "replayed_train_top1": h["train_top1"],
            "recorded_val_top1": rec["top1_per_epoch"][e - 1],
            "replayed_val_top1": h["val_top1"],
        }
        row["identical"] = (
            row["recorded_train_top1"] == row["replayed_train_top1"]
            and row["recorded_val_top1"] == row["replayed_val_top1"]
        )
        if first is None and not row["identical"]:
            first = e
        per_epoch.append(row)
    return {"identical": first is None, "first_difference": first, "per_epoch": per_epoch}


def headline(result: dict) -> str:
    if result["identical"]:
        return f"identical: {result['epochs']} epochs the same, bit for bit"
    return f"not identical: first difference at epoch {result['first_difference']}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "report", type=Path, help="a study report (results/harness/accuracy_study.py's JSON)"
    )
    p.add_argument("--row", required=True)
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--epochs", type=int, default=3, help="epochs to replay and compare")
    p.add_argument("--here", action="store_true", help="run this tree, not the recorded commit")
    p.add_argument("--out", type=Path, help="default results/bench/replay_<report>_<row>_s<seed>")
    args = p.parse_args(argv)
    if args.epochs < 1:
        p.error("--epochs must be at least 1")
    rec = recorded_run(args.report, args.row, args.seed)
    if args.epochs > len(rec.get("top1_per_epoch") or []):
        p.error(f"--epochs {args.epochs}: the record has {len(rec['top1_per_epoch'])} epochs")
    out = args.out or REPO / "results" / "bench" / (
        f"replay_{args.report.stem}_{args.row}_s{args.seed}.json"
    )
    with tempfile.TemporaryDirectory(prefix="dstrain-replay-") as tmp:
        tmp = Path(tmp)
        tree = REPO
        if not args.here:
            tree = tmp / "tree"
            git("worktree", "add", "--detach", str(tree), rec["git_sha"].removesuffix("-dirty"))
        try:
            ds_json = tmp / "ds_config.json"
            ds_json.write_text(json.dumps(rec["deepspeed_settings"], indent=2) + "\n")
            cmd = replay_command(rec, ds_json, tmp / "run")
            print(
                f"replay: {args.row} seed {args.seed}, {args.epochs} epochs at "
                f"{'this tree' if args.here else rec['git_sha'][:7]}: {shlex.join(cmd)}"
            )
            train_epochs(cmd, tree, args.epochs, tmp / "run.log")
            found = compare(rec, history(tmp / "run"), args.epochs)
        finally:
            if not args.here:
                git("worktree", "remove", "--force", str(tree))
    result = {
        **provenance_record(
            shlex.join(
                ["python", "results/harness/replay.py", *(sys.argv[1:] if argv is None else argv)]
            )
        ),
        "report": str(args.report),
        "row": args.row,
        "seed": args.seed,
        "run_git_sha": rec["git_sha"],
        "tree": "this tree" if args.here else rec["git_sha"],
        "epochs": args.epochs,
        **found,
    }
    where = "this tree" if args.here else rec["git_sha"][:7]
    title = (
        f"Replay of {args.report.stem}, row {args.row} seed {args.seed}: "
        f"{args.epochs} epochs at {where}"
    )
    write_result(out, result, title=title, headline=headline(result))
    verdict = (
        "identical, bit for bit"
        if found["identical"]
        else f"first differs at epoch {found['first_difference']}"
    )
    print(f"replay: {args.epochs} epochs {verdict} -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
