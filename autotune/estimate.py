"""``autotune estimate``: memory breakdown and predicted speed of one configuration, no launch.

Which backend answers (:data:`BACKEND_RULE`, also the ``--backend`` help): the name given picks
the engine, the weights pick the backend of that engine. A format (``gguf:Q4_K_M``,
``exl2:3.3``) is estimated by the engine's digital twin (the backend of that engine that
implements ``predict``), from the model's shape; a file or directory by the engine's real
backend, from the file's own tensors, with the speed from the twin; or, when the twin is named
(``--backend twin-llama.cpp``) or the engine has no real backend installed, by the twin alone,
which reads the same file or directory (GGUF files, EXL2 and Hugging Face directories).
``ctx`` is per sequence.

Whether it runs and fits is the study's own judge's answer (``autotune.study.admission``): the
core's rules and the backend's, then the memory model against the budget, the card's memory
less the safety margin (autotune's default, or the study's). A configuration the engine would
not run (a rule it breaks, e.g. a ctx beyond the model's context, or the engine's own refusal)
gets the verdict "invalid" or "refused", never "fits": the command prints the estimate and
exits 2.

With ``--study NAME`` the configuration is predicted for that study's GPU, model and workload
(unless ``--gpu`` / ``--model`` / ``--prompt-tokens`` / ``--output-tokens`` say otherwise), by
the twin as the study calibrated it on its own measured trials (``study/calibration.py``), and
judged against the study's budget with the memory correction the study learned for the backend
that answers, so it says what the study's report says of the same configuration.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from autotune import plugins
from autotune.engine.backend import BaseBackend, StudyContext, TrialConfig, Workload, same_value
from autotune.config import SAFETY_MARGIN_MIB, load_study_config
from autotune.engine.declarations import installed_weight_formats
from autotune.errors import ConfigError, UnknownNameError
from autotune.hardware.gpus import has_gpu, load_gpu_catalog, resolve_gpu
from autotune.measure import Protocol
from autotune.modelfiles.models import load_model_catalog, resolve_model
from autotune.hardware.placement import CardsRequest, check_cards, resolve_placement

if TYPE_CHECKING:  # pragma: no cover
    from autotune.study.admission import Budget

__all__ = ["BACKEND_RULE", "estimate_config", "estimate_text", "resolve_backends"]

BACKEND_RULE = (
    "A backend name (autotune plugins) or an engine name (llama.cpp, exllamav2, vllm): either picks "
    "the engine. Weights given as a format (gguf:Q4_K_M, exl2:3.3) are estimated by that engine's "
    "digital twin; a file or directory by the engine's real backend (memory from the file's tensors, "
    "speed from the twin), or by the twin when it is the backend named or the engine has no other (it reads "
    "GGUF files, EXL2 and Hugging Face directories)."
)
# What the command says about each verdict; "invalid" and "refused" exit 2.
VERDICTS = ("fits", "does not fit", "invalid", "refused")
DEFAULT_WORKLOAD = (1500, 800)


def is_format(weights: str) -> bool:
    """Whether ``weights`` names a format (``gguf:Q4_K_M``) rather than a file or directory.

    Something on disk is a file even with a colon in its name; ``family:...`` for a family an
    installed backend declares (``BaseBackend.weight_formats``) is a format even when the rest
    is wrong, so that the twin names the accepted ones.
    """
    if Path(weights).expanduser().exists():
        return False
    family, sep, _ = weights.partition(":")
    return bool(sep) and family.lower() in installed_weight_formats()


def _format_syntax() -> str:
    """How the installed backends' formats are written (``gguf:<TYPE> or exl2:<bpw>``)."""
    return (
        " or ".join(f.syntax for f in installed_weight_formats().values()) or "none (no installed backend declares one)"
    )


def _format_examples() -> str:
    """The formats the installed backends offer (``autotune init``'s), else how they are written."""
    offered = [fmt for family in installed_weight_formats().values() for fmt in family.offered]
    return f"such as {', '.join(offered)}" if offered else _format_syntax()


