"""KL divergence of every artifact of a study against its engine's full-precision load (issue 42):
the quality column of the EXL3 / EXL2 / GGUF table, measured after the study on the same card.

    python bench/exllamav3_h200/kld_artifacts.py STUDY_TOML \
        --reference exllamav3=/tmp/x3/q15b --reference llama-server=gguf:F16 \
        --json kld.json --md kld.md

For each backend of the study, each of its candidates' weights and each cache type its space
searches, the ``kld`` metric a study would run (``autotune_plugins.quality``: mean KL(reference
|| artifact) in nats over the second half of 256-token windows of the fixed text, top-1
agreement), through the backend's own scorer. The reference is the backend's own load of the
full precision (``--reference BACKEND=WEIGHTS``; the study's source directory when not given and
the backend loads it, as exllamav3 and ExLlamaV2 do), with the widest cache the space has: each
figure is the quantization's damage inside its engine, with that engine's FP16 as zero, so the
formats compare without mixing in how two engines differ at full precision (ExLlamaV2 and
transformers differed by nats on a random model: bench/results/h200_exllamav2_scorer_check.md).
Formats are made through the artifact cache the study used (a cache hit after the study). One
artifact's failure is recorded in its row and the others go on.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from autotune.modelfiles import artifacts
from autotune.modelfiles.artifacts import is_format
from autotune.engine.backend import TrialConfig, quality_reference
from autotune.config import load_study_config
from autotune.errors import AutotuneError
from autotune.engine.metric import QualityReference
from autotune.study.prepare import prepare_study

from autotune_plugins.quality.metrics import KldMetric


def _references(pairs: list[str]) -> dict[str, str]:
    out = {}
    for pair in pairs:
        backend, sep, weights = pair.partition("=")
        if not sep or not backend or not weights:
            raise SystemExit(f"--reference {pair!r}: use BACKEND=WEIGHTS, e.g. llama-server=gguf:F16")
        out[backend] = weights
    return out


def _ensure(backend: Any, weights: str, ctx: Any) -> None:
    """A format's file or directory, made (or found) in the artifact cache the study used."""
    if is_format(weights, backend.weight_formats) and ctx.source is not None:
        artifacts.ensure(backend, weights, ctx, say=lambda line: print(line, flush=True))


def measure(study: str, given: dict[str, str], say=print) -> list[dict[str, Any]]:
    prepared = prepare_study(load_study_config(study))
    rows: list[dict[str, Any]] = []
    for name, entry in prepared.space.entries.items():
        backend, ctx = entry.backend, prepared.contexts[name]
        if backend.scoring is None:
            say(f"{name}: no scorer, no KLD")
            continue
        reference = given.get(name)
        if reference is None:
            if ctx.source is None or backend.check_weights(str(ctx.source), ctx):
                raise SystemExit(
                    f"{study}: backend {name!r} does not load the source as it is: name its full "
                    f"precision with --reference {name}=WEIGHTS (e.g. llama-server=gguf:F16)"
                )
            reference = str(ctx.source)
        params = {p.name: p.choices for p in entry.params}
        ref_cache = quality_reference(backend, params).get("cache_type")
        ref_config = TrialConfig(name, reference, 0, 1, (("cache_type", ref_cache),) if ref_cache else ())
        _ensure(backend, reference, ctx)
        metric = KldMetric()
        metric.configure({}, {name: QualityReference(ref_config, backend, ctx)})
        for weights in entry.weights:
            for cache in params.get("cache_type") or (None,):
                row: dict[str, Any] = {
                    "backend": name,
                    "weights": weights,
                    "cache_type": cache,
                    "reference": reference,
                    "reference_cache_type": ref_cache,
                }
                started = time.monotonic()
                try:
                    _ensure(backend, weights, ctx)
                    config = TrialConfig(name, weights, 0, 1, (("cache_type", cache),) if cache else ())
                    row["path"] = (
                        str(backend.weights_path(weights, ctx)) if hasattr(backend, "weights_path") else weights
                    )
                    value = metric.evaluate(config, backend, ctx)
                except AutotuneError as exc:
                    row.update(error=str(exc), seconds=round(time.monotonic() - started, 1))
                    say(f"{name} {weights} {cache}: FAILED {exc}")
                    rows.append(row)
                    continue
                d = value.details or {}
                row.update(
                    kld_mean=value.value,
                    kld_stderr=value.stderr,
                    kld_median=d.get("kld_median"),
                    kld_p99=d.get("kld_p99"),
                    top1_agreement=d.get("top1_agreement"),
                    tokens=value.n,
                    seconds=round(time.monotonic() - started, 1),
                    scorer=d.get("scorer"),
                    reference_scorer=d.get("reference"),
                )
                say(
                    f"{name} {weights} {cache}: KLD {value.value:.5f} nats, top-1 {d.get('top1_agreement', 0):.1%} "
                    f"on {value.n} tokens ({row['seconds']} s)"
                )
                rows.append(row)
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| backend | weights | cache | KLD vs own full precision (nats) | top-1 agreement | tokens | reference | s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ref = f"{r['reference']} ({r['reference_cache_type']})"
        if "error" in r:
            lines.append(
                f"| {r['backend']} | {r['weights']} | {r['cache_type']} | failed: {r['error'][:200]} | | "
                f"| {ref} | {r['seconds']} |"
            )
            continue
        se = f" ± {r['kld_stderr']:.5f}" if r.get("kld_stderr") is not None else ""
        lines.append(
            f"| {r['backend']} | {r['weights']} | {r['cache_type']} | {r['kld_mean']:.5f}{se} "
            f"| {r['top1_agreement']:.1%} | {r['tokens']} | {ref} | {r['seconds']} |"
        )
    lines += [
        "",
        "KLD: mean KL(reference || artifact) per token over the second half of each 256-token window of "
        "the fixed text (plugins/quality/data/kld_text.txt), in nats; the reference is the same engine on the "
        "full-precision weights with the widest cache searched.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("study", help="the study file whose artifacts are scored")
    p.add_argument(
        "--reference",
        action="append",
        default=[],
        metavar="BACKEND=WEIGHTS",
        help="a backend's full precision (default: the study's source, where the backend loads it)",
    )
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--md", help="write the Markdown table here (default: stdout)")
    args = p.parse_args(argv)
    rows = measure(args.study, _references(args.reference), say=lambda line: print(line, file=sys.stderr, flush=True))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    text = markdown(rows)
    if args.md:
        with open(args.md, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 1 if any("error" in r for r in rows) or not rows else 0


if __name__ == "__main__":
    sys.exit(main())
