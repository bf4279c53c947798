"""``autotune quality``: one artifact's quality, measured outside a study.

Thin: it builds the backend's context from the flags, runs the same metric a study would
(:func:`measure_quality`) and prints the figure with its standard error, or JSON.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import click

from autotune._builtin import ConfigError, echo, handle_errors

__all__ = ["add_quality_command", "measure_quality"]

BENCHMARK_NAMES = ("mmlu", "ceval", "kld")
# The command's defaults are a quick look: one item per subject, zero-shot (57 MMLU items, under
# a minute for a small model on a 2-core CPU). A study's defaults (per_subject 5, shots 5: 285
# items, each behind five worked examples) took over 10 minutes for a 260K-parameter model there;
# `--per-subject 5 --shots 5` gives the figure a study would.
QUICK = {"per_subject": 1, "shots": 0}


def _context(settings: dict[str, Any]):
    from autotune.api import StudyContext
    from autotune._builtin import Workload
    from autotune._builtin import Protocol

    # A scorer needs the backend's settings and where relative paths start; the GPU, model and
    # workload of a study play no part in scoring, so none is resolved here.
    return StudyContext(
        gpu=None,
        model=None,
        workload=Workload(1, 1),
        vram_budget_bytes=0,  # type: ignore[arg-type]
        protocol=Protocol(),
        settings=settings,
        base_dir=Path.cwd(),
    )


def measure_quality(
    backend_name: str,
    weights: str,
    benchmark: str,
    *,
    cache_type: str | None = None,
    per_subject: int = 5,
    shots: int = 5,
    seed: int = 0,
    reference: str | None = None,
    settings: dict[str, Any] | None = None,
    progress: Callable[[int, int], None] | None = None,
    announce: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Measure one artifact with the ``mmlu``, ``ceval`` or ``kld`` metric.

    Args:
        progress: Called with (items or windows done, in all) as the measurement goes.
        announce: Called once, after the inputs are checked and before the slow part starts,
            with a line saying what is about to be measured.

    Returns:
        ``benchmark``, ``n``, ``stderr``, ``seconds``, and ``accuracy`` (mmlu, ceval) or
        ``kld_mean`` and ``top1_agreement`` (kld), plus ``details``.

    Raises:
        ConfigError: Unknown backend or benchmark, a missing file, kld without a reference, or
            a backend without scoring / lm-eval missing (the metric's own reason).
    """
    from autotune._builtin import QualityReference, get_backend, get_metric
    from autotune.api import TrialConfig

    if benchmark not in BENCHMARK_NAMES:
        raise ConfigError(f"--benchmark {benchmark!r}: use one of {', '.join(BENCHMARK_NAMES)}")
    backend = get_backend(backend_name)
    metric = get_metric(benchmark)
    settings = dict(settings or {})
    why = metric.supports(backend)
    if why:
        raise ConfigError(f"--benchmark {benchmark}: {why}")
    ctx = _context(settings)
    for flag, path in (("--weights", weights), ("--reference", reference)):
        if path is not None:
            problem = backend.check_weights(path, ctx)
            if problem and not ctx.path(path).exists():
                # There is no study file here: a relative path starts at the current directory.
                problem = f"no such file or directory (relative to the current directory {Path.cwd()})"
            if problem:
                raise ConfigError(f"{flag} {path!r}: {problem}")
    options = {"cache_type": cache_type} if cache_type else {}
    config = TrialConfig(backend.name, weights, 0, 1, tuple(options.items()))
    references = {}
    if benchmark == "kld":
        if reference is None:
            raise ConfigError("--benchmark kld: needs --reference PATH (the highest-precision file of the same model)")
        # The reference keeps the most precise cache, as a study's reference does.
        references[backend.name] = QualityReference(TrialConfig(backend.name, reference, 0, 1), backend, ctx)
    metric.configure({"per_subject": per_subject, "shots": shots, "seed": seed}, references)
    metric.progress = progress
    if announce is not None:
        announce(_plan(benchmark, per_subject, shots))
    value = metric.evaluate(config, backend, ctx)
    out: dict[str, Any] = {"benchmark": benchmark, "weights": weights, "cache_type": cache_type, "n": value.n}
    details = dict(value.details or {})
    if benchmark == "kld":
        out.update(kld_mean=value.value, top1_agreement=details.get("top1_agreement"), reference=reference)
    else:
        out.update(accuracy=value.value, per_subject=per_subject, shots=shots, seed=seed)
    out.update(stderr=value.stderr, seconds=value.seconds, details=details)
    return out


