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
``ctx_within_model`` (true: ctx does not exceed the model's context length).
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autotune.errors import ConfigError

__all__ = ["Rule", "load_rules", "violations"]

FACTS = ("head_dim_multiple_of", "min_compute_capability", "ctx_within_model")


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
        for field in ("name", "reason", "source"):
            if not isinstance(raw.get(field), str) or not raw.get(field):
                errors.append(f"{where}: {field} must be a non-empty string")
        if not errors:
            rules.append(Rule(raw["name"], {k: tuple(v) for k, v in when.items()}, dict(unless), raw["reason"],
                              raw["source"]))
    if errors:
        raise ConfigError("\n".join(errors))
    return rules


def _excused(unless: Mapping[str, Any], facts: Mapping[str, Any]) -> bool:
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
    return True


def violations(rules: list[Rule], options: Mapping[str, Any], facts: Mapping[str, Any]) -> list[str]:
    """The reasons ``options`` (a configuration's options, ctx and parallel included) are refused.

    Args:
        rules: From :func:`load_rules`.
        options: Option name -> value.
        facts: ``head_dim``, ``ctx``, ``max_context``, ``compute_capability`` (None: unknown).
    """
    reasons = []
    for rule in rules:
        if all(options.get(name) in values for name, values in rule.when.items()) and not _excused(rule.unless, facts):
            reasons.append(rule.reason.format(**{**facts, **options}))
    return reasons
