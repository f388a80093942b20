"""The docs' numbers: the key-path language, each number checked against its result file, the
directive tables rendered from theirs, figures cited by name."""

from __future__ import annotations

import itertools
import json
import re
import statistics
from collections.abc import Callable
from pathlib import Path

from tools.results.registry import (
    BEGIN,
    DERIVED,
    END,
    INDEX,
    NOT_RESULTS,
    PUBLISHED,
    README,
    README_BEGIN,
    README_END,
    REPO,
    RESULT_DIRS,
    RESULTS,
    Result,
)
from tools.results.tables import render_index, render_readme, without_staleness

# ------------------------------------------------------------------- the docs' numbers
#
# Every number with a unit in a doc is one of: (1) in a generated block (the index, README's results
# table), checked by regenerating it; (2) the text of a link to a result file whose title names the
# value: [90.13%](results/x.json "runs[row=fujitsu_span32].final_top1 | mean"), one value per number
# in the text, separated by ";"; (3) a cell of a table under a directive: <!-- evidence rows of FILE
# --> (every row is a line of FILE, a report the study wrote) or <!-- evidence columns [of FILE]: E1 ;
# E2 ; ... --> (cell i is the value Ei names in FILE, or in the file the row links; "{1}" in Ei is
# the row's first cell, "{2}" its second, ...; an empty Ei: a column without a number with a unit);
# (4) in a code span or block (a command, a setting); (5) a figure cited by name right after it,
# 6.8%<!-- derived fashion_share_b4096 --> (DERIVED: it must print from the value) or
# 75.9%<!-- published mlperf_resnet_target --> (PUBLISHED: a paper or a rulebook, written as
# registered), each registered for the docs that quote it; or (6) stated by the doc with why, for its
# paragraph: <!-- stated 15 min: pytest-timeout's limit -->.

_UNIT = r"(?:\s?(%|pt\b|points?\b|img/s|ms\b|min\b|s\b(?!/))|(x)(?!\w))"
UNIT_NUMBER = re.compile(r"(?<![\w.])([-+]?\d[\d,]*(?:\.\d+)?)" + _UNIT)  # what must be sourced
UNIT_NUMBER_AT_END = re.compile(UNIT_NUMBER.pattern + r"$")  # the number a figure's name follows
# a count (GPUs, nodes, ranks, epochs, steps, images) is a claim in a paragraph that quotes results:
# "sign is fastest up to 16 GPUs" beside the model's milliseconds (issue 53: it passed, the model says 8)
COUNT = re.compile(r"(?<![\w.])~?\d[\d,]*\s(?:GPUs?|nodes?|ranks?|epochs?|steps?|images?)\b")
NUMBER = re.compile(r"(?<![\w.])([-+]?\d[\d,]*(?:\.\d+)?)" + _UNIT + "?")  # in a label or cell
SOURCED = re.compile(r'\[([^\[\]]*)\]\(([^)\s]+)\s+"([^"]+)"\)')
LINK = re.compile(r"\]\(([^)\s#]+)")
CODE = re.compile(r"```.*?```|`[^`\n]*`", re.S)
STATED = re.compile(r"<!-- stated (.+?): (.+?) -->", re.S)  # a setting or threshold, and why
DIRECTIVE = re.compile(
    r"<!-- evidence (rows|columns)(?: of (\S+))?(?::\s(.*?))? -->\n+((?:\|[^\n]*\n?)+)", re.S
)
COMMENT = re.compile(r"<!--.*?-->", re.S)
STEP = re.compile(r"([^.\[\]]+)|\[([^\]]*)\]")
FUNCTIONS: dict[str, Callable[[list[float]], float]] = {
    "mean": statistics.mean,
    "sd": statistics.stdev,
    "median": statistics.median,
    "min": min,
    "max": max,
    "count": len,
    "sum": sum,
    "dip": lambda curves: max(map(_dip, curves)),  # the largest dip of a row's seeds (fraction)
}
UNARY: dict[str, Callable[[float], float]] = {
    "minutes": lambda v: round(v) // 60,  # the "M" of "M min S s"
    "seconds": lambda v: round(v) % 60,  # the "S" of "M min S s"
    "abs": abs,
}
# how a value prints in each unit: a share or a gap is kept as a fraction and printed x 100 (never
# as is: a 0.46-pt gap kept as 0.0046 does not print as "0.00 pt", nor 92.43% as "0.92%")
SCALES = {"%": (100,), "pt": (100,), "point": (100,), "points": (100,), "min": (1, 1 / 60)}


