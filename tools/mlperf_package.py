"""Build an MLPerf Training submission package from five dstrain runs, and judge it with MLPerf's
own package checker and result summarizer (``./run.sh mlperf-package``).

    ./run.sh mlperf-package --template > my_system.json      # the system description to fill in
    ./run.sh mlperf-package runs/b3264-s{0,1,2,3,4} --system my_system.json --org MyOrg \\
        --out submission                                     # or a folder holding the five runs

Writes, as MLPerf's submission rules lay it out (ruleset 4.0.0, the last with ResNet)::

    OUT/ORG/systems/<system>.json                                  the system description
    OUT/ORG/results/<system>/resnet/result_{0..4}.txt              each run's mlperf.log
    OUT/ORG/benchmarks/resnet/implementations/dstrain/             the code the runs ran (git
                                                                   archive of their commit) and a
                                                                   README with each run's command

then runs ``python -m mlperf_logging.package_checker OUT/ORG training 4.0.0`` (it exits 0 whatever
it finds: its last line is read) and ``python -m mlperf_logging.result_summarizer OUT/ORG training
4.0.0 --csv OUT/summary.csv`` (the olympic mean of the five run times, in minutes), and records
what it did in ``OUT/package.json`` (the command, commit, date, the checker's verdict). Refused before
anything is written, in one line each: not exactly 5 runs (MLPerf's ResNet result), a run without
``mlperf.log`` or resumed (``mlperf-2.log``), two runs with the same seed, runs of different global
batches, divisions or commits, a system description missing any of the 33 fields MLPerf's
system_desc_checker requires (each named) or with a status outside its list, and an OUT that
exists. Exit 0 the checker found no errors, 1 it found some (its error lines printed), 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from dstrain.core.errors import ConfigError  # noqa: E402
from dstrain.core.files import atomic_write_text  # noqa: E402
from dstrain.core.provenance import record as provenance_record  # noqa: E402
from dstrain.loop import mlperf  # noqa: E402
from tools.rcp_check import (  # noqa: E402
    RUNS_PER_RESNET_RESULT,
    RunConvergence,
    convergence,
    refuse_repeated_seeds,
    run_dirs,
)

# mlperf-logging 4.1.68, system_desc_checker: the fields a training system description must hold
SYSTEM_FIELDS = (
    "submitter", "division", "status", "system_name", "number_of_nodes",
    "host_processors_per_node", "host_processor_model_name", "host_processor_core_count",
    "host_processor_vcpu_count", "host_processor_frequency", "host_processor_caches",
    "host_processor_interconnect", "host_memory_capacity", "host_storage_type",
    "host_storage_capacity", "host_networking", "host_networking_topology",
    "host_memory_configuration", "accelerators_per_node", "accelerator_model_name",
    "accelerator_host_interconnect", "accelerator_frequency", "accelerator_on-chip_memories",
    "accelerator_memory_configuration", "accelerator_memory_capacity", "accelerator_interconnect",
    "accelerator_interconnect_topology", "cooling", "hw_notes", "framework",
    "other_software_stack", "operating_system", "sw_notes",
)  # fmt: skip
# its status list for training, ruleset 4 and later (the log's submission_status is another list)
SYSTEM_STATUS = (
    "Available on-premise",
    "Available cloud",
    "Research, Development, or Internal (RDI)",
    "Preview",
)
COUNTS = (
    "number_of_nodes",
    "host_processors_per_node",
    "accelerators_per_node",
)  # int() by the summarizer
IMPLEMENTATION = "dstrain"
CHECKER_OK = "PACKAGE CHECKER FOUND NO ERRORS"


def template() -> dict:
    """A system description with every required field: an ABCI 3.0 node as the example."""
    example = {
        "submitter": "MyOrg",
        "division": "closed",
        "status": "Research, Development, or Internal (RDI)",
        "system_name": "ABCI 3.0 (1 node, 8x H200)",
        "number_of_nodes": "1",
        "host_processors_per_node": "2",
        "host_processor_model_name": "Intel Xeon Platinum 8558",
        "host_processor_core_count": "48",
        "host_processor_vcpu_count": "96",
        "host_processor_frequency": "2100 MHz",
        "host_processor_caches": "",
        "host_processor_interconnect": "",
        "host_memory_capacity": "2 TB",
        "host_storage_type": "NVMe SSD",
        "host_storage_capacity": "",
        "host_networking": "InfiniBand NDR 200 Gb/s x 8",
        "host_networking_topology": "",
        "host_memory_configuration": "",
        "accelerators_per_node": "8",
        "accelerator_model_name": "NVIDIA H200",
        "accelerator_host_interconnect": "PCIe 5.0 x16",
        "accelerator_frequency": "",
        "accelerator_on-chip_memories": "",
        "accelerator_memory_configuration": "HBM3e",
        "accelerator_memory_capacity": "141 GB",
        "accelerator_interconnect": "NVLink",
        "accelerator_interconnect_topology": "",
        "cooling": "",
        "hw_notes": "",
        "framework": "dstrain (PyTorch, DeepSpeed)",
        "other_software_stack": "",
        "operating_system": "",
        "sw_notes": "",
    }
    assert tuple(example) == SYSTEM_FIELDS
    return example


def read_system(path: Path, division: str) -> dict:
    """The system description, refused naming every missing field, a status outside MLPerf's list,
    a division that is not the logs', a count that is not an integer."""
    try:
        system = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(f"--system {path}: not a readable JSON file ({err})") from None
    missing = [field for field in SYSTEM_FIELDS if field not in system]
    if missing:
        raise ConfigError(
            f"--system {path}: missing {len(missing)} of the fields MLPerf's system_desc_checker "
            f"requires: {', '.join(missing)} (./run.sh mlperf-package --template lists them all)"
        )
    if system["status"] not in SYSTEM_STATUS:
        raise ConfigError(
            f"--system {path}: status {system['status']!r} is not one of {list(SYSTEM_STATUS)} "
            "(MLPerf's list for a system description; the log's submission_status is another)"
        )
    if system["division"] != division:
        raise ConfigError(
            f"--system {path}: division {system['division']!r}, but the runs log "
            f"submission_division {division!r}; they must agree"
        )
    for field in COUNTS:
        if not str(system[field]).isdigit():
            raise ConfigError(f"--system {path}: {field}={system[field]!r} must be an integer")
    return system


