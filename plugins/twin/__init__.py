"""The digital twin: backends that answer like llama.cpp, ExLlamaV2 or vLLM on a given GPU would.

Each twin backend computes memory and speed from physics (``physics.py``) with constants
fitted to the article's measurements (``constants.toml``, ``fit.py``), and quality from
published quantization-damage data (``quality.py``). It runs the whole tuner in seconds on a
machine with no GPU, and serves as the prior of real studies: a real backend of the same
``engine`` gets its predictions.

Settings (study file, ``[backends.twin-exllamav2]`` etc.) are declared in ``TWIN_SETTINGS``
(and ``TwinVllm.settings``): simulated noise and thermal throttling for tests and drills,
llama.cpp's layer offload, the stability metric, vLLM's version.
"""

from __future__ import annotations

import functools
import random
import tomllib
from dataclasses import replace
from importlib import resources
from pathlib import Path
from typing import Any, ClassVar, Mapping, Sequence

from autotune import hookimpl
from autotune.backend import BaseBackend, DefaultLaunch, Measurement, MemoryEstimate, Param, Setting, StudyContext, \
    TrialConfig, deploy_line, same_value
from autotune.errors import AutotuneError, BackendError, ConfigError, UnsupportedError
from autotune.formats import WeightsBreakdown, normalize_format, parse_format, safetensors_dir_weights, weights_for
from autotune.gguf_file import read_gguf
from autotune.measure import Protocol, measure_engine
from autotune.metric import BaseMetric, MetricValue
from autotune.models import ModelSpec

from autotune_plugins.exllamav2 import declarations as exllamav2_declared, generator_settings as exllamav2_generator
from autotune_plugins.exllamav3 import declarations as exllamav3_declared
from autotune_plugins.exllamav3.backend import deploy_for as exllamav3_deploy
from autotune_plugins.exllamav3.generator_settings import generator_settings as exllamav3_generator
from autotune_plugins.llama_server import declarations as llama_declared
from autotune_plugins.llama_server.formats import format_of, gguf_file_weights
from autotune_plugins.llama_server.engine_defaults import DEFAULT_SLOTS, ENGINE_DEFAULTS
from autotune_plugins.openai_server import declarations as vllm_declared
from autotune_plugins.twin import calibration, physics, quality, service, traffic
from autotune_plugins.twin.formats import ARTIFACT_WORDS, artifact_kind, directory_as_format
from autotune_plugins.twin.clock import SimulatedClock
from autotune_plugins.twin.settings import TWIN_SETTINGS, UNITS, card_share, layers_problem
from autotune_plugins.twin.strategy import TwinStrategy

__all__ = ["TwinLlamaCpp", "TwinExllamaV2", "TwinExllamaV3", "TwinVllm", "TwinMmlu", "load_constants"]


@functools.lru_cache(maxsize=1)
def _constants_doc() -> dict[str, Any]:
    return tomllib.loads(resources.files(__package__).joinpath("constants.toml").read_text(encoding="utf-8"))


def load_constants(doc: Mapping[str, Any] | None = None) -> tuple[dict[str, physics.EngineConstants], physics.HostConstants, float]:
    """Engine constants by engine, host constants, and MMLU points per unit KLD at 8B."""
    doc = doc or _constants_doc()
    engines = {name: physics.EngineConstants(**values) for name, values in doc["engines"].items()}
    for name, k in engines.items():
        if k.memory_model not in physics.MEMORY_MODELS:
            raise ConfigError(f"plugins/twin/constants.toml: [engines.\"{name}\"] memory_model = {k.memory_model!r}: "
                              f"accepted: {', '.join(map(repr, physics.MEMORY_MODELS))}")
    return engines, physics.HostConstants(**doc["host"]), float(doc["quality"]["points_per_kld_8b"])


def _kept(space: Mapping[str, Sequence[Any]], name: str, accepted: tuple[Any, ...]) -> tuple[Any, ...]:
    """The study's values of ``name`` that are in ``accepted``, as given and in its order
    (all of ``accepted`` when the study does not name the option)."""
    if name not in space:
        return accepted
    kept: list[Any] = []
    for value in space[name]:
        if any(same_value(value, a) for a in accepted) and not any(same_value(value, k) for k in kept):
            kept.append(value)
    return tuple(kept)