def _dip(curve: list) -> float:
    """How far a top-1 curve ever fell below its best before (as bench/study/stats.py largest_dip)."""
    best, dip = None, 0.0
    for top1 in (v for v in curve if v is not None):
        dip = dip if best is None else max(dip, best - top1)
        best = top1 if best is None else max(best, top1)
    return dip


def _holds(value, op: str, wanted: str) -> bool:
    """A selector's test on one item's value: ``=`` compares text, ``<`` and ``>`` numbers."""
    if op == "=":
        return str(value).lower() == wanted.lower()
    if value is None:
        return False
    return float(value) > float(wanted) if op == ">" else float(value) < float(wanted)


def walk(data, path: str):
    """The value at a key path: ``a.b[0].c``; ``[k=v,k2=v2]`` selects the items of a list whose keys
    have those values (``[step>20]``: above, ``<``: below), ``[*]`` all of them; a key after a
    selection maps over it."""
    cur, many = data, False
    for key, sel in STEP.findall(path):
        if key:
            cur = [c[key] for c in cur] if many else cur[key]
        elif sel == "*":
            many = True
        elif re.fullmatch(r"-?\d+", sel):
            cur, many = cur[int(sel)], False
        else:
            tests = [re.fullmatch(r"([^=<>]+)([=<>])(.*)", kv).groups() for kv in sel.split(",")]
            cur = [c for c in cur if all(_holds(c.get(k), op, v) for k, op, v in tests)]
            many = True
    return cur


def resolve(data, expr: str) -> float:
    """The number ``expr`` names in a result file's data: a key path (:func:`walk`) with functions
    after ``|`` (mean, sd, median, min, max, count, sum, dip over curves; minutes, seconds, abs), or
    two of them (or one and a constant) joined by one of `` / ``, `` - ``, `` + ``."""
    ops = {" + ": float.__add__, " - ": float.__sub__, " / ": float.__truediv__}
    for level in ((" + ", " - "), (" / ",)):  # the loosest operator splits first, the rightmost
        at, op = max((expr.rfind(o), o) for o in level)  # of them: a - b - c is (a - b) - c
        if at >= 0:
            return ops[op](resolve(data, expr[:at]), resolve(data, expr[at + len(op) :]))
    path, *fns = [part.strip() for part in expr.split("|")]
    if re.fullmatch(r"-?\d+(\.\d+)?", path):  # a constant: the goal's 0.3 pt as 0.003
        return float(path)
    value = data if path == "." else walk(data, path)
    for fn in fns:
        if fn in FUNCTIONS:
            floats = value if fn in ("count", "dip") else [float(v) for v in value]
            value = FUNCTIONS[fn](floats)
        else:
            value = UNARY[fn](value)
    if isinstance(value, list):
        if len(value) != 1:
            raise ValueError(f"{len(value)} values, not one (add | mean, | min, ... or select)")
        value = value[0]
    return float(value)


def prints_as(written: str, unit: str | None, value: float) -> bool:
    """Whether ``value`` (a fraction or in percent for %/pt; seconds or minutes for min) is written
    so; a number written without a sign may be the value's magnitude (a drop of 1.5 pt)."""
    plain = written.replace(",", "")
    decimals = len(plain.split(".")[1]) if "." in plain else 0
    for scale in SCALES.get(unit or "", (1,)):
        shown = float(f"{value * scale:.{decimals}f}")
        if shown == float(plain) or (plain[0] not in "+-" and abs(shown) == float(plain)):
            return True
    return False


def _load(rel: str) -> dict:
    path = REPO / rel
    if path.suffix == ".json":
        return json.loads(path.read_text())
    return {"lines": path.read_text().splitlines()}


def check_value(rel: str, expr: str, written: str, unit: str | None) -> str | None:
    """None when ``written`` prints from the value ``expr`` names in ``rel``; else what is wrong."""
    try:
        value = resolve(_load(rel), expr)
    except (KeyError, IndexError, TypeError, ValueError, statistics.StatisticsError) as e:
        return f'"{expr}" names no value in {rel} ({type(e).__name__}: {e})'
    if prints_as(written, unit, value):
        return None
    shown = written + ("" if unit in (None, "%", "x") else " ") + (unit or "")
    return f'{shown} is not "{expr}" in {rel} ({value:.6g})'


