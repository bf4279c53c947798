"""What the twin is fitted on and checked against, read into one shape: measured figures with
the scenario that produced them.

Three kinds of evidence, each kept where it was published or measured:

* published single-stream decode on other cards (``autotune/data/published_decode.toml``: every
  figure with its source), run by llama.cpp's or ExLlamaV2's own benchmark harness, which
  samples nothing (``harness = "bench"``);
* llama-bench on an H200 (``bench/results/h200_grids/llama_bench_*.json``: tg128, this
  project's own synthetic Qwen2.5-7B and Llama-3.1-8B shapes);
* llama-server on an H200 under autotune's protocol (``bench/results/``: the probe, the study
  and the two exhaustive grids), single stream and 1-32 parallel streams;
* llama-server on an H200 with part of the model in host memory (``offload_probe_h200``: a
  dense 7B and a 12-layer MoE shape, -ngl / --n-cpu-moe / -ub / --fit), which fits only the two
  offload constants, on two dense points (``OFFLOAD_FIT``; ``fit.fit_offload``).

Each figure carries a role: ``fit`` (the constants are fitted on it) or ``check`` (held out).
The split is by card and by run, so that every check figure comes from a card or a model shape
the fit did not see under that harness (see ``ROLE`` and docs/twin.md).
"""

from __future__ import annotations

import json
import sqlite3
import statistics
import tomllib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterator

from autotune.api import ModelSpec
from autotune.api import WeightsBreakdown
from autotune._builtin import get_gpu, get_model, load_gpu_catalog, load_model_catalog, weights_for

from autotune_plugins.twin import physics
from autotune_plugins.twin.formats import twin_formats

REPO = Path(__file__).resolve().parents[2]
PUBLISHED = REPO / "autotune" / "data" / "published_decode.toml"
RESULTS = REPO / "bench" / "results"

# Which published cards the constants are fitted on; every other card is held out. The fit
# cards span the generations the catalog's figures cover (Pascal P40, Volta V100s, Ampere A100,
# Ada 4090); the RTX 3090, the RTX 3090 Ti and the H200's Qwen shape are checked, never fitted. The V100s are
# fitted because the article's rows, the only other Volta evidence, are all partly offloaded
# and cannot separate Volta's kernel efficiency from the cost of running layers on the host.
FIT_CARDS = {"llama.cpp": {"p40", "v100-16gb", "v100-32gb", "a100-80gb", "rtx4090"}, "exllamav2": {"rtx4090"}}


@dataclass(frozen=True)
class Figure:
    """One measured figure and the scenario the twin predicts it for."""

    id: str
    source: str
    role: str  # "fit" or "check"
    metric: str  # decode_tok_s, per_user_tok_s or aggregate_tok_s
    value: float
    scenario: physics.Scenario
    weights: str  # the format, as the twin reads it
    lower_bound: bool = False  # the source says the card does at least this (published_decode.toml)

    @property
    def gpu(self) -> str:
        return self.scenario.gpu.key


def _scenario(
    engine: str,
    gpu: str,
    model: str,
    weights: str,
    *,
    ctx: int = 4096,
    parallel: int = 1,
    cache: str | None = None,
    flash_attn: bool | None = None,
    prompt: int = 0,
    output: int = 128,
    harness: str = "bench",
) -> physics.Scenario:
    m = get_model(model)
    return physics.Scenario(
        engine=engine,
        gpu=get_gpu(gpu),
        model=m,
        weights=weights_for(m, weights, twin_formats()),
        ctx=ctx,
        parallel=parallel,
        cache_type=cache or ("f16" if engine == "llama.cpp" else "fp16"),
        flash_attn=(engine == "exllamav2") if flash_attn is None else flash_attn,
        prompt_tokens=max(prompt, 1),
        output_tokens=output,
        harness=harness,
    )


