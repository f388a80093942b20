"""Command line: ``python -m dstrain`` / ``python dstrain/main.py`` / ``deepspeed dstrain/main.py``.

    deepspeed dstrain/main.py --deepspeed_config ds_configs/fp32.json \\
        --config fashion_mnist optim.warmup_epochs=2 data.root=/path
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import sys

# run as a script (the deepspeed launcher does this): make `dstrain` importable
if __package__ in (
    None,
    "",
):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="dstrain", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--config",
        "-c",
        default=None,
        help="trainer recipe: a YAML path or a name in dstrain/recipes/ (default: built-in defaults)",
    )
    p.add_argument(
        "--deepspeed_config",
        "--deepspeed-config",
        default=None,
        help="DeepSpeed JSON (precision, optimizer, communication); overrides deepspeed_config=",
    )
    p.add_argument(
        "--local_rank",
        "--local-rank",
        type=int,
        default=None,
        help="set by the deepspeed launcher; ranks are read from the environment",
    )
    # accepted for compatibility
    p.add_argument("--deepspeed", action="store_true", help=argparse.SUPPRESS)
    p.add_argument(
        "--help-config",
        action="store_true",
        help="list the trainer config keys and the JSON keys dstrain reads, with units",
    )
    p.add_argument(
        "--check",
        action="store_true",
        help="check the recipe, JSON, overrides, batch arithmetic, data root and run directory, "
        "print the resolved plan, write nothing; exit 0 (would start) or 2 (would not)",
    )
    p.add_argument(
        "--world",
        type=int,
        default=None,
        metavar="N",
        help="with --check: the job's number of ranks (default: the slots of --hostfile, else "
        "$WORLD_SIZE, else 1)",
    )
    p.add_argument(
        "--hostfile",
        default=None,
        metavar="FILE",
        help="with --check: the DeepSpeed hostfile of `deepspeed --hostfile FILE`, read as DeepSpeed "
        "reads it; its slots are the job's ranks",
    )
    p.add_argument(
        "--device",
        choices=("auto", "cuda", "cpu"),
        default="auto",
        help="with --check: the device the job trains on (default: this machine's)",
    )
    p.add_argument("overrides", nargs="*", metavar="key=value", help="trainer config overrides")
    return p.parse_intermixed_args(argv)  # options and key=value overrides in any order


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from dstrain.core.errors import ConfigError, Preempted, RunStopped
    from dstrain.core.logs import setup_logging
    from dstrain.settings.config import help_lines, load_config

    if args.help_config:
        from dstrain.run.ds_config import help_lines as json_lines

        print(
            "# The trainer config (YAML recipe and key=value overrides): what the trainer schedules"
        )
        print("\n".join(help_lines()))
        print(
            "\n# The DeepSpeed JSON (--deepspeed_config): precision, the optimizer and its "
            "parameters, communication. dstrain reads these blocks itself:"
        )
        print("\n".join(json_lines()))
        return 0
    if args.local_rank is not None:
        os.environ.setdefault("LOCAL_RANK", str(args.local_rank))
    faulthandler.enable()  # a native crash before the run directory exists: signal and stack on stderr
    from dstrain.run.launch import adopt_mpi_env

    adopt_mpi_env()  # ranks started by mpirun: RANK before the log reads it
    setup_logging()
    try:
        if args.hostfile is not None and not args.check:  # the launcher gives a run its ranks
            raise ConfigError(
                f"--hostfile {args.hostfile} belongs to --check; to run on its hosts, give it to "
                f"DeepSpeed's launcher: deepspeed --hostfile {args.hostfile} dstrain/main.py ..."
            )
        cfg = load_config(args.config, args.overrides)
        from dstrain.core.dist import quiet_deepspeed

        quiet_deepspeed()  # before DeepSpeed is imported (by --check too)
        if args.check:
            return check(cfg, args)
        from dstrain.run.train import (
            run,  # torch and DeepSpeed: not needed for --help-config or a config error
        )

        run(cfg, args.deepspeed_config or cfg.deepspeed_config)
    except (ConfigError, RunStopped) as err:
        if getattr(err, "said_by_peer", False):  # the peer's own line on stderr names the bad input
            return report(err, err.exit_code, "stopped", sys.stdout)
        return report(err, err.exit_code, "stopped" if isinstance(err, Preempted) else "error")
    return 0


def check(cfg, args: argparse.Namespace) -> int:
    """``--check``: the run's start-up checks and its plan, nothing written (dstrain/run/preflight.py)."""
    from dstrain.run import preflight

    target = preflight.Target.resolve(args.world, args.device, args.hostfile)
    lines = preflight.check(cfg, args.deepspeed_config or cfg.deepspeed_config, target)
    print("dstrain --check: the run would start; nothing was written")
    print("\n".join("  " + line for line in lines))
    return 0


def report(err: Exception, code: int, kind: str = "error", stream=None) -> int:
    """One line on stderr (or ``stream``): ``dstrain: error: ...`` (``dstrain[rank R]: ...`` in a
    multi-rank run)."""
    stream = stream or sys.stderr
    rank = os.environ.get("RANK", "0")
    prefix = "dstrain" if os.environ.get("WORLD_SIZE", "1") == "1" else f"dstrain[rank {rank}]"
    # one write() per line: under the launcher (python -u) print() writes the text and its newline
    # separately, and two ranks' lines then interleaved into one
    stream.write(f"{prefix}: {kind}: {err}\n")
    stream.flush()
    return code


def cli() -> None:
    """The process entry point (``python -m dstrain``, the ``dstrain`` command, ``deepspeed
    dstrain/main.py``): :func:`main`, ended by :func:`dstrain.core.process.run`."""
    from dstrain.core import process

    process.run(main)


if __name__ == "__main__":
    cli()