class RunFacts(NamedTuple):
    """What a run's log and meta.json say that the package needs to agree across runs: the
    convergence record (seed, global batch, division are read from it), the commit and command."""

    run_dir: Path
    found: RunConvergence
    sha: str | None
    command: str | list[str] | None

    @property
    def seed(self) -> int:
        return self.found.seed

    @property
    def global_batch(self) -> int:
        return self.found.global_batch

    @property
    def division(self) -> str:
        return self.found.division


def run_facts(run_dir: Path) -> RunFacts:
    found = convergence(run_dir)  # refuses a missing or resumed log
    meta_path = run_dir / "meta.json"
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    return RunFacts(run_dir, found, meta.get("git_sha"), meta.get("command"))


def check_runs(runs: list[RunFacts]) -> None:
    if len(runs) != RUNS_PER_RESNET_RESULT:
        raise ConfigError(
            f"{len(runs)} run(s) given: an MLPerf ResNet result is exactly "
            f"{RUNS_PER_RESNET_RESULT} runs with different seeds; give 5 run directories"
        )
    refuse_repeated_seeds([run.found for run in runs])
    for key, what in (
        ("global_batch", "global batches"),
        ("division", "divisions"),
        ("sha", "commits"),
    ):
        values = {str(getattr(run, key)) for run in runs}
        if len(values) > 1:
            raise ConfigError(
                f"the runs differ in their {what} ({', '.join(sorted(values))}): a result's five "
                "runs are one configuration of one code"
            )
    if runs[0].sha in (None, "unknown") or str(runs[0].sha).endswith("-dirty"):
        raise ConfigError(
            f"{runs[0].run_dir}: ran at {runs[0].sha!r}, not a commit: the package's "
            "implementation must be the code the runs ran; train from a committed tree"
        )


def as_typed(command: str | list[str] | None) -> str:
    """A run's command (meta.json keeps its sys.argv) as a user types it again in the package's
    folder: ``python -m dstrain ...`` for the path Python gave ``dstrain/__main__.py``, the
    launcher's script as ``dstrain/main.py``."""
    if not isinstance(command, list) or not command:
        return str(command)
    head, args = command[0], shlex.join(command[1:])
    if head.endswith("dstrain/__main__.py"):
        return f"python -m dstrain {args}"
    if head.endswith("dstrain/main.py"):
        return f"python dstrain/main.py {args}"
    return shlex.join(command)


