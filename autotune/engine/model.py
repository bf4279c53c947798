"""One engine's knowledge, written once: its parameters, rules, memory model and physics constants.

An engine plugin registers one :class:`EngineModel` per engine it knows (the
``register_engine_models`` hook, by the engine's name: ``llama.cpp``). Its real backend reads
its parameters, rules and defaults from that object, and the digital twin (the ``twin`` plugin)
builds a simulated backend from every registered model with a twin (``twin_name``): the same
space, the same refusals, the same memory model, the plugin's own fitted constants. So a knob,
a rule or an engine is added in the engine's plugin only, and real and simulated answers cannot
drift apart.

The twin hooks (``scenario``, ``refuse``, ``load_failure``, ``deploy_command`` ...) receive the
twin backend as ``twin``: a :class:`autotune.engine.backend.BaseBackend` whose ``setting``,
``scenario``, ``predictor``, ``as_format``, ``weights_file`` and ``layers_on_gpu`` they may call.
They never import the twin: an engine plugin imports only the core (``autotune.api``) and
``autotune_plugins.shared``.
"""

from __future__ import annotations


import tomllib
from pathlib import Path
from typing import Any, ClassVar, Mapping, Sequence

from autotune.engine.backend import DefaultLaunch, MemoryEstimate, Param, Setting, StudyContext, TrialConfig, same_value
from autotune.engine.declarations import CacheType, WeightFormats
from autotune.errors import BackendError, ConfigError, UnknownNameError
from autotune import plugins

__all__ = ["EngineModel", "engine_model", "engine_models", "kept", "weight_format"]


def kept(space: Mapping[str, Sequence[Any]], name: str, accepted: Sequence[Any]) -> tuple[Any, ...]:
    """The study's values of ``name`` that are in ``accepted``, as given and in its order, once
    each (all of ``accepted`` when the study does not name the option)."""
    if name not in space:
        return tuple(accepted)
    out: list[Any] = []
    for value in space[name]:
        if any(same_value(value, a) for a in accepted) and not any(same_value(value, k) for k in out):
            out.append(value)
    return tuple(out)


