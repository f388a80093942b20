"""MLPerf's RCP checker on a set of dstrain runs: did they converge no faster than MLCommons'
reference runs at their batch size? (``./run.sh rcp-check``)

    ./run.sh rcp-check runs/b3264-seed{0,1,2,3,4}      # five run directories
    ./run.sh rcp-check runs/b3264                      # or a folder holding them
    ./run.sh rcp-check runs/b3264 --json verdict.json  # and the verdict as JSON

Each run directory must hold the ``mlperf.log`` of one uninterrupted run (``log.mlperf=true``; the
MLPerf recipes set it, with ``target_top1: 0.759``). The logs are handed to ``python -m
mlperf_logging.rcp_checker --rcp_version 4.0.0`` as its result_<i>.txt files; the table shows the
epochs each run took to its last evaluation and how it stopped (success = the target reached).
The checker fails a set that converges faster than the reference convergence points (RCPs) at its
batch, interpolated between the batches MLCommons measured, or where more than one run never
reached the target; batches above 67,840 (Fujitsu's 86,016) have no RCP above them to compare with.
Exit 0 passed, 1 failed, 2 bad input (fewer than 5 runs, a missing or resumed log).
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from dstrain.core.errors import ConfigError  # noqa: E402
from dstrain.core.files import atomic_write_text  # noqa: E402
from dstrain.core.provenance import record as provenance_record  # noqa: E402
from dstrain.loop import mlperf  # noqa: E402

RUNS_PER_RESNET_RESULT = 5  # MLPerf's ResNet result: 5 runs (the RCP checker drops none below it)


@dataclass(frozen=True)
class RunConvergence:
    """One run's log as the RCP checker reads it: its batch, last evaluated epoch and status."""

    run_dir: Path
    global_batch: int | None
    epochs: float | None  # epoch_num of the last eval_accuracy before run_stop
    top1: float | None  # its value
    status: str | None  # run_stop's status (success = the target was reached)
    seed: int | None = None  # the seed the log names
    division: str | None = None  # its submission_division


def convergence(run_dir: Path) -> RunConvergence:
    """Read ``run_dir/mlperf.log``; a run with ``mlperf-2.log`` was resumed and is refused (MLPerf
    results come from one uninterrupted run)."""
    log = run_dir / mlperf.LOG_NAME
    if not log.is_file():
        raise ConfigError(f"{run_dir}: no {mlperf.LOG_NAME}; train it with log.mlperf=true")
    if (run_dir / "mlperf-2.log").exists():
        raise ConfigError(
            f"{run_dir}: resumed (mlperf-2.log beside {mlperf.LOG_NAME}); MLPerf results come from one "
            "uninterrupted run: train it again from the start"
        )
    batch = epochs = top1 = status = seed = division = None
    for event in mlperf.events(log):
        key, meta = event["key"], event.get("metadata") or {}
        if key == "global_batch_size":
            batch = event["value"]
        elif key == "seed":
            seed = event["value"]
        elif key == "submission_division":
            division = event["value"]
        elif key == "eval_accuracy":
            epochs, top1 = meta.get("epoch_num"), event["value"]
        elif key == "run_stop":
            status = meta.get("status")
    return RunConvergence(run_dir, batch, epochs, top1, status, seed, division)


def refuse_repeated_seeds(runs: list[RunConvergence]) -> None:
    """Five copies of one run are one run: MLPerf's package checker refuses a result whose logs
    repeat a seed, and so do the RCP check and the package builder, naming the two runs."""
    first: dict = {}
    for run in runs:
        if run.seed in first:
            raise ConfigError(
                f"{first[run.seed]} and {run.run_dir} both log seed {run.seed}: a result's runs "
                "must differ in their seeds (MLPerf's package checker refuses repeats); train "
                "each with its own seed=K (or seed=auto)"
            )
        first[run.seed] = run.run_dir


@dataclass(frozen=True)
class RCPVerdict:
    passed: bool
    message: str  # the checker's own words: "RCP found", "Insufficient convergence", ...
    runs: list[RunConvergence]
    output: str


