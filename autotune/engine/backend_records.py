"""The records a backend takes and returns: its parameters and settings, a configuration, the
study's context, a memory estimate, a measurement, a baseline launch.

They sit below :mod:`autotune.engine.backend` and :mod:`autotune.engine.parts`, which both read them, and
below the measurement loop (:mod:`autotune.measure`), which reads a context.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

from autotune.engine.deploy import control_problem
from autotune.engine.workload import Workload
from autotune.toolkit import toml_text
from autotune.toolkit.fields import type_names

if TYPE_CHECKING:  # pragma: no cover
    from autotune.hardware.gpus import GpuSpec
    from autotune.hardware.placement import Placement
    from autotune.measure import GpuTelemetry, Protocol, Stat
    from autotune.modelfiles.models import ModelSpec


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
        help: What it does, shown in errors and ``autotune plugins``; the default is shown beside
            it, so the text names a default only where the value does not say it (None: "absent:
            autotune's own").
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
        """The values accepted, as the study file writes them (TOML: "auto", true)."""
        if self.choices:
            return "one of " + ", ".join(toml_text.value(c) for c in self.choices)
        return type_names(self.kind if isinstance(self.kind, tuple) else (self.kind,))

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
            (:mod:`autotune.modelfiles.artifacts`). None: the study names its weights as files.
        placement: The study's cards when it names several (``[hardware] gpus``,
            :mod:`autotune.hardware.placement`), each with its budget; ``gpu`` is the first of them.
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