def resolve_backends(name: str, weights: str) -> tuple[BaseBackend, BaseBackend | None]:
    """The backend that estimates ``weights`` for ``--backend name``, and the speed model.

    Args:
        name: A registered backend's name or an engine's name.
        weights: A format or a file / directory (see :func:`is_format`).

    Returns:
        (the backend that answers, the twin of its engine or None when none is installed).

    Raises:
        UnknownNameError: ``name`` is neither a backend nor an engine; the message lists both.
        ConfigError: A format, and the engine has no twin to estimate it.
    """
    backends = plugins.get_backends()
    named = backends.get(name)
    engine = named.engine if named is not None else name
    same = [b for b in backends.values() if b.engine == engine]
    if not same:
        engines = sorted({b.engine for b in backends.values()})
        raise UnknownNameError(
            f"--backend {name!r}: not an installed backend or engine "
            f"(backends: {', '.join(backends) or 'none'}; engines: {', '.join(engines) or 'none'})"
        )
    twins = [b for b in same if b.predictor is not None]
    real = [b for b in same if b.predictor is None]
    if is_format(weights):
        if named is not None and named.predictor is not None:
            chosen = named
        elif twins:
            chosen = twins[0]
        else:
            raise ConfigError(
                f"--weights {weights!r} is a format, which only a digital twin estimates, and no backend of "
                f"engine {engine} is one (installed: {', '.join(b.name for b in same)}): give a weights file or "
                "directory, or install the twin plugin"
            )
    elif named is not None:
        chosen = named  # the real backend or the twin, as named: both read the file
    else:
        chosen = real[0] if real else twins[0]
    return chosen, chosen if chosen.predictor is not None else (twins[0] if twins else None)


def _weights_of(model_ref: str, weights: str | None) -> str:
    """``--weights``, or the model itself when it is a file or directory."""
    if weights is not None:
        if not is_format(weights) and not Path(weights).expanduser().exists():
            raise ConfigError(
                f"--weights {weights!r}: no such file or directory (relative to the current directory "
                f"{Path.cwd()}); a format is {_format_syntax()}"
            )
        return weights
    if model_ref in load_model_catalog():
        raise ConfigError(
            f"--weights is needed: --model {model_ref!r} is a catalog model, not a file "
            f"(give --weights: a file, a directory or a format, {_format_examples()})"
        )
    return model_ref  # resolve_model has checked that it exists: the file is model and weights


def study_gpu_and_model(study_name: str, storage: str | None) -> tuple[Any, str, str]:
    """The stored study ``--study`` names, its GPU's catalog key and a reference to its model.

    Raises:
        ConfigError: No such study in the storage, or its model is neither a catalog model nor
            found through its study file (then ``--model`` is needed).
    """
    from autotune.report.text import load_study
    from autotune.study import records
    from autotune.study.storage import resolve_url

    study = load_study(resolve_url(storage, None, f"sqlite:///{study_name}.db"), study_name)
    header = records.study_header(study)
    gpu_key = (header.get("gpu") or {}).get("key")
    model_key = header.get("model")
    if not gpu_key or not model_key:
        raise ConfigError(f"--study {study_name!r}: records no GPU or model (give --gpu and --model)")
    if model_key in load_model_catalog():
        return study, gpu_key, model_key
    study_file = Path(header.get("study_file") or "")
    if header.get("study_file") and study_file.is_file():
        cfg = load_study_config(study_file)
        in_dir = cfg.base_dir / cfg.model
        return study, gpu_key, str(in_dir) if in_dir.exists() else cfg.model
    raise ConfigError(
        f"--study {study_name!r}: its model {model_key!r} is a file named by its study file "
        f"{header.get('study_file')!r}, which is not there (from {Path.cwd()}): give --model"
    )


def _verdict(kind: str, refused: str | None) -> str:
    from autotune.study.admission import INVALID, OVER_BUDGET

    if kind == INVALID:
        return "invalid"
    if refused:
        return "refused"
    return "does not fit" if kind == OVER_BUDGET else "fits"


