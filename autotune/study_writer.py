"""``autotune init MODEL``: a study file written for one model on this machine.

From one source model (a Hugging Face directory or a full-precision GGUF file) it writes a
study that validates and runs as it is:

* the device: the card NVML finds (``--gpu auto``), a catalog card, or ``cpu`` (the host, its
  memory the budget) when there is no GPU;
* the backends whose engine is ready here (each backend's own ``preflight``), the others named
  in a comment with the reason;
* for each, the weights formats it can make from the source (``artifact_recipe``) that can fit:
  the study's own judge (``autotune.study.admission``: the rules, the memory model, the budget
  less the safety margin the written file will have) takes each at the lightest configuration
  (ctx of one request, one slot), and a format that never fits is left out with the same line
  the study's pre-search screen would print;
* ctx values from one request's length up to the model's own limit, parallel 1..16, and the
  options each engine searches by default (its cache types, flash attention), less the values
  its rules refuse for every format of this model (a quantized KV cache for a head size the
  engine refuses), named in a comment;
* for a format too large for the card whole, the dimensions its backend splits a model with
  (``offload_space``: layers on the GPU, experts kept in host memory), with the values the judge
  admits, and a comment saying so; such a format is kept instead of left out;
* quality ``kld`` against the source itself (its full-precision format, the largest candidate)
  when the source is full precision and the metric can score the backend, with a bound
  (``MAX_DROP_POINTS``) so that it counts.

Nothing is converted here: artifacts are made by the first trial that needs them. What a
making would fail on is asked of its recipe's dry run (``artifacts.check_makings``: llama.cpp's
converter on the vocabulary only), and a backend whose makings would all fail is left out with
the cause, as the study would stop on it before its first trial.
"""

from __future__ import annotations

import datetime
import itertools
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from autotune import plugins
from autotune.hardware import gpus as hardware
from autotune.toolkit import toml_text
from autotune.engine.backend import Param, StudyContext, TrialConfig, Workload
from autotune.config import MAX_STUDY_NAME, SAFETY_MARGIN_MIB
from autotune.modelfiles.artifacts import check_makings
from autotune.engine.declarations import installed_weight_formats
from autotune.errors import AutotuneError, ConfigError
from autotune.toolkit.shell import command_line
from autotune.engine.formats import normalize_format
from autotune.modelfiles.gguf_file import read_gguf
from autotune.measure import Protocol
from autotune.modelfiles.models import ModelSpec, resolve_model
from autotune.modelfiles.safetensors_dir import read_safetensors_dir
from autotune.study.admission import ADMITTED, INVALID, Admission, Budget, budget_of, budget_text

__all__ = ["StudyDraft", "draft_study", "offered_formats", "render"]

PARALLEL = (1, 2, 4, 8, 16)
# One request: a chat turn on a GPU; shorter on a CPU, where a trial must stay seconds long.
WORKLOAD_GPU = (1024, 256)
WORKLOAD_CPU = (128, 64)
MIN_CTX = 256  # config.py's lower bound of [space] ctx
# Host memory the CPU mode's configurations may use: the rest is the OS's, autotune's and the
# load generator's.
CPU_BUDGET_SHARE = 0.75
QUALITY_METRIC = "kld"
# The quality term must count: a metric with no penalty and no bound is measured and ignored.
# A bound, not a penalty: a penalty is in tok/s per point, whose right size depends on the
# model's speed, which init does not know; a bound is in the metric's own unit. 5 points of KLD
# is a mean 0.05 nats (the kld metric's docstring: about a good 4-bit quantization of an 8B).
MAX_DROP_POINTS = 5.0


