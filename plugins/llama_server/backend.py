"""The real llama.cpp backend: launch ``llama-server`` on a GGUF file, measure it, tear it down.

A trial's lifecycle (see :mod:`autotune.backend`):

* weights are GGUF file paths, relative to the study file's directory;
* ``check`` refuses what llama.cpp refuses (a quantized V cache without flash attention, a
  quantized cache whose block does not divide the head size, a context beyond the model's);
* ``estimate_memory`` reads the file's real tensor bytes and adds llama-server's KV layout,
  compute buffer and CUDA context (:mod:`~autotune_plugins.llama_server.memory`);
* ``run`` starts ``llama-server`` in its own process session, waits for ``/health``, warms up,
  then measures one stream (the server's own timings) and ``parallel`` simultaneous streams
  (client timestamps) with :func:`autotune.measure.repeat_until_stable_many`. The server is
  always stopped, also when autotune itself is interrupted (``atexit`` and ``SIGTERM``).

Settings (study file, ``[backends.llama-server]``):
    binary: llama-server executable or its directory (default: see ``engine.find_llama_server``).
    threads: CPU threads (``-t``, default ``os.cpu_count()``).
    gpu_layers: "all" (default, ``-ngl 999``) or a number of layers; 0 on a machine with no GPU.
    startup_timeout_s: bound on loading the model (default 120).
    request_timeout_s: bound on one measurement's requests (default 600).
    stability_metric: the quantity whose spread decides when to stop (default aggregate_tok_s).
"""

from __future__ import annotations

import functools
import json
import os
import re
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, ClassVar, Mapping, Sequence

import requests

from autotune.backend import BaseBackend, Measurement, MemoryEstimate, Param, StudyContext, TrialConfig
from autotune.errors import AutotuneError, BackendError
from autotune.measure import GpuSampler, StreamResult, repeat_until_stable_many, run_streams_threaded
from autotune.models import ModelSpec, model_from_gguf

from autotune import processes
from autotune.hardware import has_gpu as _has_gpu
from autotune.rules import Rule, load_rules, violations
from autotune.vram import gguf_weights
from autotune_plugins.llama_server import engine, memory

__all__ = ["LlamaServerBackend", "parse_log"]

CACHE_CHOICES = ("f16", "q8_0", "q4_0")
GGUF_MAGIC = b"GGUF"
KV_PAD = 256  # llama.cpp pads each sequence's cache to 256 cells

UNITS = {
    "decode_tok_s": "tok/s",
    "prefill_tok_s": "tok/s",
    "ttft_ms": "ms",
    "aggregate_tok_s": "tok/s",
    "per_user_tok_s": "tok/s",
}

# Real text for prompts; tokenized by the server and repeated/trimmed to the workload's length.
PROMPT_TEXT = (
    "Once upon a time, in a small town by the sea, there lived an old clockmaker who repaired "
    "every watch the fishermen brought him. Each morning he opened his shop, swept the floor, "
    "and listened to the ticking of a hundred clocks. One day a girl came in with a broken "
    "compass and asked him whether he could make it point home again. He smiled, took out his "
    "smallest screwdriver, and began to explain how the needle feels the pull of the earth. "
)

# ------------------------------------------------------------------------------ GGUF file


@functools.lru_cache(maxsize=1)
def _rules() -> list[Rule]:
    """llama.cpp's refusals, kept as data beside this module (rules.toml)."""
    return load_rules(Path(__file__).with_name("rules.toml"))


@functools.lru_cache(maxsize=64)
def _model_cached(path: str, mtime_ns: int, size: int) -> ModelSpec:
    return model_from_gguf(path)


def _model_of(path: Path) -> ModelSpec:
    st = path.stat()
    return _model_cached(str(path.resolve()), st.st_mtime_ns, st.st_size)


# ------------------------------------------------------------------------------ log parsing

_BUFFER_RX = {
    "model_buffer_mib": re.compile(r"(\S+) model buffer size\s*=\s*([\d.]+) MiB"),
    "kv_buffer_mib": re.compile(r"(\S+) KV buffer size\s*=\s*([\d.]+) MiB"),
    "compute_buffer_mib": re.compile(r"(\S+) compute buffer size\s*=\s*([\d.]+) MiB"),
}
_OFFLOAD_RX = re.compile(r"offloaded (\d+)/(\d+) layers to GPU")
_KV_CELLS_RX = re.compile(r"llama_kv_cache: size\s*=.*?\(\s*(\d+) cells,\s*(\d+) layers,\s*(\d+)/(\d+) seqs\)")


