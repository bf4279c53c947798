"""example-echo: a toy serving backend, the template for autotune backend plugins.

The toy engine "serves" a model of the study's shape scaled down ``scale`` times, on the CPU.
It answers a prompt by echoing its words, and per token it does the memory traffic a decoder
does: it reads every weight byte once (a SHA-256 over the weights buffer, which releases the
GIL, so parallel streams really overlap) and then the stream's KV cache so far. Its speed thus
really depends on the weights format and the number of parallel streams (ctx and the KV-cache
type change its memory far more than its speed, as in a real engine at short contexts), and
every figure it reports is measured on the wall clock with ``autotune.measure``.

Settings (study file, ``[backends.example-echo]``):
    scale: how many times smaller than the real model the toy's buffers are (default 4096).
    timeout_s: limit for one set of concurrent streams (default 60).
"""

from __future__ import annotations

import hashlib
import platform
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from fractions import Fraction

import click

# A plugin imports autotune.api only: the names a backend, engine model, metric or strategy needs.
from autotune.api import (
    AutotuneError,
    BackendError,
    BaseBackend,
    CacheType,
    EngineModel,
    Measurement,
    MeasurementError,
    MemoryEstimate,
    ModelSpec,
    Param,
    Setting,
    StreamResult,
    StudyContext,
    bits_per_weight,
    deploy_line,
    hookimpl,
    measure_engine,
    parse_format,
    resolve_model,
    serving_run,
    weight_format,
)


def weight_formats():
    """The weight formats the toy loads: GGUF files, as the engine model that declares them does
    (how a `gguf:<TYPE>` is written, its bits per weight, its predicted size), looked up when
    needed. A backend of a format no installed plugin declares writes its own WeightFormats
    (docs/plugins.md)."""
    return (weight_format("gguf"),)


__version__ = "0.1.0"

# The engine's KV-cache types, declared as data: the core sizes caches and compares engines'
# caches (by bits) with these; q8_0 is 32 int8 + one f16 scale per block.
CACHE_TYPES = (
    CacheType("f16", "example-echo", Fraction(2), "ToyEngine: a half per element", 16),
    CacheType("q8_0", "example-echo", Fraction(34, 32), "ToyEngine: 32 int8 + one f16 scale per 32", 8),
)
CACHE_BYTES = {ct.name: float(ct.bytes_per_element) for ct in CACHE_TYPES}  # bytes per element
PREFILL_BATCH = 64  # prompt tokens per pass over the weights: prefill is batched, decode is not
OVERHEAD_BYTES = 300 * 2**20  # what a CUDA context costs an engine; a guess, fit yours to measurements


class ToyEngine:
    """The model's weights and KV cache, ``scale`` times smaller, and a token loop over them."""

    def __init__(self, model: ModelSpec, weights: str, cache_type: str, scale: int):
        self.weights = bytes(int(model.n_params * bits_per_weight(weights, declared=weight_formats()) / 8 / scale))
        self.kv_bytes_per_token = max(1, round(kv_bytes_per_token(model, cache_type) / scale))
        self.log = [f"loaded {len(self.weights)} weight bytes (1/{scale} of {model.key} {weights})"]

    def generate(self, prompt: list[str], n_tokens: int):
        """Yield ``n_tokens`` words of ``prompt``, each after one decode step."""
        kv = bytearray(len(prompt) * self.kv_bytes_per_token)
        for _ in range(0, len(prompt), PREFILL_BATCH):
            hashlib.sha256(self.weights)
        for _ in range(n_tokens):
            step = hashlib.sha256(self.weights)
            step.update(kv)  # attention reads the whole cache so far
            kv += bytes(self.kv_bytes_per_token)
            yield prompt[step.digest()[0] % len(prompt)]


def kv_bytes_per_token(model: ModelSpec, cache_type: str) -> float:
    """K and V of every layer for one token."""
    return 2 * model.n_layers * model.n_kv_heads * model.head_dim * CACHE_BYTES[cache_type]


