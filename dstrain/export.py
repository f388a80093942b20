"""``python -m dstrain.export --checkpoint RUN_DIR``: a finished run's weights as a plain
``state_dict`` file. An entry point only: the command is dstrain/run/export.py."""

import os
import sys


def main(argv: list[str] | None = None) -> int:
    from dstrain.run.export import main as export

    return export(argv)


if __name__ == "__main__":
    if __package__ in (None, ""):  # run as a script
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from dstrain.core import process

    process.run(main)
