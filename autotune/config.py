"""Study files (TOML) -> validated, typed objects.

Every problem in a file is collected and reported at once, one per line, each naming the
file, the field, the bad value and what would be accepted:
``studies/v100.toml: [space] ctx = 0: must be >= 256``.
Only structure and values are checked here; names of backends, models and GPUs are resolved
against plugins and catalogs by ``autotune.study.prepare``, which reports those the same way.
``[study] sampler`` is the exception: a strategy may stand in another for a Pareto objective
(``BaseStrategy.pareto``), so its name is checked against the registry here.
"""

from __future__ import annotations

import difflib
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from autotune import plugins
from autotune.errors import ConfigError
from autotune.toolkit.paths import read_input
from autotune.measure.protocol import Protocol
from autotune.hardware.placement import CardsRequest, read_cards
from autotune.engine.workload import SLO_KEYS, WORKLOAD_KEYS, WorkloadSpec, draw, read_slo, read_workload
from autotune.toolkit.fields import MISSING, FieldReader, at_least, between, one_of, show
from autotune.toolkit.durations import parse_duration

# Memory kept free of the budget when a study file does not say ([hardware] safety_margin_mib):
# `autotune init` and `autotune estimate` judge with it too, so a study they describe agrees.
SAFETY_MARGIN_MIB = 256

OBJECTIVE_MODES = ("single", "pareto")
# What [objective] metric may name: a measured rate, or goodput (docs/workload.md).
METRICS = ("aggregate_tok_s", "decode_tok_s", "per_user_tok_s", "goodput_tok_s", "goodput_req_s", "rate_req_s")
# [quality] table: field -> (type, min, max or None, what it is). Metrics that sample a
# benchmark read the first three (the shipped samples hold 10 items and 5 dev examples per
# subject); the rest say how the study measures a paired drop (autotune/study/quality.py).
MAX_STUDY_FILE_BYTES = 16 * 2**20  # a study file is a page of TOML; more is not one
# The longest study name: it becomes file names (<name>.db, <name>.html, <name>.<suffix> of
# the report's assets), and a file name has at most 255 bytes on the usual filesystems.
MAX_STUDY_NAME = 200

QUALITY_OPTIONS: dict[str, tuple[type, float, float | None, str]] = {
    "per_subject": (int, 1, 10, "items per subject (the shipped samples hold 10)"),
    "shots": (int, 0, 5, "dev examples before each question (0..5)"),
    "seed": (int, 0, None, "chooses the per-subject subset and the order items are drawn in"),
    "batch": (int, 1, None, "items added per look of a sequential measurement (default: one per subject)"),
    "max_items": (int, 2, None, "the most items one artifact is measured on (default: the whole pool)"),
    "max_seconds": (float, 1, None, "the most seconds one candidate's sequential measurement may take"),
    "expected_agreement": (
        float,
        0.5,
        1.0,
        "the fraction of items candidate and reference are expected to answer alike",
    ),
}
# [measure] table: field -> (type, min, what it is); max_runs' minimum is min_runs, and
# max_seconds must be above its minimum (see autotune.measure.Protocol).
MEASURE_OPTIONS: dict[str, tuple[type, float, str]] = {
    "warmup_runs": (int, 0, "runs kept apart before measuring"),
    "min_runs": (int, 1, "runs always measured"),
    "max_runs": (int, 1, "the most runs measured, at least min_runs"),
    "rel_spread_tol": (float, 0, "a fraction of the median, e.g. 0.05 for 5%"),
    "max_seconds": (float, 0, "seconds for one configuration's whole measurement"),
}
# [quality] pool: where items are drawn from; undecided: what a configuration whose drop is
# still undecided at the cap counts as (the safe answer by default).
QUALITY_POOLS = ("sample", "full")
UNDECIDED_POLICIES = ("reject", "accept", "kld")
# Optuna's samplers seed numpy's generator, which takes 0..2**32-1: a seed outside it would be a
# numpy traceback after the storage was made, so the file and --seed are checked against this.
SEED_MAX = 2**32 - 1
# No single card holds more (the largest in 2026 hold under 300 GB): a budget or margin above it
# is a typo of unit, and its byte count would overflow.
MAX_VRAM_GIB = 1024


@dataclass(frozen=True)
class Candidates:
    """Weights artifacts one backend may load."""

    backend: str
    weights: tuple[str, ...]
    draft: tuple[str, ...] = ()  # draft weights for speculative decoding, searched as the option "draft"


