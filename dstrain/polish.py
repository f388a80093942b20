"""``python -m dstrain.polish --checkpoint RUN_DIR`` (also ``deepspeed --num_gpus N
dstrain/polish.py ...``): Final Polishing of a finished run. An entry point only: the command is
dstrain/run/polish.py, the technique dstrain/techniques/bn_refit.py."""

import os
import sys


def main(argv: list[str] | None = None) -> int:
    from dstrain.run.polish import main as polish

    return polish(argv)


if __name__ == "__main__":
    if __package__ in (None, ""):  # run as a script by the deepspeed launcher
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from dstrain.core import process

    process.run(main)
