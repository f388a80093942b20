"""What a process pays before it trains and as it exits: the imports of a rank, what dstrain's
import guard saves, and what dstrain's exit (dstrain/core/process.py) saves.

    .venv/bin/python bench/startup.py --repeats 7            # -> results/bench/startup_cpu.json

Every rank of every run, and each of DeepSpeed's launcher processes, starts a Python that imports
torch, DeepSpeed and (through torch's Optimizer constructor) torch._dynamo; the test suite starts
hundreds of them. Each statement below runs in a fresh interpreter (``python -c``), timed from the
parent as its wall time; the statements alternate within a repeat, in an order rotated each repeat,
so a machine busy with other work slows all of them alike. Per statement: every time and the median;
derived per repeat (so each difference is taken between processes run side by side), with the
median, min and max:

- ``torch_s``: ``import torch`` over a bare interpreter;
- ``dynamo_s``: ``torch._dynamo`` over torch alone;
- ``deepspeed_s``: DeepSpeed (guarded, as a rank imports it) over torch and dstrain;
- ``config_error``'s time itself: a typo in an override refused by ``python -m dstrain``'s main
  (the log set-up imports no torch, so neither does a refused config);
- ``guard_saves_s``: ``import deepspeed`` bare over ``import dstrain, deepspeed``: what
  ``dstrain/core/import_guard.py`` saves a process by keeping DeepSpeed's autotuner from importing
  MLflow (zero, within noise, where MLflow is not installed; each statement's run says whether MLflow
  ended up loaded, and the file records whether it is installed);
- ``exit_saves_s``: ``import dstrain, deepspeed`` ending as the interpreter ends it over the same
  ended as every dstrain command ends (``dstrain.core.process.run``): the interpreter's teardown of
  that heap, which it skips. A rank's heap also holds its model and engine, so a rank saves at least
  this.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.common import provenance, write_result  # noqa: E402

# name -> what the fresh interpreter runs; each prints whether MLflow got imported
STATEMENTS = {
    "python": "pass",
    "torch": "import torch",
    "torch_dynamo": "import torch, torch._dynamo",
    "dstrain": "import torch, dstrain",
    "deepspeed_guarded": "import dstrain, deepspeed",
    "deepspeed": "import deepspeed",
    # the same heap, ended as dstrain's commands end (after the probe)
    "deepspeed_ended": "import dstrain, deepspeed",
    # a typo in an override, refused by the real main(): its one line goes to /dev/null
    "config_error": "import os, sys; sys.stderr = open(os.devnull, 'w'); "
    "from dstrain.main import main; assert main(['epochs=abc']) == 2",
}
# derived -> (statement, minus statement)
DERIVED = {
    "torch_s": ("torch", "python"),
    "dynamo_s": ("torch_dynamo", "torch"),
    "deepspeed_s": ("deepspeed_guarded", "dstrain"),
    "guard_saves_s": ("deepspeed", "deepspeed_guarded"),
    "exit_saves_s": ("deepspeed_guarded", "deepspeed_ended"),
}
PROBE = "; import sys; print('mlflow' in sys.modules)"
# statements that end as dstrain's commands end, after the probe
ENDING = "; from dstrain.core import process; process.run(lambda: 0)"
ENDED = {"deepspeed_ended"}


def time_statement(code: str, env: dict, ended: bool = False) -> tuple[float, bool]:
    """Wall seconds of ``python -c code`` from the repository root, and whether MLflow was loaded;
    ``ended``: the process ends as dstrain's commands end."""
    script = code + PROBE + (ENDING if ended else "")
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True
    )
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"bench/startup.py: `python -c {code!r}` failed:\n{proc.stderr[-2000:]}")
    return wall, proc.stdout.strip().splitlines()[-1] == "True"


def rotated(names: list[str], repeat: int) -> list[str]:
    k = repeat % len(names)
    return names[k:] + names[:k]


def derive(times: dict[str, list[float]]) -> dict[str, dict]:
    """Each derived difference per repeat (its two statements ran in the same repeat), with its
    median, min and max; only those whose two statements were both timed."""
    out = {}
    for name, (a, b) in DERIVED.items():
        if a in times and b in times:
            per_repeat = [x - y for x, y in zip(times[a], times[b])]
            out[name] = {
                "per_repeat": per_repeat,
                "median": statistics.median(per_repeat),
                "min": min(per_repeat),
                "max": max(per_repeat),
                "of": [a, b],
            }
    return out


def headline(result: dict) -> str:
    """The import costs, the guard's saving and a refused config's time: those that were timed."""
    derived, statements = result["derived"], result["statements"]
    named = {
        "torch_s": "torch",
        "dynamo_s": "torch._dynamo",
        "deepspeed_s": "DeepSpeed",
    }
    parts = [
        ", ".join(f"{w} {derived[k]['median']:.2f} s" for k, w in named.items() if k in derived)
    ]
    if "guard_saves_s" in derived:
        parts.append(f"the guard saves {derived['guard_saves_s']['median']:.2f} s a process")
    if "exit_saves_s" in derived:
        parts.append(f"dstrain's exit saves {derived['exit_saves_s']['median']:.2f} s a process")
    if "config_error" in statements:
        parts.append(f"a refused config {statements['config_error']['median_s']:.2f} s")
    if not any(parts):  # statements with nothing to subtract: their own times
        parts = [", ".join(f"{n} {s['median_s']:.2f} s" for n, s in statements.items())]
    return "; ".join(p for p in parts if p)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=7, help="times each statement runs (default 7)")
    p.add_argument(
        "--only",
        nargs="+",
        choices=list(STATEMENTS),
        help="time these statements alone (default: all)",
    )
    p.add_argument("--out", type=Path, default=REPO / "results/bench/startup_cpu.json")
    p.add_argument(
        "--note", default="", help="what the machine was doing besides (kept in the file)"
    )
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    names = args.only or list(STATEMENTS)
    # one thread a process, as the suite's workers and the CPU ranks run; no inherited guard
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    times: dict[str, list[float]] = {n: [] for n in names}
    mlflow_loaded: dict[str, bool] = {}
    for r in range(args.repeats):
        for name in rotated(names, r):
            wall, loaded = time_statement(STATEMENTS[name], env, ended=name in ENDED)
            times[name].append(wall)
            mlflow_loaded[name] = loaded
        print(
            f"repeat {r + 1}/{args.repeats}: "
            + ", ".join(f"{n} {times[n][-1]:.2f} s" for n in names),
            flush=True,
        )
    result = {
        **provenance("startup.py", argv),
        "repeats": args.repeats,
        "omp_num_threads": 1,
        "mlflow_installed": importlib.util.find_spec("mlflow") is not None,
        "statements": {
            n: {
                "code": STATEMENTS[n],
                "ended_as_dstrain_ends": n in ENDED,
                "wall_s": times[n],
                "median_s": statistics.median(times[n]),
                "mlflow_loaded": mlflow_loaded[n],
            }
            for n in names
        },
        "derived": derive(times),
        "note": args.note,
    }
    title = (
        "What a process pays to start and to end; the import guard's and dstrain's exit's savings"
    )
    if args.only:
        title += f" ({', '.join(names)} only)"
    write_result(args.out, result, title=title, headline=headline(result))
    for name, d in result["derived"].items():
        print(f"{name}: median {d['median']:.2f} s ({d['min']:.2f} to {d['max']:.2f})")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
