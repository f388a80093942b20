"""Where a LARS run blew up, tensor by tensor: a run's ``log.lars_tensors`` TensorBoard scalars read back.

    python results/harness/lars_tensors.py RUN_DIR [--out results/studies/stability] [--name NAME]

A run trained with ``log.tensorboard=true log.lars_tensors=true log.every_steps=1`` has, for every
optimizer step, each parameter tensor's trust ratio (``lars_trust/<name>``; LARS-adapted weights
only) and its step relative to its norm (``lars_step/<name>`` = ||w_before - w_after|| / ||w||;
for BN/bias tensors, which LARS excludes, a plain SGD step at the scheduled LR). This reads them
with the loss, the LR and the per-epoch top-1, and writes NAME.json / NAME.md: per step the loss,
the LR, the largest relative step among the LARS-adapted weights and among BN/bias, and the
tensors with the largest steps at the step where the loss jumped most (and the steps before it).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.common import provenance, write_result  # noqa: E402


def read(tb: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(tb), size_guidance={"scalars": 0})
    ea.Reload()
    return {t: [(e.step, e.value) for e in ea.Scalars(t)] for t in ea.Tags()["scalars"]}


def is_bn_or_bias(name: str, trust_tags: set[str]) -> bool:
    """Excluded from LARS (no trust ratio logged): BN gamma/beta and biases."""
    return f"lars_trust/{name}" not in trust_tags


def analyse(scalars: dict[str, list[tuple[int, float]]], around: int = 3) -> dict:
    steps_of = {t: dict(v) for t, v in scalars.items()}
    loss = steps_of.get("train/loss", {})
    if not loss:
        raise SystemExit("no train/loss scalars: was the run trained with log.tensorboard=true?")
    names = sorted(t.split("/", 1)[1] for t in steps_of if t.startswith("lars_step/"))
    if not names:
        raise SystemExit(
            "no lars_step/* scalars: train with log.lars_tensors=true (and LARS), log.every_steps=1"
        )
    trust_tags = {t for t in steps_of if t.startswith("lars_trust/")}
    excluded = [n for n in names if is_bn_or_bias(n, trust_tags)]
    adapted = [n for n in names if n not in excluded]
    rows = []
    for step in sorted(loss):
        adapted_steps = [steps_of[f"lars_step/{n}"].get(step, math.nan) for n in adapted]
        excluded_steps = [steps_of[f"lars_step/{n}"].get(step, math.nan) for n in excluded]
        trusts = [steps_of[f"lars_trust/{n}"].get(step, math.nan) for n in adapted]
        rows.append(
            {
                "step": step,
                "loss": loss[step],
                "lr": steps_of.get("train/lr", {}).get(step),
                "max_step_lars": max(adapted_steps, default=math.nan),
                "max_step_bn_bias": max(excluded_steps, default=math.nan),
                "max_trust": max(trusts, default=math.nan),
            }
        )
    # the loss's largest jump over the previous step: where it blew up
    jumps = [(rows[i]["loss"] - rows[i - 1]["loss"], i) for i in range(1, len(rows))]
    _, worst = max(jumps)
    window = rows[max(0, worst - around) : worst + 1]
    detail = []
    for r in window:
        step = r["step"]
        ranked = sorted(names, key=lambda n: -steps_of[f"lars_step/{n}"].get(step, 0.0))[:6]
        detail.append(
            {
                "step": step,
                "loss": r["loss"],
                "largest": [
                    {
                        "tensor": n,
                        "kind": "bn/bias" if n in excluded else "weight",
                        "step_over_norm": steps_of[f"lars_step/{n}"].get(step),
                        "trust": steps_of.get(f"lars_trust/{n}", {}).get(step),
                    }
                    for n in ranked
                ],
            }
        )
    return {
        "tensors": {"lars_adapted": len(adapted), "bn_bias": len(excluded)},
        "top1_per_epoch": [v for _, v in scalars.get("epoch/val_top1", [])],
        "train_top1_per_epoch": [v for _, v in scalars.get("epoch/train_top1", [])],
        "worst_step": rows[worst]["step"],
        "steps": rows,
        "before_the_jump": detail,
    }


def markdown(result: dict) -> str:
    lines = [
        f"# Where the LARS run jumped: {result['run_dir']}",
        "",
        f"`{result['command']}` at git {result['git_sha']}, {result['date']}. "
        f"{result['tensors']['lars_adapted']} LARS-adapted weight tensors, "
        f"{result['tensors']['bn_bias']} BN/bias tensors (plain steps).",
        "",
        "Test top-1 per epoch: " + ", ".join(f"{100 * v:.1f}" for v in result["top1_per_epoch"]),
        "",
        f"The loss's largest one-step rise: step {result['worst_step']}. The largest relative steps "
        "(||step|| / ||w||) there and in the steps before:",
        "",
        "| step | loss | tensor | kind | step / norm | trust |",
        "|---|---|---|---|---|---|",
    ]
    for d in result["before_the_jump"]:
        for k, t in enumerate(d["largest"]):
            step, loss = (str(d["step"]), f"{d['loss']:.3f}") if k == 0 else ("", "")
            trust = "-" if t["trust"] is None else f"{t['trust']:.3g}"
            lines.append(
                f"| {step} | {loss} | {t['tensor']} | {t['kind']} | {t['step_over_norm']:.3g} | {trust} |"
            )
    lines += ["", "Per step (max over tensors): see the JSON's `steps`.", ""]
    return "\n".join(lines)


def headline(result: dict) -> str:
    """The largest one-step loss rise, and the largest relative steps after the first 20 steps
    (all of them in a run that short): BN/bias against the LARS-adapted weights."""
    steps = result["steps"]
    rises = [b["loss"] - a["loss"] for a, b in zip(steps, steps[1:])] or [0.0]
    later = steps[20:] or steps
    lars = max(r["max_step_lars"] for r in later)
    bn = max(r["max_step_bn_bias"] for r in later)
    after = "after step 20" if len(steps) > 20 else "over all its steps"
    return (
        f"{len(result['top1_per_epoch'])} epochs; largest one-step loss rise {max(rises):.2f} "
        f"(step {result['worst_step']}); {after}, relative steps up to {bn:.2f} (BN/bias) vs "
        f"{lars:.3f} (LARS weights)"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", type=Path, help="a run trained with log.lars_tensors=true")
    p.add_argument("--out", default=str(REPO / "results/studies/stability"))
    p.add_argument("--name", help="result file stem (default lars_tensors_<run dir name>)")
    p.add_argument("--around", type=int, default=3, help="steps shown before the jump")
    args = p.parse_args(argv)
    tb = args.run_dir / "tb"
    if not tb.is_dir():
        print(
            f"lars_tensors: error: {tb}: no TensorBoard folder (log.tensorboard=true)",
            file=sys.stderr,
        )
        return 2
    meta = args.run_dir / "meta.json"
    run_sha = json.loads(meta.read_text()).get("git_sha") if meta.is_file() else None
    result = {
        **provenance("results/harness/lars_tensors.py", sys.argv[1:] if argv is None else argv),
        "run_dir": str(args.run_dir),
        "run_git_shas": [s for s in [run_sha] if s],
        **analyse(read(tb), args.around),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = args.name or f"lars_tensors_{args.run_dir.name}"
    title = f"LARS tensors of the run {args.run_dir.name}: where its loss jumped"
    write_result(out / f"{name}.json", result, title=title, headline=headline(result))
    (out / f"{name}.md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
