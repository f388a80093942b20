"""A DeepSpeed hostfile, read as DeepSpeed 0.19's launcher reads it, refused in one line.

One floor above the ground: the standard library and dstrain.core.errors only (launch.sh runs it in
whichever Python it finds; tests/test_hostfile.py holds it there).

DeepSpeed (``deepspeed/launcher/runner.py``, ``fetch_hostfile`` and ``_parse_hostfile``) strips each
line, skips blank ones and those starting with ``#``, and takes ``HOST slots=N`` from the start of
every other line; what follows the digits is ignored (mpirun, which DeepSpeed's openmpi launcher
hands the same file, reads words such as ``max_slots=8`` there). It stops on a line of another
shape, on a host listed twice and on a file with no host, each time with a traceback and the
whole file in its log; a missing file it only warns about, and then runs on this machine alone.

:func:`parse` applies the same rules and refuses with one line ``FILE:LINE: ...`` that names the
fix. It refuses two things DeepSpeed takes: ``slots=0`` (a host that gets no rank) and a slot
count with more after its digits (``slots=8x``, which DeepSpeed reads as 8).
``python -m dstrain --check --hostfile FILE`` (dstrain/run/preflight.py) reads a file with
:func:`read`; ``launch.sh`` (dstrain/run/launch.py) checks the text it generates with :func:`parse`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import NamedTuple

from dstrain.core.errors import ConfigError

FORM = "'HOST slots=N'"
# DeepSpeed's pattern is r"^(\S+)\s+slots=(\d+)"; the count is taken here up to a space or a
# comment, so that a count DeepSpeed would misread (8x) or refuse (abc, -1) is named as a count
LINE = re.compile(r"^(\S+)\s+slots=([^\s#]*)")


class Host(NamedTuple):
    """One hostfile entry: the host, its slots (ranks started there) and its line (1-based)."""

    name: str
    slots: int
    line: int


def parse(text: str, path: str) -> list[Host]:
    """The hosts of hostfile ``text`` in file order, as DeepSpeed's launcher would take them;
    ``path`` names the file in the errors. Raises ConfigError (``path:line: ...``)."""
    hosts: dict[str, Host] = {}
    for number, raw in enumerate(re.split(r"\r\n|\r|\n", text), start=1):
        line = raw.strip()
        if line == "" or line.startswith("#"):
            continue
        match = LINE.match(line)
        if match is None:
            raise ConfigError(
                f"{path}:{number}: {line!r} is not a hostfile line; write {FORM} "
                "(one host and its number of ranks) or start a comment with #"
            )
        name, count = match.groups()
        if not (count.isascii() and count.isdigit()) or int(count) < 1:
            raise ConfigError(
                f"{path}:{number}: {name} slots={count}: the slot count must be a whole number "
                ">= 1 (the ranks to start on the host, e.g. its GPUs); fix it or drop the line"
            )
        if name in hosts:
            raise ConfigError(
                f"{path}:{number}: {name} is listed again (first on line {hosts[name].line}); "
                f"DeepSpeed refuses a host listed twice: keep one {FORM} line per host"
            )
        hosts[name] = Host(name, int(count), number)
    if not hosts:
        what = "is empty" if text.strip() == "" else "holds only comments and blank lines"
        raise ConfigError(f"{path}: the hostfile {what}; write one {FORM} line per host")
    return list(hosts.values())


def read(path: str | Path) -> list[Host]:
    """:func:`parse` of the file at ``path``; a file that cannot be read is one ConfigError line
    (DeepSpeed itself would warn and start on this machine alone)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as err:
        raise ConfigError(
            f"{path}: cannot read the hostfile ({err.strerror or err}); pass a readable file"
        ) from None
    except UnicodeDecodeError:
        raise ConfigError(
            f"{path}: not a text file (not UTF-8); a hostfile holds {FORM} lines"
        ) from None
    return parse(text, str(path))


def slot_total(hosts: list[Host]) -> int:
    """The job's world size: every host's slots together."""
    return sum(host.slots for host in hosts)
