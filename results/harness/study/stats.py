"""The accuracy study's numbers from its run records: time and epochs to a level, mean and sample
standard deviation, a gap to the reference row with its 95% interval (Welch), the largest dip, the
worst-seed choice, and epochs to each target level per batch against the reference.
"""

from __future__ import annotations

import statistics

from results.harness.study.rows import DERIVED, EMA_DERIVED


def time_to(history: list[dict], target: float) -> float | None:
    """Training wall time (s, cumulative epoch times) until test top-1 first reaches target; None if never."""
    elapsed = 0.0
    for h in history:
        elapsed += h["epoch_time_s"]
        if h.get("val_top1", 0.0) >= target:
            return elapsed
    return None


def epochs_to(top1_per_epoch: list[float | None], target: float) -> int | None:
    """The first epoch (1-based) whose top-1 reaches target; None if none does."""
    for epoch, top1 in enumerate(top1_per_epoch, start=1):
        if top1 is not None and top1 >= target:
            return epoch
    return None


def steps_to(record: dict, target: float) -> int | None:
    """The optimizer steps done when the run's top-1 first reached ``target`` (the end of that
    epoch); None if it never did or the run recorded no steps per epoch."""
    epoch = epochs_to(record.get("top1_per_epoch") or [], target)
    steps = record.get("step_per_epoch") or []
    return steps[epoch - 1] if epoch and epoch <= len(steps) else None


def mean_sd(values: list[float]) -> tuple[float, float]:
    """The mean and the sample standard deviation (n - 1 in the denominator; 0 for one value): the
    ± every table prints."""
    return statistics.mean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def gap_interval(row: list[float], reference: list[float]) -> tuple[float, float, float] | None:
    """(gap, low, high): ``row``'s mean minus ``reference``'s and its 95% interval (Welch's t: the
    two rows' variances are not assumed equal). None below two values a side (no spread to use)."""
    if len(row) < 2 or len(reference) < 2:
        return None
    from scipy.stats import t as student_t

    gap = statistics.mean(row) - statistics.mean(reference)
    v_row, v_ref = (
        statistics.variance(row) / len(row),
        statistics.variance(reference) / len(reference),
    )
    se = (v_row + v_ref) ** 0.5
    if se == 0:
        return gap, gap, gap
    df = (v_row + v_ref) ** 2 / (v_row**2 / (len(row) - 1) + v_ref**2 / (len(reference) - 1))
    half = float(student_t.ppf(0.975, df)) * se
    return gap, gap - half, gap + half


def pooled_sd(groups: list[list[float]]) -> tuple[float, int] | None:
    """(sd, df): the seed standard deviation pooled over the groups of two values or more (each
    group's squared deviations from its own mean, over the sum of n - 1); None if no group has two."""
    kept = [g for g in groups if len(g) > 1]
    df = sum(len(g) - 1 for g in kept)
    if not df:
        return None
    return (sum(statistics.variance(g) * (len(g) - 1) for g in kept) / df) ** 0.5, df


def pooled_interval(
    row: list[float], reference: list[float], sd: float, df: int
) -> tuple[float, float, float]:
    """(gap, low, high): ``row``'s mean minus ``reference``'s with a 95% t interval that takes the
    seed spread from elsewhere (``sd`` pooled over ``df`` degrees of freedom: rows of one batch, whose
    seeds are assumed to spread alike), so that a side of one seed still gets an interval."""
    from scipy.stats import t as student_t

    gap = statistics.mean(row) - statistics.mean(reference)
    half = float(student_t.ppf(0.975, df)) * sd * (1 / len(row) + 1 / len(reference)) ** 0.5
    return gap, gap - half, gap + half


def gaps(records: list[dict], rows: list[str], reference: str = "baseline") -> dict:
    """Each row's final top-1 gap to ``reference`` in points, with its 95% interval (Welch) and the
    seeds on each side: what the report prints and the docs link to."""
    ref = [100 * r["final_top1"] for r in records if r["row"] == reference]
    out = {}
    for row in rows:
        values = [100 * r["final_top1"] for r in records if r["row"] == row]
        if not values or row == reference or not ref:
            continue
        found = gap_interval(values, ref)
        out[row] = {
            "gap_pt": statistics.mean(values) - statistics.mean(ref),
            "ci95_pt": list(found[1:]) if found else None,
            "seeds": len(values),
            "reference_seeds": len(ref),
        }
    return out