def check_rcp(run_dirs: list[Path], timeout: float = 300) -> RCPVerdict:
    """MLPerf's RCP checker (``python -m mlperf_logging.rcp_checker --rcp_version 4.0.0``) on the
    runs' logs, copied as result_<i>.txt into a scratch folder as the checker expects. It fails a
    set that converges faster than MLCommons' reference runs at that batch (interpolated between
    batches), or where more than one run did not reach the target."""
    if len(run_dirs) < RUNS_PER_RESNET_RESULT:
        raise ConfigError(
            f"{len(run_dirs)} run(s) given: an MLPerf ResNet result is {RUNS_PER_RESNET_RESULT} "
            "runs with different seeds; give 5 run directories (or a folder holding them)"
        )
    runs = [convergence(d) for d in run_dirs]
    refuse_repeated_seeds(runs)
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch) / "results"
        folder.mkdir()
        for i, run in enumerate(runs):
            shutil.copyfile(run.run_dir / mlperf.LOG_NAME, folder / f"result_{i}.txt")
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "mlperf_logging.rcp_checker",
                "--rcp_version",
                mlperf.RULESET,
                "--log_output",
                str(Path(scratch) / "rcp_checker.log"),
                str(folder),
            ],
            cwd=scratch,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    output = proc.stdout + proc.stderr
    said = re.findall(r"(?:INFO|ERROR) - (.+?), RCP test (?:PASSED|FAILED)", output)
    message = said[-1] if said else (output.strip().splitlines() or ["no output"])[-1]
    return RCPVerdict(proc.returncode == 0 and "RCP test PASSED" in output, message, runs, output)


def run_dirs(paths: list[Path]) -> list[Path]:
    """The run directories named, or each folder's run directories (those holding mlperf.log)."""
    found = []
    for path in paths:
        if not path.is_dir():
            raise ConfigError(
                f"{path}: no such directory; give run directories or a folder of them"
            )
        if (path / mlperf.LOG_NAME).is_file():
            found.append(path)
            continue
        inside = sorted(p.parent for p in path.glob(f"*/{mlperf.LOG_NAME}"))
        if not inside:
            raise ConfigError(
                f"{path}: neither a run directory with {mlperf.LOG_NAME} nor a folder of them; "
                "train with log.mlperf=true"
            )
        found += inside
    return found


def table(verdict: RCPVerdict) -> list[str]:
    lines = ["| run | global batch | epochs | top-1 | stopped |", "|---|---|---|---|---|"]
    for run in verdict.runs:
        top1 = f"{run.top1:.4f}" if run.top1 is not None else "-"
        lines.append(
            f"| {run.run_dir} | {run.global_batch or '-'} | {run.epochs if run.epochs is not None else '-'} "
            f"| {top1} | {run.status or 'no run_stop'} |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", type=Path, help="run directories, or folders of them")
    p.add_argument("--json", type=Path, help="also write the verdict and the runs here")
    args = p.parse_args(argv)
    try:
        verdict = check_rcp(run_dirs(args.runs))
    except ConfigError as err:
        print(f"rcp-check: {err}", file=sys.stderr)
        return 2
    print("\n".join(table(verdict)))
    print(
        f"RCP check (ruleset {mlperf.RULESET}): {'PASSED' if verdict.passed else 'FAILED'}: {verdict.message}"
    )
    if args.json:
        command = "./run.sh rcp-check " + shlex.join(argv if argv is not None else sys.argv[1:])
        record = {
            **provenance_record(command),
            "passed": verdict.passed,
            "message": verdict.message,
            "ruleset": mlperf.RULESET,
            "runs": [
                {
                    "run_dir": str(r.run_dir),
                    "global_batch": r.global_batch,
                    "epochs": r.epochs,
                    "top1": r.top1,
                    "status": r.status,
                }
                for r in verdict.runs
            ],
        }
        atomic_write_text(args.json, json.dumps(record, indent=2) + "\n")
    return 0 if verdict.passed else 1


if __name__ == "__main__":
    sys.exit(main())
