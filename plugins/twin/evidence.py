"""What the twin is fitted on and checked against, read into one shape: measured figures with
the scenario that produced them.

Three kinds of evidence, each kept where it was published or measured:

* published single-stream decode on other cards (``autotune/data/published_decode.toml``: every
  figure with its source), run by llama.cpp's or ExLlamaV2's own benchmark harness, which
  samples nothing (``harness = "bench"``);
* llama-bench on an H200 (``bench/results/h200_grids/llama_bench_*.json``: tg128, this
  project's own synthetic Qwen2.5-7B and Llama-3.1-8B shapes);
* llama-server on an H200 under autotune's protocol (``bench/results/``: the probe, the study
  and the two exhaustive grids), single stream and 1-32 parallel streams.

Each figure carries a role: ``fit`` (the constants are fitted on it) or ``check`` (held out).
The split is by card and by run, so that every check figure comes from a card or a model shape
the fit did not see under that harness (see ``ROLE`` and docs/twin.md).
"""

from __future__ import annotations

import json
import sqlite3
import statistics
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from autotune.formats import weights_for
from autotune.hardware import get_gpu, load_gpu_catalog
from autotune.models import get_model, load_model_catalog

from autotune_plugins.twin import physics
from autotune_plugins.twin.formats import FORMATS

REPO = Path(__file__).resolve().parents[2]
PUBLISHED = REPO / "autotune" / "data" / "published_decode.toml"
RESULTS = REPO / "bench" / "results"

# Which published cards the constants are fitted on; every other card is held out. The fit
# cards span the generations the catalog's figures cover (Pascal P40, Volta V100s, Ampere A100,
# Ada 4090); the RTX 3090 and the H200's Qwen shape are checked, never fitted. The V100s are
# fitted because the article's rows, the only other Volta evidence, are all partly offloaded
# and cannot separate Volta's kernel efficiency from the cost of running layers on the host.
FIT_CARDS = {"llama.cpp": {"p40", "v100-16gb", "v100-32gb", "a100-80gb", "rtx4090"}, "exllamav2": {"rtx4090"}}


@dataclass(frozen=True)
class Figure:
    """One measured figure and the scenario the twin predicts it for."""

    id: str
    source: str
    role: str            # "fit" or "check"
    metric: str          # decode_tok_s, per_user_tok_s or aggregate_tok_s
    value: float
    scenario: physics.Scenario
    weights: str         # the format, as the twin reads it

    @property
    def gpu(self) -> str:
        return self.scenario.gpu.key


def _scenario(engine: str, gpu: str, model: str, weights: str, *, ctx: int = 4096, parallel: int = 1,
              cache: str | None = None, flash_attn: bool | None = None, prompt: int = 0, output: int = 128,
              harness: str = "bench") -> physics.Scenario:
    m = get_model(model)
    return physics.Scenario(
        engine=engine, gpu=get_gpu(gpu), model=m, weights=weights_for(m, weights, FORMATS), ctx=ctx, parallel=parallel,
        cache_type=cache or ("f16" if engine == "llama.cpp" else "fp16"),
        flash_attn=(engine == "exllamav2") if flash_attn is None else flash_attn,
        prompt_tokens=max(prompt, 1), output_tokens=output, harness=harness)


def published() -> Iterator[Figure]:
    """The published figures whose card, model and format the catalogs know."""
    doc = tomllib.loads(PUBLISHED.read_text(encoding="utf-8"))
    gpus, models = load_gpu_catalog(), load_model_catalog()
    for i, f in enumerate(doc["figure"]):
        if f["gpu"] not in gpus or f["model"] not in models or f["weights"].startswith("gptq:"):
            continue
        prompt, output = int(f.get("prompt_tokens", 0)), int(f.get("output_tokens", 128))
        s = _scenario(f["engine"], f["gpu"], f["model"], f["weights"], ctx=max(512, prompt + output),
                      flash_attn=f.get("flash_attn"), prompt=prompt, output=output)
        role = "fit" if f["gpu"] in FIT_CARDS.get(f["engine"], ()) else "check"
        yield Figure(f"pub{i}", f["source"], role, "decode_tok_s", float(f["decode_tok_s"]), s, f["weights"])


# The H200's synthetic shapes: the catalog's Qwen2.5-7B (llama.cpp's qwen2 vocabulary, 151,936
# tokens, is 128 short of the HF config's: no measurable difference) and Llama-3.1-8B.
H200_MODELS = {"q7b": "qwen2.5-7b", "l8b": "llama-3.1-8b"}
LLAMA_BENCH_TYPES = {"F16": "gguf:F16", "Q8_0": "gguf:Q8_0", "Q4_0": "gguf:Q4_0",
                     "Q4_K - Medium": "gguf:Q4_K_M", "Q5_K - Medium": "gguf:Q5_K_M"}


