"""Reading a schema-2 trial: its long values were stored in parts.

Until schema 3 a trial's dict, list or string wider than 72 columns was cut into parts
(``<field>.~0``, ``<field>.0``, ...) under a marker (``{"_split": "dict"}``) so that
optuna-dashboard showed each on one line; the parts were joined back on read. Schema 3 stores
each field whole. Every storage committed under bench/results is schema 2, and replays read
them as they were: this is the whole reader of that layout, kept so, and
``autotune storage upgrade`` (study/upgrade.py) rewrites one to schema 3 with it. Nothing writes
this layout any more.
"""

from __future__ import annotations

from typing import Any, Mapping

SPLIT_MARK = "_split"  # {"_split": "dict"}, "list" or "text" (a long string, in pieces)
STALE = {SPLIT_MARK: "stale"}  # a part of an earlier, longer value (attributes cannot be deleted)
GROUP = "~"  # ``<field>.~<i>``: several short items of a dict, stored as one


def is_split(value: Any) -> bool:
    """Whether a stored value is the marker of a value stored in parts."""
    return isinstance(value, dict) and len(value) == 1 and SPLIT_MARK in value


def joined(attrs: Mapping[str, Any], name: str) -> Any:
    """The value stored under ``name`` (a value stored whole is returned as is)."""
    value = attrs.get(name)
    if not is_split(value):
        return value
    prefix = name + "."
    keys = {k[len(prefix) :].split(".", 1)[0] for k in attrs if k.startswith(prefix)}
    parts = {k: joined(attrs, prefix + k) for k in keys if attrs.get(prefix + k) != STALE}
    if value[SPLIT_MARK] in ("list", "text"):
        ordered = [parts[k] for k in sorted(parts, key=int)]
        return "".join(ordered) if value[SPLIT_MARK] == "text" else ordered
    out: dict[str, Any] = {}
    # The groups in the order they were packed (so the dict's keys keep their order), then the
    # long items by name: ``keys`` is a set, whose order differs from one process to the next.
    for k in sorted(parts, key=lambda k: (0, int(k[len(GROUP) :]), "") if k.startswith(GROUP) else (1, 0, k)):
        if k.startswith(GROUP):
            out.update(parts[k])
        else:
            out[k] = parts[k]
    return out


def is_part(key: str, attrs: Mapping[str, Any]) -> bool:
    """Whether ``key`` is a part of a split value (``<field>.<...>`` under a marker), not a
    field of its own."""
    head, dot, _ = key.partition(".")
    return bool(dot) and is_split(attrs.get(head))