class TwinBackend(BaseBackend):
    """Common machinery of the three twin backends."""

    settings: ClassVar[tuple[Setting, ...]] = TWIN_SETTINGS
    #: Launches of each configuration in this process (a key's n-th launch draws the n-th noise).
    _launches: ClassVar[dict[str, int]] = {}
    #: The artifacts on disk the engine loads (keys of ``ARTIFACT_WORDS``).
    artifacts: ClassVar[tuple[str, ...]] = ()
    cache_types: ClassVar[tuple[str, ...]] = ()
    default_cache: ClassVar[str] = ""

    # ------------------------------------------------------------------ space and rules

    @property
    def weight_families(self) -> tuple[str, ...]:
        """The format families the engine loads: those its twin declares (``weight_formats``)."""
        return tuple(f.name for f in self.weight_formats)

    def parameters(self, space: Mapping[str, Sequence[Any]]) -> list[Param]:
        """``cache_type`` and ``flash_attn``: the study's values this engine has, as given; an
        option whose values are all foreign comes back without choices (the core reports it)."""
        return [
            Param("cache_type", _kept(space, "cache_type", self.cache_types),
                  f"KV-cache type ({', '.join(self.cache_types)})", accepted=self.cache_types),
            Param("flash_attn", _kept(space, "flash_attn", (True, False)), "fused attention kernels",
                  accepted=(True, False)),
        ]

    def as_format(self, weights: str, ctx: StudyContext) -> str:
        """A weights reference as the twin's models read it: a format as given; a GGUF file as the
        format its header names; a model directory as its EXL2 bits per weight (``exl2:4.0``) or,
        unquantized, as the unquantized format of its element type (``gguf:BF16``); so the twin
        predicts for what a real study names.

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
            return directory_as_format(path)
        spec = format_of(read_gguf(path))
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
            return gguf_file_weights(path)
        # A directory does not say where the embedding goes; the engine does (ExLlamaV2 keeps it
        # on the host, and loads it again as the head of a tied model without lm_head tensors).
        return replace(safetensors_dir_weights(path), embedding_on_gpu=not self.constants().keeps_embeddings_on_host)

    def check_weights(self, weights: str, ctx: StudyContext) -> str | None:
        path = self.weights_file(weights, ctx)
        try:
            if path is not None:
                kind = artifact_kind(path)
                if kind not in self.artifacts:
                    return (f"{path}: {ARTIFACT_WORDS[kind][0]}, which {self.engine} does not load (it loads "
                            f"{' and '.join(ARTIFACT_WORDS[a][1] for a in self.artifacts)}, or a format "
                            f"{' or '.join(f.syntax for f in self.weight_formats)})")
            family, _ = parse_format(self.as_format(weights, ctx), self.weight_formats)
        except AutotuneError as exc:
            return str(exc)
        if family not in self.weight_families:
            return f"{self.engine} loads {', '.join(self.weight_families)} weights, not {family}"
        return None

    def check(self, config: TrialConfig, ctx: StudyContext) -> list[str]:
        problem = self.check_weights(config.weights, ctx)
        return [problem] if problem else []

    # ------------------------------------------------------------------ physics

    def constants(self) -> physics.EngineConstants:
        return load_constants()[0][self.engine]

    def scenario(self, config: TrialConfig, ctx: StudyContext) -> physics.Scenario:
        gpu_layers = self.setting(ctx, "gpu_layers")
        return physics.Scenario(
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

    def calibrated_constants(self, ctx: StudyContext) -> physics.EngineConstants:
        """The published constants, with a study's calibration (``ctx.calibration``) applied
        when it was fitted for this engine on this card."""
        k = self.constants()
        cal = ctx.calibration
        if not cal or cal.get("engine") != self.engine or cal.get("gpu") != ctx.gpu.key:
            return k
        return replace(k, **{f: float(v) for f, v in cal.get("after", {}).items() if f in calibration.CALIBRATED_FIELDS})

    def estimate_memory(self, config: TrialConfig, ctx: StudyContext) -> MemoryEstimate:
        return physics.memory(self.scenario(config, ctx), self.constants())

    def predict(self, config: TrialConfig, ctx: StudyContext) -> Mapping[str, float] | None:
        try:
            self.refuse(config, ctx)
        except UnsupportedError:
            return None
        _, host, _ = load_constants()
        scenario, k = self.scenario(config, ctx), self.calibrated_constants(ctx)
        out = physics.predict(scenario, k, host).as_dict()
        if ctx.workload.shaped or ctx.workload.slo:  # the requests one by one (traffic.py): their latencies
            out.update(traffic.predicted_metrics(scenario, k, host, ctx.workload, out["aggregate_tok_s"]))
        return out

    def calibrate(self, measured: Sequence[tuple[TrialConfig, Mapping[str, float]]],
                  ctx: StudyContext) -> Mapping[str, Any] | None:
        """The speed constants refit to a real study's measurements (``calibration.fit``),
        always from the published ones: the stored result is a function of the trials alone."""
        observations = []
        for config, metrics in measured:
            try:
                self.refuse(config, ctx)
                observations.append((self.scenario(config, ctx), metrics))
            except AutotuneError:
                continue  # weights it cannot read, an option it refuses: no say on that trial
        if not observations:
            return None
        _, host, _ = load_constants()
        _, report = calibration.fit(self.constants(), host, observations)
        return {"engine": self.engine, "gpu": ctx.gpu.key, **report}

    def refuse(self, config: TrialConfig, ctx: StudyContext) -> None:
        """Raise the engine's own error for a card or option it does not support."""

    def attention_path(self, config: TrialConfig, ctx: StudyContext) -> str:
        return "fused" if config.option("flash_attn", True) else "unfused"

    def load_failure(self, config: TrialConfig, ctx: StudyContext, mem: MemoryEstimate) -> None:
        """Raise what the engine prints when the configuration does not fit the card."""
        if mem.total_bytes > ctx.gpu.vram_bytes:
            raise BackendError(
                f"CUDA out of memory: needs {mem.total_bytes / 2**30:.2f} GiB, "
                f"card has {ctx.gpu.vram_bytes / 2**30:.2f} GiB"
            )

    # ------------------------------------------------------------------ run

    def repeats_exactly(self, ctx: StudyContext) -> bool:
        """Without simulated noise a launch draws nothing: the same configuration predicts the same
        figures every time (throttling included: each launch starts its own clock)."""
        return not float(self.setting(ctx, "noise"))

    def run(self, config: TrialConfig, ctx: StudyContext) -> Measurement:
        self.refuse(config, ctx)
        scenario = self.scenario(config, ctx)
        k = self.constants()
        _, host, _ = load_constants()
        mem = physics.memory(scenario, k)
        self.load_failure(config, ctx, mem)
        p = physics.predict(scenario, k, host)
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
            out.update(traffic.run_metrics(traffic.scaled(run, speed), wl, out["aggregate_tok_s"],
                                           None if offered is None else offered * speed))
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


