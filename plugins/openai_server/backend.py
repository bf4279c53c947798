"""Any OpenAI-compatible server as a backend, started from a command template.

A trial's lifecycle (see :mod:`autotune.engine.backend`):

* the study names a template (``[backends.openai-server] template = "vllm"``, or a TOML file of
  its own) and may replace its ``command``, ``ready`` path, executable or memory model; all of it
  is checked before the study starts (:meth:`OpenAIServerBackend.preflight`: a bad placeholder
  or an unknown flag mapping is exit 2, naming the file and the field);
* ``check`` refuses what the template does not map (a cache type, flash attention, an option)
  and what its ``[[rule]]`` table says the engine refuses;
* ``estimate_memory``: for an engine that pre-allocates a share of the card (vLLM's
  ``--gpu-memory-utilization``), that share; otherwise the weights on disk plus the KV cache,
  and the trial records the server's measured NVML peak (its whole process group);
* ``run`` renders the template to an argument list (never through a shell), starts it with
  :mod:`autotune.toolkit.processes`, waits for the ready path, then measures one stream and
  ``parallel`` concurrent streams of ``/v1/completions`` through the core's loop,
  :func:`autotune.measure.measure_engine` (the study's protocol and probe), reading the
  engine's own ``/metrics`` before and after each concurrent phase; it always stops the server;
* ``deploy_command`` prints the same argument list with the deploy port.
"""

from __future__ import annotations

import functools
import os
import shlex
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path
from typing import Any, ClassVar, Mapping, Sequence

from autotune.api import (
    AutotuneError,
    BackendError,
    BaseBackend,
    CacheType,
    Measurement,
    MemoryEstimate,
    Param,
    Setting,
    StudyContext,
    TrialConfig,
    deploy_line,
    part,
)
from autotune._builtin import (
    ConfigError,
    Scoring,
    SlotLayout,
    cuda_visible,
    cuda_visible_entry,
    engine_environment,
    engine_models,
    free_port,
    has_gpu as _has_gpu,
    kv_cache_bytes,
    loopback,
    path_problem,
    processes,
    remember_secret,
    violations,
)
from autotune_plugins.shared.engine_cache import engines_dir
from autotune_plugins.shared.paging import PAGE_SIZE as EXL3_PAGE, pages_per_job
from autotune_plugins.openai_server import declarations, trial_run
from autotune_plugins.openai_server.server import OpenAIServer
from autotune_plugins.openai_server.settings import SETTINGS
from autotune_plugins.openai_server.templates import (
    Template,
    load_template,
    render,
    shipped,
    template_path,
    with_overrides,
)

__all__ = ["OpenAIServerBackend"]

CORE = ("ctx", "parallel")


def _args(value: Any) -> list[str]:
    return shlex.split(value) if isinstance(value, str) else list(value or ())


@functools.lru_cache(maxsize=32)
def _load(path: str, mtime_ns: int) -> Template:
    return load_template(Path(path))


class OpenAIServerScoring(Scoring):
    def scorer(self, weights: str, cache_type: str | None, ctx: StudyContext):
        """Log-likelihoods through the server's ``/v1/completions`` log-probabilities.

        Raises:
            ScoringUnsupportedError: The template's engine returns no usable log-probabilities
                (``[api] logprobs = "none"``), with the template's reason.
        """
        from autotune_plugins.openai_server.scoring import OpenAIServerScorer

        return OpenAIServerScorer(self.backend, weights, cache_type, ctx)


