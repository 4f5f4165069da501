"""Typed loading of a config's sections: a YAML mapping built into a dataclass, each value
converted to its field's annotation, and user values shown short in every problem message.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import reprlib
import types
import typing
from typing import Any, Literal


def build(
    cls: Any,
    raw: Any,
    prefix: str,
    problems: list[str],
    skip: frozenset[str] | set[str] = frozenset(),
) -> Any:
    """Instantiate dataclass `cls` from a mapping, appending every problem found to `problems`.

    A section left out (or empty) is built from `{}` and checked like any other: its required
    keys are reported as missing, not discovered later by the code that needs them."""
    section = prefix.rstrip(".") or "the file"
    missing = f" (the {section}: section is missing or empty)" if raw is None and prefix else ""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        problems.append(f"{section}: got {described(raw)}; must be a mapping of keys")
        return cls()
    hints = typing.get_type_hints(cls)
    # A field's YAML key is its name, or metadata["key"] where the name cannot be (`from`).
    keys = {f.metadata.get("key", f.name): f.name for f in dataclasses.fields(cls)}
    names = [key for key, name in keys.items() if name not in skip]
    values: dict[str, Any] = {}
    failed = set()
    for key, value in raw.items():
        if key not in names:
            hint = did_you_mean(key, names) if isinstance(key, str) else ""
            known = ", ".join(names)
            problems.append(f"{prefix}{shown_key(key)}: unknown key{hint}; known: {known}")
            continue
        ok, converted, rule = convert(value, hints[keys[key]], f"{prefix}{key}.", problems)
        if ok:
            values[keys[key]] = converted
            continue
        failed.add(key)
        if rule:
            problems.append(f"{prefix}{key}: got {show(value)}; must be {rule}")
    for key in names:  # absent sections are validated too
        if key not in raw and dataclasses.is_dataclass(hints[keys[key]]):
            values[keys[key]] = build(hints[keys[key]], None, f"{prefix}{key}.", problems)
    instance = cls(**values)
    # Fields that failed conversion hold their defaults here: already reported, not again.
    for key, value, rule in getattr(instance, "problems", list)():
        if key in failed:
            continue
        if key in raw:
            problems.append(f"{prefix}{key}: got {show(value)}; {rule}")
        else:
            problems.append(f"{prefix}{key}: {rule}{missing}")
    return instance


# Every user value in a message goes through show: a YAML alias bomb ("billion laughs") or a
# 10 MB string must give a short line, never a repr the size of the expanded document.
_SHORT_REPR = reprlib.Repr()
_SHORT_REPR.maxlevel = 2
_SHORT_REPR.maxlist = _SHORT_REPR.maxtuple = _SHORT_REPR.maxset = _SHORT_REPR.maxdict = 4
_SHORT_REPR.maxstring = _SHORT_REPR.maxother = 60
_SHORT_REPR.maxlong = 40


MAX_SHOWN_CHARS = 80


def show(value: Any) -> str:
    """A user value as YAML users know it (null, true), never longer than MAX_SHOWN_CHARS."""
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    if isinstance(value, int) and value.bit_length() > 128:
        # repr() of an integer over 4300 digits raises; nobody needs its digits anyway.
        return f"an integer of about {int(value.bit_length() * math.log10(2)) + 1} digits"
    return clip(_SHORT_REPR.repr(value), MAX_SHOWN_CHARS)


def clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def shown_key(key: Any) -> str:
    """A mapping key for a message: a string as written, anything else as show gives it."""
    return clip(key, MAX_SHOWN_CHARS) if isinstance(key, str) else show(key)


def described(value: Any) -> str:
    """A value with the YAML word for its type, for a section that is not a mapping."""
    kinds = ((list, "a list"), (str, "the text"), (bool, ""), ((int, float), "the number"))
    kind = next((word for types_, word in kinds if isinstance(value, types_)), "")
    return f"{kind} {show(value)}".strip()


def convert(value: Any, hint: Any, prefix: str, problems: list[str]) -> tuple[bool, Any, str]:
    """Coerce `value` to the annotation `hint`; returns (ok, value, rule it broke)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return True, None, ""
        rules = []
        for option in options:
            if option is type(None):
                continue
            ok, converted, rule = convert(value, option, prefix, problems)
            if ok:
                return True, converted, ""
            rules.append(rule)
        if type(None) in options:
            rules.append("null")
        return False, None, " or ".join(r for r in rules if r)
    if origin is Literal:
        allowed = typing.get_args(hint)
        if value in allowed:
            return True, value, ""
        return False, None, "one of " + ", ".join(str(a) for a in allowed)
    if origin is list:
        if not isinstance(value, list):
            return False, None, "a list"
        (item_hint,) = typing.get_args(hint) or (Any,)
        items = [convert(v, item_hint, prefix, problems) for v in value]
        failed = [rule for ok, _, rule in items if not ok]
        if not failed:
            return True, [v for _, v, _ in items], ""
        return False, None, f"a list, each item {failed[0]}"
    if origin is dict:
        return (True, value, "") if isinstance(value, dict) else (False, None, "a mapping")
    if dataclasses.is_dataclass(hint):
        return True, build(hint, value, prefix, problems), ""
    return _convert_scalar(value, hint)


def _convert_scalar(value: Any, hint: Any) -> tuple[bool, Any, str]:
    if hint is Any:
        return True, value, ""
    if hint is bool:
        return (True, value, "") if isinstance(value, bool) else (False, None, "true or false")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return True, value, ""
        number = _as_float(value)  # 64.0, and `1e3`, which YAML 1.1 reads as a string
        if number is not None and number.is_integer():
            return True, int(number), ""
        return False, None, "an integer"
    if hint is float:
        number = _as_float(value)
        if number is None:
            return False, None, "a number"
        if not math.isfinite(number):
            return False, None, "a finite number"
        return True, number, ""
    if hint is str:
        return (True, value, "") if isinstance(value, str) else (False, None, "a string")
    raise TypeError(f"unsupported config annotation {hint!r}")


def _as_float(value: Any) -> float | None:
    """Numbers and numeric strings: YAML 1.1 reads `1e-6` (no dot) as a string."""
    if isinstance(value, bool):
        return None
    if not isinstance(value, (int, float, str)):
        return None
    if isinstance(value, str) and "_" in value:
        return None  # float() reads "1_0" as 10; nobody means that
    try:
        return float(value)
    except (ValueError, OverflowError):  # not a number; an integer beyond the float range
        return None


def did_you_mean(word: str, candidates: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""