def h200_llama_bench() -> Iterator[Figure]:
    """llama-bench tg128 on the H200 (flash-attn on and off): the Llama shape is fitted, the
    Qwen shape held out."""
    for family, model in H200_MODELS.items():
        path = RESULTS / "h200_grids" / f"llama_bench_{family}.json"
        for r in json.loads(path.read_text(encoding="utf-8")):
            if r["n_gen"] == 0:
                continue
            fmt = LLAMA_BENCH_TYPES[r["model_type"].split(" ", 2)[-1]]
            s = _scenario("llama.cpp", "h200", model, fmt, ctx=512, flash_attn=bool(r["flash_attn"]),
                          output=r["n_gen"])
            yield Figure(f"h200-bench-{family}-{fmt}-fa{int(r['flash_attn'])}", str(path.relative_to(REPO)),
                         "fit" if family == "l8b" else "check", "decode_tok_s", float(r["avg_ts"]), s, fmt)


def _weights_format(path: str) -> str:
    """The synthetic files are named <shape>-<TYPE>.gguf."""
    return "gguf:" + Path(path).stem.rsplit("-", 1)[-1]


def _server(figure_id: str, source: str, role: str, model: str, config: dict[str, Any], prompt: int,
            output: int, metrics: dict[str, float | None]) -> Iterator[Figure]:
    fmt = _weights_format(config["weights"])
    s = _scenario("llama.cpp", "h200", model, fmt,
                  ctx=int(config["ctx"]), parallel=int(config["parallel"]), cache=config["cache_type"],
                  flash_attn=bool(config["flash_attn"]), prompt=prompt, output=output, harness="server")
    for metric, value in metrics.items():
        if value:
            yield Figure(f"{figure_id}-{metric}", source, role, metric, float(value), s, fmt)


def h200_probe() -> Iterator[Figure]:
    """bench/results/h200_llama_server_probe.json: 12 configurations, 1 and 4 streams (fitted)."""
    path = RESULTS / "h200_llama_server_probe.json"
    for i, r in enumerate(json.loads(path.read_text(encoding="utf-8"))["rows"]):
        config = {"weights": r["model"].removesuffix(".gguf"), "ctx": r["ctx_per_slot"], "parallel": r["parallel"],
                  "cache_type": r["cache_type"], "flash_attn": True}
        per_user = statistics.median(r["decode_tok_s_per_stream"])
        metrics = {"per_user_tok_s": per_user, "aggregate_tok_s": r["aggregate_tok_s"]}
        yield from _server(f"h200-probe{i}", str(path.relative_to(REPO)), "fit", "qwen2.5-7b", config,
                           int(r["prompt_tokens"]), 256, metrics)


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
        yield from _server(f"h200-1.5b-{t['trial']}", str(path.relative_to(REPO)), "fit", "qwen2.5-1.5b",
                           config, 512, 128, metrics)


def h200_study() -> Iterator[Figure]:
    """bench/results/h200_llama_study_trials.json: 35 trials, 1-16 streams (held out)."""
    path = RESULTS / "h200_llama_study_trials.json"
    for t in json.loads(path.read_text(encoding="utf-8")):
        if t["state"] != "COMPLETE":
            continue
        metrics = {"decode_tok_s": t["decode"], "per_user_tok_s": t["per_user"], "aggregate_tok_s": t["agg"]}
        yield from _server(f"h200-study{t['n']}", str(path.relative_to(REPO)), "check", "qwen2.5-7b",
                           t["config"], 512, 128, metrics)


# The grids' first runs, both held out: the fit sees how streams share a step only in the probe
# (7B, 1 and 4 streams) and the 1.5B trials (1-8 streams).
GRIDS = {"h200_grid_qwen7b": ("qwen2.5-7b", 512, 128, "check"), "h200_grid_llama8b": ("llama-3.1-8b", 1024, 128, "check")}


def h200_grids() -> Iterator[Figure]:
    """The two exhaustive grids' first runs (bench/results/h200_grids/*-run1.db)."""
    for name, (model, prompt, output, role) in GRIDS.items():
        path = RESULTS / "h200_grids" / f"{name}-run1.db"
        con = sqlite3.connect(f"file:{path}?immutable=1", uri=True)  # writes nothing beside it
        try:
            rows = con.execute(
                "SELECT t.trial_id, t.number, a.key, a.value_json FROM trials t JOIN trial_user_attributes a "
                "ON a.trial_id = t.trial_id WHERE t.state = 'COMPLETE' AND a.key IN ('config', 'metrics')").fetchall()
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
            yield from _server(f"{name}-{number}", str(path.relative_to(REPO)), role, model, t["config"],
                               prompt, output, metrics)


def everything() -> list[Figure]:
    return [*published(), *h200_llama_bench(), *h200_probe(), *h200_small_model(), *h200_study(), *h200_grids()]
