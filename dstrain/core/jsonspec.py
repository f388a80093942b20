"""Typed reading of JSON blocks: each block is declared once, and every value is checked where it is read.

A block's declaration maps each key to a :class:`Value` (its kind and, optionally, a range rule).
A block the code then uses as an object is declared as a dataclass whose fields carry their
:class:`Value` (:func:`setting`): names, types, ranges and defaults in one place, read with
:func:`read_into` (the dstrain_communication block, each optimizer's parameters).
:func:`read_block` returns a typed copy of the block or raises one :class:`ConfigError` line that names
the file and the full key path::

    ds_configs/x.json: optimizer.params.momentum must be a number, got "0.9"
    ds_configs/x.json: optimizer.params.trust_coefficient=0: must be > 0
    ds_configs/x.json: unknown key 'torch_autocast.enabeld' (DeepSpeed would ignore it). Did you mean 'enabled'?

Keys starting with ``_`` are documentation (``"_comment"``) and are dropped. JSON has no separate
integer type for users, so a whole float (``2.0``) is accepted where an integer is declared; a bool is
never a number, and a string is never a bool.
"""

from __future__ import annotations

import difflib
import json
import math
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from dstrain.core.errors import ConfigError

KINDS = {
    "number": "a number",
    "integer": "an integer",
    "bool": "true or false",
    "text": "a string",
    "choice": "one of",
    "pair": "a list of two numbers",
    "texts": "a list of strings",
    "integers": "a list of integers",
}


def shown(value: Any) -> str:
    """A value as the user wrote it in JSON: ``"0.1"`` for a string, ``[1, 2]`` for a list."""
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


@dataclass(frozen=True)
class Value:
    """What one key may hold: its kind, an optional range rule (``rule(v)`` true when fine) and its text."""

    kind: str
    rule: Callable[[Any], bool] | None = None
    rule_text: str = ""  # "must be > 0": said when ``rule`` fails
    choices: tuple = ()
    nullable: bool = False  # JSON null allowed (DeepSpeed's "use the default")
    fields: dict | None = None  # kind "block": the nested object's declaration

    def read(self, value: Any, path: str, source: str) -> Any:
        if value is None and self.nullable:
            return None
        if self.kind == "block":
            return read_block(value, self.fields, path, source)
        typed = self._typed(value)
        if typed is _WRONG:
            expected = KINDS[self.kind]
            if self.kind == "choice":
                expected += " " + ", ".join(shown(c) for c in self.choices)
            raise ConfigError(f"{source}: {path} must be {expected}, got {shown(value)}")
        if self.rule is not None and not self.rule(typed):
            raise ConfigError(f"{source}: {path}={shown(value)}: {self.rule_text}")
        return typed

    def _typed(self, v: Any) -> Any:
        number = isinstance(v, (int, float)) and not isinstance(v, bool)
        if self.kind == "number":
            return float(v) if number and math.isfinite(v) else _WRONG
        if self.kind == "integer":
            whole = number and math.isfinite(v) and float(v).is_integer()
            return int(v) if whole else _WRONG
        if self.kind == "bool":
            return v if isinstance(v, bool) else _WRONG
        if self.kind == "text":
            return v if isinstance(v, str) else _WRONG
        if self.kind == "choice":
            return v if isinstance(v, str) and v in self.choices else _WRONG
        if self.kind == "pair":
            ok = isinstance(v, (list, tuple)) and len(v) == 2
            ok = ok and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v)
            return tuple(float(x) for x in v) if ok else _WRONG
        if self.kind == "integers":
            ok = isinstance(v, list) and all(
                isinstance(x, int) and not isinstance(x, bool) for x in v
            )
            return list(v) if ok else _WRONG
        if self.kind == "texts":
            ok = isinstance(v, list) and all(isinstance(x, str) for x in v)
            return list(v) if ok else _WRONG
        raise ValueError(f"unknown kind {self.kind!r}")


_WRONG = object()


def block(fields: dict[str, Value]) -> Value:
    return Value("block", fields=fields)


def number(rule=None, rule_text: str = "") -> Value:
    return Value("number", rule, rule_text)


def integer(rule=None, rule_text: str = "") -> Value:
    return Value("integer", rule, rule_text)


def boolean() -> Value:
    return Value("bool")


def choice(*choices: str, nullable: bool = False) -> Value:
    return Value("choice", choices=choices, nullable=nullable)


def positive(what: str = "") -> Value:
    return number(lambda v: v > 0, "must be > 0" + (f" ({what})" if what else ""))


def non_negative() -> Value:
    return number(lambda v: v >= 0, "must be >= 0")


def fraction() -> Value:
    return number(lambda v: 0 <= v < 1, "must be in [0, 1)")


def unknown_key(key: str, known, path: str, source: str, why: str) -> ConfigError:
    """``source: unknown key 'path.key' (why). Did you mean 'x'?`` (or the known keys when nothing is close)."""
    close = difflib.get_close_matches(key, list(known), n=1)
    if close:
        hint = f" Did you mean '{close[0]}'?"
    else:
        hint = f" Known keys: {', '.join(sorted(known))}." if known else ""
    full = f"{path}.{key}" if path else key
    return ConfigError(f"{source}: unknown key '{full}' ({why}).{hint}")


def check_keys(block: dict, known, path: str, source: str, why: str) -> None:
    """Refuse the first key of ``block`` (``_`` keys aside: documentation) that ``known`` lacks."""
    for key in block:
        if not key.startswith("_") and key not in known:
            raise unknown_key(key, known, path, source, why)


def read_block(
    block: Any,
    spec: dict[str, Value],
    path: str,
    source: str,
    why: str = "DeepSpeed would silently ignore it",
) -> dict:
    """The typed copy of a JSON object declared by ``spec``; ``_`` keys dropped, unknown keys refused."""
    if not isinstance(block, dict):
        raise ConfigError(f"{source}: {path} must be a JSON object {{...}}, got {shown(block)}")
    check_keys(block, spec, path, source, why)
    return {
        key: spec[key].read(value, f"{path}.{key}", source)
        for key, value in block.items()
        if not key.startswith("_")
    }


# ---------------------------------------------------------------- a block declared as a dataclass
def setting(default: Any = MISSING, help: str = "", *, json: Value | None = None) -> Any:  # noqa: A002
    """The one way dstrain declares a setting: a dataclass field with its default (none: required),
    its help text (unit included) and, for a key of a DeepSpeed JSON block, its :class:`Value`
    (kind and range). The trainer's YAML config (dstrain/settings/config.py) and the JSON blocks dstrain
    reads (optimizer parameters, dstrain_communication) both use it; ``--help-config`` lists both."""
    metadata = {"help": help, **({"json": json} if json is not None else {})}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def declaration(cls: type) -> dict[str, Value]:
    """The block declaration (key -> :class:`Value`) of a dataclass written with :func:`setting`."""
    return {f.name: f.metadata["json"] for f in fields(cls) if "json" in f.metadata}


def read_into(cls: type, block: Any, path: str, source: str, why: str):
    """The JSON object ``block`` read against ``cls``'s declaration, as an instance of ``cls``
    (keys left out take the field defaults)."""
    return cls(**read_block(block, declaration(cls), path, source, why))
