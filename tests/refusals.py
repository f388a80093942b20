"""Many refusals of ``python -m dstrain`` in one process (tests/test_cli_errors.py's CASES).

    python -m tests.refusals CASES.json RESULTS.json

CASES.json is a list of argument lists; RESULTS.json gets, for each, what ``python -m dstrain ARGS``
shows: the exit status, stdout and stderr (file descriptors 1 and 2, so that logging, warnings and a
traceback are all caught), and an exception that escaped ``main`` with its traceback, as the
interpreter would print it. One process instead of one per case: starting Python with torch and
DeepSpeed costs 3-8 s on 2 cores, the refusal itself well under one.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import traceback


def refuse(args: list[str]) -> dict:
    """``python -m dstrain *args`` in this process: its exit status and output, and whether the
    start-up checks (dstrain/run/startup.py) had passed before it ended (``after_startup``): a refusal
    of input made after them is one ``--check`` cannot make (issue 53's fence)."""
    from dstrain.main import main
    from dstrain.run import startup

    captured = {"after_startup": False}
    check = startup.check

    def fenced(*a, **kw):
        start = check(*a, **kw)
        captured["after_startup"] = True
        return start

    startup.check = fenced
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
            startup.check = check
            for fd, copy in saved.items():
                os.dup2(copy, fd)
                os.close(copy)
        for name, f in (("stdout", out), ("stderr", err)):
            f.seek(0)
            captured[name] = f.read()
    return {"returncode": code, **captured}


def main() -> int:
    cases_file, results_file = sys.argv[1:3]
    cases = json.loads(open(cases_file).read())
    results = [refuse(args) for args in cases]
    with open(results_file, "w") as fh:
        json.dump(results, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
