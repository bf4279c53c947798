"""The conditional search space: the backend picks which parameters exist.

``backend`` is the root choice. The knobs every backend means the same by have one Optuna
name across backends, so that the dashboard's plots and the sampler compare them: ``ctx``,
``parallel``, ``flash_attn`` and ``kv_bits``, the KV cache's nominal precision (a cache type's
bits in ``cache_types.CACHE_TYPES``: llama.cpp's ``q8_0`` and ExLlamaV2's ``q8`` are both 8).
Everything engine-specific stays ``<backend>.<name>`` (the weights, ``ubatch``, and a
backend's ``cache_type`` where two of its searched types share a precision, so that bits
could not say which one is meant).

Optuna fixes one distribution per parameter name for a whole study, so a shared knob is drawn
over the union of every backend's values (``SearchSpace.distributions``); a value the drawn
backend does not offer is a configuration it cannot run: the study's sampler never proposes
one (``ScreenedSampler`` completes proposals from each backend's own values), and a draw that
still holds one is refused, free, with ``NotOffered`` (docs/architecture.md).

A backend's parameter may be conditional (``ConditionalParam``): drawn only when another of
its parameters has one of the listed values (a speculative draft's length only when
speculation is on). Otherwise the configuration leaves it out, and so do Optuna's parameters
for that trial: TPE models it over the trials that drew it, and the inactive value is never a
second configuration of the same launch.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Sequence

from autotune.engine.backend import BaseBackend, Param, StudyContext, TrialConfig
from autotune.engine.cache_types import cache_bits
from autotune.engine.declarations import CacheType

if TYPE_CHECKING:  # pragma: no cover
    import optuna

CORE_OPTIONS = ("ctx", "parallel")
SHARED_OPTIONS = ("flash_attn",)  # backend options every engine means the same by
KV_BITS = "kv_bits"
# A candidate's draft weights for speculative decoding ([[candidates]] draft): the backend's
# option of this name, made like the main weights (artifacts) by the first trial that loads them.
DRAFT_OPTION = "draft"


class NotOffered(ValueError):
    """A draw holds a shared knob's value that the drawn backend does not offer."""


@dataclass(frozen=True)
class ConditionalParam(Param):
    """A parameter that exists only when the parameter ``parent`` of the same backend has one of
    ``parent_values`` (the parent is an unconditional one of its ``parameters``)."""

    parent: str = ""
    parent_values: tuple[Any, ...] = ()


def canonical_order(values: Any) -> tuple[Any, ...]:
    """A shared knob's values in one order, whichever backend listed them first."""
    return tuple(sorted(set(values), key=lambda v: (type(v).__name__, v)))


@dataclass(frozen=True)
class Dimension:
    """One parameter as Optuna stores it, and the configuration field it sets.

    ``choices`` are what Optuna sees; ``values`` the configuration's, in the same order (they
    differ for ``kv_bits``: 8 stands for the backend's ``q8_0``)."""

    name: str
    option: str
    choices: tuple[Any, ...]
    values: tuple[Any, ...]
    parent: str | None = None  # the option this one depends on (ConditionalParam)
    parent_values: tuple[Any, ...] = ()

    def active(self, plain: Mapping[str, Any]) -> bool:
        """Whether it is drawn, given the configuration's values of the options before it."""
        return self.parent is None or (self.parent in plain and plain[self.parent] in self.parent_values)

    @property
    def shared(self) -> bool:
        return "." not in self.name

    def encode(self, value: Any) -> Any:
        return self.choices[self.values.index(value)]

    def decode(self, choice: Any) -> Any:
        return self.values[self.choices.index(choice)]


def dimension_of(backend: str, option: str, values: tuple[Any, ...], declared: Sequence[CacheType] = ()) -> Dimension:
    """The parameter a backend's option is searched as (the module docstring's naming rule):
    a shared name for ctx, parallel and ``SHARED_OPTIONS``; ``kv_bits`` for ``cache_type`` when
    the nominal bits name each of the backend's searched types (its ``declared`` cache types,
    else the installed backends'); else ``<backend>.<option>``."""
    if option in CORE_OPTIONS or option in SHARED_OPTIONS:
        return Dimension(option, option, values, values)
    if option == "cache_type":
        bits = tuple(cache_bits(c, declared) for c in values)
        if None not in bits and len(set(bits)) == len(bits):
            return Dimension(KV_BITS, option, bits, values)
    return Dimension(f"{backend}.{option}", option, values, values)


@dataclass(frozen=True)
class BackendSpace:
    """One backend's part of the space."""

    backend: BaseBackend
    weights: tuple[str, ...]
    ctx: tuple[int, ...]
    parallel: tuple[int, ...]
    params: tuple[Param, ...]

    @property
    def size(self) -> int:
        n = len(self.weights) * len(self.ctx) * len(self.parallel)
        plain = [p for p in self.params if not isinstance(p, ConditionalParam)]
        for p in plain:
            if not any(isinstance(c, ConditionalParam) and c.parent == p.name for c in self.params):
                n *= len(p.choices)
        for parent in plain:  # a parent's values, each times what it switches on
            children = [c for c in self.params if isinstance(c, ConditionalParam) and c.parent == parent.name]
            if children:
                n *= sum(_product(len(c.choices) for c in children if v in c.parent_values) for v in parent.choices)
        return n

    def active(self, options: Mapping[str, Any]) -> dict[str, Any]:
        """``options`` without the conditional parameters their parent switches off."""
        return {
            k: v
            for k, v in options.items()
            if not any(
                isinstance(p, ConditionalParam) and p.name == k and options.get(p.parent) not in p.parent_values
                for p in self.params
            )
        }

    def dimensions(self) -> list[Dimension]:
        """Its parameters as Optuna names them (module docstring), in a stable order."""
        name = self.backend.name
        dims = [
            dimension_of(name, "weights", self.weights),
            dimension_of(name, "ctx", self.ctx),
            dimension_of(name, "parallel", self.parallel),
        ]
        declared = self.backend.kv_cache_types
        plain = [p for p in self.params if not isinstance(p, ConditionalParam)]
        conditional = [p for p in self.params if isinstance(p, ConditionalParam)]
        dims += [dimension_of(name, p.name, p.choices, declared) for p in plain]
        # Conditional ones last: their parent is drawn (and decoded) before them.
        return dims + [
            replace(
                dimension_of(name, p.name, p.choices, declared), parent=p.parent, parent_values=tuple(p.parent_values)
            )
            for p in conditional
        ]