def parse_log(text: str) -> dict[str, Any]:
    """Buffer sizes by device (MiB) and the offloaded layers, as llama.cpp logs them at start."""
    out: dict[str, Any] = {}
    for key, rx in _BUFFER_RX.items():
        found: dict[str, float] = {}
        for dev, mib in rx.findall(text):
            found[dev] = found.get(dev, 0.0) + float(mib)
        if found:
            out[key] = found
    m = _OFFLOAD_RX.search(text)
    if m:
        on_gpu, total = int(m.group(1)), int(m.group(2))
        out["offloaded_layers"] = on_gpu
        out["total_layers"] = total
        out["spilled"] = on_gpu < total
    m = _KV_CELLS_RX.search(text)
    if m:
        # cells per sequence stream x streams: the cache's real capacity
        out["kv_cells"] = int(m.group(1)) * int(m.group(4))
    return out


_REASON_RX = re.compile(
    r"(out of memory|failed to allocate|unsupported cache type|does not divide|no such file|"
    r"failed to open|failed to load|invalid argument|error:|unknown value|not supported|"
    r"requires|requested)",
    re.IGNORECASE,
)


def engine_reason(log_text: str) -> str:
    """The engine's own words for a failure: its error lines, most specific first."""
    lines = [ln.strip() for ln in log_text.splitlines() if ln.strip()]
    errors = [ln for ln in lines if re.search(r"\s E\s", f" {ln} ") or _REASON_RX.search(ln)]
    pick = errors[:3] if errors else lines[-3:]
    return " | ".join(pick)[:800] or "no output"


def _tail(text: str, n: int = 40) -> str:
    return "\n".join(text.splitlines()[-n:])


# ------------------------------------------------------------------------------ helpers


def _port_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _free_port() -> int:
    for _ in range(20):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if _port_free(port):
            return port
    raise BackendError("no free TCP port on 127.0.0.1 for llama-server")


class _Server:
    """One running llama-server: its process, port and log."""

    def __init__(self, proc: subprocess.Popen, port: int, log_path: Path, cmd: list[str]):
        self.proc = proc
        self.port = port
        self.log_path = log_path
        self.cmd = cmd
        self.url = f"http://127.0.0.1:{port}"
        self.session = requests.Session()

    def log(self) -> str:
        try:
            return self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""

    def failure(self, what: str) -> BackendError:
        text = self.log()
        rc = self.proc.poll()
        status = f"exited with code {rc}" if rc is not None else "is running"
        return BackendError(f"llama-server {status}: {what}: {engine_reason(text)}", log_tail=_tail(text))


# ------------------------------------------------------------------------------ the backend