class EngineModel:
    """What one engine is, as data and small functions; subclass it in the engine's plugin.

    Attributes:
        name: The engine (``BaseBackend.engine`` of its backends): the registry's key.
        weight_formats: The formats it loads (its plugin's declarations).
        kv_cache_types: Its cache types (its plugin's declarations).
        engine_variables: Environment patterns the engine reads beyond the core's allow-list.
        cache_types: The cache types its twin offers a study that names none.
        default_cache: The cache type when a configuration names none.
        twin_name: Its twin backend's name (``twin-llama.cpp``); empty: no twin.
        twin_class: The Python name the twin module exports it under (``TwinLlamaCpp``).
        twin_description: What ``autotune plugins`` says of the twin.
        artifacts: The artifacts on disk it loads, keys of ``artifact_words``' union.
        artifact_words: Artifact kinds this engine introduces, as messages name them (one, many).
        twin_settings: The twin's settings beyond the twin's common ones.
        constants_file: The TOML holding its physics constants (``[constants]``), beside the
            engine model's module; ``fit`` writes it.
    """

    name: ClassVar[str] = ""
    weight_formats: ClassVar[tuple[WeightFormats, ...]] = ()
    kv_cache_types: ClassVar[tuple[CacheType, ...]] = ()
    engine_variables: ClassVar[tuple[str, ...]] = ()
    cache_types: ClassVar[tuple[str, ...]] = ()
    default_cache: ClassVar[str] = ""
    twin_name: ClassVar[str] = ""
    twin_class: ClassVar[str] = ""
    twin_description: ClassVar[str] = ""
    artifacts: ClassVar[tuple[str, ...]] = ()
    artifact_words: ClassVar[Mapping[str, tuple[str, str]]] = {}
    twin_settings: ClassVar[tuple[Setting, ...]] = ()
    constants_file: ClassVar[Path | None] = None

    # ------------------------------------------------------------------ constants

    def constants(self) -> dict[str, Any]:
        """The engine's physics constants (``[constants]`` of ``constants_file``); {} without one.

        Raises:
            ConfigError: The file has no ``[constants]`` table; the message names the file.
        """
        if self.constants_file is None:
            return {}
        doc = tomllib.loads(self.constants_file.read_text(encoding="utf-8"))
        if not isinstance(doc.get("constants"), dict):
            raise ConfigError(f"{self.constants_file}: no [constants] table (the engine's physics constants)")
        return dict(doc["constants"])

    # ------------------------------------------------------------------ space and rules

    # The study's values of an option that the engine accepts: ``self.kept(space, name, accepted)``.
    kept = staticmethod(kept)

    def parameters(self, space: Mapping[str, Sequence[Any]]) -> list[Param]:
        """The engine's tunables: ``cache_type`` and ``flash_attn`` unless overridden; an option
        whose values are all foreign comes back without choices (the core reports it)."""
        return [
            Param(
                "cache_type",
                kept(space, "cache_type", self.cache_types),
                f"KV-cache type ({', '.join(self.cache_types)})",
                accepted=self.cache_types,
            ),
            Param(
                "flash_attn",
                kept(space, "flash_attn", (True, False)),
                "fused attention kernels",
                accepted=(True, False),
            ),
        ]

    def rules(self, config: TrialConfig, ctx: StudyContext) -> list[str]:
        """Why the engine would refuse ``config`` before launching (empty: it starts)."""
        return []

    def placement_parameters(self, space: Mapping[str, Sequence[Any]]) -> list[Param]:
        """The engine's split dimensions over several cards that ``space`` names (docs/study-file.md,
        "Several cards"); none by default: the engine runs on one card."""
        return []

    def placement_rules(self, config: TrialConfig, ctx: StudyContext) -> list[str]:
        """Why the engine would refuse ``config``'s split over the study's cards (empty: it starts)."""
        return []

    def placement_space(self, ctx: StudyContext) -> dict[str, list[Any]]:
        """What a study on several cards searches of the split when its ``[space]`` does not say."""
        return {}

    def placement_memory(
        self, mem: MemoryEstimate, s: Any, config: TrialConfig, ctx: StudyContext
    ) -> MemoryEstimate | None:
        """Each card's share of ``mem`` (the one-card estimate of scenario ``s``, every layer on
        the card) by the engine's own placement, where it has one (its real backend's per-card
        model); None: the twin's generic split (``plugins/twin/multicard.py``) stands for it."""
        return None

    def refuse(self, twin: Any, config: TrialConfig, ctx: StudyContext) -> None:
        """Raise the engine's own ``UnsupportedError`` for a card or option it does not support."""

    def default_launch(self, twin: Any, weights: str, ctx: StudyContext) -> DefaultLaunch | None:
        """The launch a user gets without tuning (None: the core's default)."""
        return None

    # ------------------------------------------------------------------ memory and physics

    def memory(self, scenario: Any, constants: Any) -> MemoryEstimate:
        """Device memory of a scenario (``autotune_plugins.shared.scenario.Scenario``) with every
        layer on the GPU, by the engine's own model."""
        raise NotImplementedError(f"engine model {self.name!r} has no memory model")

    def scenario(self, twin: Any, scenario: Any, config: TrialConfig, ctx: StudyContext) -> Any:
        """The common scenario with the engine's own flags translated (placement, jobs at once)."""
        return scenario

    def load_failure(self, twin: Any, config: TrialConfig, ctx: StudyContext, mem: MemoryEstimate) -> None:
        """Raise what the engine prints when the configuration does not fit the card."""
        if mem.total_bytes > ctx.gpu.vram_bytes:
            raise BackendError(
                f"CUDA out of memory: needs {mem.total_bytes / 2**30:.2f} GiB, "
                f"card has {ctx.gpu.vram_bytes / 2**30:.2f} GiB"
            )

    def attention_path(self, config: TrialConfig, ctx: StudyContext) -> str:
        return "fused" if config.option("flash_attn", True) else "unfused"

    def deploy_command(self, twin: Any, config: TrialConfig, ctx: StudyContext) -> str:
        raise NotImplementedError(f"engine model {self.name!r} has no deploy command")

    # ------------------------------------------------------------------ artifacts

    def directory_format(self, directory: Any, check: bool = False) -> str | None:
        """A model directory (``autotune.modelfiles.safetensors_dir.SafetensorsDir``) as this engine's
        format (``exl2:4.0``), or None when it is not in one of this engine's formats.

        Raises:
            ConfigError: With ``check``: it is, but outside what the engine's twin predicts; the
                message names the file.
        """
        return None

    def file_format(self, path: Path) -> str | None:
        """A weights file as this engine's format (``gguf:Q8_0``); None when it is not one of its files.

        Raises:
            ConfigError: It is, but unreadable; the message names the file.
        """
        return None

    def file_weights(self, path: Path) -> Any:
        """The exact weight bytes (``autotune.engine.formats.WeightsBreakdown``) of one of this engine's
        weights files, from its own tensor table; None when it is not one of its files."""
        return None

    def cache_kv_bits(self, cache_type: str) -> tuple[int, int] | None:
        """(K bits, V bits) of a cache type that quantizes K and V apart (None: not one of those)."""
        return None


def engine_models() -> dict[str, EngineModel]:
    """Every engine model by engine name: the registered ones over those of every installed
    plugin (``plugins.installed_engine_models``)."""
    return plugins.installed_engine_models()


def engine_model(name: str) -> EngineModel:
    """One engine's model.

    Raises:
        UnknownNameError: No engine of that name; the message lists the known ones.
    """
    models = engine_models()
    if name not in models:
        raise UnknownNameError(
            f"engine model '{name}' is not installed (installed: {', '.join(sorted(models)) or 'none'})"
        )
    return models[name]


_asking: set[str] = set()


def weight_format(family: str) -> WeightFormats:
    """A weight-format family (``gguf``) as the engine model that declares it does.

    Raises:
        UnknownNameError: No engine declares it; the message lists the families declared.
    """
    declared: dict[str, WeightFormats] = {}
    for m in engine_models().values():
        if m.name in _asking:
            continue  # an engine model whose formats are themselves looked up here (a property)
        _asking.add(m.name)
        try:
            formats = m.weight_formats
        finally:
            _asking.discard(m.name)
        for f in formats:
            declared.setdefault(f.name, f)
    if family not in declared:
        raise UnknownNameError(
            f"weight format '{family}' is declared by no engine model "
            f"(declared: {', '.join(sorted(declared)) or 'none'})"
        )
    return declared[family]
