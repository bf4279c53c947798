"""What a serving backend is: the base class every backend plugin implements.

Lifecycle of one trial, as the study runner drives it (see ``autotune.study``):

1. ``parameters(space)`` once per study: the backend's part of the conditional search space,
   built from the study file's ``[space]`` table (it keeps only the values it understands).
2. ``check(config, ctx)``: reasons the configuration is invalid for this engine; a non-empty
   list prunes the trial with those reasons, nothing is launched.
3. ``estimate_memory(config, ctx)``: the predicted VRAM breakdown; over the study's budget the
   trial is recorded as infeasible with this breakdown, nothing is launched.
4. ``run(config, ctx)``: launch, warm up, measure with ``autotune.measure``, tear down. Raise
   ``BackendError`` (with the engine's reason and log tail) on any failure; the runner
   records the trial as failed and the study goes on.
5. ``deploy_command(config, ctx)``: the exact command a user runs to serve this configuration.

Before the search a study also measures, once, each backend's ``baselines``: what a user gets
without tuning (its ``default_launch``, the engine's defaults, and any other launch the engine
chooses for itself, such as llama.cpp's ``--fit``), the baselines every winner is compared against.

A backend never decides scores or constraints: that is ``autotune.study.objective``'s job.
"""

from __future__ import annotations

import abc
from typing import Any, ClassVar, Mapping, Sequence

from autotune.engine import cache_types
from autotune.engine.backend_records import (  # noqa: F401 - backend writers and the core import them from here
    DEFAULT_BASELINE,
    DefaultLaunch,
    Measurement,
    MemoryEstimate,
    Param,
    Setting,
    StudyContext,
    TrialConfig,
    UserLoad,
    same_value,
)
from autotune.engine.declarations import CacheType, WeightFormats
from autotune.engine.deploy import control_problem, deploy_line  # noqa: F401 - a backend writer imports both from here
from autotune.errors import ConfigError
from autotune.engine.parts import ArtifactMaker, Predictor, Scoring, Splitting
from autotune.engine.workload import Workload  # noqa: F401 - backends and tests import it from here, as always


