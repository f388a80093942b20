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
import shlex
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from dstrain.core.errors import ConfigError  # noqa: E402
from dstrain.core.files import atomic_write_text  # noqa: E402
from dstrain.core.provenance import record as provenance_record  # noqa: E402
from dstrain.loop import mlperf  # noqa: E402


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


def table(verdict: mlperf.RCPVerdict) -> list[str]:
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
        verdict = mlperf.check_rcp(run_dirs(args.runs))
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