class TwinLlamaCpp(TwinBackend):
    name = "twin-llama.cpp"
    engine = "llama.cpp"
    artifacts = ("gguf",)
    # The engine's own tables (the real backends' declarations): its cache types and formats are
    # known to the core with the twin alone installed.
    kv_cache_types = llama_declared.CACHE_TYPES
    weight_formats = (llama_declared.GGUF,)
    cache_types = ("f16", "q8_0", "q4_0")
    default_cache = "f16"
    description = "digital twin of llama.cpp's llama-server (physics, no GPU needed)"

    def parameters(self, space: Mapping[str, Sequence[Any]]) -> list[Param]:
        """The common options, and the placement llama-server searches when the study names it:
        ``gpu_layers`` (-ngl: a count, or "all"), ``n_cpu_moe`` (--n-cpu-moe) and ``ubatch`` (-ub)."""
        params = super().parameters(space)
        if "gpu_layers" in space:
            layers = tuple(v for v in space["gpu_layers"] if v == "all" or (type(v) is int and v >= 0))
            params.append(Param("gpu_layers", layers, "layers on the GPU (-ngl; the output head counts as one)",
                                accepted=('"all"', "any integer >= 0")))
        if "n_cpu_moe" in space:
            moe = tuple(v for v in space["n_cpu_moe"] if type(v) is int and v >= 0)
            params.append(Param("n_cpu_moe", moe, "layers whose experts stay in host memory (--n-cpu-moe)",
                                accepted=("any integer >= 0",)))
        if "ubatch" in space:
            ub = tuple(v for v in space["ubatch"] if type(v) is int and v > 0)
            params.append(Param("ubatch", ub, "physical batch size (-ub)", accepted=("any integer >= 1",)))
        return params

    def scenario(self, config: TrialConfig, ctx: StudyContext) -> physics.Scenario:
        """The common scenario with llama.cpp's placement: the trial's ``gpu_layers`` (else the
        setting), ``n_cpu_moe`` (else 0), ``ubatch`` (else llama-server's default) and the
        ``host_threads`` setting."""
        layers = config.option("gpu_layers")
        threads = self.setting(ctx, "host_threads")
        return replace(super().scenario(config, ctx),
                       gpu_layers=self.setting(ctx, "gpu_layers") if layers is None else layers,
                       n_cpu_moe=int(config.option("n_cpu_moe", 0)),
                       ubatch=int(config.option("ubatch", physics.LLAMA_UBATCH)),
                       host_threads=None if threads is None else int(threads))

    def check(self, config: TrialConfig, ctx: StudyContext) -> list[str]:
        reasons = super().check(config, ctx)
        layers, moe = config.option("gpu_layers"), config.option("n_cpu_moe", 0)
        if layers is not None and layers_problem(layers) is not None or layers == "auto":
            reasons.append(f"gpu_layers {layers!r}: accepted: \"all\" or an integer >= 0 (-ngl)")
        if type(moe) is not int or moe < 0:
            reasons.append(f"n_cpu_moe {moe!r}: accepted: an integer >= 0 (--n-cpu-moe)")
        elif moe and not ctx.model.is_moe:
            reasons.append(f"n_cpu_moe {moe}: {ctx.model.key} has no experts (a dense model ignores --n-cpu-moe)")
        ub = config.option("ubatch")
        if ub is not None and (type(ub) is not int or ub < 1):
            reasons.append(f"ubatch {ub!r}: accepted: an integer >= 1 (-ub)")
        cache = config.option("cache_type", "f16")
        if cache != "f16" and not config.option("flash_attn", True):
            # llama.cpp refuses a quantized V cache without flash attention.
            reasons.append(f"cache_type {cache}: llama.cpp needs flash_attn for a quantized V cache")
        return reasons

    def load_failure(self, config: TrialConfig, ctx: StudyContext, mem: MemoryEstimate) -> None:
        """llama.cpp does not fail: it spills layers to the CPU (recorded as host_layers)."""

    def default_launch(self, weights: str, ctx: StudyContext) -> DefaultLaunch | None:
        """The real llama-server's default launch (its ``default_launch`` says where each default
        comes from): the model's trained context in one pool of 4 slots, f16 cache, flash attention
        on (``-fa auto`` where the card has it). llama.cpp's ``--fit`` would shrink that context to
        fit the card; the twin does not model it and spills layers instead, as it does for every
        configuration that does not fit."""
        config = TrialConfig(self.name, weights, max(1, ctx.model.max_context // DEFAULT_SLOTS), DEFAULT_SLOTS,
                             (("cache_type", "f16"), (ENGINE_DEFAULTS, True), ("flash_attn", True)))
        return DefaultLaunch(config, (
            f"predicted for llama-server -m only: the model's own {ctx.model.max_context} tokens in one "
            f"KV pool of {DEFAULT_SLOTS} slots (-c 0, -np auto), f16 cache, -fa auto; {DEFAULT_SLOTS} users at once"))

    def deploy_command(self, config: TrialConfig, ctx: StudyContext) -> str:
        if config.option(ENGINE_DEFAULTS):
            _, detail = parse_format(self.as_format(config.weights, ctx), self.weight_formats)
            path = self.weights_file(config.weights, ctx)
            model_file = str(path) if path is not None else f"{ctx.model.key}-{detail}.gguf"
            return deploy_line(["llama-server", "-m", model_file, "--host", "127.0.0.1", "--port", "8080"],
                               ["every other flag at llama-server's default"])
        cache = config.option("cache_type", "f16")
        fa = "on" if config.option("flash_attn", True) else "off"
        _, detail = parse_format(self.as_format(config.weights, ctx), self.weight_formats)
        path = self.weights_file(config.weights, ctx)
        model_file = str(path) if path is not None else f"{ctx.model.key}-{detail}.gguf"
        # The layers the simulation kept on the GPU, so the line serves what was simulated.
        scenario = self.scenario(config, ctx)
        on_gpu = physics.gpu_layer_split(scenario, self.constants(), physics.memory(scenario, self.constants()))
        n = ctx.model.n_layers
        setting = self.setting(ctx, "gpu_layers") if config.option("gpu_layers") is None else config.option("gpu_layers")
        # -ngl counts the output head as the last of n + 1 layers: N puts it and N - 1 layers on the GPU.
        if isinstance(setting, int) and on_gpu < n:
            ngl = setting
        else:
            ngl = on_gpu + 1 if on_gpu < n else max(99, n + 1)  # all of them, the output layer too
        notes = [f"-c is ctx {config.ctx} x {config.parallel} slots"]
        if on_gpu < n:
            notes.append(f"{n - on_gpu} of {n} layers run on the CPU")
        placement: list[Any] = []
        if scenario.n_cpu_moe:
            placement += ["--n-cpu-moe", scenario.n_cpu_moe]
            notes.append(f"the experts of the first {min(scenario.n_cpu_moe, n)} layers stay in host memory")
        if config.option("ubatch") is not None:
            placement += ["-ub", scenario.ubatch]
        return deploy_line(["llama-server", "-m", model_file, "-c", config.ctx * config.parallel, "-np", config.parallel,
                            "-ngl", ngl, *placement, "-fa", fa, "-ctk", cache, "-ctv", cache, "--host", "127.0.0.1",
                            "--port", "8080"], notes)

    def engine_version(self) -> str:
        return "twin"



class TwinExllamaV2(TwinBackend):
    name = "twin-exllamav2"
    engine = "exllamav2"
    artifacts = ("exl2",)
    kv_cache_types = exllamav2_declared.CACHE_TYPES
    weight_formats = (exllamav2_declared.EXL2,)
    cache_types = ("fp16", "q8", "q6", "q4")
    default_cache = "fp16"
    description = "digital twin of ExLlamaV2's dynamic generator (physics, no GPU needed)"
    # The real backend's two settings for concurrency, with its names and meanings.
    settings = TWIN_SETTINGS + (
        Setting("paged", (str, bool), "auto", "paged attention for concurrent jobs: \"auto\" (where flash-attn 2 "
                "runs: sm_80 and later), true or false", choices=("auto", True, False)),
        Setting("unpaged_parallel", str, "queue", "how parallel > 1 runs without paged attention: \"queue\" "
                "(one job at a time, as TabbyAPI serves them) or \"batched\" (offline batched passes)",
                choices=exllamav2_generator.UNPAGED_CHOICES),
    )

    def generator(self, config: TrialConfig, ctx: StudyContext) -> exllamav2_generator.GeneratorSettings:
        """The real backend's generator for this trial on this card (:func:`service.exllamav2_settings`)."""
        return service.exllamav2_settings(ctx.gpu, config.option("cache_type", "fp16"), config.ctx, config.parallel,
                                          self.setting(ctx, "paged"), self.setting(ctx, "unpaged_parallel"))

    def scenario(self, config: TrialConfig, ctx: StudyContext) -> physics.Scenario:
        return replace(super().scenario(config, ctx), jobs_at_once=self.generator(config, ctx).jobs_at_once)

    def attention_path(self, config: TrialConfig, ctx: StudyContext) -> str:
        if not config.option("flash_attn", True):
            return "matmul"
        # flash-attn 2 needs sm_80; before that ExLlamaV2 falls back to SDPA/xformers, which
        # is still fused (no scores over the allocated cache).
        return "flash_attn" if ctx.gpu.compute_capability_tuple >= service.FLASH_ATTN2_MIN_CC else "sdpa"

    def default_launch(self, weights: str, ctx: StudyContext) -> DefaultLaunch | None:
        """ExLlamaV2's defaults, as the real backend's ``default_launch``: an FP16 cache of the
        model's own context, one sequence."""
        config = TrialConfig(self.name, weights, ctx.model.max_context, 1,
                             (("cache_type", "fp16"), ("flash_attn", True)))
        return DefaultLaunch(config, (
            f"predicted for ExLlamaV2's defaults: FP16 cache of the model's own {ctx.model.max_context} tokens "
            "(max_seq_len from config.json), one sequence at a time; one user"))

    def deploy_command(self, config: TrialConfig, ctx: StudyContext) -> str:
        _, bpw = parse_format(self.as_format(config.weights, ctx), self.weight_formats)
        path = self.weights_file(config.weights, ctx) or Path("models") / f"{ctx.model.key}-exl2-{bpw}bpw"
        generator = self.generator(config, ctx)
        alone = None
        if generator.mode == "batched":  # no server gives this: say what the one that exists gives
            one = self.predict(replace(config, parallel=1), ctx)
            alone = None if one is None else (one["decode_tok_s"], one["aggregate_tok_s"])
        return service.exllamav2_deploy(generator, path, ctx.gpu, served_alone=alone)

    def engine_version(self) -> str:
        return "twin"


class TwinExllamaV3(TwinBackend):
    """exllamav3 (EXL3 weights, paged cache, continuous batching): its memory is the exllamav3
    backend's own model; its speed the physics with the trellis decode cost (docs/twin.md)."""

    name = "twin-exllamav3"
    engine = "exllamav3"
    artifacts = ("exl3",)
    kv_cache_types = exllamav3_declared.CACHE_TYPES
    weight_formats = (exllamav3_declared.EXL3,)
    cache_types = tuple(c.name for c in exllamav3_declared.CACHE_TYPES)
    default_cache = "fp16"
    description = "digital twin of exllamav3's paged generator (physics, no GPU needed)"

    def parameters(self, space: Mapping[str, Sequence[Any]]) -> list[Param]:
        """``cache_type`` only: exllamav3 attends with its own Triton kernels, fused always."""
        offered = ("fp16", "k8v8", "k6v6", "k4v4") if "cache_type" not in space else self.cache_types
        return [Param("cache_type", _kept(space, "cache_type", offered),
                      "KV-cache type: fp16 or k<K>v<V>, K and V bits 2-8", accepted=self.cache_types)]

    def scenario(self, config: TrialConfig, ctx: StudyContext) -> physics.Scenario:
        # Paged: every job of the trial holds its pages at once and decodes in the same steps.
        settings = exllamav3_generator(config.option("cache_type", "fp16"), config.ctx, config.parallel)
        return replace(super().scenario(config, ctx), flash_attn=True, jobs_at_once=settings.jobs_at_once)

    def attention_path(self, config: TrialConfig, ctx: StudyContext) -> str:
        return "paged"

    def deploy_command(self, config: TrialConfig, ctx: StudyContext) -> str:
        """The exllamav3 backend's own TabbyAPI line for the generator predicted."""
        _, bpw = parse_format(self.as_format(config.weights, ctx), self.weight_formats)
        path = self.weights_file(config.weights, ctx) or Path("models") / f"{ctx.model.key}-exl3-{bpw}bpw"
        settings = exllamav3_generator(config.option("cache_type", "fp16"), config.ctx, config.parallel)
        return exllamav3_deploy(settings, path, config.parallel, found="predicted")

    def engine_version(self) -> str:
        return "twin"


class TwinVllm(TwinBackend):
    name = "twin-vllm"
    engine = "vllm"
    artifacts = ("hf", "gguf")
    kv_cache_types = vllm_declared.CACHE_TYPES
    weight_formats = (llama_declared.GGUF,)
    cache_types = ("auto", "fp8")
    default_cache = "auto"
    description = "digital twin of vLLM (physics, no GPU needed); refuses Volta as recent vLLM does"
    settings = TWIN_SETTINGS + (
        Setting("version", str, "0.11", "the vLLM release to answer like (0.6 and later refuse Volta)"),
        Setting("gpu_memory_utilization", float, physics.VLLM_GPU_MEMORY_UTILIZATION,
                "the share of the card vLLM reserves (--gpu-memory-utilization): its memory footprint",
                check=card_share),)

    def scenario(self, config: TrialConfig, ctx: StudyContext) -> physics.Scenario:
        return replace(super().scenario(config, ctx),
                       gpu_memory_utilization=float(self.setting(ctx, "gpu_memory_utilization")))

    def load_failure(self, config: TrialConfig, ctx: StudyContext, mem: MemoryEstimate) -> None:
        """vLLM fails at start-up when weights, runtime and the KV of ``ctx x parallel`` tokens
        exceed its share of the card (``physics.vllm_memory`` then estimates more than the share)."""
        share = float(self.setting(ctx, "gpu_memory_utilization"))
        if mem.total_bytes > int(share * ctx.gpu.vram_bytes):
            raise BackendError(
                f"ValueError: needs {mem.total_bytes / 2**30:.2f} GiB, more than gpu_memory_utilization "
                f"{share:g} of the card ({share * ctx.gpu.vram_bytes / 2**30:.2f} GiB): try increasing "
                "`gpu_memory_utilization` or decreasing `max_model_len` (vLLM's advice)")

    def refuse(self, config: TrialConfig, ctx: StudyContext) -> None:
        cc = ctx.gpu.compute_capability_tuple
        version = str(self.setting(ctx, "version"))
        if cc < (7, 0) or (cc < (7, 5) and _version_tuple(version) >= (0, 6)):
            raise UnsupportedError(
                f"vLLM {version} does not support compute capability {ctx.gpu.compute_capability} "
                f"({ctx.gpu.name}); the last releases for Volta are 0.5.x with CUDA 11.8"
            )
        if normalize_format(self.as_format(config.weights, ctx), self.weight_formats) == "gguf:BF16" and not ctx.gpu.bf16:
            # The article's pitfall 2: BF16 weights on a card without BF16 (vLLM's own words).
            raise UnsupportedError(
                f"Bfloat16 is only supported on GPUs with compute capability of at least 8.0. Your "
                f"{ctx.gpu.name} GPU has compute capability {ctx.gpu.compute_capability}. You can use "
                "float16 instead by explicitly setting the `dtype` flag in CLI, for example: --dtype=half."
            )
        if config.option("flash_attn", True) and cc < service.FLASH_ATTN2_MIN_CC:
            raise UnsupportedError("Cannot use FlashAttention-2 backend for Volta and Turing GPUs.")
        if config.option("cache_type", "auto").startswith("fp8") and cc < (8, 9):
            raise UnsupportedError(f"fp8 KV cache needs compute capability 8.9, {ctx.gpu.name} has {ctx.gpu.compute_capability}")

    def deploy_command(self, config: TrialConfig, ctx: StudyContext) -> str:
        model = self.weights_file(config.weights, ctx) or ctx.model.key
        return deploy_line(["vllm", "serve", model, "--max-model-len", config.ctx, "--max-num-seqs", config.parallel,
                            "--kv-cache-dtype", config.option("cache_type", "auto"), "--dtype", "half",
                            "--gpu-memory-utilization", f"{float(self.setting(ctx, 'gpu_memory_utilization')):g}"])

    def engine_version(self) -> str:
        return "twin"


def _version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split(".") if p.isdigit())


