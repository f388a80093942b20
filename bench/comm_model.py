"""Alpha-beta cost model of one gradient all-reduce of ResNet-50 (25.6M gradients) on an ABCI-like cluster.

    .venv/bin/python bench/comm_model.py     # -> results/bench/comm_model.{json,md,png}
    .venv/bin/python bench/comm_model.py --out /tmp/x   # the same files elsewhere

A model, not a measurement: it says where each algorithm should win, for
choosing ``dstrain_communication`` before a run. Time of sending m bytes over
one hop = alpha + m / B.

Machine (ABCI-like, METHODS.md section 6): 4 GPUs a node joined by NVLink
(alpha 1 us, 100 GB/s per GPU), nodes joined by 2 x 100 Gb/s InfiniBand
(25 GB/s per node, alpha 5 us per hop). When the 4 GPUs of a node all send
across nodes at once, each gets a quarter of the node's bandwidth.

Algorithms, for P GPUs and S bytes of gradients
  ring          one ring over all P GPUs: 2(P-1) steps of S/P; every step is paced by an
                inter-node hop (one GPU per node on that hop: the full 25 GB/s)
  hierarchical  reduce to a leader in the node (NVLink), ring all-reduce of S among the P/4
                leaders (25 GB/s), broadcast in the node
  torus 4xP/4   dstrain's torus2d with X = 4 (a row = a node): reduce-scatter and all-gather
                over NVLink, then 4 concurrent column rings of S/4 across nodes, each at 25/4 GB/s
  torus square  torus2d with the "auto" grid (X ~ Y ~ sqrt(P)): rows span X/4 nodes (row hops paced
                by 25 GB/s inter-node links), columns all cross nodes (25/4 GB/s each)
Payloads: FP32 (4 bytes/gradient), FP16 (2), and 1-bit sign compression (1/8 byte + one
4-byte scale per bucket). dstrain's sign exchange is an all-gather: each GPU receives the
other P-1 GPUs' codes, (P-1) x S/32 bytes; in torus2d+sign only the column phase is
compressed: (Y-1) x S/(32 X).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

N_GRADS = 25.6e6
GPUS_PER_NODE = 4
A_NV, B_NV = 1e-6, 100e9  # NVLink: latency (s), bandwidth per GPU (bytes/s)
A_IB, B_NODE = 5e-6, 2 * 100e9 / 8  # InfiniBand: latency per hop (s), bandwidth per node (bytes/s)
BUCKET = 25 * 2**20  # dstrain's default bucket: one scale per 25 MiB of fp32 gradients


def ring(p: int, s: float) -> float:
    if p == 1:
        return 0.0
    alpha, bw = (A_NV, B_NV) if p <= GPUS_PER_NODE else (A_IB, B_NODE)
    return 2 * (p - 1) * (alpha + s / p / bw)


def hierarchical(p: int, s: float) -> float:
    nodes = max(1, p // GPUS_PER_NODE)
    g = min(p, GPUS_PER_NODE)
    intra = (
        math.ceil(math.log2(g)) * (A_NV + s / B_NV) if g > 1 else 0.0
    )  # tree reduce, then broadcast
    inter = 2 * (nodes - 1) * (A_IB + s / nodes / B_NODE) if nodes > 1 else 0.0
    return 2 * intra + inter


def torus(x: int, y: int, s: float, column_bytes: float | None = None) -> float:
    """Reduce-scatter + all-gather in rows of x, all-reduce (or a given column exchange) across y rows."""
    nodes_per_row = max(1, x // GPUS_PER_NODE)
    row_alpha, row_bw = (A_NV, B_NV) if nodes_per_row == 1 else (A_IB, B_NODE)
    rows = 2 * (x - 1) * (row_alpha + s / x / row_bw) if x > 1 else 0.0
    per_gpu_ib = B_NODE / min(
        GPUS_PER_NODE, x
    )  # the GPUs of a node in different columns share its NICs
    if y == 1:
        cols = 0.0
    elif column_bytes is None:
        cols = 2 * (y - 1) * (A_IB + s / x / y / per_gpu_ib)
    else:  # compressed column phase: an all-gather of (y-1) blocks of column_bytes
        cols = (y - 1) * (A_IB + column_bytes / per_gpu_ib)
    return rows + cols


def square(p: int) -> tuple[int, int]:
    y = max(d for d in range(1, math.isqrt(p) + 1) if p % d == 0)
    return p // y, y


def sign_allgather(p: int, s_fp32: float) -> float:
    code = s_fp32 / 32 + 4 * math.ceil(s_fp32 / BUCKET)
    alpha, bw = (A_NV, B_NV) if p <= GPUS_PER_NODE else (A_IB, B_NODE)
    return (p - 1) * (alpha + code / bw) if p > 1 else 0.0


def model(p: int) -> dict:
    s32, s16 = 4 * N_GRADS, 2 * N_GRADS
    x4, y4 = GPUS_PER_NODE, p // GPUS_PER_NODE
    xs, ys = square(p)
    out = {}
    for name, s in (("fp32", s32), ("fp16", s16)):
        out[f"ring_{name}"] = ring(p, s)
        out[f"hierarchical_{name}"] = hierarchical(p, s)
        out[f"torus_4xN_{name}"] = torus(x4, y4, s)
        out[f"torus_square_{name}"] = torus(xs, ys, s)
    out["sign_allgather_1bit"] = sign_allgather(p, s32)
    out["torus_4xN_sign_columns"] = torus(x4, y4, s32, column_bytes=s32 / x4 / 32)
    return out


COLUMNS = [
    "ring_fp32",
    "hierarchical_fp32",
    "torus_4xN_fp32",
    "torus_square_fp32",
    "ring_fp16",
    "torus_4xN_fp16",
    "torus_square_fp16",
    "sign_allgather_1bit",
    "torus_4xN_sign_columns",
]


def readout(rows: list[dict]) -> dict:
    """What the docs read off the model, computed here so that they quote it (issue 53: "sign is
    fastest up to 16 GPUs" passed where the model says 8): the GPU counts where each way is the
    fastest, from how many GPUs the flat FP32 ring's latency steps, 2(P-1) alpha, outweigh its
    bandwidth term, and up to how many GPUs 1-bit sign stays below the FP16 4 x N torus and the
    FP16 ring."""
    fastest = {
        c: [r["gpus"] for r in rows if min(COLUMNS, key=lambda k: r[k]) == c] for c in COLUMNS
    }
    latency_ms = {
        r["gpus"]: 1e3 * 2 * (r["gpus"] - 1) * (A_NV if r["gpus"] <= GPUS_PER_NODE else A_IB)
        for r in rows
    }
    ring = {r["gpus"]: r["ring_fp32"] for r in rows}
    dominates = [p for p, ms in latency_ms.items() if ms > ring[p] - ms]
    below = [r["gpus"] for r in rows if r["sign_allgather_1bit"] < r["torus_4xN_fp16"]]
    below_ring = [r["gpus"] for r in rows if r["sign_allgather_1bit"] < r["ring_fp16"]]
    return {
        "fastest": {c: g for c, g in fastest.items() if g},
        "ring_fp32_latency_ms": latency_ms,
        "ring_latency_dominates_from_gpus": min(dominates) if dominates else None,
        "sign_below_torus_4xN_fp16_up_to_gpus": max(below) if below else None,
        "sign_below_ring_fp16_up_to_gpus": max(below_ring) if below_ring else None,
    }


def headline(result: dict) -> str:
    """How many cluster sizes, and which algorithm the model finds fastest at the largest."""
    rows = result["rows"]
    last = rows[-1]
    best = min(COLUMNS, key=lambda c: last[c])
    return (
        f"{len(rows)} cluster sizes, {rows[0]['gpus']} to {last['gpus']} GPUs; at "
        f"{last['gpus']}: {best} fastest, {last[best]:.2f} ms"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--out", type=Path, default=REPO / "results" / "bench", help="folder of comm_model.*"
    )
    args = p.parse_args(argv)
    gpus = [2**k for k in range(3, 13)]  # 8 ... 4096
    rows = [
        {
            "gpus": p,
            "grid_square": list(square(p)),
            **{k: round(v * 1e3, 3) for k, v in model(p).items()},
        }
        for p in gpus
    ]
    from bench.common import provenance, write_result

    result = {
        **provenance("comm_model.py", sys.argv[1:] if argv is None else argv),
        "units": "milliseconds per all-reduce of ResNet-50's 25.6M gradients (model, not measured)",
        "machine_model": {
            "gpus_per_node": GPUS_PER_NODE,
            "nvlink_alpha_s": A_NV,
            "nvlink_bytes_per_s": B_NV,
            "ib_alpha_s": A_IB,
            "ib_bytes_per_s_per_node": B_NODE,
        },
        "rows": rows,
        "readout": readout(rows),
    }
    out = args.out
    title = "All-reduce cost model (ring, hierarchical, 2D-Torus; modelled, not measured)"
    write_result(out / "comm_model.json", result, title=title, headline=headline(result))
    cols = COLUMNS
    lines = ["| GPUs | " + " | ".join(cols) + " | fastest |", "|---" * (len(cols) + 2) + "|"]
    for r in rows:
        best = min(cols, key=lambda c: r[c])
        lines.append(f"| {r['gpus']} | " + " | ".join(f"{r[c]:.2f}" for c in cols) + f" | {best} |")
    table = "\n".join(lines) + "\n"
    (out / "comm_model.md").write_text(
        "Milliseconds per all-reduce of 25.6M gradients, alpha-beta model "
        "(bench/comm_model.py)\n\n" + table
    )
    plot(rows, out / "comm_model.png")
    print(table)
    return 0


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    gpus = [r["gpus"] for r in rows]
    panels = (
        (
            "FP32 / FP16 payloads",
            [
                "ring_fp32",
                "hierarchical_fp32",
                "torus_4xN_fp32",
                "torus_square_fp32",
                "ring_fp16",
                "torus_4xN_fp16",
            ],
        ),
        (
            "1-bit sign compression vs FP16",
            [
                "ring_fp16",
                "torus_4xN_fp16",
                "torus_square_fp16",
                "sign_allgather_1bit",
                "torus_4xN_sign_columns",
            ],
        ),
    )
    for ax, (title, keys) in zip(axes, panels):
        for key in keys:
            ax.plot(gpus, [r[key] for r in rows], marker="o", markersize=3, label=key)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("GPUs (4 per node)")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_ylabel("ms per all-reduce (ResNet-50, model)")
    fig.suptitle("Alpha-beta model, ABCI-like: NVLink 100 GB/s in a node, 2x100 Gb/s IB per node")
    fig.tight_layout()
    from bench.common import save_png

    save_png(fig, path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
