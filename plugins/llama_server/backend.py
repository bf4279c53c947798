"""The real llama.cpp backend: launch ``llama-server`` on a GGUF file, measure it, tear it down.

A trial's lifecycle (see :mod:`autotune.engine.backend`):

* weights are GGUF file paths, relative to the study file's directory, or formats
  (``gguf:Q4_K_M``) made from the study's ``[model] source`` when a trial first needs them
  (:mod:`autotune.modelfiles.artifacts`, recipes in :mod:`~autotune_plugins.llama_server.recipes`);
* ``check`` refuses what llama.cpp refuses (a quantized V cache without flash attention, a
  quantized cache whose block does not divide the head size, a context beyond the model's) or
  would ignore or clamp (``n_cpu_moe`` on a dense model or beyond the layers, ``gpu_layers``
  beyond the layers + 1, ``ubatch`` above ``batch``);
* ``[space]`` may name ``gpu_layers``, ``n_cpu_moe``, ``ubatch`` and ``batch`` (-ngl,
  --n-cpu-moe, -ub, -b): a model too large for the card, split between it and host memory; a
  space without them launches as before;
* ``estimate_memory`` reads the file's real tensor bytes and adds llama-server's KV layout,
  compute buffer and CUDA context (:mod:`~autotune_plugins.llama_server.memory`);
* ``run`` starts ``llama-server`` in its own process session with the argument list
  ``server_argv`` builds (the same one ``deploy_command`` prints), waits for ``/health``, warms
  up, then measures one stream (the server's own timings) and ``parallel`` simultaneous
  streams (client timestamps) through the core's loop, :func:`autotune.measure.measure_engine`. The server
  is always stopped, also when autotune itself is interrupted (``atexit`` and ``SIGTERM``).

What a trial keeps beside its metrics (``Measurement.attrs``): the command, with the setting
``startup_facts`` the buffers the engine logged at start (from a launch of their own at ``-lv 4``,
once per weights file: the measured launch runs at the default verbosity, as deployed), the engine's own
timings next to the client's (``engine_timings``, ``client_timings``), and what the load
generator cost and where it ran (``load_generator``).

Settings (study file, ``[backends.llama-server]``): :mod:`.settings`; the command line: :mod:`.server_command`.
"""

from __future__ import annotations

import contextlib
import functools
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any, ClassVar, Mapping, Sequence

from autotune._builtin import (
    PROMPT_TEXT,
    DefaultLaunch,
    EngineUnavailableError,
    UserLoad,
    artifact_path,
    cuda_visible_entry,
    engine_environment,
    fetch,
    free_port,
    is_format,
    model_from_gguf,
    normalize_format,
    path_problem,
    processes,
    prompt_of,
    tail,
    wait_ready,
    weights_for,
    has_gpu as _has_gpu,
)
from autotune.api import (
    AutotuneError,
    BackendError,
    BaseBackend,
    CacheType,
    Measurement,
    MemoryEstimate,
    ModelSpec,
    Param,
    Setting,
    StudyContext,
    TrialConfig,
    WeightFormats,
    part,
)
from autotune_plugins.llama_server import draft_memory, engine, memory, rpc, speculation, split
from autotune_plugins.llama_server import server_command, startup_facts as startup_facts_mod, trial_run
from autotune_plugins.llama_server.engine_model import LLAMA_CPP, engine_rules
from autotune_plugins.llama_server.engine_defaults import DEFAULT_SLOTS, ENGINE_DEFAULTS, FIT
from autotune_plugins.llama_server.formats import gguf_file_weights
from autotune_plugins.llama_server.parts import LlamaArtifacts, LlamaScoring, LlamaSplitting
from autotune_plugins.llama_server.server import BUILD_REMEDY, CpuPlan, Pinned, Server, parse_log, plan_cpus
from autotune_plugins.llama_server.settings import SETTINGS

__all__ = ["LlamaServerBackend", "parse_log"]

GGUF_MAGIC = b"GGUF"
KV_PAD = 256  # llama.cpp pads each sequence's cache to 256 cells

