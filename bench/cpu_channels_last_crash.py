"""Which CPU convolutions crash in channels_last (NHWC) backward: one subprocess per shape, pure PyTorch.

    .venv/bin/python bench/cpu_channels_last_crash.py   # -> bench/results/cpu_channels_last_crash.{json,md}

Each shape runs 4 forward/backward passes of one ``Conv2d(c_in, c_out, k, stride)`` on a batch of
256 x c_in x 28 x 28 in NHWC on 1 thread, in its own process (a crash must not take the bench down),
and records the exit status: 0 = fine, -11 segfault, -6 abort, -7 bus error, None = hung (60 s).
This is why dstrain.techniques.models.cpu_channels_last_hazards exists.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

PROBE = """
import sys, torch
torch.manual_seed(0); torch.set_num_threads(1)
cin, cout, k, s = map(int, sys.argv[1:5])
conv = torch.nn.Conv2d(cin, cout, k, s, k // 2, bias=False).to(memory_format=torch.channels_last)
x = torch.randn(256, cin, 28, 28).contiguous(memory_format=torch.channels_last).requires_grad_(True)
for _ in range(4):
    conv(x).square().mean().backward()
"""
SHAPES = [
    (2, 4, 1, 2),
    (4, 4, 1, 2),
    (4, 8, 1, 2),
    (6, 12, 1, 2),
    (4, 16, 1, 2),
    (8, 16, 1, 2),
    (16, 32, 1, 2),
    (4, 8, 1, 1),
    (4, 8, 3, 2),
    (1, 4, 3, 1),
    (8, 16, 3, 2),
]


def run(shape) -> int | None:
    try:
        proc = subprocess.run(
            [sys.executable, "-c", PROBE, *map(str, shape)], capture_output=True, timeout=60
        )
    except subprocess.TimeoutExpired:
        return None
    return proc.returncode


def main() -> int:
    from bench.common import provenance

    rows = []
    for shape in SHAPES:
        code = run(shape)
        name = (
            "ok"
            if code == 0
            else "hung"
            if code is None
            else signal.Signals(-code).name
            if code < 0
            else code
        )
        rows.append(
            {
                "c_in": shape[0],
                "c_out": shape[1],
                "kernel": shape[2],
                "stride": shape[3],
                "exit": code,
                "outcome": name,
            }
        )
        print(rows[-1], flush=True)
    result = {**provenance("cpu_channels_last_crash.py"), "rows": rows}
    out = REPO / "bench/results/cpu_channels_last_crash.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        f"NHWC conv backward on CPU, torch {result['torch']}, 1 thread (git {result['git_sha'][:7]}, "
        f"`{result['command']}`)",
        "",
        "| c_in | c_out | kernel | stride | outcome |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['c_in']} | {r['c_out']} | {r['kernel']} | {r['stride']} | {r['outcome']} |"
        for r in rows
    ]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