@dataclass
class StudyDraft:
    """What ``init`` decided, before it is written as TOML."""

    name: str
    source: Path
    model: ModelSpec
    gpu: hardware.GpuSpec
    gpu_key: str
    budget_gib: float | None
    workload: tuple[int, int]
    candidates: dict[str, list[str]] = field(default_factory=dict)
    left_out: list[str] = field(default_factory=list)
    ctx: list[int] = field(default_factory=list)
    space: dict[str, list[Any]] = field(default_factory=dict)
    quality: str | None = None
    notes: list[str] = field(default_factory=list)
    budget: Budget | None = None  # what the study's judge will allow, as init judged with it
    offload: list[str] = field(default_factory=list)  # formats kept only split between card and host
    refused: list[str] = field(default_factory=list)  # option values the engine's rules refuse for this model


def _ctx_values(model: ModelSpec, sequence: int) -> list[int]:
    """Powers of two from one request's length to the model's context, the limit itself included."""
    low = max(MIN_CTX, 1 << (max(sequence, 1) - 1).bit_length())
    values = []
    c = low
    while c <= model.max_context:
        values.append(c)
        c *= 2
    if model.max_context >= low and model.max_context not in values:
        values.append(model.max_context)
    # A long list makes a long study; keep the short end and the limit.
    if len(values) > 6:
        values = values[:5] + [values[-1]]
    return values


