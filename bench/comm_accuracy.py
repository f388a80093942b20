"""Accuracy cost and bytes of each gradient-communication mode: Fashion-MNIST, 2 CPU ranks, same epochs.

    .venv/bin/python bench/comm_accuracy.py [--epochs 3]   # -> results/bench/comm_accuracy.{json,md}
    .venv/bin/python bench/comm_accuracy.py --epochs 1 --modes comm_sign --out /tmp/c \\
        model.width=4 data.root=DIR                        # tiny: fp32 and one mode, 2 ranks

Each mode trains the default recipe (ResNet-8, batch 256, SGD) under
``deepspeed --num_gpus 2`` with one shipped DeepSpeed JSON; only the
communication differs from the fp32 baseline (bf16_comm_bf16 also computes in
bf16). torus2d_sign runs on a 1 x 2 grid, so that its compressed column phase
is the one that carries data on 2 ranks. Bytes per step are what rank 0's
comm layer counted; for DeepSpeed's own all-reduce (fp32, bf16 comm) they are
the ring's 2(W-1)/W x gradient bytes, computed from the parameter count.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

MODES = [  # (name, shipped JSON, changes to its dstrain_communication block)
    ("fp32 (DeepSpeed all-reduce)", "fp32", None),
    ("bf16 compute + bf16 comm (DeepSpeed)", "bf16_comm_bf16", None),
    ("torus2d", "comm_torus2d", None),
    ("sign (1-bit, error feedback)", "comm_sign", None),
    ("powersgd rank 4", "comm_powersgd", None),
    ("torus2d + sign columns (1x2 grid)", "comm_torus2d_sign", {"grid": [1, 2]}),
]


def headline(result: dict) -> str:
    """Each mode's top-1 and bytes against the fp32 all-reduce."""
    rows = result["rows"][1:]
    return "vs the fp32 all-reduce: " + "; ".join(
        f"{r['config'].split('/')[-1].split('.json')[0].removeprefix('comm_')} "
        f"{100 * r['top1_vs_fp32']:+.2f} pt, {r['bytes_vs_fp32']:.3f}x bytes"
        for r in rows
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=3)
    others = [config for _, config, _ in MODES[1:]]
    p.add_argument(
        "--modes",
        nargs="+",
        choices=others,
        default=others,
        help="the modes to compare with the fp32 all-reduce (always run, first)",
    )
    p.add_argument(
        "--out", type=Path, default=REPO / "results" / "bench", help="folder of comm_accuracy.*"
    )
    p.add_argument("overrides", nargs="*", help="more trainer overrides for every run (key=value)")
    args = p.parse_args()
    from bench.common import provenance, write_result
    from dstrain.core.dist import free_port

    deepspeed = str(Path(sys.executable).parent / "deepspeed")
    modes = [MODES[0], *[m for m in MODES[1:] if m[1] in args.modes]]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, config, change in modes:
            path = REPO / "ds_configs" / f"{config}.json"
            if change:
                data = json.loads(path.read_text())
                data["dstrain_communication"].update(change)
                path = Path(tmp) / f"{config}.json"
                path.write_text(json.dumps(data))
            run_dir = Path(tmp) / config
            cmd = [
                deepspeed,
                "--num_gpus",
                "2",
                "--master_port",
                str(free_port()),
                "dstrain/main.py",
                "--config",
                "fashion_mnist",
                "--deepspeed_config",
                str(path),
                f"epochs={args.epochs}",
                f"run_dir={run_dir}",
                "log.every_steps=100",
                *args.overrides,
            ]
            from bench.common import run_trainer

            summary = run_trainer(cmd, run_dir, what=name)
            comm = summary.get("comm")
            if comm is None:  # DeepSpeed's own ring all-reduce: 2(W-1)/W x gradient bytes
                from dstrain.core.safe_load import load_data

                state = load_data(
                    run_dir
                    / "checkpoints"
                    / f"epoch{args.epochs:04d}"
                    / "mp_rank_00_model_states.pt"
                )["module"]
                n = sum(
                    v.numel()
                    for k, v in state.items()
                    if v.is_floating_point() and "running" not in k
                )
                width = 2 if config.startswith("bf16") else 4
                sent = 2 * (2 - 1) / 2 * n * width
            else:
                sent = comm["bytes_sent_per_step"]
            rows.append(
                {
                    "mode": name,
                    "config": f"ds_configs/{config}.json" + (f" with {change}" if change else ""),
                    "final_top1": summary["final_top1"],
                    "best_top1": summary["best_top1"],
                    "bytes_sent_per_step": round(sent),
                    "wall_s": round(summary["command_wall_s"], 1),
                    "steps": summary["steps"],
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    base = rows[0]
    for r in rows:
        r["top1_vs_fp32"] = round(r["final_top1"] - base["final_top1"], 4)
        r["bytes_vs_fp32"] = round(r["bytes_sent_per_step"] / base["bytes_sent_per_step"], 4)
    result = {
        **provenance("comm_accuracy.py"),
        "ranks": 2,
        "setup": " ".join(["--config fashion_mnist", f"epochs={args.epochs}", *args.overrides])
        + ", deepspeed --num_gpus 2 (gloo)",
        "rows": rows,
    }
    out = args.out
    title = f"Gradient communication, accuracy and bytes (2 ranks, {args.epochs} epochs)"
    write_result(out / "comm_accuracy.json", result, title=title, headline=headline(result))
    lines = [
        f"Fashion-MNIST, default recipe, {args.epochs} epochs, 2 CPU ranks (git {result['git_sha'][:7]})",
        "",
        "| mode | test top-1 % | vs fp32 (points) | bytes sent per step (rank 0) | vs fp32 | wall s |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['mode']} | {100 * r['final_top1']:.2f} | {100 * r['top1_vs_fp32']:+.2f} | "
            f"{r['bytes_sent_per_step']:,} | {r['bytes_vs_fp32']:.3f} | {r['wall_s']} |"
        )
    (out / "comm_accuracy.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