def _label_problems(rel: str, label: str, exprs: str, sep: str) -> list[str]:
    """What is wrong with the numbers of a link's text or a table cell against the values named."""
    numbers = list(NUMBER.finditer(label))
    named = [" ".join(e.split()) for e in exprs.split(sep)]
    if len(numbers) != len(named):
        return [f"{label!r} holds {len(numbers)} number(s) but names {len(named)} value(s)"]
    whys = (check_value(rel, e, n[1], n[2] or n[3]) for n, e in zip(numbers, named, strict=True))
    return [w for w in whys if w]


def _result_file(doc: str, target: str) -> str | None:
    """A link's target as a repository path when it is a result file, else None."""
    if "://" in target:
        return None
    try:
        rel = str(((REPO / doc).parent / target).resolve().relative_to(REPO))
    except ValueError:
        return None
    ok = rel.startswith(RESULT_DIRS) and Path(rel).name != "README.md" and rel not in NOT_RESULTS
    return rel if ok else None


def _blank(text: str, spans) -> str:
    """``text`` with the given spans replaced by spaces (lines kept): checked, or not numbers."""
    chars = list(text)
    for a, b in spans:
        chars[a:b] = [c if c == "\n" else " " for c in text[a:b]]
    return "".join(chars)


def _table_problems(doc: str, m: re.Match, results: list[Result]) -> list[str]:
    kind, of, exprs, table = m.groups()
    where = f"{doc}:{m.string.count(chr(10), 0, m.start(4)) + 1}"
    rows = [r for r in table.strip("\n").splitlines() if not re.fullmatch(r"\|[-:| ]+\|", r)]
    source = _result_file(doc, of) if of else None
    if (of or kind == "rows") and source is None:
        return [f"{where}: {of or 'a rows directive without a file'} is not a result file"]
    if kind == "rows":
        lines = set((REPO / source).read_text().splitlines())
        return [
            f"{where}: a row that is not a line of {source}: {r}" for r in rows if r not in lines
        ]
    columns = [e.strip() for e in (exprs or "").split(";")]
    problems = []
    for row in rows[1:]:  # the header names the columns
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        rel = source or next(
            (f for f in map(lambda t: _result_file(doc, t), LINK.findall(row)) if f), None
        )
        if rel is None:
            problems.append(
                f"{where}: the row links no result file and the directive names none: {row}"
            )
            continue
        named = {f"{{{i}}}": re.sub(r"[`*]", "", c) for i, c in enumerate(cells, 1)}
        for cell, expr in itertools.zip_longest(cells, columns[: len(cells)], fillvalue=""):
            if not expr:  # not a value column: a number with a unit here would go unchecked
                problems += [
                    f"{where}: {n[0]} is in a column the directive names no value for"
                    for n in UNIT_NUMBER.finditer(cell)
                ]
            else:
                problems += [
                    f"{where}: {w}"
                    for w in _label_problems(
                        rel, cell, re.sub(r"\{\d+\}", lambda k, named=named: named[k[0]], expr), "&"
                    )
                ]
    return problems


def render_number(written: str, unit: str | None, value: float) -> str:
    """``value`` printed as ``written`` is: its decimals, thousands commas, sign style (a ``+`` kept,
    no sign: the magnitude) and the unit's scale the author used (% and pt: x 100)."""
    plain = written.replace(",", "")
    decimals = len(plain.split(".")[1]) if "." in plain else 0
    scale = min(SCALES.get(unit or "", (1,)), key=lambda k: abs(abs(value * k) - abs(float(plain))))
    shown = value * scale
    if plain[0] not in "+-":
        shown = abs(shown)
    text = f"{shown:{'+' if plain[0] == '+' else ''}{',' if ',' in written else ''}.{decimals}f}"
    return text


def render_cell(rel: str, cell: str, exprs: str) -> str:
    """A table cell with each of its numbers printed from the value its expression names (``&``
    between several); a cell whose numbers and expressions do not pair up is left as it is."""
    numbers = list(NUMBER.finditer(cell))
    named = [" ".join(e.split()) for e in exprs.split("&")]
    if len(numbers) != len(named):
        return cell
    data, out, last = _load(rel), [], 0
    for n, expr in zip(numbers, named, strict=True):
        try:
            value = resolve(data, expr)
        except (KeyError, IndexError, TypeError, ValueError, statistics.StatisticsError):
            return cell
        out += [cell[last : n.start(1)], render_number(n[1], n[2] or n[3], value)]
        last = n.end(1)
    return "".join(out) + cell[last:]


