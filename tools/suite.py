"""The test suite's outcome as a result file: counts, each skip with its reason, failures, device, SHA.

    python tools/suite.py                          # run the suite here (python -m pytest) and write
                                                   #   results/bench/suite_<device>.json
    python tools/suite.py --out F.json -- -m oldest   # pytest arguments go after --
    python tools/suite.py --junit run.xml --ran "./run.sh test -q --junitxml=run.xml"
                                                   # summarise a finished run (its junit XML) instead;
                                                   # several files: one suite run in parts

On a GPU node the suite runs as it does on CPU: the GPU-only tests (tests/test_gpu.py) run where
CUDA is, and CPU-only expectations follow the hardware. A lent GPU machine has no network, so
``./run.sh test`` cannot install there; the packages travel as wheels (docs/gpu.md) and this script
runs pytest with the interpreter that has them; where one call is too short for the whole suite, run
it in parts (``python -m pytest --junitxml=/tmp/pN.xml FILES``) and summarise them all on the same
machine with ``--junit``. The file names the device, so a GPU summary and the CPU one sit side by
side. Exit status: pytest's.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from dstrain.core.provenance import record as provenance_record  # noqa: E402

OUTCOMES = ("passed", "failed", "error", "skipped")


def by_file(durations: list[tuple[str, float]]) -> list[list]:
    """[test file, seconds, tests] per file, the costliest first: where a suite's time goes (with
    xdist, worker seconds: the wall clock is about their sum divided by the workers)."""
    files: dict[str, list] = {}
    for test, seconds in durations:
        row = files.setdefault(test.split("::")[0], [0.0, 0])
        row[0] += seconds
        row[1] += 1
    ranked = sorted(files.items(), key=lambda item: -item[1][0])
    return [[name, round(seconds, 1), n] for name, (seconds, n) in ranked]


def device_slug() -> str:
    """``nvidia_h100_80gb_hbm3`` on a GPU, ``cpu_2_cores`` without one: the result file's suffix."""
    import torch

    if torch.cuda.is_available():
        name = f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}"
    else:
        name = f"cpu {os.cpu_count()} cores"
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def summarise(junits: list[Path]) -> dict:
    """Counts, skip reasons, failures, the slowest tests and the values tests recorded
    (``record_property``) of pytest junit XML files (one run's parts)."""
    suites = []
    for junit in junits:
        root = ET.parse(junit).getroot()
        suites += [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = dict.fromkeys(OUTCOMES, 0)
    skipped: dict[str, list[str]] = {}
    failed, durations, measured = [], [], {}
    for case in (c for s in suites for c in s.iter("testcase")):
        test = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
        durations.append((test, float(case.get("time") or 0)))
        tags = {child.tag: child for child in case}
        if "properties" in tags:  # values the test recorded (record_property): kept with the run
            measured[test] = {p.get("name"): p.get("value") for p in tags["properties"]}
        outcome = next((t for t in ("failure", "error", "skipped") if t in tags), "passed")
        outcome = {"failure": "failed"}.get(outcome, outcome)
        counts[outcome] += 1
        if outcome == "skipped":
            reason = tags["skipped"].get("message") or "no reason given"
            skipped.setdefault(reason, []).append(test)
        elif outcome != "passed":
            message = tags["failure" if outcome == "failed" else "error"].get("message") or ""
            first_line = (message.splitlines() or [""])[0]
            failed.append({"test": test, "outcome": outcome, "message": first_line})
    durations.sort(key=lambda item: -item[1])
    return {
        "counts": {**counts, "total": sum(counts.values())},
        "wall_s": round(sum(float(s.get("time") or 0) for s in suites), 1),
        "skipped": skipped,
        "failed": failed,
        "slowest": [[test, round(seconds, 1)] for test, seconds in durations[:15]],
        "by_file": by_file(durations),
        "measured": measured,
    }


def progress_outcomes(paths: list[Path]) -> tuple[dict[str, dict], list[str]]:
    """Each finished test's last outcome from tools/pytest_progress.py's lines, and the tests that
    started but never finished (a run cut off while they ran), in order."""
    finished: dict[str, dict] = {}
    running: dict[str, list[dict]] = {}
    for path in paths:
        if not path.is_file():
            continue
        for line in path.read_text().splitlines():
            try:
                event = json.loads(line)
            except json.JSONDecodeError:  # a line cut by a kill
                continue
            nodeid = event["nodeid"]
            if event["event"] == "start":
                running[nodeid] = []
            elif event["event"] == "report":
                running.setdefault(nodeid, []).append(event)
            elif event["event"] == "finish":
                reports = running.pop(nodeid, [])
                finished[nodeid] = _outcome(reports)
            elif event["event"] == "collect":  # a whole file skipped, or not importable
                kind = "skipped" if event["outcome"] == "skipped" else "error"
                finished[nodeid] = {"outcome": kind, "message": event["message"], "duration": 0.0}
    return finished, list(running)


def _outcome(reports: list[dict]) -> dict:
    duration = sum(r["duration"] for r in reports)
    properties = {k: v for r in reports for k, v in r.get("properties", {}).items()}
    for r in reports:
        if r["outcome"] == "failed":
            kind = "failed" if r["when"] == "call" else "error"
            return {"outcome": kind, "message": r["message"], "duration": duration}
    for r in reports:
        if r["outcome"] == "skipped":
            return {"outcome": "skipped", "message": r["message"], "duration": duration}
    return {"outcome": "passed", "message": "", "duration": duration, "properties": properties}


def summarise_progress(paths: list[Path], cut: list[str] = ()) -> dict:
    """:func:`summarise`'s shape from progress lines; ``cut``: tests given up on (a job's limit
    stopped them twice), counted apart."""
    finished, _ = progress_outcomes(paths)
    counts = dict.fromkeys(OUTCOMES, 0)
    skipped: dict[str, list[str]] = {}
    failed, measured = [], {}
    for test, o in finished.items():
        counts[o["outcome"]] += 1
        if o["outcome"] == "skipped":
            skipped.setdefault(o["message"] or "no reason given", []).append(test)
        elif o["outcome"] != "passed":
            failed.append({"test": test, "outcome": o["outcome"], "message": o["message"]})
        if o.get("properties"):
            measured[test] = o["properties"]
    slowest = sorted(finished.items(), key=lambda item: -item[1]["duration"])[:15]
    return {
        "counts": {**counts, "cut": len(cut), "total": sum(counts.values()) + len(cut)},
        "wall_s": round(sum(o["duration"] for o in finished.values()), 1),
        "skipped": skipped,
        "failed": failed,
        "cut": list(cut),
        "slowest": [[test, round(o["duration"], 1)] for test, o in slowest],
        "by_file": by_file([(test, o["duration"]) for test, o in finished.items()]),
        "measured": measured,
    }


def headline(d: dict) -> str:
    """``750 passed, 6 skipped, 0 failed in 19 min 31 s``: how README quotes a suite result."""
    c = d["counts"]
    minutes, seconds = divmod(round(d["wall_s"]), 60)
    return (
        f"{c['passed']} passed, {c['skipped']} skipped, {c['failed'] + c['error']} failed "
        f"in {minutes} min {seconds} s"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="result file (default results/bench/suite_<device>.json)")
    p.add_argument(
        "--junit",
        type=Path,
        nargs="+",
        help="summarise these junit XML files instead of running pytest",
    )
    p.add_argument(
        "--ran",
        help="with --junit: the commands that wrote them (recorded; default: the XML files' names)",
    )
    p.add_argument("--note", help="how the machine was loaded, or anything else a reader needs")
    p.add_argument("pytest_args", nargs="*", help="after --: arguments for pytest")
    args = p.parse_args()
    for junit in args.junit or []:
        if not junit.is_file():
            p.error(f"--junit {junit}: no such file")
    out = Path(args.out or REPO / f"results/bench/suite_{device_slug()}.json")
    record = provenance_record(f"python tools/suite.py {shlex.join(sys.argv[1:])}")
    if args.junit:
        # what ran: as the caller says, else the XML files' names (the record never goes without)
        ran = args.ran or "pytest runs that wrote " + " ".join(str(j) for j in args.junit)
        status, junits = None, args.junit
    else:
        junit = Path(tempfile.mkdtemp(prefix="dstrain-suite-")) / "junit.xml"
        junits = [junit]
        cmd = [sys.executable, "-m", "pytest", f"--junitxml={junit}", *args.pytest_args]
        ran = "python -m pytest " + " ".join(args.pytest_args)
        print(f"[suite] {ran.strip()} (junit XML: {junit})", flush=True)
        status = subprocess.run(cmd, cwd=REPO).returncode
        if not junit.is_file():
            print(f"[suite] pytest wrote no junit XML (exit {status}); nothing recorded")
            return status or 1
    record.update(ran=ran.strip(), exit_status=status, **summarise(junits))
    if args.note:
        record["note"] = args.note
    from bench.common import write_result

    where = record["cuda"] or "CPU"
    write_result(
        out, record, title=f"Test suite on {where}: {ran.strip()}", headline=headline(record)
    )
    print(f"[suite] {headline(record)} on {record['cuda'] or 'CPU'} -> {out}")
    return status or 0


if __name__ == "__main__":
    sys.exit(main())
