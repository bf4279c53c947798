"""The twin backend, generic over the registered engine models (:mod:`autotune.engine.model`).

:func:`twin_class` makes one :class:`TwinBackend` subclass per engine model that names a
``twin_name``: its space, refusals, memory model, placement and deploy line are the engine
model's own (the same object its real backend reads), its speed the physics (``physics.py``)
with the engine's constants (its plugin's ``engine_model.toml``), its quality the published
quantization damage (``quality.py``). The twin knows no engine by name.
"""

from __future__ import annotations

import functools
import random
import tomllib
from dataclasses import replace
from importlib import resources
from pathlib import Path
from typing import Any, ClassVar, Mapping, Sequence

from autotune.api import part
from autotune._builtin import Predictor, Splitting
from autotune.api import (
    AutotuneError,
    BaseBackend,
    EngineModel,
    Measurement,
    MemoryEstimate,
    Param,
    Setting,
    StudyContext,
    TrialConfig,
    measure_engine,
    parse_format,
    resolve_model,
)
from autotune.api import WeightsBreakdown
from autotune._builtin import (
    ConfigError,
    DefaultLaunch,
    Protocol,
    UnsupportedError,
    engine_models,
    safetensors_dir_weights,
    weights_for,
)
from autotune_plugins.twin import calibration, formats, multicard, physics, speculation, traffic
from autotune_plugins.twin.clock import SimulatedClock
from autotune_plugins.twin.settings import TWIN_SETTINGS, UNITS

__all__ = ["TwinBackend", "load_constants", "twin_class", "twin_classes"]


@functools.lru_cache(maxsize=1)
def _twin_doc() -> dict[str, Any]:
    return tomllib.loads(resources.files(__package__).joinpath("constants.toml").read_text(encoding="utf-8"))


def _constants_doc() -> dict[str, Any]:
    """The twin's constants (host, quality) with each engine model's own (``engines``)."""
    return {**_twin_doc(), "engines": {name: m.constants() for name, m in engine_models().items() if m.twin_name}}


def load_constants(
    doc: Mapping[str, Any] | None = None,
) -> tuple[dict[str, physics.EngineConstants], physics.HostConstants, float]:
    """Engine constants by engine, host constants, and MMLU points per unit KLD at 8B.

    Raises:
        ConfigError: An engine's table names a constant the physics does not have, or lacks one;
            the message names the engine's file and the accepted names.
    """
    doc = doc or _cached_doc()
    engines = {}
    for name, values in doc["engines"].items():
        try:
            engines[name] = physics.EngineConstants(**values)
        except TypeError as exc:
            model = engine_models().get(name)
            where = model.constants_file if model is not None else f'[engines."{name}"]'
            raise ConfigError(
                f"{where}: [constants]: {exc}; accepted: {', '.join(physics.EngineConstants.__dataclass_fields__)}"
            ) from None
    return engines, physics.HostConstants(**doc["host"]), float(doc["quality"]["points_per_kld_8b"])


_doc_cache: dict[tuple[str, ...], dict[str, Any]] = {}


def _cached_doc() -> dict[str, Any]:
    # Read once per set of engines: the physics asks for the constants in its inner loops.
    key = tuple(sorted(engine_models()))
    if key not in _doc_cache:
        _doc_cache[key] = _constants_doc()
    return _doc_cache[key]


