"""What a run of the accuracy study *is*, whatever words its command used.

A run is defined by the settings the trainer resolves from its command (the recipe, the
key=value overrides, the DeepSpeed JSON's content), not by the command's text: two commands that
spell one run differently are the same run, and a kept run whose definition changed is not. The
three study scripts (accuracy_study reusing and resuming runs, epochs_tuned holding its runs to one
recipe, ablation holding each row to one change) all compare runs through these functions.
"""

from __future__ import annotations

import functools
import json
import shlex

from results.harness.study.rows import json_settings

# where a run lives and reads its data: not part of a row's definition (a GPU job's tree moves)
LOCATIONS = ("run_dir=", "data.root=")
# what a launcher adds to each rank's command line (deepspeed's --local_rank=N): not the run's
LAUNCHER_ARGS = ("--local_rank",)


def trainer_args(cmd: list[str]) -> list[str]:
    """The trainer's own arguments in a command: what follows ``dstrain`` or a script path, less
    the locations and what a launcher adds to it (a run's meta.json keeps the rank's own argv)."""
    start = next(i for i, a in enumerate(cmd) if a == "dstrain" or a.endswith(".py"))
    return [a for a in cmd[start + 1 :] if not a.startswith(LOCATIONS + LAUNCHER_ARGS)]


def definition(trainer_argv: list[str], ds_settings: dict | None = None) -> dict:
    """What a run is, whatever words its command used: what its DeepSpeed JSON sets
    (:func:`json_settings`, or ``ds_settings`` as a report recorded them when the run ended) and
    the config the trainer builds from the recipe and the overrides (a later key=value wins, a
    value equal to the recipe's is no change), without the locations (``LOCATIONS``) and the
    recipe's default JSON path (the JSON the run was given is compared by content)."""
    from omegaconf import OmegaConf

    from dstrain.settings.config import load_config

    recipe, ds_json, overrides, rest = None, None, [], iter(trainer_argv)
    for arg in rest:
        if arg == "--config":
            recipe = next(rest)
        elif arg == "--deepspeed_config":
            ds_json = next(rest)
        elif not arg.startswith(LOCATIONS):
            overrides.append(arg)
    config = OmegaConf.to_container(load_config(recipe, overrides))
    config.pop("run_dir")
    config["data"].pop("root")
    recipe_json = config.pop("deepspeed_config")
    if ds_settings is None:
        ds_settings = json_settings(ds_json or recipe_json)
    else:  # as recorded: the JSON's lr left out as json_settings leaves it out
        ds_settings = json.loads(json.dumps(ds_settings))
        ds_settings.get("optimizer", {}).get("params", {}).pop("lr", None)
    return {"deepspeed_config": ds_settings, **config}


@functools.cache
def _recorded(command: str, ds_settings: str) -> dict:
    """The :func:`definition` of a report's run record (its command and, as JSON text, the
    DeepSpeed settings it recorded), built once per distinct record: reports are read many times
    over. Raises what :func:`definition` raises. Callers compare it, never change it."""
    return definition(trainer_args(shlex.split(command)), json.loads(ds_settings))


def _of_record(record: dict) -> dict:
    return _recorded(record["command"], json.dumps(record.get("deepspeed_settings")))


def definition_or_none(record: dict) -> dict | None:
    """A report's run record's :func:`definition`, or None when its recipe or a key it sets no
    longer exists (then it is not the same run as anything defined now)."""
    from dstrain.settings.config import ConfigError

    try:
        return _of_record(record)
    except ConfigError:
        return None


def flat(tree: dict, prefix: str = "") -> dict:
    """A nested settings tree as ``{"optim.base_lr": 10.0, ...}``."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def resolved(record: dict) -> dict:
    """A report's run record's settings as the trainer resolved them (:func:`definition`: the
    recipe, the overrides, the DeepSpeed settings the run recorded), flat; ValueError naming the
    run when they no longer load."""
    from dstrain.settings.config import ConfigError

    try:
        return flat(_of_record(record))
    except (ConfigError, OSError) as e:
        raise ValueError(f"{run_name(record)}: its settings do not load: {e}") from None


def batch_of(record: dict) -> int:
    """The global batch a run starts at, from its resolved settings (ValueError as :func:`resolved`)."""
    return int(resolved(record)["batch.global_size"])


def run_name(record: dict) -> str:
    """``row seed N``: a run as the messages name it."""
    return f"{record['row']} seed {record['seed']}"


def differing(a: dict, b: dict, free: set[str] | frozenset = frozenset()) -> list[str]:
    """The keys outside ``free`` whose values differ between two flat settings, sorted."""
    return sorted(k for k in a.keys() | b.keys() if k not in free and a.get(k) != b.get(k))


def described(before: dict, after: dict, keys: list[str]) -> list[str]:
    """``key: before -> after`` for each of ``keys``: a difference as the messages print it."""
    return [f"{k}: {before.get(k)} -> {after.get(k)}" for k in keys]


def changes_between(old: list[str], new: list[str], old_settings: dict | None = None) -> str | None:
    """``key: old -> new, ...`` between the runs two trainer argument lists define (``old``'s JSON
    as recorded, ``old_settings``, when given), or None when they define the same run."""
    from dstrain.settings.config import ConfigError

    try:
        before = flat(definition(old, old_settings))
    except ConfigError as err:
        return f"its settings no longer load: {err}"
    after = flat(definition(new))
    return ", ".join(described(before, after, differing(before, after))) or None