def _settings(ctx: click.Context, param: click.Parameter, values: tuple[str, ...]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in values:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{item!r}: use KEY=VALUE, e.g. threads=4")
        out[key] = int(raw) if raw.lstrip("-").isdigit() else raw
    return out


def add_quality_command(cli: click.Group) -> None:
    """Register ``autotune quality`` on the top-level group."""

    @cli.command("quality")
    @click.option("--backend", "backend_name", required=True, help="Backend that loads the weights (autotune plugins).")
    @click.option("--weights", required=True, help="The artifact: a file (GGUF) or directory (EXL2).")
    @click.option("--cache", "cache_type", default=None, help="KV-cache type to load it with (default: the engine's).")
    @click.option("--benchmark", type=click.Choice(BENCHMARK_NAMES), required=True, help="What to measure.")
    @click.option(
        "--per-subject",
        type=click.IntRange(1, 10),
        default=QUICK["per_subject"],
        show_default=True,
        help="Items per subject (mmlu, ceval). A study's [quality] default is 5.",
    )
    @click.option(
        "--shots",
        type=click.IntRange(0, 5),
        default=QUICK["shots"],
        show_default=True,
        help="Dev examples before each question (mmlu, ceval). A study's [quality] default is 5.",
    )
    @click.option("--seed", type=click.IntRange(0), default=0, show_default=True, help="Chooses the subset.")
    @click.option("--reference", default=None, help="kld: the highest-precision file of the same model.")
    @click.option(
        "--set",
        "settings",
        multiple=True,
        callback=_settings,
        metavar="KEY=VALUE",
        help="A backend setting, as in the study file's [backends.NAME] (e.g. threads=4).",
    )
    @click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
    @click.pass_context
    def quality(
        ctx: click.Context,
        backend_name: str,
        weights: str,
        cache_type: str | None,
        benchmark: str,
        per_subject: int,
        shots: int,
        seed: int,
        reference: str | None,
        settings: dict[str, Any],
        as_json: bool,
    ) -> None:
        """Measure one artifact's quality: MMLU or C-Eval accuracy, or KL divergence vs --reference.

        The defaults are a quick look (one item per subject, zero-shot); --per-subject 5
        --shots 5 measures what a study does by default. Progress goes to stderr: a bar on a
        terminal, a line every few seconds elsewhere.
        """
        from autotune_plugins.quality.progress import QualityProgress

        with handle_errors((ctx.obj or {}).get("debug", False)):
            unit = "windows" if benchmark == "kld" else "items"
            with QualityProgress(f"{benchmark} {Path(weights).name}", unit) as progress:
                result = measure_quality(
                    backend_name,
                    weights,
                    benchmark,
                    cache_type=cache_type,
                    per_subject=per_subject,
                    shots=shots,
                    seed=seed,
                    reference=reference,
                    settings=settings,
                    progress=progress.update,
                    announce=progress.note,
                )
        if as_json:
            echo(json.dumps(result, indent=2, ensure_ascii=False))
            return
        se = f" ± {result['stderr']:.4f}" if result["stderr"] is not None else ""
        if benchmark == "kld":
            echo(
                f"kld {weights} vs {reference}: mean KLD {result['kld_mean']:.5f}{se} nats, top-1 agreement "
                f"{result['top1_agreement']:.1%} on {result['n']} tokens ({result['seconds']:.1f} s)"
            )
        else:
            echo(
                f"{benchmark} {weights}: accuracy {result['accuracy']:.1%}{se} on {result['n']} items "
                f"({per_subject} per subject, {shots}-shot, seed {seed}; {result['seconds']:.1f} s)"
            )


def _plan(benchmark: str, per_subject: int, shots: int) -> str:
    """What is about to happen, said before the model loads (which takes a while on its own)."""
    if benchmark == "kld":
        return "scoring the reference and the artifact on the fixed text"
    from autotune_plugins.quality import benchmarks

    n_subjects = len(benchmarks.load_items(benchmark))  # the metric's supports() has read it already
    return (
        f"{n_subjects * per_subject} items ({per_subject} per subject of {n_subjects}, {shots}-shot); "
        "loading the model and building the tasks"
    )
