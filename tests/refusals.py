"""Many refusals of ``python -m dstrain`` in one process (tests/test_cli_errors.py's CASES), and the
fence around them: every refusal of input is made by the start-up checks, before anything is
written.

    python -m tests.refusals CASES.json RESULTS.json

CASES.json is a list of argument lists; RESULTS.json gets, for each, what ``python -m dstrain ARGS``
shows: the exit status, stdout and stderr (file descriptors 1 and 2, so that logging, warnings and a
traceback are all caught), and an exception that escaped ``main`` with its traceback, as the
interpreter would print it. One process instead of one per case: starting Python with torch and
DeepSpeed costs 3-8 s on 2 cores, the refusal itself well under one.

The fence is found, not listed: every function of dstrain/ that raises a refusal
(:data:`REFUSAL` in its own body: :func:`refusal_checks`) is watched while each case runs, and
:func:`fence_breaches` names a case refused after the start-up checks (dstrain/run/startup.py)
returned, and a refusal check the run entered after them that they had not made first (one
``--check`` cannot make), such as a resume refusing what start-up let through.
"""

from __future__ import annotations

import ast
import json
import os
import sys
import tempfile
import threading
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
REFUSAL = "ConfigError"  # dstrain.core.errors: bad input, exit 2, one line
# refusal checks the run makes after start-up by design, each with why start-up cannot make it
AFTER_STARTUP_BY_DESIGN = {
    "dstrain.loop.checkpoint:load": "the backstop for DeepSpeed's own load errors that compat.py "
    "did not foresee (dstrain/run/compat.py refuses the known causes at start-up)",
    "dstrain.core.safe_load:load_data": "the backstop of refuse_code, which start-up ran on every "
    "file of the checkpoint it resumes (checkpoint.refuse_foreign_code)",
    "dstrain.run.rundir:create": "the backstop for a directory that changed since start-up "
    "(startup.check_creatable and rundir.in_use refused what they could see then)",
    "dstrain.run.rundir:hold": "the lock itself: a run that started in the same directory since "
    "start-up probed it (rundir.in_use)",
    "dstrain.data.fashion_mnist:read_idx": "reading the data: a truncated idx file shows only when "
    "read whole (startup.py's documented exception; start-up reads the headers)",
    # found by this fence: start-up reads the image files' headers only, so a missing or
    # mismatched label file is refused here, after the run directory was made (left open)
    "dstrain.data.fashion_mnist:load_fashion_mnist": "reading the data (see the note above)",
}


def refusal_checks(package: Path = REPO / "dstrain") -> dict[tuple[str, int], str]:
    """(file, first line of its code object) -> ``module:qualified name`` of every function or
    method in ``package`` whose own body (nested functions apart) raises :data:`REFUSAL`."""
    found = {}
    for path in sorted(package.rglob("*.py")):
        module = ".".join(path.relative_to(package.parent).with_suffix("").parts)
        module = module.removesuffix(".__init__")
        _collect(ast.parse(path.read_text()), str(path.resolve()), f"{module}:", found)
    return found


def _collect(node: ast.AST, path: str, prefix: str, found: dict) -> None:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.ClassDef):
            _collect(child, path, f"{prefix}{child.name}.", found)
        elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
            if _raises_refusal(child):
                first = min([child.lineno] + [d.lineno for d in child.decorator_list])
                found[(path, first)] = f"{prefix}{child.name}"
            _collect(child, path, f"{prefix}{child.name}.", found)


def _raises_refusal(function: ast.AST) -> bool:
    todo = list(ast.iter_child_nodes(function))
    while todo:
        node = todo.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda | ast.ClassDef):
            continue  # its own function: watched on its own
        if isinstance(node, ast.Raise) and node.exc is not None:
            exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            if getattr(exc, "id", getattr(exc, "attr", None)) == REFUSAL:
                return True
        todo.extend(ast.iter_child_nodes(node))
    return False


def fence_breaches(shown: dict) -> list[str]:
    """What one case's result (:func:`refuse`'s) says against the fence, in words; [] holds it."""
    out = []
    if shown["after_startup"] and shown["returncode"] == 2:
        out.append("refused after the start-up checks passed")
    made_first = set(shown["checks_in_startup"])
    for check in shown["checks_after_startup"]:
        if check not in made_first and check not in AFTER_STARTUP_BY_DESIGN:
            out.append(
                f"{check} can refuse after the start-up checks, which do not make it first "
                "(call it from dstrain/run/startup.py too, as the run's own check)"
            )
    return out


def refuse(args: list[str], checks: dict | None = None) -> dict:
    """``python -m dstrain *args`` in this process: its exit status and output, whether the
    start-up checks (dstrain/run/startup.py) had passed before it ended (``after_startup``), and
    the refusal checks (``checks``, :func:`refusal_checks`) it entered before and after that."""
    from dstrain.main import main
    from dstrain.run import startup

    checks = refusal_checks() if checks is None else checks
    captured: dict = {"after_startup": False}
    entered: dict[bool, set[str]] = {False: set(), True: set()}
    check = startup.check

    def fenced(*a, **kw):
        start = check(*a, **kw)
        captured["after_startup"] = True
        return start

    def watch(frame, event, _arg):
        # a trace function: called once per Python call (a profile function would also be called
        # on every return and C call, about three times the callbacks); None: no line tracing
        code = frame.f_code
        name = checks.get((code.co_filename, code.co_firstlineno))
        if name is not None:
            entered[captured["after_startup"]].add(name)

    startup.check = fenced
    sys.settrace(watch)
    threading.settrace(watch)  # loader and watchdog threads
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        saved = {fd: os.dup(fd) for fd in (1, 2)}
        sys.stdout.flush(), sys.stderr.flush()
        os.dup2(out.fileno(), 1), os.dup2(err.fileno(), 2)
        try:
            try:
                code = main(args)
            except SystemExit as e:  # argparse, or sys.exit inside
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            except BaseException:  # what `python -m dstrain` would die with: a traceback, exit 1
                traceback.print_exc()
                code = 1
            sys.stdout.flush(), sys.stderr.flush()
        finally:
            sys.settrace(None)
            threading.settrace(None)
            startup.check = check
            for fd, copy in saved.items():
                os.dup2(copy, fd)
                os.close(copy)
        for name, f in (("stdout", out), ("stderr", err)):
            f.seek(0)
            captured[name] = f.read()
    captured["checks_in_startup"] = sorted(entered[False])
    captured["checks_after_startup"] = sorted(entered[True])
    return {"returncode": code, **captured}


def main() -> int:
    cases_file, results_file = sys.argv[1:3]
    cases = json.loads(open(cases_file).read())
    checks = refusal_checks()
    results = [refuse(args, checks) for args in cases]
    with open(results_file, "w") as fh:
        json.dump(results, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