def _study_budget(study: Any, study_name: str, gpu: Any) -> tuple["Budget", list[int] | None, str | None]:
    """The budget ``--study`` judges with, whether its learned corrections apply, and why not.

    Returns:
        (the budget, None when the corrections do not apply else [], a note or None).
    """
    from autotune.study import records
    from autotune.study.admission import Budget, budget_of

    header = records.study_header(study)
    study_gpu = (header.get("gpu") or {}).get("key")
    margin = header.get("safety_margin_bytes")
    if study_gpu != gpu.key:
        margin = SAFETY_MARGIN_MIB * 2**20 if margin is None else int(margin)
        return (
            budget_of(gpu, None, margin),
            None,
            f"study {study_name!r} ran on {study_gpu}, not {gpu.key}: judged against {gpu.key}'s memory with "
            "the study's safety margin and without the memory correction it learned there",
        )
    stored = int(header["vram_budget_bytes"])
    if margin is None:  # a study written before the header kept its margin
        return Budget(stored, 0, f"study {study_name!r}'s budget, its safety margin already off"), [], None
    margin = int(margin)
    source = f"{gpu.name}'s memory" if stored + margin == gpu.vram_bytes else "[hardware] vram_budget_gib"
    return Budget(stored + margin, margin, f"{source}, study {study_name!r}"), [], None