def published() -> Iterator[Figure]:
    """The published figures whose card, model and format the catalogs know."""
    doc = tomllib.loads(PUBLISHED.read_text(encoding="utf-8"))
    gpus, models = load_gpu_catalog(), load_model_catalog()
    for i, f in enumerate(doc["figure"]):
        if f["gpu"] not in gpus or f["model"] not in models or f["weights"].startswith("gptq:"):
            continue
        prompt, output = int(f.get("prompt_tokens", 0)), int(f.get("output_tokens", 128))
        s = _scenario(
            f["engine"],
            f["gpu"],
            f["model"],
            f["weights"],
            ctx=max(512, prompt + output),
            flash_attn=f.get("flash_attn"),
            prompt=prompt,
            output=output,
        )
        role = "fit" if f["gpu"] in FIT_CARDS.get(f["engine"], ()) else "check"
        yield Figure(
            f"pub{i}",
            f["source"],
            role,
            "decode_tok_s",
            float(f["decode_tok_s"]),
            s,
            f["weights"],
            bool(f.get("lower_bound", False)),
        )


# The H200's synthetic shapes: the catalog's Qwen2.5-7B (llama.cpp's qwen2 vocabulary, 151,936
# tokens, is 128 short of the HF config's: no measurable difference) and Llama-3.1-8B.
H200_MODELS = {"q7b": "qwen2.5-7b", "l8b": "llama-3.1-8b"}
LLAMA_BENCH_TYPES = {
    "F16": "gguf:F16",
    "Q8_0": "gguf:Q8_0",
    "Q4_0": "gguf:Q4_0",
    "Q4_K - Medium": "gguf:Q4_K_M",
    "Q5_K - Medium": "gguf:Q5_K_M",
}


def h200_llama_bench() -> Iterator[Figure]:
    """llama-bench tg128 on the H200 (flash-attn on and off): the Llama shape is fitted, the
    Qwen shape held out."""
    for family, model in H200_MODELS.items():
        path = RESULTS / "h200_grids" / f"llama_bench_{family}.json"
        for r in json.loads(path.read_text(encoding="utf-8")):
            if r["n_gen"] == 0:
                continue
            fmt = LLAMA_BENCH_TYPES[r["model_type"].split(" ", 2)[-1]]
            s = _scenario("llama.cpp", "h200", model, fmt, ctx=512, flash_attn=bool(r["flash_attn"]), output=r["n_gen"])
            yield Figure(
                f"h200-bench-{family}-{fmt}-fa{int(r['flash_attn'])}",
                str(path.relative_to(REPO)),
                "fit" if family == "l8b" else "check",
                "decode_tok_s",
                float(r["avg_ts"]),
                s,
                fmt,
            )


def _weights_format(path: str) -> str:
    """The synthetic files are named <shape>-<TYPE>.gguf."""
    return "gguf:" + Path(path).stem.rsplit("-", 1)[-1]


def _server(
    figure_id: str,
    source: str,
    role: str,
    model: str,
    config: dict[str, Any],
    prompt: int,
    output: int,
    metrics: dict[str, float | None],
) -> Iterator[Figure]:
    fmt = _weights_format(config["weights"])
    s = _scenario(
        "llama.cpp",
        "h200",
        model,
        fmt,
        ctx=int(config["ctx"]),
        parallel=int(config["parallel"]),
        cache=config["cache_type"],
        flash_attn=bool(config["flash_attn"]),
        prompt=prompt,
        output=output,
        harness="server",
    )
    for metric, value in metrics.items():
        if value:
            yield Figure(f"{figure_id}-{metric}", source, role, metric, float(value), s, fmt)


def h200_probe() -> Iterator[Figure]:
    """bench/results/h200_llama_server_probe.json: 12 configurations, 1 and 4 streams (fitted)."""
    path = RESULTS / "h200_llama_server_probe.json"
    for i, r in enumerate(json.loads(path.read_text(encoding="utf-8"))["rows"]):
        config = {
            "weights": r["model"].removesuffix(".gguf"),
            "ctx": r["ctx_per_slot"],
            "parallel": r["parallel"],
            "cache_type": r["cache_type"],
            "flash_attn": True,
        }
        per_user = statistics.median(r["decode_tok_s_per_stream"])
        metrics = {"per_user_tok_s": per_user, "aggregate_tok_s": r["aggregate_tok_s"]}
        yield from _server(
            f"h200-probe{i}",
            str(path.relative_to(REPO)),
            "fit",
            "qwen2.5-7b",
            config,
            int(r["prompt_tokens"]),
            256,
            metrics,
        )


