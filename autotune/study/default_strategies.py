"""The core's search strategies, registered through ``register_strategies`` like a plugin's.

``autotune.plugins`` registers this module always, even with ``AUTOTUNE_LOAD_PLUGINS`` empty
(as pytest's essential plugins): a study file without ``[study] sampler`` names ``tpe``, and
these need nothing but Optuna. A strategy that ranks with a model (the twin's ``twin``) comes
from the plugin that ships the model.
"""

from __future__ import annotations

import random

import optuna

from autotune.hookspecs import hookimpl
from autotune.engine.strategy import BaseStrategy, Search
from autotune.study.optuna_internals import FitOnceTPESampler

__all__ = ["GridStrategy", "Nsga2Strategy", "PriorStrategy", "RandomStrategy", "TpeStrategy"]


class TpeStrategy(BaseStrategy):
    name = "tpe"
    description = "autotune's multivariate TPE (NSGA-II for a Pareto objective)"
    pareto = "nsga2"  # TPE handles several objectives too, but NSGA-II is the Pareto workhorse

    def sampler(self, seed: int) -> optuna.samplers.BaseSampler:
        # Multivariate TPE with groups models each backend's parameters jointly: the space is
        # conditional on the backend, and cache type, ctx and parallel interact through memory.
        # Exact duplicates from parallel workers are caught by the claims, so no constant liar.
        # FitOnceTPESampler: TPE's proposals, one fit per trial for the screened sampler's tries.
        return FitOnceTPESampler(seed=seed, multivariate=True, group=True, n_startup_trials=8, constant_liar=False)


class PriorStrategy(TpeStrategy):
    name = "prior"
    description = "the engine's model's ranking first ([study] prior on: its top prior_trials), then TPE"
    prior = True


class RandomStrategy(BaseStrategy):
    name = "random"
    description = "Optuna's random sampler"

    def sampler(self, seed: int) -> optuna.samplers.BaseSampler:
        return optuna.samplers.RandomSampler(seed=seed)


class Nsga2Strategy(BaseStrategy):
    name = "nsga2"
    description = "Optuna's NSGA-II (population 20), for Pareto objectives"

    def sampler(self, seed: int) -> optuna.samplers.BaseSampler:
        return optuna.samplers.NSGAIISampler(seed=seed, population_size=20)


class GridStrategy(RandomStrategy):
    name = "grid"
    description = "every configuration once, in a seeded random order"
    takes_prior = False  # every configuration is queued anyway: a head start would only reorder it
    ends_with_queue = True

    def queue_first(self, search: Search) -> None:
        if search.has_waiting():
            return
        configs = list(search.configurations())
        random.Random(search.seed).shuffle(configs)
        done = search.evaluated_keys()
        for config in configs:
            if config.key not in done:
                search.enqueue(config)


@hookimpl
def register_strategies(register):
    for cls in (TpeStrategy, PriorStrategy, RandomStrategy, Nsga2Strategy, GridStrategy):
        register(cls())