class OpenAIServerBackend(BaseBackend):
    name: ClassVar[str] = "openai-server"
    engine: ClassVar[str] = "openai-api"
    description: ClassVar[str] = (
        "any OpenAI-compatible server started from a command template (shipped: " + ", ".join(shipped()) + ")"
    )
    scoring = part(OpenAIServerScoring)
    # vLLM's and SGLang's own environment, beyond what the engine models of the engines its
    # shipped templates serve declare (``engine_variables``).
    own_variables: ClassVar[tuple[str, ...]] = ("TOKENIZERS_*", "VLLM_*", "SGLANG_*", "FLASHINFER_*")

    @property
    def kv_cache_types(self) -> tuple[CacheType, ...]:  # type: ignore[override]
        """The cache types of the engines its shipped templates serve: vLLM's and SGLang's
        --kv-cache-dtype, and every engine model's (llama-server's -ctk, TabbyAPI's cache_mode
        for ExLlamaV2 and for exllamav3), each name once (fp16 is both exllamas', declared alike)."""
        out, seen = list(declarations.CACHE_TYPES), {c.name for c in declarations.CACHE_TYPES}
        for model in engine_models().values():
            for c in model.kv_cache_types:
                if c.name not in seen:
                    out.append(c)
                    seen.add(c.name)
        return tuple(out)

    @property
    def engine_variables(self) -> tuple[str, ...]:  # type: ignore[override]
        """What the shipped templates' engines read: each engine model's (ggml's switches, a Python
        engine's setup) and vLLM's and SGLang's own."""
        found = [v for m in engine_models().values() for v in m.engine_variables]
        return tuple(dict.fromkeys([*found, *self.own_variables]))

    settings: ClassVar[tuple[Setting, ...]] = SETTINGS

    # -------------------------------------------------------------- the template

    def template(self, ctx: StudyContext) -> Template:
        """The study's template with its settings applied, checked.

        Raises:
            ConfigError: Naming the template file or the setting, the field and what is accepted.
        """
        ref = str(self.value(ctx, "template"))
        path = template_path(ref, ctx.base_dir)
        try:
            mtime = path.stat().st_mtime_ns
        except OSError:
            mtime = 0
        base = _load(str(path), mtime)
        command = self.value(ctx, "command")
        t = with_overrides(
            base,
            command=_args(command) if command is not None else None,
            ready=self.value(ctx, "ready"),
            memory=self.value(ctx, "memory"),
            memory_fraction=self.value(ctx, "memory_fraction"),
            where=f"[backends.{self.name}]",
        )
        executable = self.value(ctx, "executable")
        extra = _args(self.value(ctx, "extra_args"))
        if executable or extra:
            cmd = ([str(Path(executable).expanduser())] if executable else [t.command[0]]) + list(t.command[1:]) + extra
            t = replace(t, command=tuple(cmd))
        return t

    def executable(self, t: Template) -> str | None:
        """The command's executable as an absolute path, or None when it is not there."""
        first = t.command[0]
        if "/" in first:
            p = Path(first).expanduser().absolute()
            return str(p) if p.is_file() else None
        return shutil.which(first)

    def preflight(self, ctx: StudyContext) -> list[str]:
        """The template and the study's settings render (every placeholder known, every mapping
        well formed) and the executable is there; else the problem, naming the file and field."""
        try:
            t = self.template(ctx)
        except ConfigError as exc:
            return [str(exc)]
        problems = []
        if self.executable(t) is None:
            built = _built_executable(t.command[0])
            # "install llama.cpp" right after `autotune engine build llama.cpp` would be wrong:
            # the build is in autotune's cache, off PATH; name it instead.
            remedy = (
                f'autotune\'s engine cache has one: set [backends.{self.name}] executable = "{built}"'
                if built
                else f"install {t.engine}, or set [backends.{self.name}] executable to its path"
            )
            problems.append(
                f"template {t.name}: {t.command[0]!r} is not an executable here (not found on PATH): {remedy}"
            )
        try:
            self.api_key(ctx)  # a variable named but unset: said before any server starts, not as 401s
        except ConfigError as exc:
            problems.append(str(exc))
        if _has_gpu():
            try:
                cuda_visible_entry(ctx.gpu_index)
            except AutotuneError as exc:
                problems.append(str(exc))
        return problems

    # -------------------------------------------------------------- space and rules

    def parameters(self, space: Mapping[str, Sequence[Any]]) -> list[Param]:
        """The study's values as given: which of them the template maps is known only with the
        study's settings, so ``check`` refuses the others (naming the template and the key). A
        key the study does not name is left to the engine's default."""
        params = []
        for name, values in space.items():
            if name in CORE:
                continue
            if name == "flash_attn":
                params.append(
                    Param(
                        name,
                        tuple(v for v in values if isinstance(v, bool)),
                        "flash attention, as the template's [flash_attn] maps it",
                        accepted=(True, False),
                    )
                )
            elif name == "cache_type":
                params.append(
                    Param(
                        name,
                        tuple(v for v in values if isinstance(v, str)),
                        "KV-cache type, as the template's [cache_type] maps it",
                        accepted=("a key of the template's [cache_type]",),
                    )
                )
            else:
                params.append(
                    Param(
                        name,
                        tuple(v for v in values if isinstance(v, (int, float, str)) and not isinstance(v, bool)),
                        f"{name}, as the template's [options] maps it",
                        accepted=("a number or a string the template's [options] maps",),
                    )
                )
        return params

    def weights_path(self, weights: str, ctx: StudyContext) -> Path:
        return ctx.path(weights)

    def check_weights(self, weights: str, ctx: StudyContext) -> str | None:
        try:
            t = self.template(ctx)
        except ConfigError:
            return None  # preflight reports the template
        p = self.weights_path(weights, ctx)
        problem = path_problem(p, t.weights) if t.weights in ("file", "directory") else None
        if problem and t.weights == "file":
            return f"{p}: {problem} (template {t.name} loads a weights file; paths are relative to the study file)"
        if problem:
            return f"{p}: {problem} (template {t.name} loads a model directory)"
        return None

    def check(self, config: TrialConfig, ctx: StudyContext) -> list[str]:
        try:
            t = self.template(ctx)
        except ConfigError as exc:
            return [str(exc)]
        problem = self.check_weights(config.weights, ctx)
        if problem:
            return [problem]
        reasons = []
        options = dict(config.options)
        cache = options.get("cache_type")
        if cache is not None and cache not in t.cache_type:
            reasons.append(
                f"cache_type {cache!r}: template {t.name} maps only {', '.join(t.cache_type) or 'none'} "
                f"({t.source} [cache_type])"
            )
        flash = options.get("flash_attn")
        if flash is not None and flash not in t.flash_attn:
            mapped = ", ".join(str(k).lower() for k in t.flash_attn) or "neither value"
            reasons.append(
                f"flash_attn {str(flash).lower()}: template {t.name} maps only {mapped} ({t.source} [flash_attn])"
            )
        for name in options:
            if name not in ("cache_type", "flash_attn") and name not in t.options:
                reasons.append(
                    f"{name}: template {t.name} maps no such option "
                    f"({t.source} [options]: {', '.join(t.options) or 'none'})"
                )
        if reasons:
            return reasons
        model = ctx.model
        facts = {
            "head_dim": model.head_dim,
            "ctx": config.ctx,
            "max_context": model.max_context,
            "compute_capability": getattr(ctx.gpu, "compute_capability", None),
        }
        return violations(list(t.rules), {**options, "ctx": config.ctx, "parallel": config.parallel}, facts)

    # -------------------------------------------------------------- memory

    def estimate_memory(self, config: TrialConfig, ctx: StudyContext) -> MemoryEstimate:
        t = self.template(ctx)
        path = self.weights_path(config.weights, ctx)
        weights = _bytes_on_disk(path)
        cache = config.option("cache_type")
        known = {ct.name: ct for ct in self.kv_cache_types}
        kv_type = cache if cache in known else "f16"
        kv, _, how = kv_cache_bytes(ctx.model, known[kv_type], config.ctx, config.parallel, SlotLayout())
        notes = [
            f"weights: {weights} bytes on disk ({path.name})",
            f"KV: {how} x {ctx.model.n_layers} layers x {ctx.model.kv_dim} x (K+V {kv_type})"
            + ("" if cache == kv_type else f" (cache_type {cache!r} is not in autotune's catalog: sized as f16)"),
        ]
        if t.memory == "fraction":
            pool = int(float(t.memory_fraction or 0) * ctx.gpu.vram_bytes)
            notes.append(
                f"template {t.name} pre-allocates {t.memory_fraction:g} of the card's {ctx.gpu.vram_bytes} "
                f"bytes ({pool}): admission uses that share; weights + KV beyond it cannot start"
            )
            return MemoryEstimate(
                weights_bytes=weights,
                kv_bytes=kv,
                buffers_bytes=0,
                overhead_bytes=max(0, pool - weights - kv),
                notes=tuple(notes),
            )
        notes.append(
            f"template {t.name}: measured only; this is weights + KV, the trial records the engine's "
            "NVML peak and the study learns the rest from it"
        )
        return MemoryEstimate(weights_bytes=weights, kv_bytes=kv, buffers_bytes=0, overhead_bytes=0, notes=tuple(notes))

    # -------------------------------------------------------------- the command line

    def argv(
        self, config: TrialConfig, ctx: StudyContext, *, host: str, port: int, has_gpu: bool, t: Template | None = None
    ) -> list[str]:
        """The one place the command is rendered: trials launch it, deploy prints it."""
        t = t or self.template(ctx)
        path = self.weights_path(config.weights, ctx)
        values = {
            "weights": str(path),
            "weights_dir": str(path.parent),
            "weights_name": path.name,
            "ctx": config.ctx,
            "ctx_total": config.ctx * config.parallel,
            "ctx_input": max(1, config.ctx - 1),
            "ctx_paged": config.parallel * pages_per_job(config.ctx) * EXL3_PAGE,
            "parallel": config.parallel,
            "port": port,
            "host": host,
            "gpu": cuda_visible(getattr(ctx, "placement", None), ctx.gpu_index) if has_gpu else "",
            "memory_fraction": "" if t.memory_fraction is None else f"{t.memory_fraction:g}",
        }
        options = {k: v for k, v in config.options if k not in ("cache_type", "flash_attn")}
        argv = render(
            t, values, cache_type=config.option("cache_type"), flash_attn=config.option("flash_attn"), options=options
        )
        exe = self.executable(t)
        if exe:
            argv[0] = exe
        return argv

    def deploy_command(self, config: TrialConfig, ctx: StudyContext) -> str:
        has_gpu = _has_gpu() if ctx.for_gpu is None else ctx.for_gpu
        t = self.template(ctx)
        host = str(self.value(ctx, "host"))
        argv = self.argv(config, ctx, host=host, port=int(self.value(ctx, "port")), has_gpu=has_gpu, t=t)
        notes = [f"template {t.name} ({t.docs or t.source})"]
        if "{ctx_total}" in t.command:
            notes.append(f"ctx {config.ctx} x {config.parallel} slots share {config.ctx * config.parallel}")
        if "{ctx_paged}" in t.command:
            notes.append(
                f"a paged cache of {config.parallel} x pad256({config.ctx} + 1) tokens: {config.parallel} jobs of "
                f"ctx {config.ctx} at once when clients send max_tokens"
            )
        if self.executable(t) is None:
            notes.append(f"{t.command[0]} was not found here")
        if "{host}" in t.command:
            notes.append(
                f'listens on {host} only; [backends.{self.name}] host = "0.0.0.0" serves other machines'
                if loopback(host)
                else f"listens on {host}"
            )
        return deploy_line(
            argv,
            notes,
            {"CUDA_VISIBLE_DEVICES": cuda_visible(getattr(ctx, "placement", None), ctx.gpu_index)} if has_gpu else None,
        )

    def engine_build(self, ctx: StudyContext | None = None) -> str:
        return "unknown (depends on the study's template)"

    @staticmethod
    @functools.lru_cache(maxsize=16)
    def _version_of(argv: tuple[str, ...]) -> str:
        try:
            out = processes.run(list(argv), capture_output=True, text=True, timeout_s=60, env=engine_environment())
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"unknown ({exc})"
        lines = [ln.strip() for ln in (out.stdout + "\n" + out.stderr).splitlines() if ln.strip()]
        return next((ln for ln in lines if "version" in ln.lower()), lines[0] if lines else "unknown")[:200]

    def version(self, t: Template) -> str:
        exe = self.executable(t)
        if not t.version or exe is None:
            return "unknown (the template names no version arguments)" if not t.version else "unknown (not found)"
        return f"{t.name}: {self._version_of((exe, *t.version))}"

    # -------------------------------------------------------------- run

    def launch(self, config: TrialConfig, ctx: StudyContext, *, has_gpu: bool, t: Template) -> OpenAIServer:
        host = "127.0.0.1"
        port = free_port(host)
        argv = self.argv(config, ctx, host=host, port=port, has_gpu=has_gpu, t=t)
        devices = cuda_visible(getattr(ctx, "placement", None), ctx.gpu_index) if has_gpu else None
        key_env = self.value(ctx, "api_key_env")
        declared = (*self.engine_variables, key_env) if key_env else self.engine_variables
        return OpenAIServer(
            argv,
            host=host,
            port=port,
            env=OpenAIServer.environment(devices, declared),
            label=t.name,
            api_key=self.api_key(ctx),
        )

    def api_key(self, ctx: StudyContext) -> str | None:
        """The key named by ``api_key_env``, from our environment (None: none named).

        Raises:
            ConfigError: The variable is named but not set, before any server starts.
        """
        name = self.value(ctx, "api_key_env")
        if not name:
            return None
        value = os.environ.get(str(name))
        if not value:
            raise ConfigError(
                f"[backends.{self.name}] api_key_env = {name!r}: ${name} is not set (or empty); "
                f"export the server's API key as {name} before the study"
            )
        remember_secret(value)  # scrubbed from the engine's output, whatever the variable's name
        return value

    def startup_timeout(self, ctx: StudyContext, t: Template) -> float:
        given = self.value(ctx, "startup_timeout_s")
        return float(given) if given is not None else t.startup_timeout_s

    def run(self, config: TrialConfig, ctx: StudyContext) -> Measurement:
        t = self.template(ctx)
        has_gpu = _has_gpu()
        request_s = float(self.value(ctx, "request_timeout_s"))
        with self.launch(config, ctx, has_gpu=has_gpu, t=t) as server:
            try:
                server.wait_ready(t.ready, self.startup_timeout(ctx, t))
                return trial_run.measure(self, server, t, config, ctx, has_gpu, request_s)
            except BackendError:
                raise
            except Exception as exc:  # HTTP errors, measurement errors: with the engine's view too
                if server.proc.poll() is not None:
                    raise server.failure(f"died while measuring ({exc})") from exc
                raise server.failure(f"measurement failed ({exc})") from exc


def _bytes_on_disk(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    if path.is_dir():
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return 0


def _built_executable(command: str) -> str | None:
    """``command`` (a bare name) as built by ``autotune engine build`` into the engine cache
    (``<engines>/<engine>-<version>-<arch>/bin/``), the newest first; None when there is none."""
    if "/" in command:
        return None
    found = [p for p in engines_dir().glob(f"*/bin/{command}") if p.is_file() and os.access(p, os.X_OK)]
    return str(max(found, key=lambda p: p.stat().st_mtime)) if found else None
