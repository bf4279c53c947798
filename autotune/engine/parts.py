"""The optional parts of a backend: what only some engines can do, each a small class of its own.

A backend (:class:`autotune.engine.backend.BaseBackend`) answers what every engine must: its settings,
parameters, checks, memory, run and deploy command. What only some do is a part, declared on the
backend class and None where the engine has none, so the core asks ``backend.predictor is not
None`` instead of guessing from which methods a subclass overrode:

``artifacts`` (:class:`ArtifactMaker`)
    makes weights formats (``gguf:Q4_K_M``) from the study's source model.
``scoring`` (:class:`Scoring`)
    loads weights for log-likelihood scoring (the quality metrics).
``predictor`` (:class:`Predictor`)
    predicts metrics without running anything (a digital twin), and may learn from measurements.
``splitting`` (:class:`Splitting`)
    where the model goes when one card is not enough (layers or experts on the host, several cards).

A part is bound to its backend (``self.backend``), so it reads the backend's settings::

    class LlamaArtifacts(ArtifactMaker):
        def recipe(self, fmt, source, ctx):
            return recipes.recipe_for(fmt, source, self.backend.value(ctx, "quantize"))

    class LlamaServerBackend(BaseBackend):
        artifacts = part(LlamaArtifacts)
"""

from __future__ import annotations

import abc
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, Mapping, Sequence, TypeVar

from autotune.engine.backend_records import StudyContext, TrialConfig

if TYPE_CHECKING:  # pragma: no cover
    from autotune.modelfiles.artifacts import Recipe
    from autotune.engine.scoring import Scorer

__all__ = ["ArtifactMaker", "Part", "Predictor", "Scoring", "Splitting", "part"]


class Part:
    """One optional part of a backend, made once per backend instance by :func:`part`.

    Args:
        backend: The backend it belongs to; the part reads its settings and declarations.
    """

    # ``Any``, not BaseBackend: a part sits below the backend that declares it (backend.py imports
    # this module), and imports nothing back.
    def __init__(self, backend: Any) -> None:
        self.backend = backend


P = TypeVar("P", bound=Part)


class part(Generic[P]):  # noqa: N801 - read as a declaration: ``artifacts = part(LlamaArtifacts)``
    """Declare a part on a backend class: each backend instance gets its own, made on first use.

    Read on the class it is the declaration (not None: the class has the part); read on an
    instance it is the part bound to that instance.
    """

    def __init__(self, cls: type[P]) -> None:
        self.cls = cls
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, backend: Any, owner: type | None = None) -> Any:
        if backend is None:
            return self
        made = self.cls(backend)
        backend.__dict__[self.name] = made  # made once: the instance's own attribute from now on
        return made


class ArtifactMaker(Part, abc.ABC):
    """How an engine makes weights formats from a source model, for the artifact cache.

    A real backend whose candidates may be formats (``gguf:Q4_K_M``, ``exl2:4.0``) has one;
    :func:`autotune.modelfiles.artifacts.ensure` decides when to make what, keeps the result and records it
    in the trial. A backend without one reads a format-like weights name as it sees fit.
    """

    @abc.abstractmethod
    def recipe(self, fmt: str, source: Path, ctx: StudyContext) -> "Recipe | None":
        """How to make ``fmt`` from ``source``. Nothing is made here: the recipe is a description
        (cheap to build, called to find the artifact's path as well as to make it).

        Args:
            fmt: A canonical format (:func:`autotune.engine.formats.normalize_format`).
            source: The study's model source, absolute.
            ctx: The study's context for this backend (its settings name the engine's tools).

        Returns:
            The recipe, or None when this engine cannot make ``fmt``.
        """


class Scoring(Part, abc.ABC):
    """Log-likelihood scoring: a backend with it gets MMLU, C-Eval and the KL-divergence proxy
    without further work (see :mod:`autotune.engine.scoring`)."""

    @abc.abstractmethod
    def scorer(self, weights: str, cache_type: str | None, ctx: StudyContext) -> "Scorer":
        """Load ``weights`` with KV-cache type ``cache_type`` for scoring.

        Raises:
            ScoringError: The artifact could not be loaded for scoring.
        """

    def problem(self) -> str | None:
        """Why ``scorer`` cannot work here (None: it can), checked before a study starts so that a
        quality metric does not fail every trial (a scorer that needs a package checks it is
        installed)."""
        return None


class Predictor(Part, abc.ABC):
    """Predicts metrics without running anything: a model backend (a digital twin). A backend with
    one is a model: nothing it runs is measured, and it serves real backends of its ``engine`` as
    their prior."""

    @abc.abstractmethod
    def predict(self, config: TrialConfig, ctx: StudyContext) -> Mapping[str, float] | None:
        """Predicted metrics of ``config`` (None: it cannot say)."""

    learns: bool = False
    """Whether ``calibrate`` refits anything (the study then calls it after real trials)."""

    def calibrate(
        self, measured: Sequence[tuple[TrialConfig, Mapping[str, float]]], ctx: StudyContext
    ) -> Mapping[str, Any] | None:
        """Refit the speed constants to what a real backend of its engine measured.

        The study calls it (when ``learns``) after each measured trial of a real backend this one
        predicts for, stores the result and hands it back as ``ctx.calibration`` to ``predict``.

        Args:
            measured: Each measured configuration, renamed to this backend, with the medians of
                the measured ``decode_tok_s``, ``aggregate_tok_s``, ``per_user_tok_s`` and
                ``prefill_tok_s`` it has.
            ctx: The real backend's study context.

        Returns:
            A JSON-able mapping; the core reads (for the report and ``autotune estimate
            --study``) ``gpu`` (the card's key it holds for), ``n`` (configurations fitted),
            ``before`` and ``after`` (each refit constant, published and fitted),
            ``median_abs_error_before`` and ``median_abs_error_after`` (on ``measured``, as
            fractions); anything else is the backend's own. None: nothing learned.
        """
        return None

    def repeats_exactly(self, ctx: StudyContext) -> bool:
        """Whether a configuration predicted again gives exactly the same figures (no simulated
        noise). The finish then measures nothing again: its leaders are compared, and a tie
        settled, on their one figure each."""
        return False


class Splitting(Part):
    """Where the model goes when one card is not enough. Without it the engine runs a model whole
    on one card."""

    def offload_space(self, weights: str, ctx: StudyContext) -> dict[str, list[Any]]:
        """Dimensions that let ``weights`` run when they do not fit the card whole: ``[space]``
        keys of this backend's ``parameters`` with candidate values (layers on the GPU, experts
        kept in host memory...), in order of preference, each list starting with the value that
        splits nothing (``"all"`` layers, no experts on the host). ``autotune init`` asks for
        them when a format's lightest configuration is over the budget, offers the first
        dimension with values the judge admits (those values, and the first one too when another
        format of the backend fits whole), and says so in a comment. Empty: it cannot offload."""
        return {}

    def placement_space(self, ctx: StudyContext) -> dict[str, list[Any]]:
        """Dimensions of where the model goes across the study's cards (``ctx.placement``, more
        than one): ``[space]`` keys of this backend's ``parameters`` with the values it would
        search (split mode, proportions per card from their budgets...). A study that names
        several cards searches them unless its ``[space]`` names the key itself. Empty: one card."""
        return {}
