"""What each technique of the seeds earns at the large batch (issue 52, item 4): one table.

    .venv/bin/python results/harness/ablation.py \\
        --reports results/studies/ablation_90ep_holdout6000_*.json \\
                  results/studies/tuning/chosen_b8192_lr20_90ep_holdout6000.json \\
                  results/studies/tuning/chosen_b8192_lr20_90ep_holdout6000_s1_2.json \\
                  results/studies/tuning/chosen_b8192_lamb_<L>_90ep_holdout6000*.json \\
        --name ablation_90ep_holdout6000

Each row of the table is one change from the chosen recipe (``CHANGES``): without label smoothing
(Mikami), without the un-augmented tail or the BN refit (Kasagi), with Mikami's batch-size ramp, and
LAMB in place of LARS at batch 8,192 (each optimizer at the peak LR its own held-out tuning chose;
the LAMB row's runs are those of the reports given). For each: the changed row's and its base row's
final top-1 over their seeds (mean, sample standard deviation, worst seed), the gap with its 95%
interval (Welch's t; a paired t over the seeds where the changed row is the base's own runs read
before the refit) and what the technique earns, signed so that a positive number is the technique
helping. The settings that differ are read from the runs' recorded commands (the study's
:func:`definition`), not assumed: a pair that differs in more than its change, a row whose runs are
not one definition, runs on different images or lengths are refused, naming what differs; runs
made at different trainer code are refused unless named with ``--across-commits``, as
results/harness/accuracy_study.py does. A row whose runs are not in the reports yet is listed as pending.

Any other change (a knob's setting, an optimizer) is compared with ``--change WHAT CHANGED BASE``,
once per table row: CHANGED and BASE are two reports of one row definition each (e.g. the study's
row run with ``--extra optim.weight_decay=1e-4`` and the same row as defined), WHAT the table's
words for it; every setting in which the two differ is listed (where the optimizer itself is
swapped, the table counts its JSON's parameters and the .json lists them), the gap is the changed
side's minus the base's, with its Welch interval (issue 74, item 5: what earns what at 4,096 and
8,192); with ``--pooled``, a side of one seed (a screen against its base's three) gets an interval
too, from the seed sd pooled over the table's rows of its batch that have two or more. Every
table also counts each side's epochs to ``--level`` top-1 (default 90%, the study's "epochs to
90%"), from the runs' top-1 per epoch, and the ratio of their means (where every seed of both got
there): the epochs goal beside the accuracy one. With ``--grid`` (each label written ``KNOB:
SETTING``) the report opens with the same entries at a glance, a line per knob and a column per
batch: what a user scaling a batch up tries first.
Writes <name>.json and <name>.md under --out (default results/studies).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.common import mean_pm, provenance, write_result  # noqa: E402
from results.harness.study.commits import code_between, code_lines, refuse_mixed_code  # noqa: E402
from results.harness.study.definition import described, differing, resolved, run_name  # noqa: E402
from results.harness.study.report import counted  # noqa: E402
from results.harness.study.rows import CHOSEN, DERIVED  # noqa: E402
from results.harness.study.stats import (  # noqa: E402
    epochs_to,
    gap_interval,
    mean_sd,
    pooled_interval,
    pooled_sd,
)


class Change(NamedTuple):
    row: str  # the study's row with the change
    base: str  # the row it is one change from
    what: str  # the change, as the table names it
    sign: int  # +1: the row adds the technique; -1: it removes it (or replaces the base's)
    keys: tuple[str, ...] | None  # the settings it may touch (a prefix ends with "."); None: any


CHANGES = (
    Change(
        "chosen_no_ls", CHOSEN, "without label smoothing (Mikami)", -1, ("optim.label_smoothing",)
    ),
    Change(
        "chosen_no_tail",
        CHOSEN,
        "without the un-augmented last epochs (Kasagi)",
        -1,
        ("polish.last_epochs_without_augmentation",),
    ),
    Change("chosen_no_refit", CHOSEN, "without the BN refit (Kasagi)", -1, ()),
    Change(
        "chosen_ramp",
        CHOSEN,
        "with the batch-size ramp (Mikami): half the batch through the warmup",
        +1,
        ("batch.global_size", "batch.ramp"),
    ),
    Change(
        "chosen_b8192_lamb",
        "chosen_b8192",
        "batch 8,192: LAMB in place of LARS, each at its own tuned LR",
        -1,
        ("optim.base_lr", "deepspeed_config.optimizer."),
    ),
)
ALWAYS_FREE = {"seed"}
LEVEL = 0.9  # the top-1 the table counts epochs to (the study's "epochs to 90%")


def gathered(reports: list[dict]) -> dict[str, list[dict]]:
    """Each row's runs over all the reports, one per seed: a seed two reports both hold must be the
    same run (same command and top-1), else ValueError naming it."""
    by: dict[tuple[str, int], dict] = {}
    for report in reports:
        for record in report["runs"]:
            key = record["row"], record["seed"]
            seen = by.setdefault(key, record)
            if seen is not record and (
                seen.get("command") != record.get("command")
                or seen["final_top1"] != record["final_top1"]
            ):
                raise ValueError(f"{run_name(record)}: two reports hold different runs of it")
    rows: dict[str, list[dict]] = {}
    for (row, _), record in sorted(by.items()):
        rows.setdefault(row, []).append(record)
    return rows


def one_run_each(runs: list[dict]) -> dict:
    """A row's settings: every run of it the same definition but its seed (else ValueError)."""
    first = resolved(runs[0])
    for record in runs[1:]:
        keys = differing(first, resolved(record), ALWAYS_FREE)
        if keys:
            raise ValueError(
                f"{run_name(record)} differs from {run_name(runs[0])} in {', '.join(keys)}: a row's "
                "runs are one definition, only the seed differs"
            )
    return first