@dataclass(frozen=True)
class Objective:
    """How a trial is scored (see ``autotune.study.objective``)."""

    metric: str = "aggregate_tok_s"
    quality: str | None = None
    penalty_per_point: float = 0.0
    max_drop_points: float | None = None
    reference_weights: str | None = None
    mode: str = "single"
    require_quality: bool = True
    min_per_user_tok_s: float | None = None
    # Latency targets (autotune.engine.workload.SLO_KEYS: ttft_p95_ms...): each a constraint, and the
    # per-request bounds goodput counts against.
    slo: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True)
class StudyConfig:
    """A validated study file."""

    path: Path | None
    name: str
    seed: int
    sampler: str
    n_trials: int | None
    budget_s: float | None
    storage: str | None
    prior: bool | None  # None: not given (on for a real study whose engine has a model, see StudyRunner)
    prior_trials: int
    gpu: str
    gpu_index: int
    cards: CardsRequest | None  # [hardware] gpus (autotune.hardware.placement); None: one card, [hardware] gpu
    vram_budget_bytes: int | None
    safety_margin_bytes: int
    model: str
    model_source: str | None
    prompt_tokens: int
    output_tokens: int
    measure: Mapping[str, Any]
    candidates: tuple[Candidates, ...]
    space: Mapping[str, tuple[Any, ...]]
    objective: Objective
    backend_settings: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    description: str = ""
    quality_options: Mapping[str, Any] = field(default_factory=dict)
    finish_top: int = 3
    finish_rounds: int = 2
    finish_max_rounds: int = 4
    probe_margin: float | None = None  # None: every launch measured in full (see autotune.study.probe)
    baseline: bool = True  # measure each backend's default launch once, before the search (study/baseline.py)
    workload: WorkloadSpec = WorkloadSpec()  # [workload] as written (autotune.engine.workload)
    requests: tuple[tuple[int, int], ...] = ()  # the lengths drawn from its distribution, if any

    @property
    def base_dir(self) -> Path:
        return self.path.parent if self.path else Path(".")

    @property
    def default_storage(self) -> str:
        return f"sqlite:///{self.name}.db"


def study_name_problem(name: str) -> str | None:
    """Why ``name`` cannot name a study (None: it can): it names the study's files."""
    if re.fullmatch(r"[A-Za-z0-9_.-]+", name) and len(name) <= MAX_STUDY_NAME and name.strip(".") != "":
        return None
    return (
        f"use letters, digits, '.', '_' or '-', at most {MAX_STUDY_NAME} of them, not only dots (it names the "
        "study's files, <name>.db and <name>.html, and a file name has at most 255 bytes)"
    )


def load_study_config(path: str | Path, *, read_files: bool = True) -> StudyConfig:
    """Read and validate a study file.

    ``read_files=False``: the study file alone, not the files it names ([workload] file), for
    the commands that answer from the storage (``best``, ``report``): a lengths file that has
    moved since the study ran changes nothing they say.

    Raises:
        ConfigError: the file is missing, not TOML, or has bad fields (all of them listed).
    """
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"{path}: no such study file")
    if path.is_dir():
        raise ConfigError(f"{path}: is a directory; give a study file (.toml)")
    try:
        text = read_input(path, limit=MAX_STUDY_FILE_BYTES, what="a study file (.toml)").decode("utf-8")
    except ValueError as exc:  # a FIFO, a device, a huge file (UnicodeDecodeError is one, said below)
        if isinstance(exc, UnicodeDecodeError):
            raise ConfigError(f"{path}: not a UTF-8 text file") from None
        raise ConfigError(str(exc)) from None
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a UTF-8 text file") from None
    return parse_study_config(doc, source=str(path), path=path, read_files=read_files)