def offered_formats() -> tuple[tuple[str, ...], frozenset[str]]:
    """The formats offered to every backend, and those of them at full precision: what the
    installed backends declare (``BaseBackend.weight_formats``), each family widest first. Each
    backend keeps those it can make from the source; full precision first, because with a
    quality metric the largest candidate is the reference."""
    families = installed_weight_formats().values()
    return (
        tuple(fmt for f in families for fmt in f.offered),
        frozenset(fmt for f in families for fmt in f.full_precision),
    )


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def draft_study(model_ref: str, gpu: str = "auto", name: str | None = None) -> StudyDraft:
    """Decide a study for ``model_ref`` on this machine (see the module docstring).

    Raises:
        ConfigError: The model cannot be read, the GPU key is unknown, or no backend here can
            make any format of it that fits (the message lists each reason).
    """
    source = Path(model_ref).expanduser().absolute()
    if not source.exists():
        raise ConfigError(
            f"{model_ref}: no such file or directory (give a Hugging Face model directory or a "
            "full-precision .gguf file)"
        )
    model = resolve_model(str(source))
    notes: list[str] = []
    if gpu == "auto" and not hardware.detect_gpus():
        notes.append(f"no GPU found ({hardware.nvml_unavailable_reason()}): the study runs on the CPU")
        gpu = hardware.CPU_KEY
    spec = hardware.resolve_gpu(gpu, 0, source="--gpu")
    # A card the catalog lacks is found again by NVML ("auto"); its nvml: key is no catalog key.
    gpu_key = spec.key if spec.key in hardware.load_gpu_catalog() or spec.is_cpu else "auto"
    if spec.is_cpu:
        budget_gib = round(spec.vram_bytes * CPU_BUDGET_SHARE / 2**30, 1)
        workload = WORKLOAD_CPU
    else:
        budget_gib = None
        workload = WORKLOAD_GPU
    # The budget the written file gives the study: its cap (on the CPU) or the card, less the
    # default safety margin it does not override.
    budget = budget_of(spec, int(budget_gib * 2**30) if budget_gib else None, SAFETY_MARGIN_MIB * 2**20)
    if budget_gib:
        budget = Budget(
            budget.memory_bytes,
            budget.margin_bytes,
            f"{CPU_BUDGET_SHARE:.0%} of host memory, [hardware] vram_budget_gib",
        )
    if model.max_context < workload[0] + workload[1]:
        # A model with a short context (stories260K: 128 tokens... here 2048) gets a request that fits.
        prompt = max(1, model.max_context // 2)
        workload = (prompt, max(1, min(workload[1], model.max_context - prompt)))
    # A name taken from the file must be one a study may have (config.study_name_problem): cut
    # to its length and without leading dots, or the file written was refused as it was read.
    derived = re.sub(r"[^A-Za-z0-9_.-]+", "-", source.stem if source.is_file() else source.name)
    name = name or derived.lstrip(".").strip("-")[:MAX_STUDY_NAME].rstrip("-") or "study"
    draft = StudyDraft(
        name=name,
        source=source,
        model=model,
        gpu=spec,
        gpu_key=gpu_key,
        budget_gib=budget_gib,
        workload=workload,
        notes=notes,
        budget=budget,
    )
    draft.ctx = _ctx_values(model, sum(workload))
    if not draft.ctx:
        raise ConfigError(
            f"{source}: the model's context ({model.max_context} tokens) is shorter than the smallest "
            f"ctx a study searches ({MIN_CTX})"
        )

    ctx_of: dict[str, StudyContext] = {}
    judges: dict[str, tuple[Admission, list[Param]]] = {}
    offload: dict[str, list[Any]] = {}
    formats, full_precision_formats = offered_formats()
    for backend_name, backend in plugins.get_backends().items():
        if backend.predictor is not None:
            continue
        ctx = StudyContext(
            gpu=spec,
            model=model,
            workload=Workload(*workload),
            vram_budget_bytes=budget.bytes,
            protocol=Protocol(),
            source=source,
            for_gpu=False if spec.is_cpu else None,
        )
        problems = backend.preflight(ctx)
        if problems:
            draft.left_out.append(f"backend {backend_name}: " + "; ".join(problems))
            continue
        judge = Admission.for_backend(backend, ctx)
        params = [p for p in backend.parameters({}) if p.choices]

        def lightest(weights: str) -> tuple[TrialConfig, Any] | None:
            return judge.lightest(TrialConfig(backend_name, weights, draft.ctx[0], 1), params)

        kept: list[str] = []
        mine: dict[str, list[Any]] = {}  # this backend's split values
        whole = False  # whether one of its formats fits the card whole
        unmakable: dict[str, str] = {}  # format -> why it cannot be made from the source
        for fmt in formats:
            try:
                recipe = (
                    None
                    if backend.artifacts is None
                    else backend.artifacts.recipe(normalize_format(fmt, backend.weight_formats), source, ctx)
                )
            except AutotuneError as exc:
                unmakable[fmt] = str(exc)
                continue
            if recipe is None:
                continue  # another engine's format
            found = lightest(fmt)
            if found is not None and found[1].kind == INVALID:
                draft.left_out.append(f"{backend_name} {fmt}: {'; '.join(found[1].reasons)}")
            elif found is not None and found[1].kind != ADMITTED:
                split = {} if spec.is_cpu else _offload_values(backend, judge, fmt, ctx, draft.ctx[0], params)
                if split:
                    kept.append(fmt)
                    for key, values in split.items():
                        mine.setdefault(key, [_offload_space(backend, fmt, ctx)[key][0]])  # its "no split" first
                        mine[key] += [v for v in values if v not in mine[key]]
                    draft.offload.append(
                        f"{backend_name} {fmt}: does not fit whole ({judge.never_fits(*found)}); "
                        "fits with " + ", ".join(f"{k} in {_toml_value(v)}" for k, v in split.items())
                    )
                else:
                    draft.left_out.append(f"{judge.never_fits(*found)} = {budget.describe()}")
            else:
                kept.append(fmt)
                whole = True
        draft.left_out += _unmakable_lines(backend_name, unmakable)
        # The space is shared by this backend's formats: one that fits whole keeps its whole
        # configuration (the dimension's first value, the backend's "no split") among the values.
        for key, (first, *values) in mine.items():
            offload.setdefault(key, [])
            offload[key] += [v for v in ([first] if whole else []) + values if v not in offload[key]]
        if not any(fmt in full_precision_formats for fmt in kept) and backend.check_weights(str(source), ctx) is None:
            # No full-precision format of its own, but it loads the source as it is (ExLlamaV2 an
            # FP16 directory): the source is its quality reference, when it fits.
            found = lightest(str(source))
            if found is not None and found[1].admitted:
                kept.append(str(source))
        # What the makings would fail on (llama.cpp's converter on a tokenizer it does not know):
        # the study would stop on it before its first trial; init says it instead of writing it.
        failing = check_makings(backend, kept, ctx) if kept else []
        if failing:
            draft.left_out.append(f"backend {backend_name}: " + "; ".join(failing))
            continue
        if kept:
            draft.candidates[backend_name] = kept
            ctx_of[backend_name] = ctx
            judges[backend_name] = (judge, params)
    if not draft.candidates:
        raise ConfigError(
            f"{source}: no backend here can make a format of this model that fits:\n  "
            + "\n  ".join(draft.left_out or ["no real backend is installed (autotune plugins)"])
        )

    # Each engine's own defaults for the options every study searches, merged.
    # A value the rules refuse for every format of every backend that offers it (a quantized
    # KV cache for a head size llama.cpp refuses) is left out, said in a comment: each of its
    # trials would be pruned, 123 of one study's were.
    space: dict[str, list[Any]] = {}
    refused: dict[tuple[str, Any], list[str]] = {}
    accepted: set[tuple[str, Any]] = set()
    for backend_name in draft.candidates:
        judge, params = judges[backend_name]
        for p in plugins.get_backend(backend_name).parameters({}):
            values = space.setdefault(p.name, [])
            values += [v for v in p.choices if v not in values]
            for v in p.choices:
                why = _refused(judge, backend_name, draft.candidates[backend_name], draft.ctx[0], params, p.name, v)
                if why is None:
                    accepted.add((p.name, v))
                else:
                    refused.setdefault((p.name, v), []).append(f"{backend_name}: {why}")
    for (key, value), reasons in refused.items():
        if (key, value) not in accepted and len(space[key]) > 1:  # a key with no value left would be invalid
            space[key].remove(value)
            draft.refused.append(f"{key} = {_toml_value(value)}: " + "; ".join(reasons))
    # The values that let a format too large for the card run split (the backend's offload_space):
    # a format that fits whole runs with none of them named, as before.
    space.update(offload)
    draft.space = space

    quantized = _quantized_as(source)
    full_precision = any(
        fmt in full_precision_formats or (fmt == str(source) and quantized is None)
        for fmts in draft.candidates.values()
        for fmt in fmts
    )
    try:
        metric = plugins.get_metric(QUALITY_METRIC)
    except AutotuneError as exc:
        draft.notes.append(f"quality: no '{QUALITY_METRIC}' metric ({exc})")
    else:
        unsupported = [f"{b}: {why}" for b in draft.candidates if (why := metric.supports(plugins.get_backend(b)))]
        if unsupported:
            draft.notes.append(f"quality: {QUALITY_METRIC} left out ({'; '.join(unsupported)})")
        elif (
            not full_precision
            and quantized is not None
            and not any(fmt in full_precision_formats for fmts in draft.candidates.values() for fmt in fmts)
        ):
            # The source as its own reference would measure a drop against itself: zero, and called a check.
            draft.notes.append(
                f"quality: {QUALITY_METRIC} left out: the source is {quantized}, not full precision, "
                "so there is nothing to compare its quality against (give the full-precision model)"
            )
        elif not full_precision:
            draft.notes.append(
                f"quality: {QUALITY_METRIC} left out: no full-precision format of the source fits "
                "here to compare against"
            )
        else:
            draft.quality = QUALITY_METRIC
    return draft


def _unmakable_lines(backend_name: str, unmakable: Mapping[str, str]) -> list[str]:
    """What a backend cannot make from the source, one line per distinct reason: a quantized
    GGUF is no source for any GGUF format, said once for all six rather than six times."""
    by_reason: dict[str, list[str]] = {}
    for fmt, why in unmakable.items():
        by_reason.setdefault(why.replace(fmt, "\0"), []).append(fmt)
    lines = []
    for reason, fmts in by_reason.items():
        named = fmts[0] if len(fmts) == 1 else f"{', '.join(fmts[:-1])} or {fmts[-1]}"
        # Grouped, the reason names the formats itself (its "make gguf:F16, ... or gguf:Q4_0").
        lines.append(f"{backend_name}{'' if len(fmts) > 1 else ' ' + named}: {reason.replace(chr(0), named)}")
    return lines


# GGUF tensor types at full precision (llama.cpp's converter writes these from a checkpoint).
_FULL_PRECISION_TYPES = frozenset({"F32", "F16", "BF16"})


def _quantized_as(source: Path) -> str | None:
    """What the source is quantized as (a GGUF's type, a directory's ``quant_method``), None
    when it is at full precision or cannot be told (then it is taken at its word, as before)."""
    try:
        if source.is_dir():
            return read_safetensors_dir(source).quant_method
        header = read_gguf(source)
    except (OSError, ValueError, AutotuneError):
        return None
    if header.file_type is not None:
        return None if header.file_type in _FULL_PRECISION_TYPES else header.file_type
    types = {t.ggml_type for t in header.tensors}
    return None if not types or types <= _FULL_PRECISION_TYPES else "/".join(sorted(types - _FULL_PRECISION_TYPES))


def _refused(
    judge: Admission, backend: str, formats: list[str], shortest: int, params: list[Param], key: str, value: Any
) -> str | None:
    """Why the rules refuse ``key = value`` with every one of ``formats`` and every combination
    of the other options (the reasons all of them share: the head size, not the one combination
    that also lacks flash attention), or None where any is accepted (shortest ctx, one slot)."""
    others = [p for p in params if p.name != key]
    shared: list[str] | None = None
    for fmt in formats:
        for combo in itertools.product(*(p.choices for p in others)):
            options = tuple(sorted([*zip((p.name for p in others), combo), (key, value)]))
            verdict = judge.judge(TrialConfig(backend, fmt, shortest, 1, options=options))
            if verdict.kind != INVALID:
                return None
            shared = list(verdict.reasons) if shared is None else [r for r in shared if r in verdict.reasons]
    return "; ".join(shared or ["refused by the rules in every combination"])


def _offload_space(backend: Any, weights: str, ctx: StudyContext) -> dict[str, list[Any]]:
    """The backend's ``offload_space`` (its ``splitting`` part); empty when it cannot split a model."""
    return {} if backend.splitting is None else backend.splitting.offload_space(weights, ctx)


def _offload_values(
    backend: Any, judge: Admission, weights: str, ctx: StudyContext, shortest: int, params: list[Any]
) -> dict[str, list[Any]]:
    """Of the backend's ``offload_space`` for ``weights``, the first dimension (in the backend's
    order of preference) with values whose lightest configuration (shortest ctx, one slot) the
    judge admits, and those values; empty when none fits. Each dimension's first value is the
    backend's "no split", which a format over the budget never fits with."""
    kept: dict[str, list[Any]] = {}
    for key, values in _offload_space(backend, weights, ctx).items():
        fits = []
        for value in values[1:]:
            found = judge.lightest(TrialConfig(backend.name, weights, shortest, 1), [*params, Param(key, (value,))])
            if found is not None and found[1].admitted:
                fits.append(value)
        if fits:
            kept[key] = fits
            break
    return kept


def _comment_block(heading: list[str], reasons: Sequence[str]) -> list[str]:
    """A heading and each reason indented under it, as comment lines; nothing without reasons."""
    if not reasons:
        return []
    return heading + ["#   " + line[2:] for why in reasons for line in _comment(why)] + [""]


_toml_value = toml_text.value
_comment = toml_text.comment


def render(draft: StudyDraft, out: Path) -> str:
    """The study file's text; paths relative to ``out``'s directory where they can be."""
    try:
        source = os.path.relpath(draft.source, out.absolute().parent)
    except ValueError:
        source = str(draft.source)
    if source.startswith("../../.."):
        source = str(draft.source)
    stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    lines = [
        # Names the user did not choose for TOML (a newline in a file name) go through _comment.
        *_comment(f"Written by `autotune init` on {stamp} for {draft.source.name} on this machine"),
        *_comment(f"({draft.gpu.name}). Run it with: {command_line(['autotune', 'study', out.name])}"),
        "# Weights named as formats (family:variant) are made from [model] source by the first",
        "# trial that needs them and kept in ~/.cache/autotune/artifacts for every later study.",
    ]
    for note in draft.notes:
        lines += _comment(note)
    lines += [
        "",
        "[study]",
        f"name = {_toml_value(draft.name)}",
        f"budget = {_toml_value('15m' if draft.gpu.is_cpu else '2h')}",
        "",
        "[hardware]",
    ]
    if draft.gpu.is_cpu:
        # The budget every output shows is this less the safety margin: said here, so that the
        # file's 17.7 and the study's 17.45 GiB are one figure (issue 28).
        usable = budget_of(draft.gpu, int(draft.budget_gib * 2**30), SAFETY_MARGIN_MIB * 2**20)  # type: ignore[operator]
        lines += [
            "# The host: nothing is offloaded; the budget is host memory (a share of this machine's "
            f"{_gib(draft.gpu.vram_bytes)}).",
            f"gpu = {_toml_value(hardware.CPU_KEY)}",
            f"vram_budget_gib = {draft.budget_gib}  # the study's memory budget: {budget_text(usable.bytes)} "
            f"after the {SAFETY_MARGIN_MIB} MiB safety margin",
        ]
    else:
        lines += [
            f"gpu = {_toml_value(draft.gpu_key)}  " + _comment(f"{draft.gpu.name}, {_gib(draft.gpu.vram_bytes)}")[0]
        ]
        cards = hardware.detect_gpus() if draft.gpu_key == "auto" else []
        if len(cards) > 1:
            # Several cards here: where the model goes across them is a search of its own (issue 40).
            lines += [
                f"# This machine has {len(cards)} cards; to search where the model goes across them (split mode,",
                '# proportions per card), replace gpu with: gpus = ["auto"] (docs/usage.md#many-gpus-or-hosts)',
            ]
    lines += [
        "",
        "[model]",
        f"source = {_toml_value(source)}",
        "",
        "[workload]",
        f"prompt_tokens = {draft.workload[0]}",
        f"output_tokens = {draft.workload[1]}",
        "",
    ]
    if draft.gpu.is_cpu:
        lines += [
            "[measure]",
            "warmup_runs = 1",
            "min_runs = 3",
            "max_runs = 6",
            "rel_spread_tol = 0.15",
            "max_seconds = 20",
            "",
        ]
    for backend_name, fmts in draft.candidates.items():
        shown = [source if w == str(draft.source) else w for w in fmts]  # the source itself, as [model] names it
        lines += ["[[candidates]]", f"backend = {_toml_value(backend_name)}", f"weights = {_toml_value(shown)}", ""]
    lines += _comment_block(["# Left out:"], draft.left_out)
    lines += _comment_block(
        [
            "# Too large for the card whole, so split between the card and host memory: the values",
            "# below that the memory model says fit (at the shortest ctx, one slot):",
        ],
        draft.offload,
    )
    lines += _comment_block(["# Left out of [space]: the engine refuses these values for this model:"], draft.refused)
    lines += [
        "[space]",
        f"ctx = {_toml_value(draft.ctx)}  # up to the model's context, {draft.model.max_context}",
        f"parallel = {_toml_value(list(PARALLEL))}",
    ]
    lines += [f"{k} = {_toml_value(v)}" for k, v in draft.space.items()]
    lines += ["", "[objective]", 'metric = "aggregate_tok_s"']
    if draft.quality:
        lines += [
            f"# KL divergence of each format's next-token distributions against the source's own",
            "# (its full-precision format, the largest candidate), measured once per format.",
            f"quality = {_toml_value(draft.quality)}",
            f"# A bound, so that quality counts: a mean KLD over {MAX_DROP_POINTS / 100:g} nats refuses the format",
            "# (points of 0.01 nats; about a good 4-bit quantization of an 8B model). A bound rather than",
            "# penalty_per_point: a penalty is in tok/s per point, whose size depends on this model's speed.",
            f"max_drop_points = {_toml_value(MAX_DROP_POINTS)}",
        ]
    return "\n".join(lines) + "\n"