def estimate_config(
    gpu_key: str | None,
    model_ref: str | None,
    backend_name: str,
    weights: str | None,
    ctx_tokens: int,
    cache_type: str | None,
    flash_attn: bool | None,
    parallel: int,
    prompt_tokens: int | None = None,
    output_tokens: int | None = None,
    study_name: str | None = None,
    storage: str | None = None,
    settings: Mapping[str, Any] | None = None,
    dimensions: Mapping[str, Any] | None = None,
    gpus: Sequence[str] | None = None,
    acceptance: float | None = None,
) -> dict[str, Any]:
    """Memory and predicted speed of one configuration.

    Args:
        gpu_key: A catalog key or ``auto``; None: the study's GPU, else ``auto``.
        model_ref: A catalog model, file or directory; None: the study's model.
        weights: A format, a file or directory, or None when ``model_ref`` is itself the file.
        flash_attn: Fused attention; None: the engine's default (the option left out of the configuration).
        prompt_tokens, output_tokens: One request (None: the study's, else 1500 and 800).
        study_name: A stored study whose GPU, model and workload are the defaults, whose
            calibration of the twin predicts, and whose budget and learned memory correction
            judge (``storage``: where it is; default $AUTOTUNE_STORAGE, else
            ``sqlite:///<name>.db``).
        settings: The backend's settings, as a study's ``[backends.NAME]`` table gives them (how
            ExLlamaV2 runs parallel streams without paged attention, say); checked as a study's are.
        dimensions: Values of the backend's other search dimensions (``--set``: offload, experts
            on the host, micro-batch, split...), each checked against what the backend accepts.
        gpus: Several cards (``--gpus``, as ``[hardware] gpus``): the judge checks each card's
            share against its own budget (256 MiB margin each).
        acceptance: With speculation in ``dimensions`` (``spec_type``, ``spec_n_max``): the
            engine's acceptance rate of drafts, accepted / drafted at that n-max (what a trial's
            ``acceptance.rate`` records), which the speed model prices the speculation at; the
            result's ``speculation`` then compares it with the same configuration without.

    Returns:
        ``{"config", "gpu", "model", "vram": {weights_bytes, kv_bytes, buffers_bytes,
        overhead_bytes, total_bytes, budget_bytes, fits, host_bytes, predicted_bytes,
        correction_bytes, correction_trials}, "budget": {memory_bytes, safety_margin_bytes,
        memory_source, study}, "budget_note", "predicted":
        {decode_tok_s, prefill_tok_s, aggregate_tok_s, per_user_tok_s, roofline_tok_s} | None,
        "invalid": [reasons], "refused": reason | None, "verdict", "predictor": name | None,
        "resolved": how --backend became the backend that answered | None, "calibration": the
        study's calibration that predicted {study, n, median_abs_error_before, _after} | None,
        "calibration_note": why a study's calibration was not used | None}``. ``vram`` is the
        judge's estimate, the learned correction (``correction_bytes``, from
        ``correction_trials`` measured trials) in its overhead; ``predicted_bytes`` is the
        backend's own total. ``vram.fits`` is memory alone; ``verdict`` is "fits" only for a
        configuration that is also valid.
    """
    study = None
    placement = None
    if study_name is not None:
        from autotune.study import records

        study, study_gpu, study_model = study_gpu_and_model(study_name, storage)
        gpu_key = gpu_key or study_gpu
        model_ref = model_ref or study_model
        stored = records.study_header(study).get("workload") or {}
        prompt_tokens = prompt_tokens or stored.get("prompt_tokens")
        output_tokens = output_tokens or stored.get("output_tokens")
    prompt_tokens = prompt_tokens or DEFAULT_WORKLOAD[0]
    output_tokens = output_tokens or DEFAULT_WORKLOAD[1]
    if model_ref is None:
        raise ConfigError("--model is needed (a catalog model, a .gguf file or a model directory), or --study NAME")
    if gpu_key is not None and gpu_key.startswith("nvml:"):
        # The study ran on a card the catalog lacks, described by NVML on that machine: only that
        # machine can describe it again.
        here = resolve_gpu("auto") if has_gpu() else None
        if here is None or here.key != gpu_key:
            raise ConfigError(
                f"--study {study_name!r} ran on {gpu_key!r}, a card the catalog does not know; run this "
                f"on a machine with that card, or give --gpu (a catalog key: "
                f"{', '.join(load_gpu_catalog())})"
            )
        gpu = here
    elif gpus:
        if gpu_key is not None:
            raise ConfigError("--gpu names one card and --gpus several: give one or the other")
        placement = resolve_placement(CardsRequest(tuple(gpus), (None,), (float(SAFETY_MARGIN_MIB),)), "--gpus")
        gpu = placement.cards[0].spec
    else:
        gpu = resolve_gpu(gpu_key or "auto")
    try:
        model = resolve_model(model_ref)
    except UnknownNameError as exc:
        raise UnknownNameError(f"--model {exc}") from None
    except ConfigError as exc:  # a path that is no model: its message says what is one; name the flag
        raise ConfigError(f"--model {exc}") from None
    flag = "--weights" if weights is not None else "--model"
    weights = _weights_of(model_ref, weights)
    backend, predictor = resolve_backends(backend_name, weights)
    # Not given: the engine's own default (every backend's is on), as a study that does not
    # search it runs; an explicit False here once priced ExLlamaV2 on a 4090 without flash-attn.
    options: dict[str, Any] = {} if flash_attn is None else {"flash_attn": flash_attn}
    params = {p.name: p for p in backend.parameters({})}
    if cache_type is not None:
        known = params.get("cache_type")
        if known is not None and cache_type not in backend.parameters({"cache_type": (cache_type,)})[0].choices:
            raise ConfigError(f"--cache {cache_type!r}: {backend.name} takes {', '.join(known.choices)}")
        options["cache_type"] = cache_type
    elif "cache_type" in params:
        options["cache_type"] = params["cache_type"].choices[0]
    for name, value in (dimensions or {}).items():
        options[name] = _dimension(backend, name, value)
    # The study's own judge (imported here: it brings the study machinery, which `estimate
    # --help` and the CLI's import do not need).
    from autotune.study.admission import Admission, Budget, budget_of

    residuals: list[int] | None = None
    budget_note = None
    if study is not None:
        from autotune.study.judge import learned_residuals

        budget, residuals, budget_note = _study_budget(study, study_name or "", gpu)
        if residuals is not None:
            residuals = learned_residuals(study).get(backend.name, [])
    elif placement is not None:
        budget = Budget(
            sum(c.memory_bytes for c in placement.cards),
            sum(c.margin_bytes for c in placement.cards),
            f"{len(placement.cards)} cards' memory: " + ", ".join(placement.keys),
        )
    else:
        budget = budget_of(gpu, None, SAFETY_MARGIN_MIB * 2**20)
    if settings:
        from autotune.study.prepare import check_settings

        problems = check_settings(backend, settings, "--setting")
        if problems:
            raise ConfigError("; ".join(problems))
    ctx = StudyContext(
        gpu=gpu,
        model=model,
        workload=Workload(prompt_tokens, output_tokens),
        vram_budget_bytes=budget.bytes,
        protocol=Protocol(),
        for_gpu=not gpu.is_cpu,
        settings=dict(settings or {}),
        placement=placement,
    )
    problem = backend.check_weights(weights, ctx)
    if problem:
        raise ConfigError(f"{flag} {weights!r}: {problem}")
    config = TrialConfig(backend.name, weights, ctx_tokens, parallel, tuple(sorted(options.items())))
    # The study's judge: its rules, its memory model with what it learned, its budget.
    judge = Admission.for_backend(backend, ctx, residuals=residuals)
    verdict = judge.judge(config)
    invalid = list(verdict.reasons)
    mem, raw_total = (
        (verdict.estimate, verdict.raw_total_bytes) if verdict.estimate is not None else judge.memory(config)
    )
    n_learned = judge.correction(backend.name)[1]
    calibration, calibration_note = None, None
    if study is not None and predictor is not None:
        from autotune.study.calibration import calibration_for

        calibration = calibration_for(study, predictor.name, gpu.key)
        if calibration is None:
            calibration_note = (
                f"study {study_name!r} holds no calibration of {predictor.name} on {gpu.key} (a twin "
                "study, another card, or nothing measured yet): the published constants predict"
            )
        ctx = replace(ctx, calibration=calibration)
    predicted = None
    speculated = None
    refused = None
    if acceptance is not None and str(dict(options).get("spec_type", "none")) == "none":
        raise ConfigError(
            f"--acceptance {acceptance}: prices speculative decoding, and the configuration has none: "
            "give its type and draft length, e.g. --set spec_type=draft-mtp --set spec_n_max=2"
        )
    no_prediction = None if predictor is not None else "no speed model for this engine is installed"
    if invalid:
        no_prediction = "no speed is predicted for an invalid configuration"
    elif predictor is not None:
        # The twin reads the same file or directory, so it predicts for the real artifact.
        probe = TrialConfig(predictor.name, weights, ctx_tokens, parallel, config.options)
        try:
            predictor.refuse(probe, ctx)  # type: ignore[attr-defined]
        except AttributeError:
            pass
        except Exception as exc:  # the engine's own refusal, e.g. FlashAttention 2 on Volta
            refused = str(exc)
        if refused is None:
            try:
                if acceptance is not None:
                    predicted, speculated = _with_acceptance(predictor, probe, ctx, acceptance)
                else:
                    predicted = predictor.predictor.predict(probe, ctx)
            except ConfigError as exc:  # a weights file whose format the speed model has no entry for
                no_prediction = f"{predictor.name} cannot predict its speed: {exc}"
    fits = mem.total_bytes <= budget.bytes and not (
        placement is not None and mem.per_device_bytes and check_cards(mem.per_device_bytes, placement)
    )
    resolved = None
    if backend.name != backend_name:
        kind = "a format" if is_format(weights) else "a file or directory"
        role = "the engine's digital twin" if backend.predictor is not None else "the engine's real backend"
        resolved = f"--backend {backend_name} with {kind} as weights: estimated by {backend.name}, {role}"
    return {
        "config": config.as_dict(),
        "gpu": gpu.key,
        "model": model.key,
        "vram": {
            **mem.to_dict(),
            "budget_bytes": budget.bytes,
            "fits": fits,
            "predicted_bytes": raw_total,
            "correction_bytes": mem.total_bytes - raw_total,
            "correction_trials": n_learned,
        },
        "budget": {
            "memory_bytes": budget.memory_bytes,
            "safety_margin_bytes": budget.margin_bytes,
            "memory_source": budget.memory_source,
            "study": study_name,
        },
        "budget_note": budget_note,
        **({"card_budgets": list(placement.budgets)} if placement is not None else {}),
        "predicted": dict(predicted) if predicted else None,
        "speculation": speculated,
        "refused": refused,
        "invalid": invalid,
        "verdict": _verdict(verdict.kind, refused),
        "predictor": predictor.name if predictor else None,
        "no_prediction": no_prediction,
        "resolved": resolved,
        "calibration": None
        if calibration is None
        else {
            "study": study_name,
            "n": calibration.get("n"),
            "median_abs_error_before": calibration.get("median_abs_error_before"),
            "median_abs_error_after": calibration.get("median_abs_error_after"),
        },
        "calibration_note": calibration_note,
    }