def allowed(key: str, keys: tuple[str, ...] | None) -> bool:
    return keys is None or any(key == k or (k.endswith(".") and key.startswith(k)) for k in keys)


def what_differs(change: Change, row_runs: list[dict], base_runs: list[dict]) -> list[str]:
    """``key: base -> row`` for each setting the change touches; ValueError where the pair differs
    in more than its change. A derived row (the base's own runs, read before the refit) differs in
    nothing but when it is read."""
    if change.row in DERIVED:
        if DERIVED[change.row] != change.base:
            raise ValueError(f"{change.row} is read from {DERIVED[change.row]}, not {change.base}")
        return ["the same runs, top-1 read before the refit"]
    mine, base = one_run_each(row_runs), one_run_each(base_runs)
    keys = differing(base, mine, ALWAYS_FREE)
    beyond = [k for k in keys if not allowed(k, change.keys)]
    if beyond:
        detail = ", ".join(described(base, mine, beyond))
        raise ValueError(
            f"{change.row} differs from {change.base} in more than its change ({detail}): one "
            "change per row, or the table cannot say what the technique earns"
        )
    if not keys:
        raise ValueError(f"{change.row} and {change.base} are the same definition: no change")
    return described(base, mine, keys)


def paired_interval(row: list[dict], base: list[dict]) -> tuple[float, float, float] | None:
    """(gap, low, high) over the seeds both hold, paired (the same runs read twice): a 95% t
    interval of the per-seed differences; None below two seeds."""
    b = {r["seed"]: 100 * r["final_top1"] for r in base}
    diffs = [100 * r["final_top1"] - b[r["seed"]] for r in row if r["seed"] in b]
    if len(diffs) < 2:
        return None
    from scipy.stats import t as student_t

    gap, sd = statistics.mean(diffs), statistics.stdev(diffs)
    half = float(student_t.ppf(0.975, len(diffs) - 1)) * sd / len(diffs) ** 0.5
    return gap, gap - half, gap + half


def _mean_pm(summary: dict) -> str:
    return mean_pm(summary["mean"], summary["sd"], len(summary["seeds"]))


def _summary(runs: list[dict], level: float = LEVEL) -> dict:
    values = [100 * r["final_top1"] for r in runs]
    mean, sd = mean_sd(values)
    return {
        "seeds": [r["seed"] for r in runs],
        "top1": values,
        "mean": mean,
        "sd": sd,
        "worst": min(values),
        # the first epoch each run's top-1 reached the level (None: never); None for the whole
        # side where a run recorded no top-1 per epoch
        "epochs_to_level": (
            [epochs_to(r["top1_per_epoch"], level) for r in runs]
            if all(r.get("top1_per_epoch") for r in runs)
            else None
        ),
    }