class TwinPredictor(Predictor):
    """The twin's physics (``physics.predict``) with the study's calibration, refit to what a real
    backend of its engine measured (``calibration.fit``)."""

    learns = True

    def predict(self, config: TrialConfig, ctx: StudyContext) -> Mapping[str, float] | None:
        t = self.backend
        try:
            t.refuse(config, ctx)
        except UnsupportedError:
            return None
        _, host, _ = load_constants()
        scenario, k = t.scenario(config, ctx), t.calibrated_constants(ctx)
        out = t._predict(scenario, k, host, config, ctx).as_dict()
        if ctx.workload.shaped or ctx.workload.slo:  # the requests one by one (traffic.py): their latencies
            out.update(traffic.predicted_metrics(scenario, k, host, ctx.workload, out["aggregate_tok_s"]))
        return out

    def calibrate(
        self, measured: Sequence[tuple[TrialConfig, Mapping[str, float]]], ctx: StudyContext
    ) -> Mapping[str, Any] | None:
        """The speed constants refit to a real study's measurements (``calibration.fit``),
        always from the published ones: the stored result is a function of the trials alone."""
        t = self.backend
        observations = []
        for config, metrics in measured:
            try:
                t.refuse(config, ctx)
                observations.append((t.scenario(config, ctx), metrics))
            except AutotuneError:
                continue  # weights it cannot read, an option it refuses: no say on that trial
        if not observations:
            return None
        _, host, _ = load_constants()
        _, report = calibration.fit(t.constants(), host, observations)
        counted = speculation.measured_acceptance([(dict(c.options), m) for c, m in measured])
        return {"engine": t.engine, "gpu": ctx.gpu.key, **report, **({"acceptance": counted} if counted else {})}

    def repeats_exactly(self, ctx: StudyContext) -> bool:
        """Without simulated noise a launch draws nothing: the same configuration predicts the same
        figures every time (throttling included: each launch starts its own clock)."""
        return not float(self.backend.setting(ctx, "noise"))


class TwinSplitting(Splitting):
    def placement_space(self, ctx: StudyContext) -> dict[str, list[Any]]:
        """The engine model's split dimensions for a study on several cards."""
        return self.backend.model.placement_space(ctx)