def write_package(runs: list[RunFacts], system: dict, system_id: str, org: Path) -> None:
    (org / "systems").mkdir(parents=True)
    (org / "systems" / f"{system_id}.json").write_text(json.dumps(system, indent=2) + "\n")
    results = org / "results" / system_id / mlperf.BENCHMARK
    results.mkdir(parents=True)
    for i, run in enumerate(runs):
        shutil.copyfile(run.run_dir / mlperf.LOG_NAME, results / f"result_{i}.txt")
    impl = org / "benchmarks" / mlperf.BENCHMARK / "implementations" / IMPLEMENTATION
    impl.mkdir(parents=True)
    sha = runs[0].sha
    archive = subprocess.run(
        ["git", "archive", "--format=tar", sha], cwd=REPO, capture_output=True, check=False
    )
    if archive.returncode:
        raise ConfigError(f"git archive {sha}: {archive.stderr.decode().strip()[:200]}")
    subprocess.run(["tar", "-x", "-C", str(impl)], input=archive.stdout, check=True)
    lines = [
        f"# dstrain: MLPerf Training {mlperf.BENCHMARK} ({system['system_name']})",
        "",
        f"The code at commit {sha} (this folder). Each result's run, as it was started:",
        "",
    ]
    for i, run in enumerate(runs):
        lines += [f"- result_{i}.txt (seed {run.seed}): `{as_typed(run.command)}`"]
    lines += [
        "",
        "Data preprocessing, traversal order, model, initialization, optimizer, hyperparameters,",
        "evaluation frequency and method: docs/mlperf.md, docs/data.md and the recipe each command",
        "names (dstrain/recipes/).",
        "",
    ]
    (impl / "README.md").write_text("\n".join(lines))


def judge(org: Path, out: Path) -> tuple[bool, list[str], str]:
    """(package checker passed, its error lines, the summarizer's output)."""
    log = out / "package_checker.log"
    checker = subprocess.run(
        [sys.executable, "-m", "mlperf_logging.package_checker", str(org), "training",
         mlperf.RULESET, "--log_output", str(log)],
        cwd=out, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    text = checker.stdout + checker.stderr + (log.read_text() if log.is_file() else "")
    errors = [
        line.strip() for line in text.splitlines() if "ERROR" in line and CHECKER_OK not in line
    ]
    summarizer = subprocess.run(
        [sys.executable, "-m", "mlperf_logging.result_summarizer", str(org), "training",
         mlperf.RULESET, "--csv", str(out / "summary.csv")],
        cwd=out, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    return CHECKER_OK in text, errors, summarizer.stdout + summarizer.stderr


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="*", type=Path, help="5 run directories, or a folder of them")
    p.add_argument("--system", type=Path, help="the system description (JSON; see --template)")
    p.add_argument("--org", default="dstrain", help="the submitting organization's folder name")
    p.add_argument(
        "--system-id", default="", help="the system's file name (default: from --system)"
    )
    p.add_argument("--out", type=Path, help="where the package goes (must not exist)")
    p.add_argument("--template", action="store_true", help="print a system description to fill in")
    args = p.parse_args(argv)
    if args.template:
        print(json.dumps(template(), indent=2))
        return 0
    if not args.runs or args.system is None or args.out is None:
        p.error("give the runs, --system FILE and --out DIR (or --template)")
    try:
        if args.out.exists():
            raise ConfigError(f"--out {args.out}: exists; choose a new folder")
        runs = [run_facts(d) for d in run_dirs(args.runs)]
        check_runs(runs)
        system = read_system(args.system, runs[0].division)
        system_id = args.system_id or args.system.stem
        partial = args.out.with_name(args.out.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        write_package(runs, system, system_id, partial / args.org)
        partial.rename(args.out)
    except ConfigError as err:
        print(f"mlperf-package: {err}", file=sys.stderr)
        return 2
    org = args.out / args.org
    passed, errors, summary = judge(org, args.out)
    command = "./run.sh mlperf-package " + " ".join(argv if argv is not None else sys.argv[1:])
    verdict = {
        **provenance_record(command),
        "package": str(org),
        "ruleset": mlperf.RULESET,
        "package_checker_passed": passed,
        "package_checker_errors": errors,
        "runs": [{"run_dir": str(r.run_dir), "seed": r.seed, "git_sha": r.sha} for r in runs],
    }
    atomic_write_text(args.out / "package.json", json.dumps(verdict, indent=2) + "\n")
    print(f"{org}: {len(runs)} results of {system['system_name']} ({runs[0].division} division)")
    if passed:
        print(f"MLPerf's package checker (ruleset {mlperf.RULESET}): no errors")
    else:
        print(f"MLPerf's package checker (ruleset {mlperf.RULESET}): errors", file=sys.stderr)
        print("\n".join(errors[:20]), file=sys.stderr)
    if (args.out / "summary.csv").is_file():
        print(f"result summarizer: {args.out / 'summary.csv'}")
    else:
        print(f"result summarizer wrote nothing: {summary.strip()[-500:]}", file=sys.stderr)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