# ------------------------------------------------------------------------------ GGUF file


@functools.lru_cache(maxsize=64)
def _model_cached(path: str, mtime_ns: int, size: int) -> ModelSpec:
    return model_from_gguf(path)


def _model_of(path: Path) -> ModelSpec:
    st = path.stat()
    return _model_cached(str(path.resolve()), st.st_mtime_ns, st.st_size)


# ------------------------------------------------------------------------------ the backend


class LlamaServerBackend(BaseBackend):
    name: ClassVar[str] = "llama-server"
    engine: ClassVar[str] = "llama.cpp"
    description: ClassVar[str] = "llama.cpp's llama-server on a GGUF file, launched and measured"
    # The engine model's declarations (engine_model.py), which the twin of llama.cpp shares.
    kv_cache_types: ClassVar[tuple[CacheType, ...]] = LLAMA_CPP.kv_cache_types
    weight_formats: ClassVar[tuple[WeightFormats, ...]] = LLAMA_CPP.weight_formats
    engine_variables: ClassVar[tuple[str, ...]] = LLAMA_CPP.engine_variables
    artifacts = part(LlamaArtifacts)
    scoring = part(LlamaScoring)
    splitting = part(LlamaSplitting)
    settings: ClassVar[tuple[Setting, ...]] = SETTINGS

    def resolved_settings(self, ctx: StudyContext) -> dict[str, Any]:
        """Every declared setting with its value or default, for the engine finder and the scorer."""
        return {s.name: self.value(ctx, s.name) for s in self.settings}

    # -------------------------------------------------------------- space and rules

    def parameters(self, space: Mapping[str, Sequence[Any]]) -> list[Param]:
        """The engine model's space (:meth:`.engine_model.LlamaCppModel.parameters`), the twin's too,
        and the split across several devices (split.py) when the space names them."""
        return LLAMA_CPP.parameters(space) + split.parameters(space) + speculation.parameters(space)

    def default_launch(self, weights: str, ctx: StudyContext) -> DefaultLaunch | None:
        """``llama-server -m WEIGHTS``: every flag at llama-server's default (``DEFAULT_SLOTS``
        slots sharing the model's trained context, ``-ngl`` auto and ``--fit on`` in this build),
        what a user gets who types the model's path and nothing else (issue 39 item 5: a forced
        ``-ngl 999`` died of out-of-memory where the engine's own fitting would have run)."""
        model = self._model_for(weights, ctx)
        config = TrialConfig(
            self.name, weights, max(1, model.max_context // DEFAULT_SLOTS), DEFAULT_SLOTS, ((ENGINE_DEFAULTS, True),)
        )
        return DefaultLaunch(
            config,
            (
                f"llama-server -m only: -c 0 (the model's own {model.max_context} tokens, one KV pool "
                f"shared by {DEFAULT_SLOTS} slots: -np auto), -ngl auto{'' if self._on_gpu(ctx) else ' (-ngl 0: no GPU)'}, "
                f"-fa auto, f16 KV cache, -b 2048 -ub 512, --fit on, "
                f"threads chosen by the engine (llama.cpp's defaults: common/common.h, common/arg.cpp, "
                f"tools/server/server.cpp); measured with {DEFAULT_SLOTS} users at once"
            ),
        )

    def baselines(self, weights: str, ctx: StudyContext, user: UserLoad) -> list[DefaultLaunch]:
        """The default launch, and llama.cpp's own choice for the user's context and slots:
        ``llama-server -m WEIGHTS -c CTX*SLOTS -np SLOTS --fit on``, every other flag at the
        default (no -ngl: --fit chooses what it offloads), the bar a search for what does not fit
        the card must beat."""
        config = TrialConfig(self.name, weights, user.ctx, user.parallel, ((ENGINE_DEFAULTS, FIT),))
        offload = (
            "llama.cpp fits the layers and tensors it offloads to the card itself (-ngl unset: auto)"
            if self._on_gpu(ctx)
            else "-ngl 0 (the study has no GPU: --fit has nothing to offload)"
        )
        fit = DefaultLaunch(
            config,
            (
                f"llama-server -m, -c {user.ctx * user.parallel} -np {user.parallel} ({user.why}) and --fit on: "
                f"{offload}, -fa auto, f16 KV cache, -b 2048 -ub 512, threads chosen by the engine (llama.cpp's defaults: "
                f"common/common.h, common/arg.cpp); measured with {user.parallel} users at once"
            ),
            name=FIT,
            title="llama-server's --fit",
        )
        return [*super().baselines(weights, ctx, user), fit]

    def weights_path(self, weights: str, ctx: StudyContext) -> Path:
        """The GGUF file a candidate names: a path relative to the study file, or for a format
        (``gguf:Q4_K_M``) its place in the artifact cache, made or not yet."""
        if is_format(weights, self.weight_formats) and ctx.source is not None:
            return artifact_path(
                ctx.source, self.artifacts.recipe(normalize_format(weights, self.weight_formats), ctx.source, ctx)
            )
        return ctx.path(weights)

    def _made(self, weights: str, ctx: StudyContext) -> Path | None:
        """The file to read for ``weights``: None for a format not made yet (predict from the source)."""
        p = self.weights_path(weights, ctx)
        return None if is_format(weights, self.weight_formats) and not p.is_file() else p

    def _model_for(self, weights: str, ctx: StudyContext) -> ModelSpec:
        p = self._made(weights, ctx)
        return ctx.model if p is None else _model_of(p)

    def check_weights(self, weights: str, ctx: StudyContext) -> str | None:
        if is_format(weights, self.weight_formats):
            return None  # whether it can be made is the study's check (the artifacts part)
        p = self.weights_path(weights, ctx)
        problem = path_problem(p, "file")
        if problem:
            return f"{p}: {problem} (weights are GGUF paths relative to the study file)"
        try:
            with open(p, "rb") as f:
                magic = f.read(4)
        except OSError as exc:
            return f"{p}: cannot read ({exc})"
        if magic != GGUF_MAGIC:
            return f"{p}: not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r})"
        try:
            _model_of(p)
        except AutotuneError as exc:
            return str(exc)
        return None

    def check(self, config: TrialConfig, ctx: StudyContext) -> list[str]:
        """The weights file, then the engine model's rules (``rules.toml``) on what the file says
        of the model: the same refusals the twin of llama.cpp makes."""
        problem = self.check_weights(config.weights, ctx)
        if problem:
            return [problem]
        model = self._model_for(config.weights, ctx)
        draft = config.option("draft")
        if isinstance(draft, str) and (problem := self.check_weights(draft, ctx)):
            return [f"draft: {problem}"]
        return (
            LLAMA_CPP.rules(config, ctx, model)
            + split.check(config, ctx, model, cuda=self._on_gpu(ctx))
            + speculation.check(
                config, ctx, self._made(config.weights, ctx), lambda w: self._made(w, ctx), self.resolved_settings(ctx)
            )
        )

    # -------------------------------------------------------------- memory

    def estimate_memory(self, config: TrialConfig, ctx: StudyContext) -> MemoryEstimate:
        path = self._made(config.weights, ctx)
        ngl = self.layers_of(config, ctx, self._has_devices(ctx))
        # -ngl 0 from the setting: the estimate of a CPU run, as before the offload dimensions; a
        # configuration that names gpu_layers 0 on a GPU still has a CUDA context and buffers.
        on_gpu = self._on_gpu(ctx) and (ngl > 0 or config.option("gpu_layers") is not None)
        ub, b = config.option("ubatch"), config.option("batch")
        # A format not made yet: its tensors as llama-quantize will write them, from the source's shape.
        weights = (
            weights_for(ctx.model, config.weights, self.weight_formats) if path is None else gguf_file_weights(path)
        )
        model = ctx.model if path is None else _model_of(path)
        if split.n_devices(ctx) > 1:  # several cards or RPC devices: each one's share (split.py)
            return split.device_estimate(model, weights, config, ctx, None if ngl >= 999 else ngl, self._on_gpu(ctx))
        target = memory.estimate(
            model,
            weights,
            config.ctx,
            config.parallel,
            config.option("cache_type", "f16"),
            bool(config.option("flash_attn", True)),
            ubatch=int(ub) if ub is not None else None,
            gpu=on_gpu,
            gpu_layers=None if ngl >= 999 else ngl,
            n_cpu_moe=int(config.option("n_cpu_moe", 0)),
            batch=int(b) if b is not None else None,
        )
        return draft_memory.with_draft(target, self, config, ctx, on_gpu)

    def search_dimensions(self) -> list[Param]:
        """Every [space] key this backend takes (``autotune plugins``), the optional ones too."""
        return self.parameters(
            {k: [] for k in ("ubatch", "batch", "gpu_layers", "n_cpu_moe", *split.KEYS, *speculation.KEYS)}
        )

    def search_rules(self) -> list[str]:
        """What is refused before launching, in words (``autotune plugins``)."""
        return [r.name for r in engine_rules()] + list(split.RULES) + list(speculation.RULES)

    # -------------------------------------------------------------- the command line

    @staticmethod
    def _on_gpu(ctx: StudyContext) -> bool:
        return _has_gpu() if ctx.for_gpu is None else ctx.for_gpu

    def _has_devices(self, ctx: StudyContext) -> bool:
        """Whether layers can go anywhere but the host: a GPU, or the RPC devices of a CPU study."""
        return self._on_gpu(ctx) or split.rpc_device_count(ctx) > 0

    def gpu_layers(self, ctx: StudyContext, has_gpu: bool = True) -> int:
        if not has_gpu:
            return 0
        value = self.value(ctx, "gpu_layers")
        return 999 if value == "all" else int(value)

    def threads(self, ctx: StudyContext) -> int:
        return int(self.value(ctx, "threads") or os.cpu_count() or 1)

    def model_settings(self, ctx: StudyContext) -> dict[str, Any]:
        """The engine's threads (``-t``) for the twin that speaks for this backend: host layers and
        experts run at what those threads read, not at the whole host's bandwidth (on the H200
        offload grids, the twin without them over-predicted decode 2.7-4x)."""
        return {"host_threads": self.threads(ctx)}

    def layers_of(self, config: TrialConfig, ctx: StudyContext, has_gpu: bool = True) -> int:
        """``-ngl`` of ``config``: its ``gpu_layers`` when the space names it (as measured, so as
        deployed, also on a CPU build, which ignores it), else the setting (:meth:`gpu_layers`)."""
        value = config.option("gpu_layers")
        if value is None:
            return self.gpu_layers(ctx, has_gpu)
        return 999 if value == "all" else int(value)

    def server_argv(
        self, config: TrialConfig, ctx: StudyContext, *, binary: str, port: int, has_gpu: bool
    ) -> list[str]:
        """The one place the server's command line is built (:func:`.server_command.server_argv`)."""
        return server_command.server_argv(self, config, ctx, binary=binary, port=port, has_gpu=has_gpu)

    def deploy_command(self, config: TrialConfig, ctx: StudyContext) -> str:
        return server_command.deploy_command(self, config, ctx)

    @staticmethod
    def cuda_devices(ctx: StudyContext, has_gpu: bool) -> str | None:
        """``CUDA_VISIBLE_DEVICES`` of the server: the study's one card, as the user's own
        variable names it (so the server sees the card autotune watches, and only that one)."""
        if not has_gpu:
            return None
        return split.cuda_visible(ctx) or cuda_visible_entry(ctx.gpu_index)

    def _rpc_endpoints(self, ctx: StudyContext) -> list[str]:
        """The RPC devices of a CPU study on several devices: the running trial's, else the deploy
        line's (rpc-server's default port and the next ones, one server per device)."""
        n = split.rpc_device_count(ctx)
        running = getattr(self, "_rpc_running", None)  # set by _rpc_devices
        return list(running) if running and n else [f"{rpc.HOST}:{rpc.DEPLOY_PORT + i}" for i in range(n)]

    def binary(self, ctx: StudyContext | None = None) -> Path:
        settings = self.resolved_settings(ctx) if ctx is not None else {}
        try:
            return engine.find_llama_server(settings)
        except AutotuneError as exc:
            message = str(exc)
            if settings.get("binary"):
                message += (
                    f" ([backends.{self.name}] binary: point it at an executable llama-server, or leave it "
                    f"out and {BUILD_REMEDY})"
                )
            raise EngineUnavailableError(message) from exc

    def preflight(self, ctx: StudyContext) -> list[str]:
        """The engine binary is there, runs (``--version``) and, on a machine with a GPU, was
        built for the study's card; else the remedy."""
        try:
            binary = self.binary(ctx)
        except EngineUnavailableError as exc:
            return [str(exc)]
        synth = speculation.settings_problems(self.resolved_settings(ctx))
        if synth:
            return [f"[backends.{self.name}] {p}" for p in synth]
        try:
            _checked_version(str(binary))
        except AutotuneError as exc:
            return [f"{exc}: {BUILD_REMEDY}, or point [backends.llama-server] binary at a llama-server that runs here"]
        if split.rpc_device_count(ctx) and not rpc.binary_beside(binary).is_file():
            return [
                f"[hardware] gpus names {split.rpc_device_count(ctx)} CPU devices, which llama-server runs as RPC "
                f"devices, and {rpc.binary_beside(binary)} is missing (a build from before GGML_RPC): rebuild with "
                "`autotune engine build llama.cpp --force`"
            ]
        if self._on_gpu(ctx):
            try:
                cuda_visible_entry(ctx.gpu_index)
            except AutotuneError as exc:
                return [str(exc)]
            # A build without this card's kernels fails every trial, or quietly measures the CPU.
            why = engine.build_supports(binary, getattr(ctx.gpu, "compute_capability", None))
            if why:
                return [why]
        return []

    def engine_build(self, ctx: StudyContext | None) -> str:
        """The --version line of the binary the study runs: the configured ``binary`` where the
        study names one (not the cached build, which a study with its own binary never runs).
        Asked for every trial and by every resume's comparability check: one --version per binary."""
        try:
            binary = str(self.binary(ctx).absolute())
        except AutotuneError as exc:
            return f"unknown ({exc})"
        return self._version_of(binary)

    # -------------------------------------------------------------- run

    def launch(
        self, config: TrialConfig, ctx: StudyContext, has_gpu: bool, log_dir: Path, *, verbose: bool = False
    ) -> Server:
        """Start llama-server on ``config``: as deployed, or with ``verbose`` at the log verbosity
        that prints its buffers, for ``startup_facts``."""
        binary = self.binary(ctx)
        host = str(self.value(ctx, "host"))
        port = free_port(host)
        cmd = self.server_argv(config, ctx, binary=str(binary.absolute()), port=port, has_gpu=has_gpu)
        if verbose:
            cmd += ["-lv", str(startup_facts_mod.STARTUP_LOG_VERBOSITY)]
        # No LLAMA_ARG_*: each would set a flag the deploy line does not show.
        env = engine_environment(self.engine_variables)
        devices = self.cuda_devices(ctx, has_gpu)
        if devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = devices
        cpus = plan_cpus(self.threads(ctx), bool(self.value(ctx, "pin_cores")))
        log_path = log_dir / ("llama-server-startup.log" if verbose else "llama-server.log")
        # Started from a thread pinned to the engine's cores: the server and every thread it
        # makes inherit the mask, with no window in which they run elsewhere.
        with open(log_path, "w") as log, Pinned(cpus.engine) as pinned:
            try:
                proc = processes.start(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
            except OSError as exc:
                raise EngineUnavailableError(f"{binary}: cannot be started ({exc}): {BUILD_REMEDY}") from exc
        if pinned.error:
            cpus = CpuPlan(None, None, pinned.error)
        return Server(proc, port, log_path, cmd, host=host, cpus=cpus)

    def wait_ready(self, server: Server, timeout_s: float) -> None:
        wait_ready(server.proc, server.http, f"{server.url}/health", timeout_s, server.failure)

    def prompt_tokens(self, server: Server, n: int) -> list[int]:
        return prompt_of(self.base_tokens(server), n)

    def base_tokens(self, server: Server) -> list[int]:
        """The prompt text's tokens, which every request's prompt is cut from (its own length)."""
        r = fetch(server.http, "POST", f"{server.url}/tokenize", 30, setting="tokenize", json={"content": PROMPT_TEXT})
        r.raise_for_status()
        base = [t if isinstance(t, int) else t["id"] for t in r.json()["tokens"]]
        if not base:
            raise server.failure("the tokenizer returned no tokens for the prompt text")
        return base

    def run(self, config: TrialConfig, ctx: StudyContext) -> Measurement:
        # No check() here: the runner has done it, and a refused configuration must fail with
        # the engine's own reason.
        has_gpu = self._on_gpu(ctx)
        startup_s = float(self.value(ctx, "startup_timeout_s"))
        request_s = float(self.value(ctx, "request_timeout_s"))
        with tempfile.TemporaryDirectory(prefix="autotune-llama-server-") as tmp, self._rpc_devices(ctx, Path(tmp)):
            server = self.launch(config, ctx, has_gpu, Path(tmp))
            try:
                measured = self._measure(server, config, ctx, has_gpu, startup_s, request_s)
            except BackendError:
                raise
            except Exception as exc:  # HTTP errors, measurement errors: the engine's view too
                if server.proc.poll() is not None:
                    raise server.failure(f"died while measuring ({exc})") from exc
                text = server.log()
                raise BackendError(f"llama-server measurement failed: {exc}", log_tail=tail(text)) from exc
            finally:
                # Our streams first: llama-server finishes the requests it holds before it
                # exits, so an interrupt mid-measurement would otherwise wait out the grace.
                server.close()
                processes.stop(server.proc)
            # After the measured server has stopped, so the two never share the card; and only
            # for a configuration that ran, so a failing one costs one launch, as deployed. Off by
            # default: a study uses none of these figures (the memory model is checked against
            # them by tests and bench/, the learned correction uses the measured peak), and each
            # costs a launch.
            if self.value(ctx, "startup_facts"):
                try:
                    measured.attrs.update(self.startup_facts(config, ctx, has_gpu, Path(tmp), startup_s))
                except BackendError as exc:  # the figures are the engine's notes, not the trial's result
                    measured.attrs["startup_facts_error"] = str(exc)[:500]
            return measured

    @contextlib.contextmanager
    def _rpc_devices(self, ctx: StudyContext, log_dir: Path) -> Any:
        """A CPU study's RPC devices (split.rpc_device_count), running for one trial's launches;
        nothing for any other study."""
        n = split.rpc_device_count(ctx)
        binary = rpc.binary_beside(self.binary(ctx)) if n else Path()
        with rpc.rpc_servers(binary, n, max(1, self.threads(ctx) // max(1, n)), log_dir) as found:
            self._rpc_running = found
            try:
                yield found
            finally:
                self._rpc_running = None

    def startup_facts(
        self, config: TrialConfig, ctx: StudyContext, has_gpu: bool, log_dir: Path, startup_s: float
    ) -> dict[str, Any]:
        """What llama.cpp logs at start, from a short launch of its own at ``-lv 4``
        (:func:`.startup_facts.startup_facts`)."""
        return startup_facts_mod.startup_facts(self, config, ctx, has_gpu, log_dir, startup_s)

    def _measure(
        self, server: Server, config: TrialConfig, ctx: StudyContext, has_gpu: bool, startup_s: float, request_s: float
    ) -> Measurement:
        """One launched server measured under the protocol (:func:`.trial_run.measure`)."""
        return trial_run.measure(self, server, config, ctx, has_gpu, startup_s, request_s)

    @staticmethod
    @functools.lru_cache(maxsize=8)
    def _version_of(binary: str) -> str:
        try:
            return _checked_version(binary).label
        except AutotuneError as exc:
            return f"unknown ({exc})"


@functools.lru_cache(maxsize=8)
def _checked_version(binary: str) -> engine.EngineVersion:
    return engine.engine_version(binary)