class BaseBackend(abc.ABC):
    """A serving engine autotune can launch and measure. See the module docstring.

    Class attributes:
        name: Registry name, unique across plugins.
        engine: The engine family it runs (``llama.cpp``, ``exllamav2``, ...); a model
            backend with the same ``engine`` can predict for it (the twin as a prior).
        settings: The ``[backends.<name>]`` keys it reads (see ``Setting``).
        description: One line for ``autotune plugins``.
        kv_cache_types: The KV-cache types its engine stores, as data (``CacheType``): the core
            sizes a cache and compares engines' caches by these (``autotune.engine.cache_types``).
        weight_formats: The weight-format families it can make and load (``WeightFormats``):
            what a ``NAME:...`` weights value is, and the formats ``autotune init`` offers.
        engine_variables: What its engine needs of autotune's environment (see below).
        artifacts, scoring, predictor, splitting: Its optional parts (:mod:`autotune.engine.parts`),
            each None where the engine has none; declare one as ``artifacts = part(MyRecipes)``.
    """

    name: ClassVar[str] = ""
    engine: ClassVar[str] = ""
    description: ClassVar[str] = ""
    settings: ClassVar[tuple[Setting, ...]] = ()
    """The keys of ``[backends.<name>]`` this backend reads; any other key is refused."""
    kv_cache_types: ClassVar[tuple[CacheType, ...]] = ()
    weight_formats: ClassVar[tuple[WeightFormats, ...]] = ()
    engine_variables: ClassVar[tuple[str, ...]] = ()
    """Variables of autotune's environment (names or ``fnmatch`` patterns) its engine needs beyond
    the allow-list of :func:`autotune.toolkit.redact.engine_environment`; the engine gets no others. A
    pattern never hands on a secret-looking variable, a name does."""
    artifacts: ClassVar[ArtifactMaker | None] = None
    """Makes weights formats from the study's source (``autotune.modelfiles.artifacts``)."""
    scoring: ClassVar[Scoring | None] = None
    """Loads weights for log-likelihood scoring (the quality metrics)."""
    predictor: ClassVar[Predictor | None] = None
    """Predicts instead of measuring: a backend with one is a model (a digital twin)."""
    splitting: ClassVar[Splitting | None] = None
    """Where the model goes when one card is not enough (``autotune init``, several cards)."""

    def setting(self, ctx: StudyContext, name: str) -> Any:
        """A ``[backends.<name>]`` value, or its declared default (one owner of each default)."""
        for s in self.settings:
            if s.name == name:
                return ctx.settings.get(name, s.default)
        raise KeyError(f"backend '{self.name}' declares no setting {name!r}")

    def value(self, ctx: StudyContext, name: str) -> Any:
        """``setting``, checked against its declaration even when the core has not (a direct
        caller such as ``autotune quality`` or a test builds its own context).

        Raises:
            ConfigError: The value is not what the setting accepts.
        """
        v = self.setting(ctx, name)
        if name in ctx.settings:
            declared = next(s for s in self.settings if s.name == name)
            problem = declared.problem(v)
            if problem:
                raise ConfigError(f"[backends.{self.name}] {name} = {v!r}: {problem}")
        return v

    def preflight(self, ctx: StudyContext) -> list[str]:
        """Problems that would fail every trial of this backend here (engine missing, a build
        without this card's architecture...), each with its remedy. The study refuses to
        start on any; empty: ready. A problem does not name the backend: its caller does
        (``study/prepare.py``: the study file's candidate; ``init``: "backend NAME")."""
        return []

    @abc.abstractmethod
    def parameters(self, space: Mapping[str, Sequence[Any]]) -> list[Param]:
        """This backend's options in the search space.

        Args:
            space: The study's ``[space]`` table minus ``ctx`` and ``parallel`` (which every
                backend takes): option name -> values. Keep the names you understand, filter
                their values to those your engine supports, and add defaults of your own.

        Returns:
            The parameters to search; an option the study names but no backend takes is an
            error the core reports.
        """

    def check(self, config: TrialConfig, ctx: StudyContext) -> list[str]:
        """Reasons this configuration is invalid for the engine (empty: valid)."""
        return []

    @abc.abstractmethod
    def estimate_memory(self, config: TrialConfig, ctx: StudyContext) -> MemoryEstimate:
        """Predicted device memory of ``config``."""

    @abc.abstractmethod
    def run(self, config: TrialConfig, ctx: StudyContext) -> Measurement:
        """Launch, measure and tear down ``config``; raise ``BackendError`` on failure."""

    @abc.abstractmethod
    def deploy_command(self, config: TrialConfig, ctx: StudyContext) -> str:
        """The exact command that serves ``config``."""

    def default_launch(self, weights: str, ctx: StudyContext) -> DefaultLaunch | None:
        """The engine's default launch on ``weights``: the baseline a study measures once, before
        the search, and compares its winner with ("how much better than doing nothing").

        It is never a search trial: it is not admitted by the judge, never becomes the best and
        never reaches the sampler; ``run`` measures it and ``deploy_command`` prints it like any
        configuration (a model backend's ``run`` predicts it).

        Args:
            weights: The study's highest-precision candidate of this backend (what the user has
                before quantizing anything).
            ctx: The study's context for this backend.

        Returns:
            The launch, or None to decline (the default: the summary then says nothing about a
            baseline of this backend).
        """
        return None

    def baselines(self, weights: str, ctx: StudyContext, user: UserLoad) -> list[DefaultLaunch]:
        """Every launch a user gets from this engine without tuning, each measured once per study
        before the search and compared with the winner: the ``default_launch`` (named
        ``default``) and any other choice the engine makes for itself (llama-server adds ``fit``:
        ``--fit on`` with the user's context and slots). Names must differ.

        Args:
            weights: As ``default_launch``'s.
            ctx: As ``default_launch``'s.
            user: The user's context and slots as the study's space says them, for a launch
                that takes them from the user rather than from the engine's defaults.

        Returns:
            The default is ``default_launch`` alone (nothing where it declines): a backend that
            only overrides ``default_launch`` keeps working as it did.
        """
        launch = self.default_launch(weights, ctx)
        return [] if launch is None else [launch]

    def check_weights(self, weights: str, ctx: StudyContext) -> str | None:
        """Why a candidate weights reference is unusable (None: usable). Called at load time."""
        return None

    def engine_build(self, ctx: StudyContext | None) -> str:
        """Version/build of the engine this study runs (its settings may name the binary: the
        header, every trial's record and the resume's comparability check say this one, issue 39
        item 6). ``None``: the build found without a study's settings. The default: unknown."""
        return "unknown"

    def model_settings(self, ctx: StudyContext) -> Mapping[str, Any]:
        """How this backend will run its engine, as settings of the engine's model backend (the
        twin's ``host_threads``: the threads a real llama-server gets), for a model that speaks
        for this backend's configurations (``study/predictor.py``: ``model_context``)."""
        return {}


def quality_reference(backend: BaseBackend, params: Mapping[str, Sequence[Any]]) -> dict[str, Any]:
    """The options under which a backend's quality is judged best (the quality reference's options).

    Args:
        backend: Whose parameters they are (its ``kv_cache_types`` rank the cache types).
        params: Each of its parameters with its searched values.

    Returns:
        One value per parameter: the widest KV-cache type of the catalog among those searched
        (``cache_type``), fused attention when it is searched (``flash_attn``: numerically the
        same, and the setting a deployment would keep), else the first searched value.
    """
    ref = {name: values[0] for name, values in params.items()}
    known = {c: ct for c in params.get("cache_type", ()) if (ct := cache_types.resolve(c, backend.kv_cache_types))}
    if known:
        ref["cache_type"] = max(known, key=lambda c: known[c].bytes_per_element)
    if True in params.get("flash_attn", ()):
        ref["flash_attn"] = True
    return ref