class LlamaServerBackend(BaseBackend):
    name: ClassVar[str] = "llama-server"
    engine: ClassVar[str] = "llama.cpp"
    weight_families: ClassVar[tuple[str, ...]] = ("gguf",)
    description: ClassVar[str] = "llama.cpp's llama-server on a GGUF file, launched and measured"

    # -------------------------------------------------------------- space and rules

    def parameters(self, space: Mapping[str, Sequence[Any]]) -> list[Param]:
        caches = tuple(c for c in space.get("cache_type", CACHE_CHOICES) if c in CACHE_CHOICES)
        flash = tuple(v for v in space.get("flash_attn", (True, False)) if isinstance(v, bool))
        params = [
            Param("cache_type", caches or ("f16",), "KV-cache type (-ctk/-ctv): f16, q8_0, q4_0"),
            Param("flash_attn", flash or (True,), "flash attention (-fa on|off)"),
        ]
        if "ubatch" in space:
            ub = tuple(int(v) for v in space["ubatch"] if isinstance(v, int) and not isinstance(v, bool) and v > 0)
            if ub:
                params.append(Param("ubatch", ub, "physical batch size (-ub)"))
        return params

    def weights_path(self, weights: str, ctx: StudyContext) -> Path:
        return ctx.path(weights)

    def check_weights(self, weights: str, ctx: StudyContext) -> str | None:
        p = self.weights_path(weights, ctx)
        if not p.is_file():
            return f"{p}: no such file (weights are GGUF paths relative to the study file)"
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
        problem = self.check_weights(config.weights, ctx)
        if problem:
            return [problem]
        model = _model_of(self.weights_path(config.weights, ctx))
        options = {"cache_type": "f16", "flash_attn": True, **dict(config.options),
                   "ctx": config.ctx, "parallel": config.parallel}
        facts = {"head_dim": model.head_dim, "ctx": config.ctx, "max_context": model.max_context,
                 "compute_capability": getattr(ctx.gpu, "compute_capability", None)}
        return violations(_rules(), options, facts)

    # -------------------------------------------------------------- memory

    def estimate_memory(self, config: TrialConfig, ctx: StudyContext) -> MemoryEstimate:
        path = self.weights_path(config.weights, ctx)
        on_gpu = (_has_gpu() if ctx.for_gpu is None else ctx.for_gpu) and self.gpu_layers(ctx) > 0
        ub = config.option("ubatch")
        return memory.estimate(_model_of(path), gguf_weights(path), config.ctx, config.parallel,
                               config.option("cache_type", "f16"), bool(config.option("flash_attn", True)),
                               ubatch=int(ub) if ub is not None else None, gpu=on_gpu)

    # -------------------------------------------------------------- commands

    def gpu_layers(self, ctx: StudyContext, has_gpu: bool = True) -> int:
        if not has_gpu:
            return 0
        value = ctx.settings.get("gpu_layers", "all")
        if value in ("all", None):
            return 999
        try:
            return max(0, int(value))
        except (TypeError, ValueError):
            raise BackendError(f"[backends.llama-server] gpu_layers = {value!r}: use 'all' or a number") from None

    def flags(self, config: TrialConfig, ngl: int) -> list[str]:
        cache = config.option("cache_type", "f16")
        out = ["-c", str(config.ctx * config.parallel), "-np", str(config.parallel), "-ngl", str(ngl),
               "-fa", "on" if config.option("flash_attn", True) else "off", "-ctk", cache, "-ctv", cache]
        ub = config.option("ubatch")
        if ub is not None:
            out += ["-ub", str(int(ub))]
        return out

    def deploy_command(self, config: TrialConfig, ctx: StudyContext) -> str:
        path = self.weights_path(config.weights, ctx)
        args = ["llama-server", "-m", str(path), *self.flags(config, self.gpu_layers(ctx)),
                "--host", "0.0.0.0", "--port", "8080", "--fit", "off"]
        return (" ".join(args) + f"  # -c is shared by the slots: ctx {config.ctx} x {config.parallel} slots")

    def binary(self, ctx: StudyContext | None = None) -> Path:
        settings = ctx.settings if ctx is not None else {}
        try:
            return engine.find_llama_server(settings)
        except AutotuneError as exc:
            raise BackendError(str(exc)) from exc

    def scorer(self, weights: str, cache_type: str | None, ctx: StudyContext):
        """Log-likelihoods of ``weights`` through llama-cpp-python on this engine's build."""
        from autotune_plugins.llama_server.scoring import LlamaCppScorer

        return LlamaCppScorer(self.weights_path(weights, ctx), cache_type, ctx.settings)

    def engine_version(self) -> str:
        try:
            return engine.engine_version(self.binary()).label
        except AutotuneError as exc:
            return f"unknown ({exc})"

    # -------------------------------------------------------------- run

    def launch(self, config: TrialConfig, ctx: StudyContext, has_gpu: bool, log_dir: Path) -> _Server:
        path = self.weights_path(config.weights, ctx)
        binary = self.binary(ctx)
        port = _free_port()
        if not _port_free(port):
            raise BackendError(f"port {port} is taken")
        threads = int(ctx.settings.get("threads", os.cpu_count() or 1))
        cmd = [str(binary), "-m", str(path), *self.flags(config, self.gpu_layers(ctx, has_gpu)),
               "-t", str(threads), "--fit", "off", "--host", "127.0.0.1", "--port", str(port),
               "--no-webui", "-lv", "4"]
        env = {k: v for k, v in os.environ.items() if not k.startswith("LLAMA_ARG_")}
        if has_gpu and "CUDA_VISIBLE_DEVICES" not in env:
            env["CUDA_VISIBLE_DEVICES"] = str(ctx.gpu_index)
        log_path = log_dir / "llama-server.log"
        with open(log_path, "w") as log:
            proc = processes.start(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        return _Server(proc, port, log_path, cmd)

    def wait_ready(self, server: _Server, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if server.proc.poll() is not None:
                raise server.failure("failed to start")
            try:
                if server.session.get(f"{server.url}/health", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.1)
        raise server.failure(f"not ready after {timeout_s:.0f} s")

    def prompt_tokens(self, server: _Server, n: int) -> list[int]:
        r = server.session.post(f"{server.url}/tokenize", json={"content": PROMPT_TEXT}, timeout=30)
        r.raise_for_status()
        base = [t if isinstance(t, int) else t["id"] for t in r.json()["tokens"]]
        if not base:
            raise server.failure("the tokenizer returned no tokens for the prompt text")
        tokens: list[int] = []
        while len(tokens) < n:
            tokens += base
        return tokens[:max(1, n)]

    def run(self, config: TrialConfig, ctx: StudyContext) -> Measurement:
        # No check() here: the runner has done it, and a refused configuration must fail with
        # the engine's own reason.
        has_gpu = _has_gpu()
        startup_s = float(ctx.settings.get("startup_timeout_s", 120))
        request_s = float(ctx.settings.get("request_timeout_s", 600))
        with tempfile.TemporaryDirectory(prefix="autotune-llama-server-") as tmp:
            server = self.launch(config, ctx, has_gpu, Path(tmp))
            try:
                return self._measure(server, config, ctx, has_gpu, startup_s, request_s)
            except BackendError:
                raise
            except Exception as exc:  # requests errors, measurement errors: the engine's view too
                if server.proc.poll() is not None:
                    raise server.failure(f"died while measuring ({exc})") from exc
                text = server.log()
                raise BackendError(f"llama-server measurement failed: {exc}", log_tail=_tail(text)) from exc
            finally:
                processes.stop(server.proc)

    def _measure(self, server: _Server, config: TrialConfig, ctx: StudyContext, has_gpu: bool,
                 startup_s: float, request_s: float) -> Measurement:
        self.wait_ready(server, startup_s)
        wl = ctx.workload
        prompt = self.prompt_tokens(server, wl.prompt_tokens)

        def body(i: int, stream: bool) -> dict[str, Any]:
            # A different first token per request keeps the server from reusing a cached prefix.
            toks = [prompt[(i * 7) % len(prompt)], *prompt[1:]] if len(prompt) > 1 else prompt
            return {"prompt": toks, "n_predict": wl.output_tokens, "ignore_eos": True, "temperature": 0,
                    "cache_prompt": False, "stream": stream}

        def single(i: int) -> dict[str, Any]:
            r = requests.post(f"{server.url}/completion", json=body(i, False), timeout=request_s)
            if r.status_code != 200:
                raise server.failure(f"HTTP {r.status_code} from /completion: {r.text[:300]}")
            return r.json()["timings"]

        def stream(i: int) -> StreamResult:
            start = time.monotonic()
            first = None
            n_out = 0
            n_prompt = len(prompt)
            timings: dict[str, Any] = {}
            with requests.post(f"{server.url}/completion", json=body(1000 + i, True), timeout=request_s,
                               stream=True) as r:
                if r.status_code != 200:
                    raise server.failure(f"HTTP {r.status_code} from /completion: {r.text[:300]}")
                for line in r.iter_lines():
                    if not line or not line.startswith(b"data:"):
                        continue
                    data = json.loads(line[5:])
                    if first is None and data.get("content") is not None and not data.get("stop"):
                        first = time.monotonic()
                    if data.get("stop"):
                        timings = data.get("timings") or {}
                        n_out = int(timings.get("predicted_n", data.get("tokens_predicted", 0)))
                        n_prompt = int(timings.get("prompt_n", n_prompt))
            end = time.monotonic()
            if first is None:
                first = end
            client = StreamResult.from_timestamps(n_prompt, n_out, start, first, end)
            if not timings.get("predicted_per_second"):
                return client
            # The server's own clock for the rates: on a fast model a whole burst of tokens
            # arrives in one read, and the client's gaps measure the socket, not the decode.
            return StreamResult(n_prompt, n_out, client.ttft_ms, float(timings["predicted_per_second"]),
                                float(timings.get("prompt_per_second") or client.prefill_tok_s), start, end)

        single(-1)  # warm-up: allocator, caches, CUDA graphs
        counter = iter(range(10**9))

        def sample() -> dict[str, float]:
            i = next(counter)
            t = single(i)
            conc = run_streams_threaded(stream, config.parallel, request_s)
            return {
                "decode_tok_s": float(t["predicted_per_second"]),
                "prefill_tok_s": float(t["prompt_per_second"]),
                "ttft_ms": float(t["prompt_ms"]),
                "aggregate_tok_s": conc.aggregate_tok_s,
                "per_user_tok_s": conc.per_user_tok_s,
            }

        key = str(ctx.settings.get("stability_metric", "aggregate_tok_s"))
        telemetry = None
        peak = None
        if has_gpu:
            with GpuSampler(index=ctx.gpu_index, pid=server.proc.pid) as gpu:
                stats = repeat_until_stable_many(sample, ctx.protocol, UNITS, key=key)
            telemetry = gpu.result()
            if telemetry.available:
                peak = telemetry.peak_process_bytes if telemetry.peak_process_bytes is not None \
                    else telemetry.peak_delta_bytes
        else:
            stats = repeat_until_stable_many(sample, ctx.protocol, UNITS, key=key)
        attrs: dict[str, Any] = {
            "engine_version": self._version_of(server.cmd[0]),
            "command": " ".join(server.cmd),
            "gpu": has_gpu,
            "prompt_tokens": len(prompt),
            **parse_log(server.log()),
        }
        attrs.setdefault("spilled", False)
        return Measurement(metrics=stats, peak_vram_bytes=peak, telemetry=telemetry, attrs=attrs)

    @staticmethod
    @functools.lru_cache(maxsize=8)
    def _version_of(binary: str) -> str:
        try:
            return engine.engine_version(binary).label
        except AutotuneError as exc:
            return f"unknown ({exc})"
