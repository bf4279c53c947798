"""Validity rules kept as data: which configurations an engine refuses, and why.

A backend plugin ships its engine's rules in a TOML file; :func:`load_rules` reads it (every
error names the file, the rule and the field) and :func:`violations` tells a configuration's
reasons. A rule applies when every option in its ``when`` table has one of the listed values;
it is then broken unless its ``unless`` facts hold. Facts are what the study knows of the model
and the card::

    [[rule]]
    name = "quantized V cache needs flash attention"
    when = { cache_type = ["q8_0", "q4_0"], flash_attn = [false] }
    reason = "cache_type {cache_type}: llama.cpp needs flash_attn for a quantized V cache"
    source = "where the engine says so"

    [[rule]]
    name = "the cache's block must divide the head size"
    when = { cache_type = ["q8_0", "q4_0"] }
    unless = { head_dim_multiple_of = 32 }
    reason = "..."

Facts understood in ``unless``: ``head_dim_multiple_of`` (the model's head size is a multiple),
``min_compute_capability`` ("8.0": the card's is at least that; an unknown card passes),
``ctx_within_model`` (true: ctx does not exceed the model's context length), ``at_most`` (a
list of ``[option, bound]`` pairs: each numeric option, when the configuration has it, is at
most its bound, a number or the name of another option or of a fact)::

    [[rule]]
    name = "the micro-batch within the batch"
    when = {}
    unless = { at_most = [["ubatch", "batch"]] }

A ``when`` key may also name a fact the backend supplies (``moe = [true]``); options win.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autotune.errors import ConfigError

__all__ = ["Rule", "load_rules", "violations"]

FACTS = ("head_dim_multiple_of", "min_compute_capability", "ctx_within_model", "at_most")


@dataclass(frozen=True)
class Rule:
    """One refusal: when it applies, what would excuse it, and the reason given."""

    name: str
    when: Mapping[str, tuple[Any, ...]]
    unless: Mapping[str, Any]
    reason: str
    source: str


def load_rules(path: str | Path) -> list[Rule]:
    """Reads a rules file; all problems are reported at once, each naming file, rule and field."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{path}: unreadable rules file ({exc})") from None
    rules, errors = [], []
    for i, raw in enumerate(data.get("rule", [])):
        where = f"{path}: [[rule]] {i} ({raw.get('name', 'no name')!r})"
        unknown = set(raw) - {"name", "when", "unless", "reason", "source"}
        if unknown:
            errors.append(f"{where}: unknown field(s) {sorted(unknown)} (accepted: name, when, unless, reason, source)")
        when = raw.get("when", {})
        if not isinstance(when, dict) or not all(isinstance(v, list) and v for v in when.values()):
            errors.append(f"{where}: when must map option names to non-empty lists of values")
            when = {}
        unless = raw.get("unless", {})
        bad = set(unless) - set(FACTS) if isinstance(unless, dict) else {"(not a table)"}
        if bad:
            errors.append(f"{where}: unless {sorted(bad)}: not a known fact (known: {', '.join(FACTS)})")
        elif "at_most" in unless and not (
            isinstance(unless["at_most"], list)
            and all(isinstance(p, list) and len(p) == 2 and isinstance(p[0], str) for p in unless["at_most"])
        ):
            errors.append(
                f"{where}: unless at_most must be a list of [option, bound] pairs "
                f"(bound: a number, or an option's or a fact's name)"
            )
        for field in ("name", "reason", "source"):
            if not isinstance(raw.get(field), str) or not raw.get(field):
                errors.append(f"{where}: {field} must be a non-empty string")
        if not errors:
            rules.append(
                Rule(raw["name"], {k: tuple(v) for k, v in when.items()}, dict(unless), raw["reason"], raw["source"])
            )
    if errors:
        raise ConfigError("\n".join(errors))
    return rules


def _excused(unless: Mapping[str, Any], options: Mapping[str, Any], facts: Mapping[str, Any]) -> bool:
    if not unless:
        return False
    for fact, wanted in unless.items():
        if fact == "head_dim_multiple_of" and facts["head_dim"] % int(wanted):
            return False
        if fact == "min_compute_capability":
            cc = facts.get("compute_capability")
            if cc is not None and tuple(map(int, str(cc).split("."))) < tuple(map(int, str(wanted).split("."))):
                return False
        if fact == "ctx_within_model" and bool(wanted) and facts["ctx"] > facts["max_context"]:
            return False
        if fact == "at_most" and not all(_at_most(option, bound, options, facts) for option, bound in wanted):
            return False
    return True


class _Known(dict):
    """A reason's values; one the configuration does not have reads as "unset", not a KeyError."""

    def __missing__(self, key: str) -> str:
        return "unset"


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _at_most(option: str, bound: Any, options: Mapping[str, Any], facts: Mapping[str, Any]) -> bool:
    """``options[option] <= bound``; true when the option is absent or not a number (``"all"``)."""
    value = _number(options.get(option))
    if value is None:
        return True
    limit = _number(bound) if not isinstance(bound, str) else _number({**facts, **options}.get(bound))
    return limit is None or value <= limit


def violations(rules: list[Rule], options: Mapping[str, Any], facts: Mapping[str, Any]) -> list[str]:
    """The reasons ``options`` (a configuration's options, ctx and parallel included) are refused.

    Args:
        rules: From :func:`load_rules`.
        options: Option name -> value.
        facts: ``head_dim``, ``ctx``, ``max_context``, ``compute_capability`` (None: unknown), and
            whatever else the backend's rules name (in ``when``, ``at_most`` and their reasons).
    """
    reasons = []
    for rule in rules:
        known = {**facts, **options}
        if all(known.get(name) in values for name, values in rule.when.items()) and not _excused(
            rule.unless, options, facts
        ):
            reasons.append(rule.reason.format_map(_Known({**facts, **options})))
    return reasons
