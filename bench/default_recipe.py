"""Measure a recipe end to end (default: what `./run.sh train` runs): accuracy and wall time.

    .venv/bin/python bench/default_recipe.py                  # -> results/bench/default_recipe.json
    .venv/bin/python bench/default_recipe.py --config fashion_mnist_lars [key=value ...]
                                                              # -> results/bench/recipe_fashion_mnist_lars.json

Runs `python -m dstrain --config RECIPE [overrides]` in a fresh run directory, then records
the summary, the whole command's wall time (start-up included), the machine and the git SHA.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main() -> int:
    extra = sys.argv[1:]
    recipe = "fashion_mnist"
    if extra[:1] == ["--config"] and len(extra) > 1:
        recipe, extra = extra[1], extra[2:]
    name = "default_recipe" if recipe == "fashion_mnist" and not extra else f"recipe_{recipe}"
    out = REPO / "results" / "bench" / f"{name}.json"
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        sys.path.insert(0, str(REPO))
        from bench.common import TRAINER, run_trainer

        summary = run_trainer([*TRAINER, "--config", recipe, f"run_dir={run_dir}", *extra], run_dir)
        wall = summary["command_wall_s"]
        log_tail = [
            line for line in summary["stdout"].splitlines() if "done:" in line or "summary:" in line
        ]
    from bench.common import provenance

    result = {  # git_sha: "-dirty" when the working tree differs from the commit
        **provenance("", command=f"python -m dstrain --config {recipe} " + " ".join(extra)),
        "machine": {
            "cpu": cpu_model(),
            "cores": os.cpu_count(),
            "gpu": None,
            "python": platform.python_version(),
        },
        "final_top1": summary["final_top1"],
        "best_top1": summary["best_top1"],
        "epochs": summary["epochs"],
        "train_wall_time_s": round(summary["wall_time_s"], 1),
        "command_wall_time_s": round(wall, 1),
        "images_per_sec": round(summary["images_per_sec"], 1),
        "per_epoch": summary["history"],
        "log": log_tail,
    }
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"top-1 {result['final_top1']:.4f} after {result['epochs']} epochs, training {result['train_wall_time_s']} s, "
        f"whole command {result['command_wall_time_s']} s -> {out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
