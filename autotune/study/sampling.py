"""A sampler wrapper that proposes only configurations worth launching.

Most of a serving space cannot run: contexts too short for the workload, options the engine
refuses, memory over the budget, artifacts whose measured quality is already too low. All of
that is known without launching anything, and a sampler that proposes such configurations
(or ones already measured) fills the study with trials that teach it little: on the default
study, plain TPE made ~15 proposals for every configuration it could launch and often
settled early. ``ScreenedSampler`` asks its inner sampler (TPE, NSGA-II, random) for a
proposal, keeps it if it is admissible and new, and asks again otherwise; after
``max_tries`` it falls back to a random admissible new configuration.

Those tries cost one fit of the inner model each where the model does not change between
them: ``FitOnceTPESampler`` (the ``tpe`` strategy's, in study/optuna_internals.py: it reaches
into TPE) fits once per trial and draws each try from that fit, the same draws as Optuna's TPE
makes.
"""

from __future__ import annotations

import contextlib
import random
from typing import Any, Callable

import optuna
from optuna.distributions import BaseDistribution, CategoricalDistribution
from optuna.trial import FrozenTrial

from autotune.engine.backend import TrialConfig
from autotune.engine.space import SearchSpace


class ScreenedSampler(optuna.samplers.BaseSampler):
    """Wraps a sampler so that every proposal is admissible and not yet evaluated.

    Args:
        inner: The sampler whose model guides the search.
        space: The study's search space.
        admissible: Whether a configuration can run (rules, memory, known quality).
        evaluated: Keys of configurations the storage already holds.
        seed: Seed of the fallback's random choices.
        max_tries: Proposals asked of ``inner`` per trial before falling back.
    """

    def __init__(
        self,
        inner: optuna.samplers.BaseSampler,
        space: SearchSpace,
        admissible: Callable[[TrialConfig], bool],
        evaluated: Callable[[], set[str]],
        seed: int | None = None,
        max_tries: int = 16,
    ):
        self.inner = inner
        self.space = space
        self.admissible = admissible
        self.evaluated = evaluated
        self.max_tries = max_tries
        self._rng = random.Random(seed)
        self._independent = optuna.samplers.RandomSampler(seed=seed)
        self._configs: tuple[TrialConfig, ...] | None = None  # the space's, in enumeration order
        self._full: dict[str, BaseDistribution] = {
            name: CategoricalDistribution(list(choices)) for name, choices in space.distributions().items()
        }

    def reseed_rng(self) -> None:
        self.inner.reseed_rng()
        self._independent.reseed_rng()

    def infer_relative_search_space(self, study: optuna.Study, trial: FrozenTrial) -> dict[str, BaseDistribution]:
        return dict(self._full)

    def _complete(self, proposal: dict[str, Any]) -> TrialConfig:
        """A whole configuration from a (possibly partial) proposal; gaps drawn at random."""
        backend = proposal.get("backend")
        if backend not in self.space.entries:
            backend = self._rng.choice(list(self.space.entries))
        entry = self.space.entries[backend]
        values: dict[str, Any] = {}
        plain: dict[str, Any] = {}
        for dim in entry.dimensions():  # a shared knob's value this backend lacks is drawn again
            if not dim.active(plain):
                continue  # a conditional parameter its parent switched off (space.ConditionalParam)
            value = proposal.get(dim.name)
            values[dim.name] = value if value in dim.choices else self._rng.choice(dim.choices)
            plain[dim.option] = dim.decode(values[dim.name])
        return self.space.config_of(entry, values)

    def sample_relative(
        self, study: optuna.Study, trial: FrozenTrial, search_space: dict[str, BaseDistribution]
    ) -> dict[str, Any]:
        if "fixed_params" in trial.system_attrs:
            return {}  # an enqueued configuration (prior, grid, exploration) goes first
        done = self.evaluated()
        inner_space = self.inner.infer_relative_search_space(study, trial)
        config = None
        # Every try of one trial sees the same trials (the trial's snapshot of the study), so an
        # inner sampler that can keep its fit for them does: on the default study nearly every
        # trial spent all its tries, each a fit of TPE, a quarter of the study's time.
        with getattr(self.inner, "fitting_once", contextlib.nullcontext)():
            for _ in range(self.max_tries):
                proposal = self.inner.sample_relative(study, trial, inner_space) if inner_space else {}
                if not proposal:
                    break  # the inner sampler is still in its random start-up: draw it ourselves
                config = self._complete(proposal)
                if config.key not in done and self.admissible(config):
                    return self.space.params_of(config)
        fallback = self.random_admissible(done)
        if fallback is not None:
            return self.space.params_of(fallback)
        return self.space.params_of(config) if config is not None else {}

    def random_admissible(self, done: set[str]) -> TrialConfig | None:
        """A random configuration that is admissible and not in ``done`` (None: none left)."""
        if self._configs is None:  # built once: enumerating the space was 8% of the default study
            self._configs = tuple(self.space.enumerate())
        configs = list(self._configs)
        self._rng.shuffle(configs)
        for config in configs:
            if config.key not in done and self.admissible(config):
                return config
        return None

    def sample_independent(
        self, study: optuna.Study, trial: FrozenTrial, param_name: str, param_distribution: BaseDistribution
    ) -> Any:
        return self._independent.sample_independent(study, trial, param_name, param_distribution)

    def before_trial(self, study: optuna.Study, trial: FrozenTrial) -> None:
        self.inner.before_trial(study, trial)

    def after_trial(self, study: optuna.Study, trial: FrozenTrial, state: optuna.trial.TrialState, values: Any) -> None:
        self.inner.after_trial(study, trial, state, values)
