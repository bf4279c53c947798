"""Study file -> PreparedStudy: everything resolved and checked before anything runs.

Names (backends, metrics, the model, the GPU), every ``[space]`` value against what the
backends accept, every ``[backends.NAME]`` key against what that backend declares, and each
backend's preflight (is its engine there at all?) are checked here, and all problems are
reported at once, each naming the file, the table, the key and what would be accepted.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from autotune import plugins
from autotune.hardware import gpus as hardware
from autotune.modelfiles.artifacts import check_makings, is_format
from autotune.engine.backend import BaseBackend, Param, StudyContext, TrialConfig, quality_reference, same_value
from autotune.config import StudyConfig
from autotune.errors import AutotuneError, ConfigError
from autotune.engine.formats import normalize_format
from autotune.hardware.gpus import GpuSpec
from autotune.hardware.placement import resolve_placement
from autotune.measure import Protocol
from autotune.engine.metric import BaseMetric, QualityReference
from autotune.modelfiles.models import resolve_model
from autotune.engine.space import CORE_OPTIONS, DRAFT_OPTION, BackendSpace, SearchSpace
from autotune.study.admission import Admission, budget_of
from autotune.study.prepared import PreparedStudy
from autotune.study import storage as storage_mod
from autotune.study.refused import without_refused
from autotune.engine.workload import study_workload


def resolve_gpu(cfg: StudyConfig) -> GpuSpec:
    """The study's GPU: a catalog key, or the card NVML finds for ``auto``."""
    return hardware.resolve_gpu(
        cfg.gpu, cfg.gpu_index, source=f"{cfg.path}: [hardware] gpu" if cfg.path else "[hardware] gpu"
    )


def check_settings(backend: BaseBackend, settings: Mapping[str, Any], src: str) -> list[str]:
    """Problems of one ``[backends.NAME]`` table against what the backend declares."""
    declared = {s.name: s for s in backend.settings}
    problems = []
    for key, value in settings.items():
        setting = declared.get(key)
        if setting is None:
            accepted = ", ".join(sorted(declared)) or "none: this backend takes no settings"
            problems.append(f"{src}: [backends.{backend.name}] {key}: unknown setting (accepted: {accepted})")
            continue
        why = setting.problem(value)
        if why:
            problems.append(f"{src}: [backends.{backend.name}] {key} = {value!r}: {why}")
    return problems


def check_space_values(
    offered: Mapping[str, list[Param]], space: Mapping[str, tuple[Any, ...]], src: str
) -> tuple[list[str], list[str]]:
    """Every ``[space]`` value must be taken, as given, by some backend of the study.

    Args:
        offered: Each backend's parameters as it returned them for this ``[space]``.

    Returns:
        (errors: a key or value no backend takes, naming what each accepts;
         notes: a value only some backends take, dropped for the others).
    """
    errors, notes = [], []
    for key in (k for k in space if k not in CORE_OPTIONS):
        having = [(b, p) for b, params in offered.items() for p in params if p.name == key]
        if not having:
            errors.append(f"{src}: [space] {key}: no backend of this study takes it (backends: {', '.join(offered)})")
            continue
        taken = {b: tuple(v for v in space[key] if any(same_value(v, c) for c in p.choices)) for b, p in having}
        for value in space[key]:
            if not any(value in values for values in taken.values()):
                accepted = "; ".join(f"{b} accepts {_list(p.accepted or p.choices)}" for b, p in having)
                errors.append(
                    f"{src}: [space] {key} = {_list((value,))}: no backend of this study accepts it ({accepted})"
                )
        for b, p in having:
            left = tuple(v for v in space[key] if v not in taken[b] and any(v in t for t in taken.values()))
            if left:
                notes.append(
                    f"{b}: [space] {key} = {_list(left)} not searched (another backend's values; "
                    f"{b} accepts {_list(p.accepted or p.choices)})"
                )
    return errors, notes


def _format_problem(backend: BaseBackend, weights: str, ctx: StudyContext, given_source: str | None) -> str | None:
    """Why a real backend cannot make the format ``weights`` names (None: it can). A model
    backend predicts formats and needs no source."""
    if backend.predictor is not None or backend.artifacts is None:
        return None  # it predicts a format, or reads a format-like name its own way
    if ctx.source is None:
        if given_source is not None:
            return None  # the missing source is reported once, under [model] source
        return (
            'a format is made from the model\'s source: add [model] source = "path/to/model" (a Hugging Face '
            "directory or a full-precision .gguf file), or name a weights file"
        )
    try:
        recipe = backend.artifacts.recipe(normalize_format(weights, backend.weight_formats), ctx.source, ctx)
    except AutotuneError as exc:
        return str(exc)
    if recipe is None:
        return f"backend '{backend.name}' cannot make {weights} from {ctx.source}"
    return None


