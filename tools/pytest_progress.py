"""A pytest plugin: every test's start, outcome and end as one JSON line, written as it happens.

    DSTRAIN_PYTEST_PROGRESS=progress.jsonl python -m pytest -p tools.pytest_progress ...

A run killed at a job's time limit writes no junit XML; these lines survive it. ``./run.sh gpu tests``
(tools/gpu_run.py) reads them to continue the next job with the tests not yet finished (a test that
was running when a job was cut twice is not started a third time) and ``tools/suite.py`` summarises
them like junit XML. Under pytest-xdist (``-n N``) the controller writes, as the reports arrive.
"""

from __future__ import annotations

import json
import os
import time

_XDIST_WORKER = False  # set in pytest_configure: this process is a pytest-xdist worker


def pytest_configure(config):
    # under pytest-xdist the controller gets every worker's reports: it alone writes (the
    # environment cannot tell: a pytest started by a test on a worker inherits its variables)
    global _XDIST_WORKER
    _XDIST_WORKER = hasattr(config, "workerinput")


def _write(record: dict) -> None:
    path = os.environ.get("DSTRAIN_PYTEST_PROGRESS")
    if not path or _XDIST_WORKER:
        return
    with open(path, "a") as fh:
        fh.write(json.dumps(record) + "\n")


def pytest_runtest_logstart(nodeid, location):
    _write({"event": "start", "nodeid": nodeid, "t": round(time.time(), 3)})


def pytest_runtest_logreport(report):
    if report.when != "call" and report.outcome == "passed":
        return
    message = ""
    if report.skipped and isinstance(report.longrepr, tuple):
        message = str(report.longrepr[2]).removeprefix("Skipped: ")
    elif report.failed:
        message = (str(report.longrepr).strip().splitlines() or [""])[-1]
    _write(
        {
            "event": "report",
            "nodeid": report.nodeid,
            "when": report.when,
            "outcome": report.outcome,
            "duration": round(report.duration, 3),
            "message": message[:500],
            "properties": {k: str(v) for k, v in getattr(report, "user_properties", [])},
        }
    )


def pytest_collectreport(report):
    """A file skipped whole (``importorskip`` at module level) or failing to import: recorded as
    one finished item, so neither disappears from the counts."""
    if report.outcome == "passed" or not report.nodeid:
        return
    if report.skipped and isinstance(report.longrepr, tuple):
        message = str(report.longrepr[2]).removeprefix("Skipped: ")
    else:
        message = (str(report.longrepr).strip().splitlines() or [""])[-1]
    _write(
        {
            "event": "collect",
            "nodeid": report.nodeid,
            "outcome": report.outcome,
            "message": message[:500],
        }
    )


def pytest_runtest_logfinish(nodeid, location):
    _write({"event": "finish", "nodeid": nodeid, "t": round(time.time(), 3)})