class TwinMmlu(BaseMetric):
    """Predicted MMLU accuracy relative to the FP16 model (1.0 = nothing lost)."""

    name = "twin-mmlu"
    unit = "accuracy"
    higher_is_better = True
    description = "predicted MMLU accuracy vs FP16 from published quantization damage (twin backends only)"

    def value_text(self, value: float) -> str:
        return f"predicted MMLU accuracy {value:.2%} of FP16's"

    def supports(self, backend: BaseBackend) -> str | None:
        if not isinstance(backend, TwinBackend):
            return "the twin predicts quality for its own backends only; use a measured metric (mmlu, ceval, kld)"
        return None

    def covers(self, model: ModelSpec) -> str | None:
        return quality.uncovered(model)

    def evaluate(self, config: TrialConfig, backend: BaseBackend, ctx: StudyContext) -> MetricValue:
        _, _, ppk = load_constants()
        weights = backend.as_format(config.weights, ctx) if isinstance(backend, TwinBackend) else config.weights
        drop = quality.drop_points(ctx.model, weights, config.option("cache_type", "f16"), ppk)
        return MetricValue(value=1.0 - drop / 100.0, stderr=None, n=None, seconds=0.0,
                           details={"predicted_drop_points_vs_fp16": drop})


@hookimpl
def register_backends(register):
    for cls in (TwinLlamaCpp, TwinExllamaV2, TwinExllamaV3, TwinVllm):
        register(cls())


@hookimpl
def register_metrics(register):
    register(TwinMmlu())


@hookimpl
def register_strategies(register):
    register(TwinStrategy())