def _with_acceptance(
    predictor: BaseBackend, probe: TrialConfig, ctx: StudyContext, rate: float
) -> tuple[Mapping[str, float] | None, dict[str, Any] | None]:
    """The prediction of ``probe`` with its speculation priced at the engine's acceptance
    ``rate``, and how it compares with the same configuration without speculation.

    Raises:
        ConfigError: The speed model prices no acceptance, or ``rate`` is outside [0, 1).
    """
    if not 0 <= rate < 1:
        raise ConfigError(f"--acceptance {rate}: accepted / drafted, a number >= 0 and < 1")
    if not any(s.name == "acceptance_rate" for s in predictor.settings):
        raise ConfigError(
            f"--acceptance: {predictor.name} prices no speculative decoding (it takes no acceptance_rate)"
        )
    priced = predictor.predictor.predict(probe, replace(ctx, settings={**ctx.settings, "acceptance_rate": rate}))
    spec_keys = {"spec_type", "spec_n_max", "spec_n_min", "spec_p_min", "draft", "draft_gpu_layers", "draft_cache_type"}
    plain = predictor.predictor.predict(
        replace(probe, options=tuple(o for o in probe.options if o[0] not in spec_keys)), ctx
    )
    if not priced or not plain:
        return priced, None
    options = dict(probe.options)
    return priced, {
        "acceptance_rate": rate,
        "spec_type": options["spec_type"],
        "spec_n_max": options.get("spec_n_max"),
        "without": {k: plain[k] for k in ("decode_tok_s", "aggregate_tok_s", "per_user_tok_s")},
        "gain": {k: priced[k] / plain[k] for k in ("decode_tok_s", "aggregate_tok_s", "per_user_tok_s") if plain[k]},
    }