def h200_small_model() -> Iterator[Figure]:
    """bench/results/h200_exllamav2_study.json's llama-server trials: a Qwen2.5-1.5B shape, 1-8
    streams (fitted: with the 7B it separates per-stream sampling, the same for both shapes,
    from per-stream arithmetic, five times smaller for the 1.5B)."""
    path = RESULTS / "h200_exllamav2_study.json"
    for t in json.loads(path.read_text(encoding="utf-8")):
        if t["state"] != "COMPLETE" or t["backend"] != "llama-server":
            continue
        config = {"weights": t["weights"], "ctx": t["ctx"], "parallel": t["parallel"], **t["options"]}
        metrics = {k: t[k] for k in ("decode_tok_s", "per_user_tok_s", "aggregate_tok_s")}
        yield from _server(
            f"h200-1.5b-{t['trial']}", str(path.relative_to(REPO)), "fit", "qwen2.5-1.5b", config, 512, 128, metrics
        )


def h200_study() -> Iterator[Figure]:
    """bench/results/h200_llama_study_trials.json: 35 trials, 1-16 streams (held out)."""
    path = RESULTS / "h200_llama_study_trials.json"
    for t in json.loads(path.read_text(encoding="utf-8")):
        if t["state"] != "COMPLETE":
            continue
        metrics = {"decode_tok_s": t["decode"], "per_user_tok_s": t["per_user"], "aggregate_tok_s": t["agg"]}
        yield from _server(
            f"h200-study{t['n']}", str(path.relative_to(REPO)), "check", "qwen2.5-7b", t["config"], 512, 128, metrics
        )


# The grids' first runs, both held out: the fit sees how streams share a step only in the probe
# (7B, 1 and 4 streams) and the 1.5B trials (1-8 streams).
GRIDS = {
    "h200_grid_qwen7b": ("qwen2.5-7b", 512, 128, "check"),
    "h200_grid_llama8b": ("llama-3.1-8b", 1024, 128, "check"),
}


def h200_grids() -> Iterator[Figure]:
    """The two exhaustive grids' first runs (bench/results/h200_grids/*-run1.db)."""
    for name, (model, prompt, output, role) in GRIDS.items():
        path = RESULTS / "h200_grids" / f"{name}-run1.db"
        con = sqlite3.connect(f"file:{path}?immutable=1", uri=True)  # writes nothing beside it
        try:
            rows = con.execute(
                "SELECT t.trial_id, t.number, a.key, a.value_json FROM trials t JOIN trial_user_attributes a "
                "ON a.trial_id = t.trial_id WHERE t.state = 'COMPLETE' AND a.key IN ('config', 'metrics')"
            ).fetchall()
        finally:
            con.close()
        trials: dict[int, dict[str, Any]] = {}
        for trial_id, number, key, value in rows:
            trials.setdefault(number, {})[key] = json.loads(value)
        for number, t in sorted(trials.items()):
            if "config" not in t or "metrics" not in t:
                continue
            m = t["metrics"]
            metrics = {k: m[k]["median"] for k in ("decode_tok_s", "per_user_tok_s", "aggregate_tok_s") if k in m}
            yield from _server(
                f"{name}-{number}", str(path.relative_to(REPO)), role, model, t["config"], prompt, output, metrics
            )


def everything() -> list[Figure]:
    return [
        *published(),
        *h200_llama_bench(),
        *h200_probe(),
        *h200_small_model(),
        *h200_study(),
        *h200_grids(),
        *h200_offload(),
    ]


