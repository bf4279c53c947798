"""[space] values the engine's rules refuse in every configuration, refused once, up front.

``n_cpu_moe = [4]`` on a dense model, ``gpu_layers`` past the model's layers, ``ubatch`` above
every ``batch``: each of their trials was pruned, one by one, and a study made only of them
ended "no feasible configuration". A value whose every combination with the other options
(every format, ctx and slot count) breaks a rule that names its key is taken
out of the space before the search, said once with the rule's own reason among what was
excluded before the search (as weights that never fit are); a key left with no value leaves
nothing of its backend to search.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import replace
from typing import Any

from autotune.engine.backend import StudyContext, TrialConfig
from autotune.engine.space import BackendSpace

__all__ = ["always_refused", "without_refused"]

# Combinations of the other options tried per value at most: a wider space is left to the trials.
MOST_COMBINATIONS = 8192


def _mentions(reason: str, key: str) -> bool:
    return reason.startswith(key) or f" {key} " in f" {reason} " or f"{key} =" in reason


def always_refused(
    entry: BackendSpace, ctx: StudyContext, given: dict[str, tuple[Any, ...]]
) -> list[tuple[str, Any, str]]:
    """``(key, value, reason)`` for each value of ``given`` (the study's [space]) that the
    backend's rules (``check``) refuse, for a reason naming ``key``, in every combination."""
    out = []
    for param in entry.params:
        if param.name not in given:
            continue
        others = [p for p in entry.params if p.name != param.name]
        # Every ctx and slot count too: a rule may refuse the fewest slots ("needs two slots")
        # as well as the most (a batch smaller than the slots).
        if (
            math.prod(len(p.choices) for p in others) * len(entry.weights) * len(entry.ctx) * len(entry.parallel)
            > MOST_COMBINATIONS
        ):
            continue
        for value in param.choices:
            first: str | None = None
            for weights, n_ctx, slots in itertools.product(entry.weights, entry.ctx, entry.parallel):
                for combo in itertools.product(*(p.choices for p in others)):
                    drawn = entry.active({**dict(zip((p.name for p in others), combo)), param.name: value})
                    if param.name not in drawn:
                        continue  # a conditional value its parent switches off here: not this combination's
                    options = tuple(sorted(drawn.items()))
                    reasons = [
                        r
                        for r in entry.backend.check(
                            TrialConfig(entry.backend.name, weights, n_ctx, slots, options), ctx
                        )
                        if _mentions(r, param.name)
                    ]
                    if not reasons:
                        break
                    first = first or reasons[0]
                else:
                    continue
                break  # one combination without such a reason: the value can run
            else:
                if first is not None:
                    out.append((param.name, value, first))
    return out


def without_refused(
    entry: BackendSpace, ctx: StudyContext, given: dict[str, tuple[Any, ...]]
) -> tuple[BackendSpace | None, list[str]]:
    """``entry`` without its :func:`always_refused` values (None: a key has none left), and a
    line for each value taken out."""
    refused = always_refused(entry, ctx, given)
    if not refused:
        return entry, []
    name = entry.backend.name
    notes = [
        f"{name}: [space] {key} = {value!r}: refused in every configuration of this study: {reason}"
        for key, value, reason in refused
    ]
    params = tuple(
        replace(p, choices=tuple(v for v in p.choices if (p.name, v) not in {(k, v2) for k, v2, _ in refused}))
        for p in entry.params
    )
    if any(not p.choices for p in params):
        return None, notes
    return replace(entry, params=params), notes