def _reach(summary: dict) -> str:
    """The epochs-to-level cell of one side: "35.0 (1/1)", "never (0/3)"; "-" for runs that recorded
    no top-1 per epoch."""
    epochs = summary["epochs_to_level"]
    return "-" if epochs is None else counted(epochs, ".1f")


def epochs_ratio(changed: dict, reference: dict) -> float | None:
    """The changed side's mean epochs to the level over its base's (item 4's epochs goal: batch
    8,192 in at most 2.45x the baseline's); None unless every seed of both sides got there."""
    sides = changed["epochs_to_level"], reference["epochs_to_level"]
    if any(e is None or None in e for e in sides):
        return None
    return statistics.mean(sides[0]) / statistics.mean(sides[1])


def _differs_cell(differs: list[str]) -> str:
    """The table's "settings that differ": where the optimizer itself changes, its type and the
    count of its JSON's parameters that differ (the .json lists each); every other setting whole."""
    prefix = "deepspeed_config.optimizer.params."
    swapped = any(d.startswith("deepspeed_config.optimizer.type:") for d in differs)
    params = [d for d in differs if d.startswith(prefix)]
    if not swapped or not params:
        return "; ".join(differs)
    kept = [d for d in differs if not d.startswith(prefix)]
    return "; ".join(kept) + f" (and {len(params)} of the optimizers' parameters)"


def named_changes(given: list[list[str]], reports: dict[str, dict]) -> tuple[dict, tuple]:
    """``--change WHAT CHANGED BASE``: each side's runs under its report's name (one row definition
    a report, else ValueError), and the changes between them."""
    rows, changes, named = {}, [], {}
    for what, *sides in given:
        for path in sides:
            if named.setdefault(Path(path).stem, path) != path:
                raise ValueError(
                    f"--change {path} and {named[Path(path).stem]}: one name, two reports (the "
                    "table names each side by its file's name)"
                )
            runs = gathered([reports[path]])
            if len(runs) != 1:
                raise ValueError(
                    f"--change {path}: holds the rows {', '.join(sorted(runs))}; a side of a "
                    "change is one row's runs"
                )
            rows[Path(path).stem] = next(iter(runs.values()))
        changed, base = (Path(path).stem for path in sides)
        if changed == base:
            raise ValueError(f"--change {what!r}: both sides are {changed}")
        changes.append(Change(changed, base, what, +1, None))
    return rows, tuple(changes)


def _batch(runs: list[dict]) -> int | None:
    return one_run_each(runs).get("batch.global_size")


def pools_of(rows: dict[str, list[dict]], changes=CHANGES) -> dict[int, dict]:
    """``--pooled``: each batch's seed sd pooled over the compared rows of that batch with two seeds
    or more (a row read from another's runs, DERIVED, is not counted twice): sd, df, its rows."""
    compared = [c for c in changes if rows.get(c.row) and rows.get(c.base)]
    names = list(dict.fromkeys(x for c in compared for x in (c.row, c.base)))
    members = [n for n in names if len(rows[n]) > 1 and n not in DERIVED]
    pools = {}
    for b in dict.fromkeys(_batch(rows[n]) for n in members):
        these = [n for n in members if _batch(rows[n]) == b]
        sd, df = pooled_sd([[100 * r["final_top1"] for r in rows[n]] for n in these])
        pools[b] = {"sd_pt": sd, "df": df, "rows": these}
    return pools