# ----------------------------------------------------------------------------- offload and MoE
#
# bench/results/offload_probe_h200 (issue 27): llama-server on one H200 with part of the model in
# host memory, -ngl / --n-cpu-moe / -ub / --fit, one stream, decode and prompt tok/s. The machine
# is a 16-core slice of its host (README.md there), which llama-server runs with 16 threads.
OFFLOAD = RESULTS / "offload_probe_h200"
OFFLOAD_THREADS = 16
# The two new host constants (HostConstants.host_thread_gb_s, host_pcie_efficiency) are fitted on
# the dense sweep's two ends, all layers on the host and 20 of 28 on the GPU (-ngl 0 and 21, -ub
# 512), decode and prompt; every other point, and every MoE point, is held out.
OFFLOAD_FIT = {("offload_dense", "ngl=0 ub=512"), ("offload_dense", "ngl=21 ub=512")}
# What --fit chose in each run, from its own log (fit_log: "set ngl_per_device[0].n_layer=7";
# "(n_layer, n_part)=(13, 11)"); on the free card it changed nothing.
FIT_CHOICES = {("offload_held", "q7b"): {"ngl": "7"}, ("offload_held", "q30a3b12"): {"ngl": "13", "ncmoe": "11"}}


def moe_probe_model() -> ModelSpec:
    """The probe's MoE: a Qwen3-30B-A3B shape cut to 12 of its 48 layers (bench/h200_offload_probe.sh:
    `autotune synth --arch qwen3moe --layers 12 --hidden 2048 --heads 32 --kv-heads 4 --head-dim 128
    --experts 128 --experts-used 8 --expert-ffn 768`, qwen2 vocabulary of 151,936 tokens)."""
    h, v, e, f, n = 2048, 151936, 128, 768, 12
    per_layer = 2 * h * 4096 + 2 * h * 512 + 2 * 128 + h * e + e * 3 * h * f + 2 * h
    return ModelSpec(
        key="qwen3-30b-a3b-12l",
        name="Qwen3-30B-A3B shape, 12 layers (synthetic)",
        architecture="qwen3moe",
        n_layers=n,
        hidden_size=h,
        n_heads=32,
        n_kv_heads=4,
        head_dim=128,
        ffn_size=6144,
        vocab_size=v,
        n_params=2 * v * h + n * per_layer + h,
        tie_embeddings=False,
        max_context=32768,
        source="bench/h200_offload_probe.sh",
        n_experts=e,
        n_experts_used=8,
        expert_ffn_size=f,
    )


def moe_gguf_weights(model: ModelSpec, file_type: str) -> WeightsBreakdown:
    """A qwen3moe GGUF's bytes as llama-quantize writes them: the GGUF plan of the same shape with
    each layer's experts stacked as one MLP of E x expert_ffn (the same elements, rows and the same
    type rules: ffn_down_exps takes ffn_down's), plus the router (ffn_gate_inp, kept F32). The
    GGUF size predictor does not know expert tensors yet (issue 27, item 2); the probe's logged
    buffers check this (tests/plugins/test_twin_offload.py)."""
    stacked = replace(
        model,
        architecture="qwen3",
        ffn_size=model.n_experts * model.expert_ffn_size,
        n_experts=0,
        n_experts_used=0,
        expert_ffn_size=0,
    )
    w = weights_for(stacked, f"gguf:{file_type}", twin_formats())
    router = model.hidden_size * model.n_experts * 4
    return replace(w, per_layer_bytes=tuple(b + router for b in w.per_layer_bytes))


def _offload_case(source: str, model_file: str, case: dict[str, str]) -> dict[str, str]:
    if case.get("fit") == "on":
        return FIT_CHOICES.get((source, model_file.split("-")[0]), {"ngl": "999"})
    return case


def offload_scenario(model_file: str, case: dict[str, str], prompt: int, output: int) -> physics.Scenario:
    """The twin's scenario of one probe run: -ngl 999 is every layer ("all")."""
    fmt = _weights_format(model_file)
    if model_file.startswith("q30a3b12"):
        model = moe_probe_model()
        weights = moe_gguf_weights(model, fmt.split(":")[1])
    else:
        model = get_model(H200_MODELS["q7b"])
        weights = weights_for(model, fmt, twin_formats())
    ngl = int(case.get("ngl", "999"))
    return physics.Scenario(
        engine="llama.cpp",
        gpu=get_gpu("h200"),
        model=model,
        weights=weights,
        ctx=4096,
        parallel=1,
        cache_type="f16",
        flash_attn=True,
        prompt_tokens=prompt,
        output_tokens=output,
        harness="server",
        gpu_layers="all" if ngl > model.n_layers else ngl,
        n_cpu_moe=int(case.get("ncmoe", "0")),
        ubatch=int(case.get("ub", str(physics.LLAMA_UBATCH))),
        host_threads=OFFLOAD_THREADS,
    )