def _budget_over_card(cfg: StudyConfig, gpu: GpuSpec, src: str) -> str | None:
    """Why ``[hardware] vram_budget_gib`` is more than the study's card holds (None: it is not).

    Refused rather than capped: a budget above the card is a typo (of unit, of the card) or the
    wrong [hardware] gpu, and a study that quietly ran on a smaller budget than its file says
    would be judged and stored under a figure nobody wrote. On a 16 GB card, 1000 GiB let 39 of
    60 launches fail out of memory. The card is the one the study measures or models: NVML's
    for gpu = 'auto', the catalog's for a named GPU (a twin's included), host memory for 'cpu'.
    """
    cap = cfg.vram_budget_bytes
    if not cap or cap <= gpu.vram_bytes:
        return None
    card = (
        "this machine's memory"
        if gpu.is_cpu
        else f"{gpu.name} (GPU {cfg.gpu_index}, as NVML reports it)"
        if cfg.gpu == "auto"
        else f"{gpu.name} (the GPU catalog's {gpu.key})"
    )
    return (
        f"{src}: [hardware] vram_budget_gib = {cap / 2**30:g}: more than {card} holds, {gpu.vram_bytes / 2**30:.2f} "
        f"GiB; give at most {gpu.vram_bytes / 2**30:.2f}, or leave it out for all of it less [hardware] "
        "safety_margin_mib"
    )


def _list(values: tuple[Any, ...]) -> str:
    return ", ".join(
        repr(v) if isinstance(v, str) else str(v).lower() if isinstance(v, bool) else str(v) for v in values
    )