def compare(
    rows: dict[str, list[dict]],
    changes=CHANGES,
    level: float = LEVEL,
    pools: dict[int, dict] | None = None,
) -> tuple[list[dict], list[str]]:
    """One entry per change whose row and base both have runs; the others' names (pending). The
    gap's interval: paired t for a DERIVED row, Welch's where both sides have two seeds or more,
    else (``pools``, ``--pooled``) a t interval from the seed sd pooled over its batch's rows."""
    out, pending = [], []
    for change in changes:
        row_runs, base_runs = rows.get(change.row, []), rows.get(change.base, [])
        if not row_runs or not base_runs:
            pending.append(
                change.row if base_runs else f"{change.row} (and its base {change.base})"
            )
            continue
        differs = what_differs(change, row_runs, base_runs)
        paired = change.row in DERIVED
        changed, reference = _summary(row_runs, level), _summary(base_runs, level)
        found = (
            paired_interval(row_runs, base_runs)
            if paired
            else gap_interval(changed["top1"], reference["top1"])
        )
        kind = "paired t" if paired else "Welch"
        batch = _batch(row_runs)
        pool = pools.get(batch) if pools and not found else None
        if pool and _batch(base_runs) == batch:
            found = pooled_interval(changed["top1"], reference["top1"], pool["sd_pt"], pool["df"])
            kind = "pooled t"
        gap = changed["mean"] - reference["mean"]
        interval = list(found[1:]) if found else None
        out.append(
            {
                "row": change.row,
                "base": change.base,
                "change": change.what,
                "batch": batch,
                "differs": differs,
                "changed": changed,
                "reference": reference,
                "gap_pt": gap,
                "ci95_pt": interval,
                "interval": kind,
                "epochs_ratio": epochs_ratio(changed, reference),
                # what the technique earns: positive when it helps
                "earns_pt": change.sign * gap,
                "earns_ci95_pt": (
                    sorted(change.sign * x for x in interval) if interval is not None else None
                ),
            }
        )
    return out, pending


def pool_lines(pools: dict[int, dict]) -> list[str]:
    """The caption of the pooled intervals: each batch's pooled sd, its degrees of freedom and rows."""
    return [
        f'A "pooled t" interval at batch {b:,} takes the seed sd pooled over that batch\'s rows of'
        f" 2+ seeds here: {p['sd_pt']:.2f} pt (sample sd, {p['df']} degrees of freedom; "
        f"{', '.join(p['rows'])}), as if every setting spread its seeds alike."
        for b, p in pools.items()
    ]


# what a base row's runs set that its tuning chose (the table's caption names them: the chosen recipe
# is its row at the LR and warmup its held-out tuning chose, given as overrides to the row)
SCHEDULE = ("optim.base_lr", "optim.warmup_epochs", "optim.decay_epochs")


def bases(rows: dict[str, list[dict]], changes=CHANGES) -> dict[str, dict]:
    """Each base row with runs: its batch and schedule as its runs resolve them."""
    out = {}
    for name in dict.fromkeys(c.base for c in changes):
        if rows.get(name):
            settings = one_run_each(rows[name])
            out[name] = {k: settings.get(k) for k in ("batch.global_size", *SCHEDULE)}
    return out


def base_words(name: str, settings: dict) -> str:
    """``ROW at batch B (peak LR L, warmup W and decay D epochs)``: a base row as the caption
    names it."""
    lr, warmup, decay = (
        "unset" if settings.get(k) is None else f"{settings[k]:g}" for k in SCHEDULE
    )
    return (
        f"{name} at batch {settings['batch.global_size']:,} (peak LR {lr}, warmup {warmup} "
        f"and decay {decay} epochs)"
    )