def parse_study_config(
    doc: Mapping[str, Any], source: str = "<study>", path: Path | None = None, read_files: bool = True
) -> StudyConfig:
    """Validate an already-parsed study document (see ``load_study_config``)."""
    r = FieldReader(source, doc)
    r.unknown_keys(
        "",
        {k: v for k, v in doc.items()},
        {
            "study",
            "hardware",
            "model",
            "workload",
            "measure",
            "candidates",
            "space",
            "objective",
            "backends",
            "quality",
        },
    )

    study = r.table("study")
    r.unknown_keys(
        "study",
        study,
        {
            "name",
            "description",
            "seed",
            "sampler",
            "n_trials",
            "budget",
            "storage",
            "prior",
            "prior_trials",
            "finish_top",
            "finish_rounds",
            "finish_max_rounds",
            "probe_margin",
            "baseline",
        },
    )
    default_name = path.stem if path else "study"
    name = r.get("study", study, "name", str, default_name, check=study_name_problem)
    seed = r.get("study", study, "seed", int, 0, check=between(0, SEED_MAX))
    strategies = plugins.get_strategies()
    sampler = r.get("study", study, "sampler", str, "tpe", check=one_of(tuple(strategies)))
    n_trials = r.get("study", study, "n_trials", int, None, check=at_least(1))
    budget_s = None
    if "budget" in study and ("study", "budget") not in r.not_finite:
        try:
            budget_s = parse_duration(study["budget"], source=f"{source}: [study] budget =")
        except ConfigError as exc:
            r.errors.append(str(exc))
    storage = r.get("study", study, "storage", str, None)
    prior = r.get("study", study, "prior", bool, None)
    prior_trials = r.get("study", study, "prior_trials", int, 10, check=at_least(1))
    # The noise-aware finish (StudyRunner.finish): how many of the best configurations are
    # measured again, and how many times each, before a winner is named.
    finish_top = r.get(
        "study",
        study,
        "finish_top",
        int,
        3,
        check=lambda v: (
            None
            if v == 0 or v >= 2
            else "must be 0 (no finish) or >= 2 (a finish compares the best configurations with each other)"
        ),
    )
    finish_rounds = r.get("study", study, "finish_rounds", int, 2, check=at_least(1))
    # A tie whose lead is at least half what noise explains may be a real gap measured too few
    # times: rounds are added, one at a time, up to this many.
    finish_max_rounds = r.get(
        "study",
        study,
        "finish_max_rounds",
        int,
        max(4, finish_rounds),
        check=lambda v: None if v >= finish_rounds else f"must be >= finish_rounds ({finish_rounds})",
    )
    # "How much better than doing nothing": each backend's default launch, measured once per study.
    baseline = r.get("study", study, "baseline", bool, True)
    # Multi-fidelity (autotune.study.probe): a launch whose first run is this far below the
    # leader stops there. Not given: on where it pays (study/cost.py: auto_probe); 0: off.
    probe_margin = r.get(
        "study",
        study,
        "probe_margin",
        float,
        None,
        check=lambda v: None if 0 <= v < 1 else "must be a fraction between 0 and 1, e.g. 0.15, or 0 (no probe)",
    )

    hw = r.table("hardware", required=True)
    r.unknown_keys("hardware", hw, {"gpu", "gpus", "gpu_index", "vram_budget_gib", "safety_margin_mib"})
    # Several cards ([hardware] gpus, autotune.hardware.placement): their budgets are per card, read there.
    cards = read_cards(hw, lambda key, value, message: r.error("hardware", key, value, message), SAFETY_MARGIN_MIB)
    gpu = r.get("hardware", hw, "gpu", str, "auto", accepted="a catalog key such as v100-16gb, or 'auto'")
    gpu_index = r.get("hardware", hw, "gpu_index", int, 0, check=at_least(0))
    vram_gib, margin_mib = None, SAFETY_MARGIN_MIB
    if cards is None and "gpus" not in hw:
        vram_gib = r.get(
            "hardware",
            hw,
            "vram_budget_gib",
            float,
            None,
            check=lambda v: (
                None if 0 < v <= MAX_VRAM_GIB else f"must be > 0 and at most {MAX_VRAM_GIB} (GiB of one card)"
            ),
        )
        margin_mib = r.get(
            "hardware",
            hw,
            "safety_margin_mib",
            float,
            SAFETY_MARGIN_MIB,
            check=lambda v: (
                None
                if 0 <= v <= MAX_VRAM_GIB * 1024
                else f"must be >= 0 and at most {MAX_VRAM_GIB * 1024} (MiB of one card)"
            ),
        )
    elif cards is not None and cards.gpus != ("auto",):
        gpu = cards.gpus[0]  # the first card is the main one: what a one-card model reads

    model_t = r.table("model", required=True)
    r.unknown_keys("model", model_t, {"ref", "source"})
    # source: the model that candidates named as formats (gguf:Q8_0, exl2:4.0) are made from;
    # it is also the model's shape unless ref names another.
    model_source = r.get(
        "model",
        model_t,
        "source",
        str,
        None,
        check=lambda v: None if v.strip() else "must name a model directory or a .gguf file",
    )
    model = r.get(
        "model",
        model_t,
        "ref",
        str,
        model_source or "",
        required=model_source is None,
        accepted="a catalog key (autotune estimate --help lists them), a .gguf file or a model directory "
        "(or give [model] source, the model formats are made from)",
    )

    wl = r.table("workload", required=True)
    r.unknown_keys("workload", wl, set(WORKLOAD_KEYS))
    spec = read_workload(
        wl,
        lambda key, *a, **k: r.get("workload", wl, key, *a, **k),
        lambda key, value, message: r.error("workload", key, MISSING if value is None else value, message),
    )
    requests: tuple[tuple[int, int], ...] = ()
    try:
        requests = draw(spec, seed, path.parent if path else Path(".")) if read_files else ()
    except ValueError as exc:
        r.errors.append(f"{source}: [workload] file = {spec.file!r}: {exc}")
    if requests:  # the typical request stands for the distribution where one shape is asked for
        prompt_tokens = round(sum(p for p, _ in requests) / len(requests))
        output_tokens = round(sum(o for _, o in requests) / len(requests))
    else:
        prompt_tokens, output_tokens = spec.prompt_tokens or 0, spec.output_tokens or 0

    # Read here like every other table, so all its bad fields are reported at once; Protocol
    # checks the same again for callers that build one in code.
    measure_t = r.table("measure")
    r.unknown_keys("measure", measure_t, set(MEASURE_OPTIONS))
    measure: dict[str, Any] = {}
    for key, (kind, low, what) in MEASURE_OPTIONS.items():
        check = at_least(low)
        if key == "max_runs":
            floor = measure.get("min_runs", Protocol.min_runs)
            check = lambda v, floor=floor: None if v >= floor else f"must be >= min_runs ({floor})"  # noqa: E731
        elif key == "max_seconds":
            check = lambda v: None if v > 0 else "must be > 0"  # noqa: E731
        value = r.get("measure", measure_t, key, kind, None, check=check, accepted=what)
        if value is not None:
            measure[key] = value

    candidates: list[Candidates] = []
    raw_candidates = doc.get("candidates", MISSING)
    if raw_candidates is MISSING:
        r.errors.append(f"{source}: [[candidates]] is missing: list at least one backend with its weights")
    elif not isinstance(raw_candidates, list) or not all(isinstance(c, dict) for c in raw_candidates):
        r.errors.append(f"{source}: candidates must be an array of tables ([[candidates]])")
    else:
        for i, cand in enumerate(raw_candidates):
            sec = f"candidates.{i}"
            r.unknown_keys(sec, cand, {"backend", "weights", "draft"})
            backend = r.get(
                sec, cand, "backend", str, None, required=True, accepted="an installed backend (autotune plugins)"
            )
            weights = r.get(
                sec,
                cand,
                "weights",
                list,
                None,
                required=True,
                check=lambda v: (
                    None if v and all(isinstance(w, str) and w for w in v) else "must be a non-empty list of strings"
                ),
            )
            draft = r.get(
                sec,
                cand,
                "draft",
                list,
                [],
                accepted="a list of draft weights, as weights are named",
                check=lambda v: (
                    None if all(isinstance(w, str) and w for w in v) else "must be a list of non-empty strings"
                ),
            )
            if backend and weights:
                candidates.append(Candidates(backend, tuple(weights), tuple(draft or ())))

    space_t = r.table("space", required=True)
    space: dict[str, tuple[Any, ...]] = {}
    for key, values in space_t.items():
        if ("space", key) in r.not_finite:
            continue
        if not isinstance(values, list) or not values:
            r.error("space", key, values, "must be a non-empty list of values")
            continue
        if len({repr(v) for v in values}) != len(values):
            r.error("space", key, values, "has repeated values")
            continue
        space[key] = tuple(values)
    for key, minimum in (("ctx", 256), ("parallel", 1)):
        if key not in space:
            if "space" in doc:
                # A misspelt key would otherwise be reported only as the missing one.
                typo = difflib.get_close_matches(key, [k for k in space_t if k not in ("ctx", "parallel")], n=1)
                hint = f" ([space] {typo[0]} is not a known key: did you mean {key}?)" if typo else ""
                r.error("space", key, MISSING, f"required: a list of integers >= {minimum}{hint}")
            continue
        bad = [v for v in space[key] if not isinstance(v, int) or isinstance(v, bool) or v < minimum]
        if bad:
            r.error(
                "space",
                key,
                list(space[key]),
                f"every value must be an integer >= {minimum} (bad: {', '.join(map(show, bad))})",
            )
            space.pop(key)

    obj_t = r.table("objective")
    r.unknown_keys(
        "objective",
        obj_t,
        {
            "metric",
            "quality",
            "penalty_per_point",
            "max_drop_points",
            "reference_weights",
            "mode",
            "require_quality",
            "min_per_user_tok_s",
            *SLO_KEYS,
        },
    )
    slo = read_slo(obj_t, lambda key, *a, **k: r.get("objective", obj_t, key, *a, **k))
    objective = Objective(
        # With latency targets the default is goodput: throughput of the requests that met them.
        metric=r.get(
            "objective",
            obj_t,
            "metric",
            str,
            "rate_req_s" if spec.rate_search and slo else "goodput_tok_s" if slo else "aggregate_tok_s",
            check=one_of(METRICS),
        ),
        quality=r.get("objective", obj_t, "quality", str, None),
        # tok/s taken off per point of quality lost; a million is beyond any throughput, and a
        # finite 1e308 still overflowed the score to -inf.
        penalty_per_point=r.get("objective", obj_t, "penalty_per_point", float, 0.0, check=between(0, 10**6)),
        max_drop_points=r.get("objective", obj_t, "max_drop_points", float, None, check=at_least(0)),
        reference_weights=r.get("objective", obj_t, "reference_weights", str, None),
        mode=r.get("objective", obj_t, "mode", str, "single", check=one_of(OBJECTIVE_MODES)),
        require_quality=r.get("objective", obj_t, "require_quality", bool, True),
        min_per_user_tok_s=r.get(
            "objective", obj_t, "min_per_user_tok_s", float, None, check=lambda v: None if v > 0 else "must be > 0"
        ),
        slo=slo,
    )
    if spec.rate_search and not slo:
        r.errors.append(
            f"{source}: [workload] rate_search needs latency targets in [objective] (e.g. ttft_p95_ms = "
            "500): the rate searched for is the highest that meets them"
        )
    if objective.quality is None and (
        objective.penalty_per_point or objective.max_drop_points is not None or objective.mode == "pareto"
    ):
        r.errors.append(
            f"{source}: [objective] quality is missing: penalty_per_point, max_drop_points and mode = 'pareto' need a quality metric"
        )
    if objective.mode == "pareto" and sampler in strategies:
        sampler = strategies[sampler].pareto or sampler

    # How the quality metric samples its benchmark; part of its cache key, so two studies with
    # the same settings share nothing by accident and a change re-measures.
    quality_t = r.table("quality")
    r.unknown_keys("quality", quality_t, set(QUALITY_OPTIONS) | {"pool", "undecided"})
    quality_options: dict[str, Any] = {}
    for key, (kind, low, high, what) in QUALITY_OPTIONS.items():
        check = at_least(low) if high is None else between(low, high)
        value = r.get("quality", quality_t, key, kind, None, accepted=what, check=check)
        if value is not None:
            quality_options[key] = value
    for key, options in (("pool", QUALITY_POOLS), ("undecided", UNDECIDED_POLICIES)):
        value = r.get("quality", quality_t, key, str, None, check=one_of(options))
        if value is not None:
            quality_options[key] = value
    if quality_t and objective.quality is None:
        r.errors.append(f"{source}: [quality] is set but [objective] quality is missing: name the metric it configures")

    backends_t = r.table("backends")
    backend_settings = {}
    for key, value in backends_t.items():
        if not isinstance(value, dict):
            r.error("backends", key, value, "must be a table ([backends.NAME])")
        else:
            backend_settings[key] = dict(value)

    if r.errors:
        raise ConfigError("\n".join(r.errors))
    return StudyConfig(
        path=path,
        name=name,
        seed=seed,
        sampler=sampler,
        n_trials=n_trials,
        budget_s=budget_s,
        storage=storage,
        prior=prior,
        prior_trials=prior_trials,
        gpu=gpu,
        gpu_index=gpu_index,
        cards=cards,
        vram_budget_bytes=int(vram_gib * 2**30) if vram_gib else None,
        safety_margin_bytes=int(margin_mib * 2**20),
        model=model,
        model_source=model_source,
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        measure=measure,
        candidates=tuple(candidates),
        space=space,
        objective=objective,
        backend_settings=backend_settings,
        description=str(study.get("description", "")),
        quality_options=quality_options,
        finish_top=finish_top,
        finish_rounds=finish_rounds,
        finish_max_rounds=finish_max_rounds,
        probe_margin=probe_margin,
        baseline=baseline,
        workload=spec,
        requests=requests,
    )