def _product(counts: Iterator[int]) -> int:
    n = 1
    for c in counts:
        n *= c
    return n


class SearchSpace:
    """All configurations a study may try."""

    def __init__(self, entries: list[BackendSpace]):
        if not entries:
            raise ValueError("a search space needs at least one backend")
        self.entries = {e.backend.name: e for e in entries}

    @property
    def size(self) -> int:
        return sum(e.size for e in self.entries.values())

    def distributions(self) -> dict[str, tuple[Any, ...]]:
        """Each Optuna parameter's choices for the whole study: a shared knob's over every
        backend (one distribution per name, as Optuna requires), in a canonical order."""
        out: dict[str, tuple[Any, ...]] = {"backend": tuple(self.entries)}
        for entry in self.entries.values():
            for dim in entry.dimensions():
                out[dim.name] = canonical_order(out.get(dim.name, ()) + dim.choices) if dim.shared else dim.choices
        return out

    def suggest(self, trial: "optuna.Trial") -> TrialConfig:
        """Draw one configuration through Optuna's sampler.

        Raises:
            NotOffered: a shared knob drawn at a value this backend does not offer.
        """
        union = self.distributions()
        backend = trial.suggest_categorical("backend", list(self.entries))
        entry = self.entries[backend]
        drawn: dict[str, Any] = {}
        plain: dict[str, Any] = {}
        for dim in entry.dimensions():
            if not dim.active(plain):
                continue
            drawn[dim.name] = trial.suggest_categorical(dim.name, list(union[dim.name]))
            if drawn[dim.name] not in dim.choices:
                raise NotOffered(
                    f"backend '{backend}' does not offer {dim.name} = {drawn[dim.name]!r} "
                    f"(it offers {', '.join(map(repr, dim.choices))})"
                )
            plain[dim.option] = dim.decode(drawn[dim.name])
        return self.config_of(entry, drawn)

    def config_of(self, entry: BackendSpace, drawn: Mapping[str, Any]) -> TrialConfig:
        """The configuration of one backend's drawn parameters (keyed by Optuna name); a
        conditional parameter whose parent does not switch it on is left out, drawn or not."""
        plain: dict[str, Any] = {}
        for dim in entry.dimensions():
            if dim.active(plain):
                plain[dim.option] = dim.decode(drawn[dim.name])
        options = tuple(sorted((p.name, plain[p.name]) for p in entry.params if p.name in plain))
        return TrialConfig(entry.backend.name, plain["weights"], int(plain["ctx"]), int(plain["parallel"]), options)

    def enumerate(self) -> Iterator[TrialConfig]:
        """Every configuration, backend by backend, in a stable order."""
        for entry in self.entries.values():
            dims = entry.dimensions()
            fixed = [d for d in dims if d.parent is None]
            for combo in itertools.product(*(d.choices for d in fixed)):
                drawn = dict(zip((d.name for d in fixed), combo))
                plain = {d.option: d.decode(drawn[d.name]) for d in fixed}
                switched = [d for d in dims if d.parent is not None and d.active(plain)]
                for more in itertools.product(*(d.choices for d in switched)):
                    yield self.config_of(entry, {**drawn, **dict(zip((d.name for d in switched), more))})

    def params_of(self, config: TrialConfig) -> dict[str, Any]:
        """Optuna parameters that reproduce ``config`` (for ``enqueue_trial``)."""
        plain = config.as_dict()
        params: dict[str, Any] = {"backend": config.backend}
        for dim in self.entries[config.backend].dimensions():
            if dim.option in plain:  # an option left out is drawn by the sampler
                value = plain[dim.option]
                params[dim.name] = dim.encode(value) if value in dim.values else value
        return params

    def check(self, config: TrialConfig, ctx: StudyContext) -> list[str]:
        """Why ``config`` is useless or invalid: the core's rules, then the backend's."""
        reasons = []
        need = ctx.workload.sequence_tokens
        if config.ctx < need:
            reasons.append(f"ctx {config.ctx} cannot hold the workload: one sequence needs {ctx.workload.need_text}")
        own = self.entries[config.backend].backend.check(config, ctx)
        reasons += own
        # Every engine refuses a ctx beyond the model's (llama.cpp's rules, ExLlamaV2's check,
        # vLLM's max_model_len), but not every backend checks it (the twins do not): said once,
        # unless the backend's own reason already names the model's length.
        limit = ctx.model.max_context
        if config.ctx > limit and not any(str(limit) in reason for reason in own):
            reasons.append(f"ctx {config.ctx} exceeds the model's context length {limit}")
        return reasons