def reach_gaps(records: list[dict], rows: list[str], reference: str, target: float = 0.9) -> dict:
    """Each row's epochs and optimizer steps to ``target`` against ``reference``'s: the means over
    the seeds that reached it, the gap and its 95% interval (Welch; None below two seeds a side or
    where every seed of both rows took the same count), and how many seeds reached it of how many.
    Rows derived from another's runs (DERIVED, EMA_DERIVED) are left out. Where the batch varies
    along a run (a ramp), steps and epochs say different things; issue 73's goal asks for fewer of
    both."""
    ways = {
        "epochs": lambda r: epochs_to(r.get("top1_per_epoch") or [], target),
        "steps": lambda r: steps_to(r, target),
    }
    out = {}
    for row in rows:
        if row == reference or row in DERIVED or row in EMA_DERIVED:
            continue  # a derived row shares its source's curve: not runs of its own
        entry = {}
        for way, count in ways.items():
            mine = [count(r) for r in records if r["row"] == row]
            ref = [count(r) for r in records if r["row"] == reference]
            got, ref_got = [v for v in mine if v is not None], [v for v in ref if v is not None]
            if not got or not ref_got:
                continue
            found = gap_interval(got, ref_got)
            if found and found[1] == found[2]:  # every seed the same on both sides: no spread
                found = None
            entry[way] = {
                "mean": statistics.mean(got),
                "reference_mean": statistics.mean(ref_got),
                "gap": statistics.mean(got) - statistics.mean(ref_got),
                "ci95": list(found[1:]) if found else None,
                "reached": [len(got), len(mine)],
                "reference_reached": [len(ref_got), len(ref)],
            }
        if entry:
            out[row] = entry
    return out


def largest_dip(top1_per_epoch: list[float | None]) -> float:
    """How far (pt) top-1 ever fell below the best of the epochs before it: a spike, recovered
    from or not, shows here even when the final top-1 hides it."""
    best, dip = None, 0.0
    for top1 in top1_per_epoch:
        if top1 is None:
            continue
        if best is not None:
            dip = max(dip, 100 * (best - top1))
        best = top1 if best is None else max(best, top1)
    return dip


def worst_seed_choice(records: list[dict], rows: list[str]) -> list[str]:
    """The row whose worst seed is best (issue 39: a recipe is chosen by the worst of its seeds,
    not by one seed or the mean), among rows with the most seeds; rows whose worst seeds tie (on
    6,000 held-out images a seed's top-1 is a count of images: batch 4,096's LR 5 and 10 tied at
    90 epochs) are told apart by their mean."""
    by_row = {
        row: [100 * r["final_top1"] for r in records if r["row"] == row]
        for row in rows
        # a batch-128 row without its refit is a recipe of its own (the refit is one of the
        # techniques the baseline may take or leave: issue 52)
        if (row not in DERIVED or row.startswith("b128_")) and row != "baseline"
    }
    by_row = {row: v for row, v in by_row.items() if v}
    if len(by_row) < 2:
        return []
    most = max(len(v) for v in by_row.values())
    full = {row: v for row, v in by_row.items() if len(v) == most}
    best = max(full, key=lambda row: (min(full[row]), statistics.mean(full[row])))
    worst = min(full[best])
    tied = sorted(row for row in full if row != best and min(full[row]) == worst)
    partial = sorted(set(by_row) - set(full))
    # a row's worst of all its seeds is at most the worst of those it has: below the chosen row's
    # worst seed already, more seeds cannot make it the choice
    out = [row for row in partial if min(by_row[row]) < worst]
    open_ = [row for row in partial if row not in out]
    return [
        f"Chosen by the worst of {most} seeds: {best} (worst seed {worst:.2f}%, mean "
        f"{statistics.mean(full[best]):.2f}%"
        + (f"; its worst seed ties with {', '.join(tied)}'s, the mean decides" if tied else "")
        + ")"
        + (
            f"; ruled out with fewer seeds (a seed already below {worst:.2f}%): {', '.join(out)}"
            if out
            else ""
        )
        + (f"; not compared, fewer seeds: {', '.join(open_)}" if open_ else "")
        + "."
    ]


FASHION_MNIST_TRAIN, IMAGENET_TRAIN = 60_000, 1_281_167  # training images: share per step


def _batch(record: dict) -> int:
    return int(record["row"].split("_b")[-1])


def reached(
    records: list[dict],
    targets: list[float],
    reference: list[dict] | None = None,
    train_images: int = FASHION_MNIST_TRAIN,
) -> list[dict]:
    """Per target level and row, the epochs to reach it and the ratio to the reference's: the goal's
    batch-128 runs (``reference``; their mean, where every seed reached it) as row ``baseline``,
    else the smallest batch's run. Written into the report (``epochs_to_target``), so the docs can
    name each value: ``epochs_to_target[level=0.9,row=target_b4096].ratio``; ``share``: the batch's
    share of the training set per step."""
    grid = sorted(records, key=_batch)
    out = []
    for t in targets:
        if reference:
            seeds = [epochs_to(r["top1_per_epoch"], t) for r in reference]
            base = statistics.mean(seeds) if all(seeds) else None
            final = statistics.mean(r.get("final_top1", 0.0) for r in reference)
            out.append(
                {
                    "level": t,
                    "row": "baseline",
                    "batch": 128,
                    "share": 128 / train_images,
                    "seed_epochs": seeds,
                    "epochs": base,
                    "ratio": 1.0 if base else None,
                    "final_top1": final,
                }
            )
        else:
            base = epochs_to(grid[0]["top1_per_epoch"], t) if grid else None
        for r in grid:
            e = epochs_to(r["top1_per_epoch"], t)
            out.append(
                {
                    "level": t,
                    "row": r["row"],
                    "batch": _batch(r),
                    "share": _batch(r) / train_images,
                    "epochs": e,
                    "ratio": e / base if e and base else None,
                    "final_top1": r.get("final_top1"),
                    "epochs_run": r.get("epochs"),
                }
            )
    return out