def table(
    entries: list[dict], pending: list[str], named: bool = False, level: float = LEVEL
) -> list[str]:
    """The table; ``named``: rows given by --change (one change each from its own base)."""
    first, earns = (
        ("change", "the change") if named else ("change from the chosen recipe", "the technique")
    )
    lines = [
        f"| {first} | row (seeds) | top-1 % (mean ± sample sd) | worst seed % "
        "| its base (seeds) | base top-1 % | base worst % | changed − base (pt) | 95% interval "
        f"| {earns} earns (pt) | epochs to {100 * level:g}% (row) | epochs to {100 * level:g}% "
        "(base) | epochs, row / base | settings that differ |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for e in entries:
        c, b = e["changed"], e["reference"]
        interval = (
            f"{e['ci95_pt'][0]:+.2f} to {e['ci95_pt'][1]:+.2f} ({e['interval']})"
            if e["ci95_pt"]
            else "-"
        )
        ratio = "-" if e.get("epochs_ratio") is None else f"{e['epochs_ratio']:.2f}x"
        lines.append(
            f"| {e['change']} | {e['row']} ({len(c['seeds'])}) | {_mean_pm(c)} "
            f"| {c['worst']:.2f} | {e['base']} ({len(b['seeds'])}) | {_mean_pm(b)} "
            f"| {b['worst']:.2f} | {e['gap_pt']:+.2f} | {interval} | "
            f"{e['earns_pt']:+.2f} | {_reach(c)} | {_reach(b)} | {ratio} "
            f"| {_differs_cell(e['differs'])} |"
        )
    lines += [f"| {name}: pending |" + " |" * 13 for name in pending]
    return lines


def grid(entries: list[dict], level: float = LEVEL) -> list[str]:
    """``--grid``, what earns what at a glance (issue 74, item 5): a line per knob (a label's words
    before its first ": ", in the order given), a column per batch (the changed side's runs), each
    cell the rest of each label at that batch with its gap, 95% interval, seeds a side and epochs
    ratio."""
    batches = sorted({e["batch"] for e in entries})
    cells: dict[str, dict[int, list[str]]] = {}
    for e in entries:
        knob, _, rest = e["change"].partition(": ")
        ci, ratio = e["ci95_pt"], e.get("epochs_ratio")
        cells.setdefault(knob, {}).setdefault(e["batch"], []).append(
            f"{rest}: {e['gap_pt']:+.2f}"
            + (f" [{ci[0]:+.2f}, {ci[1]:+.2f}]" if ci else "")
            + f" ({len(e['changed']['seeds'])} v {len(e['reference']['seeds'])} seeds"
            + (f"; {ratio:.2f}x the epochs to {100 * level:g}%)" if ratio is not None else ")")
        )
    lines = [
        "| knob | " + " | ".join(f"batch {b:,}" for b in batches) + " |",
        "|---|" + "---|" * len(batches),
    ]
    for knob, by in cells.items():
        lines.append(
            f"| {knob} | " + " | ".join("<br>".join(by.get(b, [])) or "-" for b in batches) + " |"
        )
    return lines


def headline(entries: list[dict], what: str = "technique") -> str:
    """What each technique earns (positive: it helps), with its 95% interval: each named by its row,
    or with ``what`` = "change" (--change) by the label the command gave it, which says what changed
    where a row's name (a report's) does not."""
    parts = []
    for e in entries:
        ci = e["earns_ci95_pt"]
        parts.append(
            f"{e['change'] if what == 'change' else e['row']}: {e['earns_pt']:+.2f} pt"
            + (f" [{ci[0]:+.2f}, {ci[1]:+.2f}]" if ci else "")
        )
    return f"the {what} earns: " + ("; ".join(parts) or "nothing compared yet")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--reports",
        nargs="+",
        default=[],
        help="results/harness/accuracy_study.py reports holding the rows of CHANGES and their bases",
    )
    p.add_argument(
        "--change",
        nargs=3,
        action="append",
        default=[],
        metavar=("WHAT", "CHANGED", "BASE"),
        help="instead of CHANGES: a table row comparing two reports of one row each",
    )
    p.add_argument(
        "--across-commits",
        nargs="+",
        default=[],
        metavar="SHA",
        help="compare runs made at these different commits anyway (each named)",
    )
    p.add_argument(
        "--level",
        type=float,
        default=LEVEL,
        help="the top-1 (a fraction) the table counts each side's epochs to (default 0.9)",
    )
    p.add_argument(
        "--pooled",
        action="store_true",
        help="give a side of one seed an interval from the seed sd pooled over the table's rows of "
        "its batch that have 2+ seeds (a screen's one seed against its base's three)",
    )
    p.add_argument(
        "--grid",
        action="store_true",
        help="with --change labelled 'KNOB: SETTING', open the report with what earns what at a "
        "glance: a line per knob, a column per batch, each cell the gap and its interval",
    )
    p.add_argument("--out", default=str(REPO / "results/studies"))
    p.add_argument("--name", default="ablation")
    args = p.parse_args(argv)
    if bool(args.reports) == bool(args.change):
        p.error("give --reports (the seeds' techniques, CHANGES) or --change ... (any), not both")
    if args.grid and not args.change:
        p.error("--grid reads the knob from each --change label ('KNOB: SETTING'): give --change")
    unnamed = [what for what, *_ in args.change if ": " not in what]
    if args.grid and unnamed:
        p.error(
            f"--grid: the --change label {unnamed[0]!r} names no knob; write it 'KNOB: SETTING' "
            "(e.g. 'momentum: LARS 0.9 (was 0.96)')"
        )
    paths = args.reports or list(dict.fromkeys(path for _, *sides in args.change for path in sides))
    reports = []
    for path in paths:
        try:
            data = json.loads(Path(path).read_text())
            data["runs"]
        except (OSError, ValueError, KeyError) as e:
            p.error(f"--reports {path}: not a study report ({type(e).__name__}: {e})")
        reports.append(data)
    for field in ("holdout", "epochs"):
        seen = {(path, r.get(field)) for path, r in zip(paths, reports)}
        if len({v for _, v in seen}) > 1:
            p.error(
                f"--reports: runs of different {field} ("
                + ", ".join(f"{Path(path).name}: {v}" for path, v in sorted(seen))
                + "): one table compares runs on the same images for the same length"
            )
    try:
        if args.change:
            rows, changes = named_changes(args.change, dict(zip(paths, reports)))
        else:
            rows, changes = gathered(reports), CHANGES
        wanted = {name for c in changes for name in (c.row, c.base)}
        used = [r for name, runs in rows.items() if name in wanted for r in runs]
        code = code_between([str(r.get("git_sha")) for r in used])
        if refuse_mixed_code(code, args.across_commits, prog="ablation"):
            return 2
        pools = pools_of(rows, changes) if args.pooled else {}
        entries, pending = compare(rows, changes, args.level, pools)
        based = bases(rows, changes)
    except ValueError as e:
        p.error(str(e))
    holdout = reports[0].get("holdout", 0)
    images = f"{holdout} held-out training images" if holdout else "the test set"
    meta = {
        **provenance("results/harness/ablation.py", argv),
        "reports": paths,
        "holdout": holdout,
        "epochs": reports[0].get("epochs"),
        "sd": "sample standard deviation (n - 1)",
        "level": args.level,
        "code_between_runs": code,
        "bases": based,
        "pooled": {str(b): p for b, p in pools.items()},
        "entries": entries,
        "pending": pending,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    what = "change" if args.change else "technique"
    title = f"What each {what} earns at the large batch, {meta['epochs']} epochs, {images}"
    write_result(out / f"{args.name}.json", meta, title=title, headline=headline(entries, what))
    named = " or ".join(base_words(n, v) for n, v in based.items()) or f"{CHOSEN} at batch 4,096"
    head = (
        f"What each {what} earns at the large batch: {meta['epochs']} epochs, top-1 on "
        f"{images}; each row one change from "
        + (f"its base ({named}" if args.change else f"the chosen recipe ({named}")
        + ", as its runs set them); ± is the sample standard deviation."
    )
    rows_md = table(entries, pending, bool(args.change), args.level)
    md = [
        "# What each change earns (Fashion-MNIST)"
        if args.change
        else "# Ablation of the seeds' techniques (Fashion-MNIST)",
        "",
        f"`{meta['command']}` at git {str(meta['git_sha'])[:7]}, {meta['date']}; runs from "
        f"{len(paths)} report(s).",
        "",
        head,
        "",
        *(
            [
                "What earns what, at a glance: each knob's changes at each batch, the changed "
                "side's top-1 minus its base's (pt) with its 95% interval (the full table below "
                "gives each row's runs, base, interval kind and settings).",
                "",
                *grid(entries, args.level),
                "",
            ]
            if args.grid
            else []
        ),
        *rows_md,
        "",
        *pool_lines(pools),
        *([""] if pools else []),
        *code_lines(code),
        "",
    ]
    (out / f"{args.name}.md").write_text("\n".join(md))
    print("\n".join([head, *rows_md, *pool_lines(pools), *code_lines(code)]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