def h200_offload_predicted(
    engines: dict[str, physics.EngineConstants], host: physics.HostConstants
) -> list[tuple[Figure, float]]:
    """Each offload probe figure beside what the twin predicts for it with ``engines`` and
    ``host`` (bench/twin_offload_check.py prints them, tests/plugins/test_twin_offload.py holds them)."""
    return [
        (f, float(getattr(physics.predict(f.scenario, engines[f.scenario.engine], host), f.metric)))
        for f in h200_offload()
    ]


def h200_offload() -> Iterator[Figure]:
    """The offload probe's runs that answered: decode and prompt tok/s, each the mean of its two
    requests (a run whose server died, -ngl 14 under the 3 GiB budget, has none)."""
    for source in ("offload_dense", "offload_moe", "offload_held"):
        path = OFFLOAD / f"{source}.jsonl"
        for line in path.read_text(encoding="utf-8").splitlines():
            r = json.loads(line)
            runs = r.get("runs") or []
            if not runs:
                continue
            label = " ".join(f"{k}={v}" for k, v in r["case"].items())
            case = _offload_case(source, r["model"], r["case"])
            s = offload_scenario(r["model"], case, int(runs[0]["prompt_n"]), int(runs[0]["predicted_n"]))
            role = "fit" if (source, label) in OFFLOAD_FIT else "check"
            for metric, key in (("decode_tok_s", "decode_tok_s"), ("prefill_tok_s", "prompt_tok_s")):
                value = statistics.mean(float(x[key]) for x in runs)
                yield Figure(
                    f"offload-{source}-{r['model'].split('-')[0]}-{label.replace(' ', '-')}-{metric}",
                    str(path.relative_to(REPO)),
                    role,
                    metric,
                    value,
                    s,
                    _weights_format(r["model"]),
                )


def is_offload(figure: Figure) -> bool:
    """A figure of the offload probe: it fits only the offload constants (fit.fit_offload)."""
    return figure.id.startswith("offload-")


def implied_routed_share(figure: Figure, k: physics.EngineConstants, host: physics.HostConstants) -> float | None:
    """For a MoE prefill figure with experts (and only experts) in host memory: the share of each
    host layer's experts one ubatch must have copied for the twin's crossing, at the PCIe rate the
    dense crossings were fitted at, to take the measured time beyond the same model's time with
    every expert on the GPU. The twin assumes uniform routing (all 128 experts for any ubatch of
    a few hundred tokens); a share well below 1, the same at one ubatch size whatever the number
    of host layers, says the measured prompt routes its tokens to fewer experts (docs/twin.md,
    bench/twin_probe_routing.py). None for other figures."""
    s = figure.scenario
    if not (s.model.is_moe and figure.metric == "prefill_tok_s" and s.n_cpu_moe and s.gpu_layers == "all"):
        return None
    gpu_layers = physics.gpu_layer_split(s, k, physics.memory(s, k))
    where = physics.placement(s, gpu_layers)
    tokens = s.parallel * s.prompt_tokens
    all_gpu = replace(s, n_cpu_moe=0)
    gpu_s = tokens / physics.prefill_tok_s(all_gpu, k, host, gpu_layers)
    crossings = len(physics.offload.ubatch_sizes(tokens, s.ubatch))
    pcie = s.gpu.pcie_gb_s * 1e9 * host.host_pcie_efficiency
    copy_s = tokens / figure.value - gpu_s - crossings * where.host_dense_bytes / pcie
    return copy_s * pcie / (crossings * where.host_expert_bytes)


