"""The search strategy contract: how a study chooses the configurations it launches.

A strategy is registered by a plugin (``register_strategies``) under the name a study file gives
as ``[study] sampler``; the core's own (tpe, random, nsga2, grid, prior) are registered the
same way, by ``autotune.study.default_strategies``. The runner never compares strategy names: it
asks the study's strategy the questions below.

Lifecycle of one run of a study (``StudyRunner.run``):

1. ``sampler(seed)`` gives the Optuna sampler that proposes configurations. The runner wraps
   it (``ScreenedSampler``) so that it only ever proposes admissible, unevaluated ones.
2. ``queue_first(search)`` may queue configurations before the first launch (a grid queues
   all of them). Queued configurations are launched before the sampler is asked.
3. Unless ``takes_prior`` is false, the prior head start follows: the configurations the
   engine's model backend ranks best (``[study] prior``; ``prior`` is its default here).
4. Before each launch, while nothing is queued, a strategy with ``queues_each_launch`` is
   asked ``queue_next(search, n)``: it queues its choice, or answers False when nothing is
   left (the study has converged). Otherwise the sampler proposes.
5. With ``ends_with_queue``, the search ends when nothing is queued any more.

Two ``[study]`` options apply to every strategy: ``prior`` (the head start of step 3) and
``probe_margin`` (the probe: every launch's first run may stop it, ``autotune.study.probe``).
A strategy object is shared by every study of a process, so it keeps no state of its own;
what one run has done is in ``search`` and in the ``n`` the runner counts.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable

if TYPE_CHECKING:  # pragma: no cover - types only
    import optuna

    from autotune.engine.backend import TrialConfig

__all__ = ["BaseStrategy", "Search"]


@dataclass(frozen=True)
class Search:
    """What a strategy may read of, and add to, the run it chooses for (the runner builds it).

    Attributes:
        seed: The run's seed (``[study] seed`` or ``--seed``): a strategy that shuffles uses it.
        configurations: Every configuration of the study's search space, in a fixed order.
        evaluated_keys: ``TrialConfig.key`` of each configuration the storage already answers.
        has_waiting: Whether a queued configuration waits to be launched.
        enqueue: Queues a configuration, with user attributes of its trial (``from_prior=True``
            marks one chosen by the model's ranking, as the report shows it).
        enqueue_unexplored: Queues one random admissible configuration not yet evaluated
            (its trial marked ``explore``); False when there is none.
        ranking: The admissible configurations, best first, as the engine's model backend (the
            twin) predicts them, calibrated on the study's trials so far; empty without one.
    """

    seed: int
    configurations: Callable[[], Iterable["TrialConfig"]]
    evaluated_keys: Callable[[], set[str]]
    has_waiting: Callable[[], bool]
    enqueue: Callable[..., None]
    enqueue_unexplored: Callable[[], bool]
    ranking: Callable[[], list["TrialConfig"]]


class BaseStrategy(abc.ABC):
    """A way to choose the configurations a study launches (see the module's lifecycle).

    Attributes:
        name: Registry name, the value of ``[study] sampler``; unique among installed plugins.
        description: One line for ``autotune plugins`` and ``bench/replay.py``.
        takes_prior: Whether the prior head start may precede this strategy's own choices.
            False for one that queues its own (a grid, a model's choice at every launch):
            its queue comes first, and ``[study] prior`` is then ignored.
        prior: ``[study] prior`` when the study file does not give it. None: on for a study on
            a GPU whose engine has a model backend that is not the study's backend itself.
        queues_each_launch: Whether ``queue_next`` is asked before each launch.
        ends_with_queue: Whether the search ends when nothing is queued (a grid, once every
            configuration has been launched).
        needs_model: Whether it ranks with a model backend of each candidate's engine; a study
            whose engine has none installed is refused when it is prepared.
        pareto: The strategy a study with ``[objective] mode = "pareto"`` runs instead when it
            names this one (TPE: NSGA-II); None keeps this one.
    """

    name: str
    description: str = ""
    takes_prior: bool = True
    prior: bool | None = None
    queues_each_launch: bool = False
    ends_with_queue: bool = False
    needs_model: bool = False
    pareto: str | None = None

    @abc.abstractmethod
    def sampler(self, seed: int) -> "optuna.samplers.BaseSampler":
        """The Optuna sampler that proposes configurations when nothing is queued.

        Args:
            seed: The run's seed.

        Returns:
            A new sampler; constraints reach it through ``Trial.set_constraint``. A strategy
            that queues every choice itself still gives one (random), for the configurations
            the runner slips in when proposals keep launching nothing.
        """

    def queue_first(self, search: Search) -> None:
        """Queue configurations before the run's first launch (default: none).

        Args:
            search: The run, to read what is evaluated and to queue.
        """

    def queue_next(self, search: Search, n: int) -> bool:
        """Queue the next configuration to launch; asked only with ``queues_each_launch``, and
        only while nothing is queued.

        Args:
            search: The run.
            n: How many times this run has asked, this time included (1 the first time).

        Returns:
            True when something was queued; False when nothing is left to choose, which ends
            the search as converged.
        """
        return True

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"
