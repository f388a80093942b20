"""Find every image of an ImageNet-style folder that does not decode, before a long run does.

    python -m dstrain.data.check /data/imagenet [--workers 16]

Lists the folder the way the trainer does (dstrain.data.images.scan_split),
fully decodes every file with PIL in a process pool, prints one line per
undecodable file and a summary. Exit status: 0 all decode, 1 some do not,
2 the folder itself is unusable.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m dstrain.data.check", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("root", help="folder holding train/<class>/ and val/<class>/")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="decode processes")
    args = p.parse_args(argv)
    from dstrain.data.images import decode_error, scan_folder
    from dstrain.settings.config import ConfigError

    try:
        splits = scan_folder(args.root)
    except ConfigError as err:
        print(f"dstrain.data.check: error: {err}", file=sys.stderr)
        return 2
    files = [f for split in splits for f in split.files]
    t0, bad = time.perf_counter(), 0
    with ProcessPoolExecutor(max(1, args.workers)) as pool:
        for path, reason in zip(files, pool.map(decode_error, files, chunksize=64)):
            if reason is not None:
                bad += 1
                print(f"corrupt image: {path} ({reason})", flush=True)
    print(
        f"{len(files)} images checked under {Path(args.root)} in {time.perf_counter() - t0:.1f} s: "
        f"{bad} do not decode"
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
