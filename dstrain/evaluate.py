"""``python -m dstrain.evaluate --checkpoint RUN_DIR`` (also ``deepspeed --num_gpus N
dstrain/evaluate.py ...``): the validation top-1 of given weights, nothing trained. An entry point
only: the command is dstrain/run/evaluate.py."""

import os
import sys


def main(argv: list[str] | None = None) -> int:
    from dstrain.run.evaluate import main as evaluate

    return evaluate(argv)


if __name__ == "__main__":
    if __package__ in (None, ""):  # run as a script by the deepspeed launcher
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from dstrain.core import process

    process.run(main)