def prepare_study(cfg: StudyConfig, storage: str | None = None, *, dry_runs: bool = True) -> PreparedStudy:
    """Resolve a study file against installed plugins, catalogs and the machine.

    Args:
        cfg: The validated study file.
        storage: ``--storage`` when given (else $AUTOTUNE_STORAGE, the file's, the default).
        dry_runs: Also run the dry runs of the makings the study's first trials will need
            (``artifacts.check_makings``: a converter on the vocabulary only), a few seconds
            each; ``init``'s check of the file it wrote leaves them to ``study``.

    Raises:
        ConfigError: every unknown backend, metric, model or GPU, every value or setting no
            backend accepts, every unusable candidate, every backend whose engine is not
            ready and every making whose dry run fails, all at once, each naming the file
            and field.
    """
    src = str(cfg.path) if cfg.path else "<study>"
    errors: list[str] = []
    gpu = None
    placement = None
    try:
        if cfg.cards is not None:
            placement = resolve_placement(cfg.cards, f"{src}: [hardware] gpus")
            gpu = placement.cards[0].spec  # the main card: what a one-card model reads
        else:
            gpu = resolve_gpu(cfg)
    except ConfigError as exc:
        errors.append(str(exc))
    model = None
    field_name = "ref" if cfg.model != cfg.model_source else "source"
    try:
        candidate_path = cfg.base_dir / cfg.model
        model = resolve_model(str(candidate_path) if candidate_path.exists() else cfg.model)
    except AutotuneError as exc:
        errors.append(f"{src}: [model] {field_name} = {cfg.model!r}: {exc}")
    source = None
    if cfg.model_source is not None:
        source = (cfg.base_dir / Path(cfg.model_source).expanduser()).absolute()
        if not source.exists():
            errors.append(
                f"{src}: [model] source = {cfg.model_source!r}: {source}: no such file or directory "
                "(a Hugging Face model directory or a full-precision .gguf file)"
            )
            source = None

    backends = plugins.get_backends()
    strategy = plugins.get_strategy(cfg.sampler)
    protocol = None
    try:
        protocol = Protocol(**cfg.measure)
    except (AutotuneError, TypeError) as exc:
        errors.append(f"{src}: [measure]: {exc}")

    budget = 0
    over = _budget_over_card(cfg, gpu, src) if gpu is not None else None
    if over:
        errors.append(over)
    elif placement is not None:
        # Every card's budget together: a backend without a per-device model is judged on the
        # whole; one with it, card by card too (Admission, placement.check_cards).
        budget = placement.total_budget_bytes
    elif gpu is not None:
        budget = budget_of(gpu, cfg.vram_budget_bytes, cfg.safety_margin_bytes).bytes
        if budget <= 0:
            errors.append(
                f"{src}: [hardware] safety_margin_mib leaves no memory of "
                f"{cfg.vram_budget_bytes or gpu.vram_bytes} bytes"
            )

    bad_settings: set[str] = set()
    for name, settings in cfg.backend_settings.items():
        if name not in backends:
            # TOML reads [backends.twin-llama.cpp] as the table twin-llama holding a table cpp.
            dotted = [f"{name}.{k}" for k, v in settings.items() if isinstance(v, dict) and f"{name}.{k}" in backends]
            hint = f'; a dot in a table name nests tables: write [backends."{dotted[0]}"]' if dotted else ""
            errors.append(
                f"{src}: [backends.{name}]: no such backend (installed: {', '.join(backends) or 'none'}){hint}"
            )
            continue
        problems = check_settings(backends[name], settings, src)
        if problems:
            errors += problems
            bad_settings.add(name)  # its checks below would read the bad values

    entries: list[BackendSpace] = []
    offered: dict[str, list[Param]] = {}
    seen: set[str] = set()
    contexts: dict[str, StudyContext] = {}
    for i, cand in enumerate(cfg.candidates):
        if cand.backend not in backends:
            of_engine = [n for n, b in backends.items() if b.engine == cand.backend]
            hint = (
                f"; {cand.backend} is an engine: name one of its backends ({', '.join(of_engine)})" if of_engine else ""
            )
            errors.append(
                f"{src}: [candidates.{i}] backend = {cand.backend!r}: not installed "
                f"(installed: {', '.join(backends) or 'none'}){hint}"
            )
            continue
        if cand.backend in seen:
            errors.append(
                f"{src}: [candidates.{i}] backend = {cand.backend!r}: listed twice; merge its weights into one entry"
            )
            continue
        seen.add(cand.backend)
        backend = backends[cand.backend]
        if gpu is None or model is None or protocol is None or cand.backend in bad_settings:
            continue
        ctx = StudyContext(
            gpu=gpu,
            model=model,
            workload=study_workload(cfg),
            vram_budget_bytes=budget,
            protocol=protocol,
            seed=cfg.seed,
            settings=cfg.backend_settings.get(cand.backend, {}),
            base_dir=cfg.base_dir,
            gpu_index=cfg.gpu_index,
            source=source,
            placement=placement,
            # gpu = "cpu": nothing is offloaded, even on a machine that has a GPU.
            for_gpu=False if gpu.is_cpu else None,
        )
        contexts[cand.backend] = ctx
        if strategy.needs_model and not any(
            b.predictor is not None and b.engine == backend.engine for b in backends.values()
        ):
            errors.append(
                f"{src}: [study] sampler = {strategy.name!r}: no installed backend predicts engine "
                f"{backend.engine} (of [candidates.{i}] backend = {cand.backend!r}); install its twin "
                "or use sampler = 'tpe'"
            )
        found = len(errors)
        for problem in backend.preflight(ctx):
            errors.append(f"{src}: [candidates.{i}] backend = {cand.backend!r}: {problem}")
        for key, names in (("weights", cand.weights), (DRAFT_OPTION, cand.draft)):
            for w in names:
                made = is_format(w, backend.weight_formats)
                problem = _format_problem(backend, w, ctx, cfg.model_source) if made else None
                problem = problem or backend.check_weights(w, ctx)
                if problem:
                    errors.append(f"{src}: [candidates.{i}] {key} {w!r}: {problem}")
        if dry_runs and len(errors) == found and backend.predictor is None:
            # What every making of this backend would fail on (a converter that does not know
            # the model's tokenizer), found before the first trial rather than by each.
            errors += [
                f"{src}: [candidates.{i}] backend = {cand.backend!r}: {problem}"
                for problem in check_makings(backend, (*cand.weights, *cand.draft), ctx)
            ]
        if "ctx" in cfg.space and "parallel" in cfg.space:
            named = {k: v for k, v in cfg.space.items() if k not in CORE_OPTIONS}
            if placement is not None and len(placement.cards) > 1:
                # Several cards: where the model goes is searched (the backend's dimensions and
                # values), unless the file names a dimension itself.
                named = {**(backend.splitting.placement_space(ctx) if backend.splitting else {}), **named}
            if cand.draft:  # the candidate's draft weights are its backend's "draft" dimension
                named[DRAFT_OPTION] = list(cand.draft)
            params = backend.parameters(named)
            if cand.draft and not any(p.name == DRAFT_OPTION and p.choices for p in params):
                errors.append(
                    f"{src}: [candidates.{i}] draft: backend {cand.backend!r} searches no draft weights with "
                    "this [space]: name the speculation parameter that loads a draft there (`autotune "
                    "plugins` lists the backend's), or remove draft"
                )
            offered[cand.backend] = params
            entries.append(
                BackendSpace(
                    backend,
                    tuple(cand.weights),
                    tuple(cfg.space["ctx"]),
                    tuple(cfg.space["parallel"]),
                    tuple(p for p in params if p.choices),
                )
            )
    notes: list[str] = []
    if entries and len(entries) == len(cfg.candidates):  # an unknown backend's values cannot be judged
        space_errors, notes = check_space_values(offered, cfg.space, src)
        errors += space_errors

    quality = None
    if cfg.objective.quality:
        try:
            quality = plugins.get_metric(cfg.objective.quality)
        except AutotuneError as exc:
            errors.append(f"{src}: [objective] quality = {cfg.objective.quality!r}: {exc}")
        else:
            if model is not None and (why := quality.covers(model)):
                errors.append(f"{src}: [objective] quality = {quality.name!r}: {why}")
            for entry in entries:
                why = quality.supports(entry.backend)
                if why and cfg.objective.require_quality:
                    errors.append(
                        f"{src}: [objective] quality = {quality.name!r} cannot evaluate backend "
                        f"'{entry.backend.name}': {why} (set require_quality = false to run without it)"
                    )
    proxy = None
    if quality is not None and cfg.quality_options.get("undecided") == "kld":
        try:
            proxy = plugins.get_metric("kld")
        except AutotuneError as exc:
            errors.append(f"{src}: [quality] undecided = 'kld': {exc} (or use 'reject' or 'accept')")
        else:
            if type(quality).item_order is BaseMetric.item_order or proxy is quality:
                errors.append(
                    f"{src}: [quality] undecided = 'kld': the metric {quality.name!r} answers no items, so "
                    "nothing is undecided; use it with mmlu or ceval"
                )
    if errors:
        raise ConfigError("\n".join(errors))

    reference = _references(cfg, SearchSpace(entries), contexts) if quality else {}
    for metric in (quality, proxy):
        if metric is not None:
            metric.configure(
                cfg.quality_options,
                {
                    name: QualityReference(ref, backends[ref.backend], contexts[ref.backend])
                    for name, ref in reference.items()
                },
            )
    # The pre-search screen asks the same judge as every trial (no learned correction yet:
    # no storage is open).
    judge = Admission(SearchSpace(entries), contexts, cfg.objective)
    screened, excluded = [], list(notes)
    for entry in entries:
        # A value no configuration of the study can use is said once here, not pruned per trial.
        kept, refused = without_refused(entry, contexts[entry.backend.name], dict(cfg.space))
        excluded += refused
        if kept is None:
            continue
        narrowed, dropped = judge.screen(kept)
        excluded += dropped
        if narrowed is not None:
            screened.append(narrowed)
    if not screened:
        raise ConfigError(f"{src}: nothing in the search space can run:\n  " + "\n  ".join(excluded))
    return PreparedStudy(
        cfg=cfg,
        gpu=gpu,
        model=model,
        vram_budget_bytes=budget,
        space=SearchSpace(screened),
        contexts=contexts,
        quality=quality,
        reference=reference,
        quality_proxy=proxy,
        storage_url=storage_mod.resolve_url(storage, cfg.storage, cfg.default_storage),
        excluded=excluded,
        placement=placement,
    )


