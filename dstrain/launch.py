"""``python -m dstrain.launch`` (what ``launch.sh`` runs): the job launcher. An entry point only:
its code is dstrain/run/launch.py."""

import sys

from dstrain.run.launch import main

if __name__ == "__main__":
    sys.exit(main())