class EchoBackend(BaseBackend):
    name = "example-echo"
    engine = "example-echo"
    description = "toy CPU engine from the example plugin: echoes prompts, speed measured for real"
    kv_cache_types = CACHE_TYPES
    # Declared settings are checked before a study runs: a typo or a bad value is exit 2.
    settings = (
        Setting(
            "timeout_s",
            float,
            60.0,
            "seconds one measurement may take",
            check=lambda v: None if v > 0 else "must be > 0",
        ),
        Setting(
            "scale",
            int,
            4096,
            "the toy allocates 1/scale of the predicted weights and KV",
            check=lambda v: None if v >= 1 else "must be >= 1",
        ),
    )

    @property
    def weight_formats(self):
        return weight_formats()

    def parameters(self, space):
        """The engine model's space: the backend and its twin search the same one."""
        return ECHO.parameters(space)

    def check_weights(self, weights, ctx):
        family = weights.partition(":")[0].lower()
        if family != "gguf":
            return f"example-echo loads gguf weights, not {family}"
        try:
            parse_format(weights, self.weight_formats)  # a variant GGUF has, or what it accepts
        except AutotuneError as exc:
            return str(exc)
        return None

    def check(self, config, ctx):
        return ECHO.rules(config, ctx)

    def estimate_memory(self, config, ctx):
        model = ctx.model
        weights = int(model.n_params * bits_per_weight(config.weights, declared=self.weight_formats) / 8)
        kv = int(kv_bytes_per_token(model, config.option("cache_type", "f16")) * config.ctx * config.parallel)
        logits = 4 * model.vocab_size * PREFILL_BATCH  # f32 logits of one prefill batch
        return MemoryEstimate(
            weights,
            kv,
            logits,
            OVERHEAD_BYTES,
            notes=(f"the toy allocates weights and KV 1/{_scale(ctx)} of this, in host memory",),
        )

    def run(self, config, ctx):
        try:
            engine = ToyEngine(ctx.model, config.weights, config.option("cache_type", "f16"), _scale(ctx))
        except MemoryError as exc:
            raise BackendError(f"example-echo: out of host memory loading {config.weights}") from exc
        prompt = [f"w{i}" for i in range(ctx.workload.prompt_tokens)]
        timeout_s = float(self.setting(ctx, "timeout_s"))

        def stream(_index: int) -> StreamResult:
            start = time.monotonic()
            tokens = engine.generate(prompt, ctx.workload.output_tokens)
            next(tokens)
            first = time.monotonic()
            for _ in tokens:
                pass
            return StreamResult.from_timestamps(len(prompt), ctx.workload.output_tokens, start, first, time.monotonic())

        def around_streams(streams):
            together = streams()
            engine.log.append(f"{config.parallel} streams: {together.aggregate_tok_s:.0f} tok/s in all")
            return together

        try:
            # The core's loop: one request alone, then `parallel` at once, as often as the
            # study's protocol asks, stopped early by its probe. A backend writes no loop.
            stats, _, _ = measure_engine(
                ctx, serving_run(stream, stream, config.parallel, timeout_s, around_streams=around_streams)
            )
        except MeasurementError as exc:
            raise BackendError(f"example-echo: {exc}", log_tail="\n".join(engine.log[-20:])) from exc
        return Measurement(metrics=stats, attrs={"scale": _scale(ctx), "weights_buffer_bytes": len(engine.weights)})

    def deploy_command(self, config, ctx):
        return (
            f"autotune example-echo-serve --model {ctx.model.key} --weights {config.weights} "
            f"--ctx {config.ctx} --parallel {config.parallel} "
            f"--cache-type {config.option('cache_type', 'f16')} --scale {_scale(ctx)}"
        )

    def engine_build(self, ctx=None):
        return f"example-echo {__version__} (Python {platform.python_version()})"


def _scale(ctx: StudyContext) -> int:
    return int(EchoBackend().setting(ctx, "scale"))


