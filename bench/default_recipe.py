"""Measure a recipe end to end (default: what `./run.sh train` runs): accuracy and wall time.

    .venv/bin/python bench/default_recipe.py                  # -> results/bench/default_recipe.json
    .venv/bin/python bench/default_recipe.py --config fashion_mnist_lars [key=value ...]
                                                              # -> results/bench/recipe_fashion_mnist_lars.json
    .venv/bin/python bench/default_recipe.py --out /tmp/r.json epochs=1 model.width=4  # elsewhere

Runs `python -m dstrain --config RECIPE [overrides]` in a fresh run directory, then records
the summary, the whole command's wall time (start-up included), the machine and the git SHA;
the trainer's command is kept beside this one's.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def title(recipe: str, overrides: list[str]) -> str:
    """``Default recipe (`fashion_mnist`)``, or the recipe named with its overrides."""
    if recipe == "fashion_mnist" and not overrides:
        return "Default recipe (`fashion_mnist`)"
    return f"The `{recipe}` recipe" + (f" with {' '.join(overrides)}" if overrides else "")


def headline(result: dict) -> str:
    return (
        f"{result['final_top1']:.1%} top-1, {result['epochs']} epochs, "
        f"{result['train_wall_time_s']:.0f} s training"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="fashion_mnist", help="the recipe (dstrain/recipes)")
    p.add_argument(
        "--out", help="default results/bench/default_recipe.json or recipe_<RECIPE>.json"
    )
    p.add_argument("overrides", nargs="*", help="trainer overrides (key=value)")
    args = p.parse_args()
    recipe, extra = args.config, args.overrides
    name = "default_recipe" if recipe == "fashion_mnist" and not extra else f"recipe_{recipe}"
    out = Path(args.out or REPO / "results" / "bench" / f"{name}.json")
    sys.path.insert(0, str(REPO))
    from bench.common import TRAINER, provenance, run_trainer, write_result

    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        summary = run_trainer([*TRAINER, "--config", recipe, f"run_dir={run_dir}", *extra], run_dir)
        wall = summary["command_wall_s"]
        log_tail = [
            line for line in summary["stdout"].splitlines() if "done:" in line or "summary:" in line
        ]
    result = {  # git_sha: "-dirty" when the working tree differs from the commit
        **provenance("default_recipe.py"),
        "trainer_command": shlex.join(["python", "-m", "dstrain", "--config", recipe, *extra]),
        "final_top1": summary["final_top1"],
        "best_top1": summary["best_top1"],
        "epochs": summary["epochs"],
        "train_wall_time_s": round(summary["wall_time_s"], 1),
        "command_wall_time_s": round(wall, 1),
        "images_per_sec": round(summary["images_per_sec"], 1),
        "per_epoch": summary["history"],
        "log": log_tail,
    }
    write_result(out, result, title=title(recipe, extra), headline=headline(result))
    print(
        f"top-1 {result['final_top1']:.4f} after {result['epochs']} epochs, training "
        f"{result['train_wall_time_s']} s, whole command {result['command_wall_time_s']} s -> {out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