def _dimension(backend: Any, name: str, value: Any) -> Any:
    """``--set NAME=VALUE``: the value, if the backend takes it for that dimension; else the
    error names what it takes."""
    found = [p for p in backend.parameters({name: (value,)}) if p.name == name]
    if found and any(same_value(value, c) for c in found[0].choices):
        return value
    dims = {
        p.name: p
        for p in (backend.search_dimensions() if hasattr(backend, "search_dimensions") else backend.parameters({}))
    }
    if name in dims:
        accepted = ", ".join(str(v) for v in (dims[name].accepted or dims[name].choices))
        raise ConfigError(f"--set {name}={value!r}: {backend.name} takes {name} = {accepted}")
    raise ConfigError(
        f"--set {name}: not a dimension of {backend.name} (it has: {', '.join(dims) or 'none'}; "
        "autotune plugins lists them)"
    )


def _percent(fraction: float | None) -> str:
    return "-" if fraction is None else f"{100 * fraction:.0f}%"


def estimate_text(r: dict[str, Any]) -> str:
    from autotune.study.admission import budget_text

    v = r["vram"]
    # MiB for small models (a test model of a few MiB would print as 0.00 GiB everywhere).
    gib, unit = (2**30, "GiB") if v["total_bytes"] >= 2**30 else (2**20, "MiB")
    c = r["config"]
    verdict = r["verdict"]
    if verdict in ("fits", "does not fit"):
        memory = "fits" if v["fits"] else "DOES NOT FIT"
    else:
        memory = f"memory alone {'would fit' if v['fits'] else 'would not fit either'}, but see below"
    lines = [
        f"{c['backend']} {c['weights']} ctx {c['ctx']} x {c['parallel']} "
        + " ".join(f"{k}={val}" for k, val in c.items() if k not in ("backend", "weights", "ctx", "parallel"))
        + f" on {r['gpu']}, model {r['model']}",
    ]
    if r.get("resolved"):
        lines.append(f"  ({r['resolved']})")
    learned = v.get("correction_bytes", 0)
    lines.append(
        f"  VRAM: weights {v['weights_bytes'] / gib:.2f} + KV {v['kv_bytes'] / gib:.2f} + buffers "
        f"{v['buffers_bytes'] / gib:.2f} + overhead {(v['overhead_bytes'] - learned) / gib:.2f}"
        + (f" + learned {learned / gib:.2f}" if learned else "")
        + f" = {v['total_bytes'] / gib:.2f} {unit} of budget {budget_text(v['budget_bytes'])}: {memory}"
    )
    b = r.get("budget")
    if b:
        lines.append(
            f"  budget {budget_text(v['budget_bytes'])} = {b['memory_bytes'] / 2**30:.2f} GiB "
            f"({b['memory_source']}) - {b['safety_margin_bytes'] / 2**30:.2f} GiB safety margin"
            + ("" if b.get("study") else " (autotune's default; a study sets [hardware] safety_margin_mib)")
        )
        n = v.get("correction_trials", 0)
        if b.get("study") and not learned and not r.get("budget_note"):
            lines.append(
                f"  no learned memory correction: study {b['study']!r} has no measured peak of {c['backend']}"
                if not n
                else f"  no learned memory correction: the median of {c['backend']}'s {n} measured "
                f"peaks in study {b['study']!r} is not above its prediction"
            )
    if r.get("budget_note"):
        lines.append(f"  {r['budget_note']}")
    if v["host_bytes"]:
        lines.append(f"  host memory: {v['host_bytes'] / gib:.2f} {unit}")
    for d, (used, budget) in enumerate(zip(v.get("per_device_bytes", ()), r.get("card_budgets", ()))):
        lines.append(
            f"  device {d}: {used / gib:.2f} {unit} of budget {budget_text(budget)}"
            + ("" if used <= budget else ": DOES NOT FIT")
        )
    for note in v.get("notes", []):
        lines.append(f"  - {note}")
    p = r["predicted"]
    if p:
        lines.append(
            f"  predicted ({r['predictor']}): decode {p['decode_tok_s']:.1f} tok/s, prefill {p['prefill_tok_s']:.0f} tok/s, "
            f"aggregate {p['aggregate_tok_s']:.1f} tok/s, per user {p['per_user_tok_s']:.1f} tok/s; "
            f"roofline {p['roofline_tok_s']:.1f} tok/s"
        )
    elif not r.get("refused") and r.get("no_prediction"):
        lines.append(f"  {r['no_prediction']}")
    spec = r.get("speculation")
    if p and spec:
        gain, without = spec["gain"], spec["without"]
        lines.append(
            f"  speculation {spec['spec_type']} n-max {spec['spec_n_max'] or 'default'} at acceptance "
            f"{spec['acceptance_rate']:.2f} (accepted / drafted): decode x{gain['decode_tok_s']:.2f} "
            f"(without: {without['decode_tok_s']:.1f} tok/s), aggregate x{gain['aggregate_tok_s']:.2f} "
            f"(without: {without['aggregate_tok_s']:.1f} tok/s) at parallel {c['parallel']}"
        )
    cal = r.get("calibration")
    if p and cal:
        lines.append(
            f"  calibrated on {cal['n']} measured trials of study {cal['study']} (its median error there "
            f"{_percent(cal['median_abs_error_before'])} -> {_percent(cal['median_abs_error_after'])})"
        )
    elif r.get("calibration_note"):
        lines.append(f"  {r['calibration_note']}")
    if verdict == "invalid":
        lines.append("  INVALID, the engine would not run it: " + "; ".join(r["invalid"]))
    elif verdict == "refused":
        lines.append(f"  REFUSED by the engine: {r['refused']}")
    return "\n".join(lines)
