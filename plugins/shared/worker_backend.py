"""The parent side of a backend whose engine runs in a Python worker process per trial.

ExLlamaV2's and exllamav3's backends share it (:class:`WorkerBackend`): which interpreter
runs the worker and with what environment, the preflight that asks that interpreter for torch,
the engine and a CUDA device (in a child process, so autotune never imports torch), starting
the worker (:mod:`.worker_process`), having it build exactly the generator the deploy line
serves, and a trial's run: the core's loop (:func:`autotune.measure.measure_engine`) over
worker round trips (:mod:`.worker_sampling`), the worker always stopped, any failure wrapped
with the worker's log. What differs between the engines stays in each backend: the weights it
accepts, its space and rules, its generator settings and memory model, its deploy line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, ClassVar, Mapping, Sequence

from autotune._builtin import processes
from autotune.api import (
    AutotuneError,
    BackendError,
    BaseBackend,
    Measurement,
    ModelSpec,
    StudyContext,
    TrialConfig,
    measure_engine,
)
from autotune._builtin import (
    ConfigError,
    SERVING_UNITS,
    Workload,
    artifact_path,
    cuda_visible_entry,
    engine_environment,
    has_gpu as _has_gpu,
    is_format,
    model_from_hf_config,
    normalize_format,
)

from autotune_plugins.shared.worker_process import WorkerProcess, default_worker_command
from autotune_plugins.shared.worker_sampling import worker_sampler

__all__ = ["WorkerBackend", "command_problem", "preflight_script"]


def command_problem(command: list) -> str | None:
    """The check of a ``worker_command`` setting (the worker's whole command line)."""
    if command and all(isinstance(c, str) and c for c in command):
        return None
    return "must be a non-empty list of non-empty strings (the worker's whole command line)"


def preflight_script(engine: str, more: str = "") -> str:
    """Python source for the worker's interpreter: one JSON object saying whether ``torch`` and
    ``engine`` can be imported, and ``cuda_devices`` (or ``torch_error``); ``more`` (source at the
    top level, ``found`` in scope) adds the engine's own keys.

    The engine's module is found, not imported (an exllama import may JIT-compile its extension
    for minutes); torch is imported, as the worker will, to ask it for CUDA devices.
    """
    return f"""
import importlib.util, json
found = {{m: importlib.util.find_spec(m) is not None for m in ("torch", "{engine}")}}
if found["torch"]:
    try:
        import torch
        found["cuda_devices"] = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception as exc:
        found["torch_error"] = f"{{type(exc).__name__}}: {{exc}}"
{more}
print(json.dumps(found))
"""


class WorkerBackend(BaseBackend):
    """A backend that measures its engine in a worker process per trial.

    A subclass names its worker and engine (the class variables below), declares the settings
    ``python``, ``worker_command``, ``startup_timeout_s``, ``load_timeout_s``,
    ``request_timeout_s`` and ``stability_metric``, and implements ``generator_settings``
    (an object with ``to_dict``/``from_dict`` and ``max_seq_len``, built by ``generator_class``).
    """

    #: The worker's module, run as ``python -u -m MODULE``.
    worker_module: ClassVar[str]
    #: The generator settings' class the worker answers ``load`` with (``from_dict``).
    generator_class: ClassVar[type]
    #: How to install the engine, in the preflight's message.
    install: ClassVar[str]
    #: Python source the worker's interpreter runs to say what it has (:func:`preflight_script`).
    preflight_script: ClassVar[str]
    #: What the engine runs on, for the preflight's message when no CUDA device is seen.
    runs_on: ClassVar[str]

    # -------------------------------------------------------------- weights

    def weights_path(self, weights: str, ctx: StudyContext) -> Path:
        """The directory a candidate names: relative to the study file, or for a format
        (``exl2:4.0``) its place in the artifact cache, made or not yet."""
        if is_format(weights, self.weight_formats) and ctx.source is not None:
            fmt = normalize_format(weights, self.weight_formats)
            return artifact_path(ctx.source, self.artifacts.recipe(fmt, ctx.source, ctx))
        return ctx.path(weights)

    def _made(self, weights: str, ctx: StudyContext) -> Path | None:
        """The weights' directory, or None for a format not made yet."""
        p = self.weights_path(weights, ctx)
        return None if is_format(weights, self.weight_formats) and not p.is_dir() else p

    @staticmethod
    def _model_of(path: Path) -> ModelSpec:
        return model_from_hf_config(path)

    def _model(self, weights: str, ctx: StudyContext) -> ModelSpec:
        """The model the weights are: their directory's config.json, or the study's model for a
        format not made yet."""
        made = self._made(weights, ctx)
        return ctx.model if made is None else self._model_of(made)

    def check(self, config: TrialConfig, ctx: StudyContext) -> list[str]:
        """The weights' problem (``check_weights``), else the configuration's (``check_config``)."""
        problem = self.check_weights(config.weights, ctx)
        if problem:
            return [problem]
        return self.check_config(config, ctx, self._model(config.weights, ctx))

    def check_config(self, config: TrialConfig, ctx: StudyContext, model: ModelSpec) -> list[str]:
        """What the engine refuses in a configuration of usable weights of ``model``."""
        raise NotImplementedError

    # -------------------------------------------------------------- the worker's interpreter

    def python(self, ctx: StudyContext) -> str:
        return str(self.setting(ctx, "python") or sys.executable)

    def engine_build(self, ctx: StudyContext | None = None) -> str:
        try:
            import importlib.metadata as m

            return f"{self.engine} {m.version(self.engine)}"
        except Exception:  # noqa: BLE001 - not installed here; the worker reports its own
            return f"{self.engine} (not installed in autotune's environment)"

    def preflight(self, ctx: StudyContext) -> list[str]:
        """torch and the engine importable by the worker's interpreter, and a CUDA device it sees
        (then :meth:`preflight_more`).

        Looked up in a child process of that interpreter, so autotune itself never imports torch.
        A ``worker_command`` of the user's own is theirs to vouch for: nothing is checked then.
        """
        if self.setting(ctx, "worker_command") is not None:
            return []
        python, engine = self.python(ctx), self.engine
        try:
            env = self.worker_env(ctx)
        except AutotuneError as exc:
            return [str(exc)]
        try:
            done = processes.run(
                [python, "-c", self.preflight_script], capture_output=True, text=True, timeout_s=300, env=env
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            return [
                f"[backends.{self.name}] python = {python!r} cannot be run ({exc}): name an interpreter "
                f"that has torch and {engine}"
            ]
        try:
            found = json.loads(done.stdout.strip().splitlines()[-1])
        except (IndexError, ValueError):
            tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
            return [f"{python} could not say whether torch and {engine} are installed ({tail})"]
        missing = [m for m in ("torch", engine) if not found.get(m)]
        if missing:
            return [
                f"{' and '.join(missing)} cannot be imported by {python}: {self.install}, or set "
                f"[backends.{self.name}] python to an interpreter that has them"
            ]
        if found.get("torch_error"):
            return [f"torch cannot be imported by {python}: {found['torch_error']}"]
        if not found.get("cuda_devices"):
            return [
                f"torch in {python} sees no CUDA device (CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']!r}): "
                f"{self.runs_on}; run the study where one is visible, or predict with the twin-{engine} backend"
            ]
        return self.preflight_more(found, python)

    def preflight_more(self, found: Mapping[str, Any], python: str) -> list[str]:
        """The engine's own problems in what the preflight script found (none by default)."""
        return []

    # -------------------------------------------------------------- the worker

    def worker_command(self, ctx: StudyContext) -> list[str]:
        command = self.setting(ctx, "worker_command")
        return default_worker_command(self.python(ctx), self.worker_module) if command is None else list(command)

    @classmethod
    def worker_env(cls, ctx: StudyContext) -> dict[str, str]:
        """The worker's environment: it sees the study's one card as its CUDA device 0, named
        as the user's own CUDA_VISIBLE_DEVICES names it (the card autotune's telemetry reads)."""
        return engine_environment(cls.engine_variables, CUDA_VISIBLE_DEVICES=cuda_visible_entry(ctx.gpu_index))

    def start_worker(self, ctx: StudyContext, log_dir: Path) -> WorkerProcess:
        env = self.worker_env(ctx)
        # The worker imports autotune_plugins from wherever this process does.
        roots = [str(Path(__file__).resolve().parents[2])]
        env["PYTHONPATH"] = os.pathsep.join(roots + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
        worker = WorkerProcess(
            self.worker_command(ctx), log_dir / f"{self.engine}-worker.log", env=env, name=f"{self.engine} worker"
        )
        worker.start(float(self.setting(ctx, "startup_timeout_s")))
        return worker

    def load(
        self, worker: WorkerProcess, model_dir: Path, settings: Any, ctx: StudyContext, **fields: Any
    ) -> dict[str, Any]:
        """Have the worker build exactly ``settings``; a worker that built anything else is a failure.

        ``fields`` go with the ``load`` request as they are.
        """
        loaded = worker.request(
            "load",
            float(self.setting(ctx, "load_timeout_s")),
            model_dir=str(model_dir),
            settings=settings.to_dict(),
            **fields,
        )
        try:
            built = self.generator_class.from_dict(loaded.get("settings") or {})
        except (ConfigError, TypeError) as exc:
            raise worker.failure(f"answered 'load' without the settings it built ({exc})") from None
        if built != settings:
            raise worker.failure(
                f"built {built.to_dict()} instead of the {settings.to_dict()} asked for, so the "
                f"measurement would not be what the deploy line serves"
            )
        return loaded

    # -------------------------------------------------------------- run

    def refuse_run(self, config: TrialConfig, settings: Any, wl: Workload) -> None:
        """Raise ConfigError for a trial the engine would refuse before a worker is started."""

    def generator_attrs(self, settings: Any) -> dict[str, Any]:
        """The trial's record of its generator (after ``generator``, its settings)."""
        return {}

    def replies_attrs(self, replies: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        """The trial's record of what every ``sample`` reply reported beyond the timings (an
        engine's own counters, e.g. speculation's drafted and accepted tokens)."""
        return {}

    def run(self, config: TrialConfig, ctx: StudyContext) -> Measurement:
        has_gpu = _has_gpu()
        request_s = float(self.setting(ctx, "request_timeout_s"))
        settings = self.generator_settings(config, ctx)
        wl = ctx.workload
        self.refuse_run(config, settings, wl)
        with tempfile.TemporaryDirectory(prefix=f"autotune-{self.engine}-") as tmp:
            worker = self.start_worker(ctx, Path(tmp))
            try:
                loaded = self.load(worker, self.weights_path(config.weights, ctx), settings, ctx)
                last: dict[str, Any] = {}
                replies: list[Mapping[str, Any]] = []

                def ask(extra: Mapping[str, Any]) -> Mapping[str, Any]:
                    reply = worker.request(
                        "sample", request_s, prompt_tokens=wl.prompt_tokens, output_tokens=wl.output_tokens, **extra
                    )
                    last.update(reply)
                    replies.append(reply)
                    return reply

                # The worker composes a run in its own process (one request alone, then the run's
                # requests) and the metrics are the core's (worker_sampler); the core's loop
                # decides how many runs, the probe and the telemetry.
                sample = worker_sampler(ask, wl, config.parallel)
                stats, telemetry, peak = measure_engine(
                    ctx,
                    sample,
                    key=str(self.setting(ctx, "stability_metric")),
                    units=SERVING_UNITS,
                    gpu=has_gpu,
                    pid=worker.pid,
                )
            except BackendError:
                raise
            except Exception as exc:  # measurement errors, a malformed reply: the worker's log says more
                raise worker.failure(f"measurement failed ({type(exc).__name__}: {exc})") from exc
            finally:
                worker.stop()
        attention = loaded.get("attention") or {}
        attrs: dict[str, Any] = {
            "engine_version": f"{self.engine} {loaded.get('engine_version', 'unknown')}",
            "attention_path": attention.get("path", "unknown"),
            "attention": attention,
            "generator": settings.to_dict(),
            **self.generator_attrs(settings),
            "torch_version": loaded.get("torch_version"),
            "cuda_device": loaded.get("cuda_device"),
            "load_s": loaded.get("load_s"),
            "torch_max_allocated_bytes": last.get("max_allocated_bytes"),
            "torch_max_reserved_bytes": last.get("max_reserved_bytes"),
            "command": " ".join(self.worker_command(ctx)),
            "gpu": has_gpu,
            "prompt_tokens": wl.prompt_tokens,
            **self.replies_attrs(replies),
        }
        return Measurement(metrics=stats, peak_vram_bytes=peak, telemetry=telemetry, attrs=attrs)
