"""The conditional search space: the backend picks which parameters exist.

Every backend-specific parameter is stored as ``<backend>.<name>`` so that Optuna sees one
distribution per name (a cache type of llama.cpp is not one of ExLlamaV2) and multivariate
TPE can group each backend's parameters together. ``backend`` itself is the root choice.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Mapping

from autotune.backend import BaseBackend, Param, StudyContext, TrialConfig

if TYPE_CHECKING:  # pragma: no cover
    import optuna

CORE_OPTIONS = ("ctx", "parallel")


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
        for p in self.params:
            n *= len(p.choices)
        return n

    def dimensions(self) -> list[tuple[str, tuple[Any, ...]]]:
        name = self.backend.name
        dims = [(f"{name}.weights", self.weights), (f"{name}.ctx", self.ctx), (f"{name}.parallel", self.parallel)]
        dims += [(f"{name}.{p.name}", p.choices) for p in self.params]
        return dims


class SearchSpace:
    """All configurations a study may try."""

    def __init__(self, entries: list[BackendSpace]):
        if not entries:
            raise ValueError("a search space needs at least one backend")
        self.entries = {e.backend.name: e for e in entries}

    @property
    def size(self) -> int:
        return sum(e.size for e in self.entries.values())

    def suggest(self, trial: "optuna.Trial") -> TrialConfig:
        """Draw one configuration through Optuna's sampler."""
        backend = trial.suggest_categorical("backend", list(self.entries))
        entry = self.entries[backend]
        values = {dim: trial.suggest_categorical(dim, list(choices)) for dim, choices in entry.dimensions()}
        return self.config_of(entry, values)

    def config_of(self, entry: BackendSpace, values: Mapping[str, Any]) -> TrialConfig:
        prefix = entry.backend.name + "."
        plain = {k[len(prefix):]: v for k, v in values.items()}
        options = tuple(sorted((p.name, plain[p.name]) for p in entry.params))
        return TrialConfig(entry.backend.name, plain["weights"], int(plain["ctx"]), int(plain["parallel"]), options)

    def enumerate(self) -> Iterator[TrialConfig]:
        """Every configuration, backend by backend, in a stable order."""
        for entry in self.entries.values():
            dims = entry.dimensions()
            for combo in itertools.product(*(choices for _, choices in dims)):
                yield self.config_of(entry, dict(zip((d for d, _ in dims), combo)))

    def params_of(self, config: TrialConfig) -> dict[str, Any]:
        """Optuna parameters that reproduce ``config`` (for ``enqueue_trial``)."""
        name = config.backend
        params: dict[str, Any] = {
            "backend": name,
            f"{name}.weights": config.weights,
            f"{name}.ctx": config.ctx,
            f"{name}.parallel": config.parallel,
        }
        for key, value in config.options:
            params[f"{name}.{key}"] = value
        return params

    def check(self, config: TrialConfig, ctx: StudyContext) -> list[str]:
        """Why ``config`` is useless or invalid: the core's rules, then the backend's."""
        reasons = []
        need = ctx.workload.sequence_tokens
        if config.ctx < need:
            reasons.append(
                f"ctx {config.ctx} cannot hold the workload: one sequence needs "
                f"{ctx.workload.prompt_tokens} prompt + {ctx.workload.output_tokens} output = {need} tokens"
            )
        reasons += self.entries[config.backend].backend.check(config, ctx)
        return reasons