def render_table(doc: str, m: re.Match) -> str:
    """A directive's table as its file says (issue 53: numbers rendered, not typed): a ``rows``
    table's rows become the report's lines that start with the same first cell; a ``columns``
    table's cells are printed from the values their expressions name."""
    kind, of, exprs, table = m.groups()
    source = _result_file(doc, of) if of else None
    lines = table.split("\n")
    if kind == "rows":
        if source is None:
            return table
        report = [x for x in (REPO / source).read_text().splitlines() if x.startswith("|")]
        first: dict[str, str] = {}
        for x in report:
            if not re.fullmatch(r"\|[-:| ]+\|", x):  # the rules stay the doc's
                first.setdefault(x.split("|")[1].strip(), x)

        def row(x: str) -> str:
            if x in report or not x.startswith("|") or re.fullmatch(r"\|[-:| ]+\|", x):
                return x
            return first.get(x.split("|")[1].strip(), x)

        return "\n".join(map(row, lines))
    columns = [e.strip() for e in (exprs or "").split(";")]
    out = lines[:2]  # the header and its rule
    for row in lines[2:]:
        if not row.startswith("|"):
            out.append(row)
            continue
        cells = row.strip().strip("|").split("|")
        rel = source or next(
            (f for f in map(lambda t: _result_file(doc, t), LINK.findall(row)) if f), None
        )
        if rel is None:
            out.append(row)
            continue
        named = {f"{{{i}}}": re.sub(r"[`*]", "", c.strip()) for i, c in enumerate(cells, 1)}
        rendered = []
        for cell, expr in itertools.zip_longest(cells, columns[: len(cells)], fillvalue=""):
            if expr:
                expr = re.sub(r"\{\d+\}", lambda k, named=named: named[k[0]], expr)
                cell = " " + render_cell(rel, cell.strip(), expr) + " "
            rendered.append(cell)
        out.append("|" + "|".join(rendered) + "|")
    return "\n".join(out)


def render_doc(doc: str, text: str) -> str:
    """``text`` with every directive's table rendered from its file (:func:`render_table`)."""
    code = [(x.start(), x.end()) for x in CODE.finditer(text)]
    out, last = [], 0
    for m in DIRECTIVE.finditer(text):
        if any(a <= m.start() < b for a, b in code):
            continue
        out += [text[last : m.start(4)], render_table(doc, m)]
        last = m.end(4)
    return "".join(out) + text[last:]


def doc_problems(doc: str, text: str, results: list[Result]) -> list[str]:
    """Every number with a unit in ``text`` (the doc ``doc``) that no source backs, and every
    sourced number, table and linked file that disagrees with its result file."""
    problems: list[str] = []
    for begin, end in ((BEGIN, END), (README_BEGIN, README_END)):  # generated: compared whole
        if begin in text and end in text:
            text = _blank(text, [(text.index(begin), text.index(end))])
    code = [(x.start(), x.end()) for x in CODE.finditer(text)]  # commands and settings

    def line(pos: int) -> int:
        return text.count("\n", 0, pos) + 1

    def outside(matches):
        return [m for m in matches if not any(a <= m.start() < b for a, b in code)]

    quoting = [  # the paragraphs that quote a result (a sourced link)
        (text.rfind("\n\n", 0, m.start()), text.find("\n\n", m.end()) % (len(text) + 1))
        for m in outside(SOURCED.finditer(text))
    ]
    for m in outside(LINK.finditer(text)):
        rel = _result_file(doc, m[1])
        if rel and registered_file(rel, results) is None:
            problems.append(
                f"{doc}: links {rel}, which no Result in tools/results/registry.py registers"
            )
    done = code
    for m in outside(SOURCED.finditer(text)):
        label, target, exprs = m.groups()
        rel = _result_file(doc, target)
        if rel is None:
            continue
        problems += [
            f"{doc}:{line(m.start())}: {w}" for w in _label_problems(rel, label, exprs, ";")
        ]
        done.append((m.start(), m.end()))
    for m in outside(DIRECTIVE.finditer(text)):
        problems += _table_problems(doc, m, results)
        done.append((m.start(4), m.end(4)))
    for mark in outside(NAMED.finditer(text)):  # a published or derived figure, by name
        before = text[: mark.start()]
        num = None if mark.start() == 0 else UNIT_NUMBER_AT_END.search(before)
        if num is None:
            problems.append(f"{doc}:{line(mark.start())}: {mark[0]} follows no number")
            continue
        why = named_problem(doc, num[0], num[1], num[2] or num[3], mark[1], mark[2])
        if why:
            problems.append(f"{doc}:{line(num.start())}: {why}")
        done.append((num.start(), num.end()))
    comments = [(m.start(), m.end()) for m in COMMENT.finditer(text)]
    stated = [  # a stated number counts in the paragraph of its comment
        (text.rfind("\n\n", 0, m.start()), text.find("\n\n", m.end()) % (len(text) + 1), m[1])
        for m in STATED.finditer(text)
    ]
    text = _blank(text, done + comments)
    for m in COUNT.finditer(text):
        shown = " ".join(m.group(0).split()).lstrip("~")  # "10\nepochs" as "10 epochs"
        in_table = text[text.rfind("\n", 0, m.start()) + 1 :].lstrip().startswith("|")
        if (
            in_table
            or not any(a < m.start() < b for a, b in quoting)
            or any(
                a < m.start() < b and " ".join(n.split()).lstrip("~") == shown for a, b, n in stated
            )
        ):
            continue
        problems.append(
            f"{doc}:{line(m.start())}: {shown} is a count in a paragraph that quotes results: "
            f'link it to the value it claims ([{shown}](path/to/result.json "key.path")) or say '
            f"why it is stated (<!-- stated {shown}: why -->)"
        )
    for m in UNIT_NUMBER.finditer(text):
        shown = m.group(0)
        if any(a < m.start() < b and n == shown for a, b, n in stated):
            continue
        problems.append(
            f"{doc}:{line(m.start())}: {shown} names no source: link it to its value "
            f'([{shown}](path/to/result.json "key.path")) or say why it is stated (<!-- stated {shown}: why -->)'
        )
    return problems