# ----------------------------------------------------------------------------- exllamav3 (EXL3)
#
# exllamav3 publishes no decode tok/s: its README and doc/ (read at v1.4.1, 4f8ad01) give
# perplexity plots and conversion times, nothing else timed. What it does say, in its README and
# in its kernels' comments, is where its decode GEMV stops being bound by DRAM and starts being
# bound by decoding the trellis on the SMs' INT32 lanes, card by card: enough to pin the one
# constant the twin adds for EXL3 (trellis_ops_per_weight), fitted on one card, checked on two.


@dataclass(frozen=True)
class KernelFigure:
    """What exllamav3 says of its decode kernel (m = 1) on one card at ``bits`` per weight.

    ``what``: ``ridge_bits`` (the bitrate from which the kernel is DRAM-bound: ``value``),
    ``bandwidth_share`` (the share of the card's DRAM peak its fp16 kernel reaches, ``value`` =
    (low, high)), ``memory_bound`` or ``compute_bound`` (which side of the ridge ``bits`` is on).
    """

    id: str
    source: str
    role: str
    gpu: str
    bits: float
    what: str
    value: tuple[float, float] = (0.0, 0.0)


_INT8_GATE = (
    "exllamav3 exllamav3/exllamav3_ext/quant/exl3_gemv_int8.cu, the comment over exl3_gemv_int8_max_k (4f8ad01)"
)
EXL3_KERNEL = (
    KernelFigure(
        "exl3-3090-ridge",
        f"{_INT8_GATE}: 'Ampere is DRAM-bound from K = 6 up (3090: int8 -29/-22/-9/-6% at K=2/3/4/5 ...)'",
        "fit",
        "rtx3090",
        6.0,
        "ridge_bits",
        (6.0, 6.0),
    ),
    KernelFigure(
        "exl3-h200-share",
        "https://github.com/turboderp-org/exllamav3/issues/242 (H200 SXM, EXL3 6.0 bpw: "
        "'the best achieved bandwidth is 21-29% of peak', per-SM INT32 throughput the limit); "
        f"{_INT8_GATE}: 'Hopper's fp16 kernel is per-SM INT-throughput-bound at K = 6'",
        "check",
        "h200",
        6.0,
        "bandwidth_share",
        (0.21, 0.29),
    ),
    KernelFigure(
        "exl3-4090-memory-bound",
        "exllamav3 README.md: 'roughly memory-bound latency under optimal "
        "conditions (4bpw, RTX 4090)'; exl3_gemv.cu: 'Ada/Blackwell are memory-bound here'",
        "check",
        "rtx4090",
        4.0,
        "memory_bound",
    ),
    KernelFigure(
        "exl3-3090-low-bits",
        "exllamav3 README.md: 'still needs some work to achieve the same efficiency "
        f"on Ampere and to remain memory-bound at lower bitrates'; {_INT8_GATE}: 3090 int8 -29% at K=2",
        "check",
        "rtx3090",
        2.0,
        "compute_bound",
    ),
)


def exl3_kernel_seconds(gpu: str, bits: float, k: physics.EngineConstants) -> tuple[float, float]:
    """(memory, trellis decode) seconds per weight of the decode GEMV at ``bits`` on ``gpu``."""
    g = get_gpu(gpu)
    memory = bits / 8 / (g.mem_bandwidth_gb_s * 1e9 * physics.bandwidth_efficiency(g, k))
    return memory, k.trellis_ops_per_weight / (physics.int32_tops(g) * 1e12)


def exl3_kernel_predicted(f: KernelFigure, k: physics.EngineConstants) -> float:
    """The twin's figure for ``f``: the ridge's bits, the share of DRAM peak reached, or the
    trellis decode's time over the memory's (below 1: memory-bound)."""
    memory, trellis = exl3_kernel_seconds(f.gpu, f.bits, k)
    if f.what == "ridge_bits":
        return f.bits * trellis / memory
    if f.what == "bandwidth_share":
        return f.bits / 8 / (physics.soft_max(memory, trellis) * get_gpu(f.gpu).mem_bandwidth_gb_s * 1e9)
    return trellis / memory