class TwinBackend(BaseBackend):
    """A simulated backend of one engine model (``model``); :func:`twin_class` makes its subclasses."""

    model: ClassVar[EngineModel]
    settings: ClassVar[tuple[Setting, ...]] = TWIN_SETTINGS
    predictor = part(TwinPredictor)
    splitting = part(TwinSplitting)
    #: Launches of each configuration in this process (a key's n-th launch draws the n-th noise).
    _launches: ClassVar[dict[str, int]] = {}

    #: The artifacts on disk the engine loads (keys of ``formats.artifact_words()``), the cache
    #: types offered and the default one: the engine model's (:func:`twin_class` sets them).
    loaded_artifacts: ClassVar[tuple[str, ...]] = ()
    cache_types: ClassVar[tuple[str, ...]] = ()
    default_cache: ClassVar[str] = ""

    # ------------------------------------------------------------------ space and rules

    @property
    def weight_families(self) -> tuple[str, ...]:
        """The format families the engine loads: those its engine model declares."""
        return tuple(f.name for f in self.weight_formats)

    def parameters(self, space: Mapping[str, Sequence[Any]]) -> list[Param]:
        """The engine model's own parameters: the same space as its real backend; and the
        speculation options the twin prices (:mod:`speculation`) where the study's space names
        them and the engine model does not declare them itself."""
        params = self.model.parameters(space) + self.model.placement_parameters(space)
        declared = {p.name for p in params}
        return params + [p for p in speculation.parameters(space) if p.name not in declared]

    def _speculation_declared(self) -> bool:
        """Whether the engine model itself offers speculation (then its rules judge it)."""
        return any(p.name == "spec_type" for p in self.model.parameters({"spec_type": speculation.SPEC_TYPES}))

    def as_format(self, weights: str, ctx: StudyContext) -> str:
        """A weights reference as the twin's models read it: a format as given; a GGUF file as the
        format its header names; a model directory as the format an engine model reads in it
        (``exl2:4.0``) or, unquantized, as the unquantized format of its element type
        (``gguf:BF16``); so the twin predicts for what a real study names.

        Raises:
            ConfigError: Neither a format nor a file or directory the twin reads; the message
                names the path and what is accepted.
        """
        try:
            parse_format(weights, self.weight_formats)
            return weights
        except ConfigError as exc:
            path = ctx.path(weights)
            if not path.exists():
                raise exc from None
        if path.is_dir():
            return formats.directory_as_format(path)
        spec = formats.file_format(path)
        if spec is None:
            raise ConfigError(f"{path}: its tensors name no type the twin knows")
        return spec

    def weights_file(self, weights: str, ctx: StudyContext) -> Path | None:
        """The artifact on disk behind ``weights``: a file or a model directory (None for a format spec)."""
        path = ctx.path(weights)
        return path if path.is_file() or path.is_dir() else None

    def weights(self, weights: str, ctx: StudyContext) -> WeightsBreakdown:
        """The bytes the engine loads: a real artifact's own (its tensor table or safetensors
        headers), a format's predicted for the study's model."""
        path = self.weights_file(weights, ctx)
        if path is None:
            return weights_for(ctx.model, weights, self.weight_formats)
        if path.is_file():
            return formats.file_weights(path)
        # A directory does not say where the embedding goes; the engine does (ExLlamaV2 keeps it
        # on the host, and loads it again as the head of a tied model without lm_head tensors).
        return replace(safetensors_dir_weights(path), embedding_on_gpu=not self.constants().keeps_embeddings_on_host)

    def check_weights(self, weights: str, ctx: StudyContext) -> str | None:
        path = self.weights_file(weights, ctx)
        try:
            if path is not None:
                kind = formats.artifact_kind(path)
                if kind not in self.loaded_artifacts:
                    words = formats.artifact_words()
                    return (
                        f"{path}: {words[kind][0]}, which {self.engine} does not load (it loads "
                        f"{' and '.join(words[a][1] for a in self.loaded_artifacts)}, or a format "
                        f"{' or '.join(f.syntax for f in self.weight_formats)})"
                    )
            family, _ = parse_format(self.as_format(weights, ctx), self.weight_formats)
        except AutotuneError as exc:
            return str(exc)
        if family not in self.weight_families:
            return f"{self.engine} loads {', '.join(self.weight_families)} weights, not {family}"
        return None

    def check(self, config: TrialConfig, ctx: StudyContext) -> list[str]:
        """The weights, then the engine model's rules (the same its real backend checks)."""
        problem = self.check_weights(config.weights, ctx)
        if problem:
            return [problem]
        reasons = self.model.rules(config, ctx) + self.model.placement_rules(config, ctx)
        if not self._speculation_declared():
            reasons += speculation.rules(dict(config.options))
        draft = config.option("draft")
        if draft is not None and not reasons:
            problem = self.check_weights(str(draft), ctx)
            if problem:
                reasons.append(f"draft {draft!r}: {problem}")
        return reasons

    # ------------------------------------------------------------------ physics

    def constants(self) -> physics.EngineConstants:
        return load_constants()[0][self.engine]

    def scenario(self, config: TrialConfig, ctx: StudyContext) -> physics.Scenario:
        """The configuration as the physics sees it, with the engine model's own flags translated."""
        gpu_layers = self.setting(ctx, "gpu_layers")
        common = physics.Scenario(
            engine=self.engine,
            gpu=ctx.gpu,
            model=ctx.model,
            weights=self.weights(config.weights, ctx),
            ctx=config.ctx,
            parallel=config.parallel,
            cache_type=config.option("cache_type", self.default_cache),
            flash_attn=bool(config.option("flash_attn", True)),
            prompt_tokens=ctx.workload.prompt_tokens,
            output_tokens=ctx.workload.output_tokens,
            gpu_layers=gpu_layers,
        )
        return replace(
            self.model.scenario(self, common, config, ctx), speculation=self.speculation_of(config, ctx, common)
        )

    def speculation_of(
        self, config: TrialConfig, ctx: StudyContext, common: physics.Scenario
    ) -> speculation.Speculation | None:
        """The trial's speculation as the physics prices it (None without): its options, the
        ``acceptance`` setting (assumed, see :mod:`speculation`), and a draft model's own scenario
        (its weights: a format of the study's model or a file, on the same card)."""
        spec_type = str(config.option("spec_type", "none"))
        if spec_type == "none":
            return None
        draft = None
        ref = config.option("draft")
        if speculation.family_of_type(spec_type) == "draft" and ref is not None:
            path = self.weights_file(str(ref), ctx)
            layers = config.option("draft_gpu_layers", "all")
            draft = replace(
                common,
                model=resolve_model(str(path)) if path is not None else ctx.model,
                weights=self.weights(str(ref), ctx),
                gpu_layers=layers,
                cache_type=str(config.option("draft_cache_type", common.cache_type)),
            )
        n_max = int(config.option("spec_n_max", speculation.DEFAULT_N_MAX))
        rate = self.setting(ctx, "acceptance_rate")
        cal = ctx.calibration or {}
        measured = cal.get("acceptance", {}) if cal.get("engine") == self.engine else {}
        if spec_type in measured:  # the study's own trials counted it: no assumption beats that
            a = float(measured[spec_type]["per_token"])
        elif rate is not None:
            a = speculation.per_token(float(rate), n_max)
        else:
            a = speculation.acceptance_for(self.setting(ctx, "acceptance"), spec_type)
        return speculation.Speculation(
            spec_type=spec_type,
            n_max=n_max,
            n_min=int(config.option("spec_n_min", 0)),
            p_min=float(config.option("spec_p_min", 0.0)),
            acceptance=a,
            draft=draft,
        )

    def layers_on_gpu(self, config: TrialConfig, ctx: StudyContext) -> int:
        """Decoder layers the simulation keeps on the GPU (the rest run on the host)."""
        scenario, k = self.scenario(config, ctx), self.constants()
        if self.split(config, ctx) is not None:
            return scenario.model.n_layers  # several cards: every layer on them (multicard.predict)
        return physics.gpu_layer_split(scenario, k, physics.memory(scenario, k))

    def calibrated_constants(self, ctx: StudyContext) -> physics.EngineConstants:
        """The published constants, with a study's calibration (``ctx.calibration``) applied
        when it was fitted for this engine on this card."""
        k = self.constants()
        cal = ctx.calibration
        if not cal or cal.get("engine") != self.engine or cal.get("gpu") != ctx.gpu.key:
            return k
        return replace(
            k, **{f: float(v) for f, v in cal.get("after", {}).items() if f in calibration.CALIBRATED_FIELDS}
        )

    def split(self, config: TrialConfig, ctx: StudyContext) -> multicard.Split | None:
        """The configuration's split over the study's cards (None: the study has one)."""
        cards = multicard.cards_of(ctx)
        return None if cards is None else multicard.split_of(config, cards, self.setting(ctx, "interconnect"))

    def estimate_memory(self, config: TrialConfig, ctx: StudyContext) -> MemoryEstimate:
        s, split = self.scenario(config, ctx), self.split(config, ctx)
        mem = physics.memory(s if split is None else replace(s, gpu_layers="all"), self.constants())
        if split is None:
            return mem
        own = self.model.placement_memory(mem, s, config, ctx)
        if own is not None:  # the engine places the model itself (exllamav3's autosplit, its TP allocator)
            return own
        head = s.weights.output_bytes + s.weights.other_bytes
        return multicard.per_device(mem, split, s.weights.per_layer_bytes, head)

    def _predict(
        self,
        s: physics.Scenario,
        k: physics.EngineConstants,
        host: physics.HostConstants,
        config: TrialConfig,
        ctx: StudyContext,
    ) -> physics.Prediction:
        split = self.split(config, ctx)
        return physics.predict(s, k, host) if split is None else multicard.predict(s, k, host, split)

    def refuse(self, config: TrialConfig, ctx: StudyContext) -> None:
        """Raise the engine's own error for a card or option it does not support."""
        self.model.refuse(self, config, ctx)

    def attention_path(self, config: TrialConfig, ctx: StudyContext) -> str:
        return self.model.attention_path(config, ctx)

    def load_failure(self, config: TrialConfig, ctx: StudyContext, mem: MemoryEstimate) -> None:
        """Raise what the engine prints when the configuration does not fit the card."""
        self.model.load_failure(self, config, ctx, mem)

    def default_launch(self, weights: str, ctx: StudyContext) -> DefaultLaunch | None:
        return self.model.default_launch(self, weights, ctx)

    def deploy_command(self, config: TrialConfig, ctx: StudyContext) -> str:
        return self.model.deploy_command(self, config, ctx)

    def engine_build(self, ctx: StudyContext | None = None) -> str:
        return "twin"

    # ------------------------------------------------------------------ run

    def run(self, config: TrialConfig, ctx: StudyContext) -> Measurement:
        self.refuse(config, ctx)
        scenario = self.scenario(config, ctx)
        k = self.constants()
        _, host, _ = load_constants()
        if self.split(config, ctx) is None:  # several cards: each card's share is judged before the launch
            self.load_failure(config, ctx, physics.memory(scenario, k))
        p = self._predict(scenario, k, host, config, ctx)
        noise = float(self.setting(ctx, "noise"))
        # Seeded for reproducible studies, but each launch of a configuration draws afresh: the
        # same noise on every re-measure would hide the between-run spread the finish looks for.
        launch = self._launches[config.key] = self._launches.get(config.key, 0) + 1
        rng = random.Random(f"{ctx.seed}:{config.key}:{launch}")
        after_s = self.setting(ctx, "throttle_after_s")
        clock = SimulatedClock(None if after_s is None else float(after_s), float(self.setting(ctx, "throttle_factor")))
        truth, wl = p.as_dict(), ctx.workload
        run, offered = traffic.predicted_run(scenario, k, host, wl)  # each request (traffic.py)
        if wl.shaped:  # a distribution or arrivals: the simulation's throughput, not the one shape's closed form
            truth.update(aggregate_tok_s=run.aggregate_tok_s, per_user_tok_s=run.per_user_tok_s)
        latency_rng = random.Random(f"{ctx.seed}:{config.key}:{launch}:latency")  # leaves rng's draws as they were

        def sample() -> dict[str, float]:
            run_s = run.span_s if wl.shaped else p.ttft_ms / 1000.0 + wl.output_tokens / p.per_user_tok_s
            factor = clock.advance(run_s)
            out = {}
            for name in ("decode_tok_s", "aggregate_tok_s", "per_user_tok_s", "prefill_tok_s"):
                out[name] = truth[name] * factor * (1.0 + rng.gauss(0.0, noise) if noise else 1.0)
            out["ttft_ms"] = truth["ttft_ms"] / factor
            speed = factor * (1.0 + latency_rng.gauss(0.0, noise) if noise else 1.0)
            out.update(
                traffic.run_metrics(
                    traffic.scaled(run, speed), wl, out["aggregate_tok_s"], None if offered is None else offered * speed
                )
            )
            return out

        # Without noise every run would say the same: one run is the measurement.
        runs_in = ctx if noise else replace(ctx, protocol=Protocol(warmup_runs=0, min_runs=1, max_runs=1))
        stats, _, _ = measure_engine(runs_in, sample, key=str(self.setting(ctx, "stability_metric")), units=UNITS)
        return Measurement(
            metrics=stats,
            peak_vram_bytes=None,
            attrs={
                "simulated": True,
                "attention_path": self.attention_path(config, ctx),
                "gpu_layers": p.gpu_layers,
                "host_layers": p.host_layers,
                "host_expert_layers": p.host_expert_layers,
                "roofline_tok_s": p.roofline_tok_s,
                "step_ms": {"single": p.step_ms_single, "parallel": p.step_ms_parallel},
                "throttled": clock.throttled,
            },
        )


_classes: dict[str, tuple[EngineModel, type[TwinBackend]]] = {}


def twin_class(model: EngineModel) -> type[TwinBackend]:
    """The twin backend class of one engine model (made once per model: the same class each time)."""
    known = _classes.get(model.twin_class)
    if known is not None and known[0] is model:
        return known[1]
    cls = type(
        model.twin_class,
        (TwinBackend,),
        {
            "__doc__": f"The twin of {model.name}: {model.twin_description}.",
            "__module__": "autotune_plugins.twin",
            "model": model,
            "name": model.twin_name,
            "engine": model.name,
            "description": model.twin_description,
            "kv_cache_types": model.kv_cache_types,
            "weight_formats": tuple(model.weight_formats),
            "loaded_artifacts": model.artifacts,
            "cache_types": model.cache_types,
            "default_cache": model.default_cache,
            "settings": TWIN_SETTINGS + tuple(model.twin_settings),
        },
    )
    _classes[model.twin_class] = (model, cls)
    return cls


def twin_classes() -> dict[str, type[TwinBackend]]:
    """The twin backend class of every engine model with a twin, by its Python name (``TwinLlamaCpp``)."""
    return {m.twin_class: twin_class(m) for m in engine_models().values() if m.twin_name}