def docs(results: list[Result]) -> list[Path]:
    """The docs whose numbers are checked: every Markdown page but the reports results wrote."""
    pages = [REPO / "README.md"] + [
        p
        for d in ("docs", "ds_configs", "bench", "tools", "hostfiles")
        for p in (REPO / d).rglob("*.md")
    ]
    return sorted(p for p in pages if registered_file(str(p.relative_to(REPO)), results) is None)


def registered_file(rel: str, results: list[Result]) -> Result | None:
    """The result a file belongs to: its own, or that of the .json beside it (a report, a plot)."""
    stem = str(Path(rel).with_suffix(""))
    for r in results:
        if r.file == rel or str(Path(r.file).with_suffix("")) == stem:
            return r
    return None


def check(texts: dict[str, str] | None = None, results: list[Result] | None = None) -> list[str]:
    """Every way the docs disagree with the result files (``texts``: doc -> text, default the files)."""
    results = RESULTS if results is None else results
    texts = {str(p.relative_to(REPO)): p.read_text() for p in docs(results)} | (texts or {})
    index, readme = str(INDEX.relative_to(REPO)), str(README.relative_to(REPO))
    problems = []
    if without_staleness(render_index(texts[index], results, stale=False)) != without_staleness(
        texts[index]
    ):
        problems.append(
            f"{index}: the table differs from the result files; run python tools/evidence.py index"
        )
    if render_readme(texts[readme], results) != texts[readme]:
        problems.append(
            f"{readme}: the results table differs from the result files; run python tools/evidence.py index"
        )
    for doc, text in texts.items():
        problems += doc_problems(doc, text, results)
        if render_doc(doc, text) != text:
            problems.append(
                f"{doc}: a table differs from its file; run python tools/evidence.py index"
            )
    for rel in unregistered(results):
        problems.append(f"{rel}: a result file no Result in tools/results/registry.py registers")
    return problems


def unregistered(results: list[Result]) -> list[str]:
    files = {r.file for r in results}
    return sorted(
        str(p.relative_to(REPO))
        for d in RESULT_DIRS
        for p in (REPO / d).rglob("*.json")
        if str(p.relative_to(REPO)) not in files and str(p.relative_to(REPO)) not in NOT_RESULTS
    )


NAMED = re.compile(r"<!-- (published|derived) ([\w.-]+) -->")


def named_problem(doc: str, written: str, number: str, unit: str | None, kind: str, name: str):
    """What is wrong with a number quoted under a published or derived figure's name, or None."""
    table = PUBLISHED if kind == "published" else DERIVED
    if name not in table:
        return f"{written} cites {kind} {name!r}, which tools/evidence.py does not register"
    value, _, quoting = table[name]
    if doc not in quoting:
        return f"{written} cites {kind} {name!r}, registered for {', '.join(quoting)} only"
    if kind == "published" and written != value:
        return f"{written} is not {name} as published ({value})"
    if kind == "derived" and not prints_as(number, unit, value):
        return f"{written} is not {name} ({value:.6g})"
    return None