def highest_precision(backend: BaseBackend, weights: tuple[str, ...] | list[str], ctx: StudyContext) -> str:
    """The candidate with the most bytes of weights by the backend's own estimate: the highest
    precision the user has (their unquantized file where they listed it). The quality reference
    and the default launch (``study.baseline``) both start from it."""

    def size(w: str) -> int:
        probe = TrialConfig(backend.name, w, ctx.workload.sequence_tokens, 1)
        return backend.estimate_memory(probe, ctx).weights_bytes

    return max(weights, key=size)


def _references(cfg: StudyConfig, space: SearchSpace, contexts: Mapping[str, StudyContext]) -> dict[str, TrialConfig]:
    """The configuration each backend's quality is compared against.

    The study file may name the reference weights; otherwise the largest candidate (by the
    backend's own weights estimate) is the highest-precision one. The options are the
    backend's most precise ones (``quality_reference`` picks them).
    """
    refs: dict[str, TrialConfig] = {}
    named = cfg.objective.reference_weights
    for name, entry in space.entries.items():
        ctx = contexts[name]
        weights = entry.weights
        if named and named in weights:
            chosen = named
        elif named and any(named in e.weights for e in space.entries.values()):
            continue  # another backend owns the reference: compare against that one's quality
        else:
            chosen = highest_precision(entry.backend, entry.weights, ctx)
        options = quality_reference(entry.backend, {p.name: p.choices for p in entry.params})
        refs[name] = TrialConfig(name, chosen, max(entry.ctx), 1, tuple(sorted(options.items())))
    if named and refs:
        owner = next((n for n, e in space.entries.items() if named in e.weights), None)
        if owner is None:
            raise ConfigError(
                f"{cfg.path}: [objective] reference_weights = {named!r}: not among the candidates' weights"
            )
        for name in space.entries:
            refs.setdefault(name, refs[owner])
    return refs
