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

A backend never decides scores or constraints: that is ``autotune.objective``'s job.
"""

from __future__ import annotations

import abc
import functools
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Mapping, Sequence

from autotune import cache_types
from autotune.declarations import CacheType, WeightFormats
from autotune.deploy import control_problem, deploy_line  # noqa: F401 - a backend writer imports both from here
from autotune.errors import ConfigError
from autotune.scoring import ScoringUnsupportedError
from autotune.workload import Workload  # noqa: F401 - backends and tests import it from here, as always

if TYPE_CHECKING:  # pragma: no cover
    from autotune.hardware import GpuSpec
    from autotune.placement import Placement
    from autotune.measure import GpuTelemetry, Protocol, Stat
    from autotune.models import ModelSpec
    from autotune.scoring import Scorer
    from autotune.artifacts import Recipe


@dataclass(frozen=True)
class Param:
    """One dimension a backend adds to the search space.

    Args:
        name: Short name, e.g. ``cache_type``; the study stores it as ``<backend>.<name>``.
        choices: The values to search, in a stable order.
        doc: What the parameter means for this engine.
    """

    name: str
    choices: tuple[Any, ...]
    doc: str = ""
    accepted: tuple[Any, ...] = ()
    """Every value the engine understands for this option, named in the error when a study
    asks for one that no backend takes (empty: the choices say it all)."""


def same_value(a: Any, b: Any) -> bool:
    """Equality that tells ``true`` from ``1``: a study value is taken only as itself."""
    return type(a) is type(b) and a == b


_KIND_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}
@dataclass(frozen=True)
class Setting:
    """One key a backend accepts in the study file's ``[backends.<name>]`` table.

    Declared settings are checked when the study is prepared, before anything runs: an unknown
    key or a value of the wrong type is an error naming the file, the table and the key.

    Args:
        name: The key.
        kind: Accepted Python type(s) of the value (``int``, ``float``, ``str``, ``bool``); an
            int is accepted where ``float`` is.
        default: Value when the key is absent (``BaseBackend.setting`` returns it).
        help: What it does, shown in errors and ``autotune plugins``.
        choices: The only values accepted, when there are few.
        check: Further check of a well-typed value; returns why it is wrong, or None.
    """

    name: str
    kind: type | tuple[type, ...]
    default: Any
    help: str
    choices: tuple[Any, ...] = ()
    check: Callable[[Any], str | None] | None = None

    def accepted(self) -> str:
        if self.choices:
            return "one of " + ", ".join(repr(c) for c in self.choices)
        kinds = self.kind if isinstance(self.kind, tuple) else (self.kind,)
        return " or ".join(_KIND_NAMES.get(k, k.__name__) for k in kinds)

    def problem(self, value: Any) -> str | None:
        """Why ``value`` is not acceptable for this setting (None: it is)."""
        kinds = self.kind if isinstance(self.kind, tuple) else (self.kind,)
        ok = isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)
        if float in kinds and isinstance(value, int) and not isinstance(value, bool):
            ok = True
        if not ok or (self.choices and not any(same_value(value, c) for c in self.choices)):
            return f"must be {self.accepted()} ({self.help})"
        # A string that is an argument list (a command) is split into words; any other is one line.
        if isinstance(value, str) and list not in kinds and control_problem(value):
            return control_problem(value)
        return self.check(value) if self.check else None


@dataclass(frozen=True)
class TrialConfig:
    """One serving configuration.

    ``ctx`` is always the context each sequence gets (what one user's prompt plus output
    needs); a backend translates it into its engine's flags (llama-server ``-c`` is ctx x
    parallel) and says so in the deploy command.
    """

    backend: str
    weights: str
    ctx: int
    parallel: int
    options: tuple[tuple[str, Any], ...] = ()

    def option(self, name: str, default: Any = None) -> Any:
        for key, value in self.options:
            if key == name:
                return value
        return default

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "backend": self.backend,
            "weights": self.weights,
            "ctx": self.ctx,
            "parallel": self.parallel,
        }
        out.update(dict(self.options))
        return out

    @functools.cached_property  # asked of each configuration of the space at every fallback draw
    def key(self) -> str:
        """Canonical text of the configuration: equal keys are the same thing to measure."""
        return json.dumps(self.as_dict(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "TrialConfig":
        rest = {k: v for k, v in data.items() if k not in ("backend", "weights", "ctx", "parallel")}
        return cls(
            backend=data["backend"],
            weights=data["weights"],
            ctx=int(data["ctx"]),
            parallel=int(data["parallel"]),
            options=tuple(sorted(rest.items())),
        )


@dataclass(frozen=True)
class StudyContext:
    """Everything a backend may need to know about the study it serves.

    Args:
        gpu: The card (detected, or named by the study file).
        model: The model architecture the candidates share.
        workload: Prompt and output lengths of one request.
        vram_budget_bytes: Memory a configuration may use, safety margin already taken off.
        protocol: Repetition rules for measurements.
        seed: The study seed, for anything random a backend does.
        settings: The study file's ``[backends.<name>]`` table for this backend.
        base_dir: Directory that relative paths in the study file are relative to.
        gpu_index: Which GPU to run on.
        for_gpu: Estimate for ``gpu`` even on a machine without it (``autotune estimate``);
            None lets a backend decide from the machine it runs on.
        probe: Multi-fidelity (``[study] probe_margin``): set by the runner for one launch;
            :func:`autotune.measure.measure_engine`, every backend's loop, stops after the
            first run when it says so. None: measure in full.
        calibration: What a model backend's ``calibrate`` returned for this study (JSON-able),
            as the study stores it; the model backend uses it in ``predict`` when it is its own
            (its engine and card). None: predict with the published constants.
        source: The study's ``[model] source`` as an absolute path (a Hugging Face directory or
            a full-precision GGUF file): what candidates named as formats are made from
            (:mod:`autotune.artifacts`). None: the study names its weights as files.
        placement: The study's cards when it names several (``[hardware] gpus``,
            :mod:`autotune.placement`), each with its budget; ``gpu`` is the first of them.
            None: one card, ``gpu``.
    """

    gpu: "GpuSpec"
    model: "ModelSpec"
    workload: Workload
    vram_budget_bytes: int
    protocol: "Protocol"
    seed: int = 0
    settings: Mapping[str, Any] = field(default_factory=dict)
    base_dir: Path = Path(".")
    gpu_index: int = 0
    for_gpu: bool | None = None
    calibration: Mapping[str, Any] | None = None
    probe: Callable[[Mapping[str, float]], bool] | None = None
    source: Path | None = None
    placement: "Placement | None" = None

    def path(self, ref: str) -> Path:
        """A file or directory the study file names, as an absolute path (relative ones are
        relative to the study file), so no engine command depends on the working directory."""
        p = Path(ref).expanduser()
        return (p if p.is_absolute() else Path(self.base_dir) / p).absolute()


@dataclass(frozen=True)
class MemoryEstimate:
    """Predicted device memory of one configuration, by where it goes.

    Args:
        weights_bytes: Weights resident on the GPU.
        kv_bytes: KV cache for all sequences, as the engine lays it out.
        buffers_bytes: Compute/activation buffers the engine allocates.
        overhead_bytes: CUDA context and allocator slack.
        host_bytes: What the configuration keeps in host memory instead (spilled layers,
            embeddings an engine keeps on the CPU, the KV cache of layers left there).
        notes: Why a figure is what it is, for the trial record.
        host_buffers_bytes: Buffers the engine allocates in host memory beside those (pinned
            staging or the host's compute buffer): host memory the configuration needs too.
        per_device_bytes: Each card's share of the total, in the study's device order, when
            the study has several cards (``StudyContext.placement``) and the backend knows
            where things go; the judge checks each against its card's budget. Empty: one card.
    """

    weights_bytes: int
    kv_bytes: int
    buffers_bytes: int
    overhead_bytes: int
    host_bytes: int = 0
    notes: tuple[str, ...] = ()
    host_buffers_bytes: int = 0
    per_device_bytes: tuple[int, ...] = ()

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_bytes + self.buffers_bytes + self.overhead_bytes

    def to_dict(self) -> dict[str, Any]:
        return {
            "weights_bytes": self.weights_bytes,
            "kv_bytes": self.kv_bytes,
            "buffers_bytes": self.buffers_bytes,
            "overhead_bytes": self.overhead_bytes,
            "host_bytes": self.host_bytes,
            "host_buffers_bytes": self.host_buffers_bytes,
            "total_bytes": self.total_bytes,
            **({"per_device_bytes": list(self.per_device_bytes)} if self.per_device_bytes else {}),
            "notes": list(self.notes),
        }


@dataclass(frozen=True)
class Measurement:
    """What a backend measured for one configuration.

    Args:
        metrics: Stats by name. Every backend provides ``decode_tok_s`` (one stream),
            ``aggregate_tok_s`` (all ``parallel`` streams together) and ``per_user_tok_s``;
            ``prefill_tok_s`` and ``ttft_ms`` where it can.
        peak_vram_bytes: Measured peak device memory of the configuration, if known.
        telemetry: NVML readings taken while measuring, if a GPU was there.
        attrs: Engine facts worth keeping (version, attention path, layers offloaded...).
    """

    metrics: Mapping[str, "Stat"]
    peak_vram_bytes: int | None = None
    telemetry: "GpuTelemetry | None" = None
    attrs: Mapping[str, Any] = field(default_factory=dict)


DEFAULT_BASELINE = "default"  # the name of a backend's default launch among its baselines


@dataclass(frozen=True)
class DefaultLaunch:
    """What a user gets from this engine without tuning: its default launch on the user's weights.

    Args:
        config: What ``run`` and ``deploy_command`` are given. ``ctx`` and ``parallel`` say what
            the defaults amount to in the study's terms (``parallel``: the streams the baseline is
            measured with, the engine's default number of concurrent requests); a backend marks
            it with an option of its own when its command must leave flags out to keep the
            engine's defaults (llama-server: ``engine_defaults``).
        description: In words, which settings are left at which default and where those
            defaults come from (the engine's source or documentation), for the summary.
        name: Which of the backend's baselines this is (``baselines``): ``default`` for the
            engine's default launch, another short name (``fit``) for each other one. The
            study stores and shows it as ``<backend>`` or ``<backend>:<name>``.
        title: How the summary names it ("N x what <title> gives"); empty: "<backend>'s
            default launch".
    """

    config: TrialConfig
    description: str
    name: str = DEFAULT_BASELINE
    title: str = ""

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[a-z][a-z0-9_-]*", self.name):
            raise ValueError(f"a baseline's name must be lowercase letters, digits, '-' or '_' (got {self.name!r})")


@dataclass(frozen=True)
class UserLoad:
    """The context per user and the users at once the study's user serves, as the study's
    ``[space]`` says them: what a baseline that takes the user's context and slots is given
    (``BaseBackend.baselines``), chosen by the core so that every backend gets the same.

    Args:
        ctx: Tokens per user.
        parallel: Users at once.
        why: Where both come from, in words, for the baseline's description.
    """

    ctx: int
    parallel: int
    why: str = ""


class BaseBackend(abc.ABC):
    """A serving engine autotune can launch and measure. See the module docstring.

    Class attributes:
        name: Registry name, unique across plugins.
        engine: The engine family it runs (``llama.cpp``, ``exllamav2``, ...); a model
            backend with the same ``engine`` can predict for it (the twin as a prior).
        settings: The ``[backends.<name>]`` keys it reads (see ``Setting``).
        description: One line for ``autotune plugins``.
        kv_cache_types: The KV-cache types its engine stores, as data (``CacheType``): the core
            sizes a cache and compares engines' caches by these (``autotune.cache_types``).
        weight_formats: The weight-format families it can make and load (``WeightFormats``):
            what a ``NAME:...`` weights value is, and the formats ``autotune init`` offers.
        engine_variables: What its engine needs of autotune's environment (see below).
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
    the allow-list of :func:`autotune.redact.engine_environment`; the engine gets no others. A
    pattern never hands on a secret-looking variable, a name does."""

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

    def quality_reference(self, params: Mapping[str, Sequence[Any]]) -> dict[str, Any]:
        """The options under which quality is judged best (the reference's options).

        Args:
            params: Each of this backend's parameters with its searched values.

        Returns:
            One value per parameter: the widest KV-cache type of the catalog among those searched
            (``cache_type``), fused attention when it is searched (``flash_attn``: numerically the
            same, and the setting a deployment would keep), else the first searched value.
            Backends override it when their engine knows better.
        """
        ref = {name: values[0] for name, values in params.items()}
        known = {c: ct for c in params.get("cache_type", ()) if (ct := cache_types.resolve(c, self.kv_cache_types))}
        if known:
            ref["cache_type"] = max(known, key=lambda c: known[c].bytes_per_element)
        if True in params.get("flash_attn", ()):
            ref["flash_attn"] = True
        return ref

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

    def offload_space(self, weights: str, ctx: StudyContext) -> dict[str, list[Any]]:
        """Dimensions that let ``weights`` run when they do not fit the card whole: ``[space]``
        keys of this backend's ``parameters`` with candidate values (layers on the GPU, experts
        kept in host memory...), in order of preference, each list starting with the value that
        splits nothing (``"all"`` layers, no experts on the host). ``autotune init`` asks for
        them when a format's lightest configuration is over the budget, offers the first
        dimension with values the judge admits (those values, and the first one too when another
        format of the backend fits whole), and says so in a comment. Empty (the default): the
        engine cannot split a model."""
        return {}

    def placement_space(self, ctx: StudyContext) -> dict[str, list[Any]]:
        """Dimensions of where the model goes across the study's cards (``ctx.placement``, more
        than one): ``[space]`` keys of this backend's ``parameters`` with the values it would
        search (split mode, proportions per card from their budgets...). A study that names
        several cards searches them unless its ``[space]`` names the key itself. Empty (the
        default): the engine runs on one card."""
        return {}

    def check_weights(self, weights: str, ctx: StudyContext) -> str | None:
        """Why a candidate weights reference is unusable (None: usable). Called at load time."""
        return None

    def artifact_recipe(self, fmt: str, source: Path, ctx: StudyContext) -> "Recipe | None":
        """How this engine makes weights format ``fmt`` from a source model, for the artifact cache.

        A real backend whose candidates may be formats (``gguf:Q4_K_M``, ``exl2:4.0``) implements
        it; :func:`autotune.artifacts.ensure` decides when to make what, keeps the result and
        records it in the trial. Nothing is made here: the recipe is a description (cheap to
        build, called to find the artifact's path as well as to make it).

        Args:
            fmt: A canonical format (:func:`autotune.formats.normalize_format`).
            source: The study's model source, absolute.
            ctx: The study's context for this backend (its settings name the engine's tools).

        Returns:
            The recipe, or None when this engine cannot make ``fmt`` (the default: it makes nothing).
        """
        return None

    def engine_version(self) -> str:
        """Version/build of the engine, recorded with every trial."""
        return "unknown"

    def engine_build(self, ctx: StudyContext | None) -> str:
        """Version/build of the engine this study runs (its settings may name the binary: the
        header, every trial's record and the resume's comparability check say this one, issue 39
        item 6). The default is ``engine_version``: a backend whose settings choose no build."""
        return self.engine_version()

    def predict(self, config: TrialConfig, ctx: StudyContext) -> Mapping[str, float] | None:
        """Predicted metrics without running anything; only model backends implement it."""
        return None

    def model_settings(self, ctx: StudyContext) -> Mapping[str, Any]:
        """How this backend will run its engine, as settings of the engine's model backend (the
        twin's ``host_threads``: the threads a real llama-server gets), for a model that speaks
        for this backend's configurations (``study/predictor.py``: ``model_context``)."""
        return {}

    def calibrate(self, measured: Sequence[tuple[TrialConfig, Mapping[str, float]]],
                  ctx: StudyContext) -> Mapping[str, Any] | None:
        """Refit this model backend's speed constants to what a real backend of its engine measured.

        Only model backends implement it (the default: None, nothing learned). The study calls
        it after each measured trial of a real backend this one predicts for, stores the result
        and hands it back as ``ctx.calibration`` to ``predict``.

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
            fractions); anything else is the backend's own.
        """
        return None

    def scorer(self, weights: str, cache_type: str | None, ctx: StudyContext) -> "Scorer":
        """Load ``weights`` with KV-cache type ``cache_type`` for log-likelihood scoring.

        Quality metrics use only this (see ``autotune.scoring``); a backend that implements it
        gets MMLU, C-Eval and the KL-divergence proxy without further work.

        Raises:
            ScoringUnsupportedError: This backend has no scoring API (the default).
            ScoringError: The artifact could not be loaded for scoring.
        """
        raise ScoringUnsupportedError(f"backend '{self.name}' has no scoring API (it does not implement scorer())")

    def repeats_exactly(self, ctx: StudyContext) -> bool:
        """Whether a configuration measured again gives exactly the same figures (a model without
        simulated noise). The finish then measures nothing again: its leaders are compared, and a
        tie settled, on their one figure each."""
        return False

    @property
    def is_model(self) -> bool:
        """Whether it predicts instead of measuring (implements ``predict``: a digital twin)."""
        return type(self).predict is not BaseBackend.predict

    @property
    def makes_artifacts(self) -> bool:
        """Whether it makes weights formats from a source (implements ``artifact_recipe``); a
        backend that does not reads a format-like weights name as it sees fit."""
        return type(self).artifact_recipe is not BaseBackend.artifact_recipe

    def scoring_problem(self) -> str | None:
        """Why ``scorer`` cannot work here (None: it can), checked before a study starts so that a
        quality metric does not fail every trial. The default: only whether ``scorer`` is
        implemented; a backend whose scorer needs a package checks that it is installed."""
        if not self.supports_scoring:
            return f"backend '{self.name}' has no scoring API (it does not implement scorer())"
        return None

    @property
    def supports_scoring(self) -> bool:
        """Whether ``scorer`` is implemented (metrics' ``supports`` checks this)."""
        return type(self).scorer is not BaseBackend.scorer