class EchoModel(EngineModel):
    """The toy engine as an engine model: its space, its rule and its memory model, written once
    for the backend above and for the twin, which simulates it from this declaration alone
    (``twin-example-echo``; docs/plugins.md, "Adding an engine with its twin")."""

    name = "example-echo"
    kv_cache_types = CACHE_TYPES
    cache_types = tuple(CACHE_BYTES)
    default_cache = "f16"
    twin_name = "twin-example-echo"
    twin_class = "TwinExampleEcho"
    twin_description = "digital twin of the example plugin's toy engine (physics, no GPU needed)"
    artifacts = ("gguf",)

    @property
    def weight_formats(self):
        return weight_formats()

    def constants(self):
        # The twin's physics constants (autotune_plugins.shared.scenario.EngineConstants): a real
        # engine keeps them in a TOML beside its engine model (constants_file) and fits them to
        # measurements; the toy's are round guesses.
        return {
            "weight_bw_efficiency": 0.5,
            "layer_us_ghz": 50.0,
            "sample_ns_per_vocab": 0.0,
            "request_ms": 1.0,
            "spill_step_ms": 0.0,
            "volta_bw_factor": 1.0,
            "vector_max_batch": 8,
            "unfused_attn_per_layer_us": 0.0,
            "unfused_kv_copies": 0.0,
            "quant_cache_extra_bytes": 0.0,
            "decode_compute_efficiency": 0.5,
            "prefill_efficiency": 0.3,
            "context_bytes": OVERHEAD_BYTES,
            "keeps_embeddings_on_host": False,
            "spill": "oom",
        }

    def parameters(self, space):
        # Keep the cache types this engine knows, exactly as given (the core refuses a value no
        # backend takes); when the study does not search cache types, search both.
        caches = self.kept(space, "cache_type", tuple(CACHE_BYTES))
        return [Param("cache_type", caches, "KV-cache element type (f16, q8_0)", accepted=tuple(CACHE_BYTES))]

    def rules(self, config, ctx, model=None):
        model = model or ctx.model
        if config.ctx > model.max_context:
            return [f"ctx {config.ctx} is beyond {model.key}'s trained context of {model.max_context}"]
        return []

    def memory(self, s, k):
        kv = int(kv_bytes_per_token(s.model, s.cache_type) * s.ctx * s.parallel)
        return MemoryEstimate(
            int(s.weights.total_bytes), kv, 4 * s.model.vocab_size * PREFILL_BATCH, int(k.context_bytes)
        )

    def deploy_command(self, twin, config, ctx):
        return deploy_line(["autotune", "example-echo-serve", "--model", ctx.model.key, "--weights", config.weights])


ECHO = EchoModel()


@hookimpl
def register_backends(register):
    register(EchoBackend())


@hookimpl
def register_engine_models(register):
    register(ECHO)


@hookimpl
def register_commands(cli):
    @cli.command("example-echo-serve")
    @click.option("--model", "model_ref", required=True, help="Catalog model key or model file.")
    @click.option("--weights", required=True, help="gguf:<TYPE>")
    @click.option("--ctx", "ctx_tokens", type=click.IntRange(min=2), required=True, help="Context per sequence.")
    @click.option("--parallel", type=click.IntRange(min=1), default=1, show_default=True)
    @click.option("--cache-type", type=click.Choice(sorted(CACHE_BYTES)), default="f16", show_default=True)
    @click.option("--scale", type=click.IntRange(min=1), default=4096, show_default=True)
    @click.option("--max-tokens", type=click.IntRange(min=1), default=16, show_default=True)
    def serve(model_ref, weights, ctx_tokens, parallel, cache_type, scale, max_tokens):
        """Serve the example-echo toy engine: one prompt per stdin line, one answer per line."""
        problem = EchoBackend().check_weights(weights, None)
        if problem:
            raise click.BadParameter(problem, param_hint="--weights")
        try:
            engine = ToyEngine(resolve_model(model_ref), weights, cache_type, scale)
        except AutotuneError as exc:
            raise click.ClickException(str(exc)) from None
        n_out = min(max_tokens, ctx_tokens - 1)

        def answer(line: str) -> str:
            prompt = line.split()[: ctx_tokens - n_out] or ["..."]
            return " ".join(engine.generate(prompt, n_out))

        with ThreadPoolExecutor(parallel) as pool:  # `parallel` slots, as the study measured
            for text in pool.map(answer, sys.stdin):
                click.echo(text)
