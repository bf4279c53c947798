"""llama-server's speculative decoding as search dimensions: the type, the draft weights and
the draft's length, placement and cache; what the engine refuses; the flags.

Every fact below is this pinned build's (llama.cpp of llama-cpp-python 0.3.36), read from its
``llama-server --help`` and its source: ``common/common.h`` (``common_speculative_type``,
``common_params_speculative_draft``: n_max 3, n_min 0, p_min 0.0 by default),
``common/arg.cpp`` (the flags), ``common/speculative.cpp`` (what each type needs) and
``tools/server/server-context.cpp`` (``load_model``: which types load a draft model).

Only a space that names ``spec_type`` searches speculation; the draft's length, placement and
cache are conditional on it (:class:`autotune.api.ConditionalParam`): drawn only for the types
that read them, so ``spec_type = "none"`` is one configuration, not one per n-max.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from autotune.api import Param, Setting, StudyContext, TrialConfig
from autotune._builtin import kept
from autotune._builtin import ConditionalParam
from autotune._builtin import read_gguf

__all__ = [
    "DRAFT_MODEL_TYPES",
    "DRAFT_TYPES",
    "KEYS",
    "NGRAM_SIZE_FLAGS",
    "RULES",
    "SETTINGS",
    "SPEC_TYPES",
    "check",
    "flags",
    "has_nextn",
    "parameters",
    "speculates",
]

# `llama-server --help`, --spec-type, in its order (common/speculative.cpp
# common_speculative_type_from_name_map). The flag takes a comma-separated list; one type per
# configuration is searched.
SPEC_TYPES = (
    "none",
    "draft-simple",
    "draft-eagle3",
    "draft-mtp",
    "draft-dflash",
    "draft-dspark",
    "ngram-simple",
    "ngram-map-k",
    "ngram-map-k4v",
    "ngram-mod",
    "ngram-cache",
)
# Types that load the -md weights: server-context.cpp load_model loads a draft model when
# params.speculative.has_dft(); draft-simple throws "draft-simple requires a draft context"
# without one, draft-eagle3 checks the draft is an EAGLE3 head, draft-dflash/-dspark read a
# "dflash" GGUF (common_speculative_types_from_gguf). draft-mtp runs the target's own nextn
# layers in a second context on the target model: no -md.
DRAFT_MODEL_TYPES = ("draft-simple", "draft-eagle3", "draft-dflash", "draft-dspark")
# Types whose draft length is --spec-draft-n-max/-n-min/-p-min and whose draft context takes
# -ctkd/-ctvd (common_speculative_n_max; common_base_params_to_speculative sets the draft
# context's cache types for every type that makes one).
DRAFT_TYPES = (*DRAFT_MODEL_TYPES, "draft-mtp")
# The n-gram types' lookup length: each its own flag (--spec-ngram-size-n was removed); ngram-cache
# has none (its n-gram sizes are compiled in, common/ngram-cache.h).
NGRAM_SIZE_FLAGS = {
    "ngram-simple": "--spec-ngram-simple-size-n",
    "ngram-map-k": "--spec-ngram-map-k-size-n",
    "ngram-map-k4v": "--spec-ngram-map-k4v-size-n",
    "ngram-mod": "--spec-ngram-mod-n-match",
}
DRAFT_CACHE_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")  # --help, -ctkd
DEFAULT_N_MAX = 3  # common/common.h common_params_speculative_draft
DEFAULT_N_MIN = 0
KEYS = (
    "spec_type",
    "draft",
    "spec_n_max",
    "spec_n_min",
    "spec_p_min",
    "spec_ngram_n",
    "draft_gpu_layers",
    "draft_cache_type",
)
RULES = (
    "spec_type draft-simple/-eagle3/-dflash/-dspark: needs draft weights ([[candidates]] draft)",
    "draft weights only with a type that loads them",
    "spec_type draft-mtp: needs nextn (MTP) layers in the model's GGUF",
    "spec_type draft-mtp: not with split_mode tensor",
    "spec_n_min <= spec_n_max",
    "spec_synth_len within [1, n_max + 1]; spec_synth_rates: n_max values",
    "draft weights: the target's vocabulary type",
)


def speculates(config: TrialConfig) -> bool:
    """Whether the configuration runs speculative decoding."""
    return config.option("spec_type", "none") != "none"


def _ints(space: Mapping[str, Sequence[Any]], key: str, low: int, high: int) -> tuple[int, ...]:
    return tuple(v for v in space.get(key, ()) if type(v) is int and low <= v <= high)


def parameters(space: Mapping[str, Sequence[Any]]) -> list[Param]:
    """The speculation dimensions the space names (none unless it names ``spec_type``). The
    draft weights are the candidate's ``draft`` list (the study puts it under ``draft``)."""
    if "spec_type" not in space:
        return []
    top = 2**31 - 1  # std::stoi into an int32 (common/arg.cpp)
    params: list[Param] = [
        Param(
            "spec_type",
            kept(space, "spec_type", SPEC_TYPES),
            "speculative decoding type (--spec-type)",
            accepted=SPEC_TYPES,
        )
    ]

    def on(name: str, choices: tuple[Any, ...], doc: str, types: Sequence[str], accepted: tuple[Any, ...]) -> None:
        params.append(
            ConditionalParam(name, choices, doc, accepted=accepted, parent="spec_type", parent_values=tuple(types))
        )

    if "draft" in space:
        on(
            "draft",
            tuple(w for w in space["draft"] if isinstance(w, str) and w),
            "draft weights (-md)",
            DRAFT_MODEL_TYPES,
            ("weights listed in [[candidates]] draft",),
        )
    if "spec_n_max" in space:
        on(
            "spec_n_max",
            _ints(space, "spec_n_max", 0, top),
            "tokens drafted per step (--spec-draft-n-max)",
            DRAFT_TYPES,
            (f"an integer 0..{top}",),
        )
    if "spec_n_min" in space:
        on(
            "spec_n_min",
            _ints(space, "spec_n_min", 0, top),
            "shortest draft used (--spec-draft-n-min)",
            DRAFT_TYPES,
            (f"an integer 0..{top}",),
        )
    if "spec_p_min" in space:
        on(
            "spec_p_min",
            tuple(v for v in space["spec_p_min"] if type(v) in (int, float) and 0 <= v <= 1),
            "least draft probability kept, greedy (--spec-draft-p-min)",
            DRAFT_TYPES,
            ("a number 0..1",),
        )
    if "spec_ngram_n" in space:
        on(
            "spec_ngram_n",
            _ints(space, "spec_ngram_n", 1, 65535),
            f"n-gram lookup length ({', '.join(NGRAM_SIZE_FLAGS.values())})",
            tuple(NGRAM_SIZE_FLAGS),
            ("an integer 1..65535",),
        )
    if "draft_gpu_layers" in space:
        on(
            "draft_gpu_layers",
            tuple(v for v in space["draft_gpu_layers"] if v == "all" or (type(v) is int and 0 <= v <= top)),
            "draft layers on the GPU (-ngld)",
            DRAFT_MODEL_TYPES,
            ('"all"', f"an integer 0..{top}"),
        )
    if "draft_cache_type" in space:
        on(
            "draft_cache_type",
            kept(space, "draft_cache_type", DRAFT_CACHE_TYPES),
            "draft KV-cache type (-ctkd/-ctvd)",
            DRAFT_TYPES,
            DRAFT_CACHE_TYPES,
        )
    return params


# ------------------------------------------------------------------ settings


def _synth_len_problem(value: Any) -> str | None:
    return None if value >= 1 else "must be >= 1 (the target token counts: 1 is no draft accepted)"


def _synth_rates_problem(value: Any) -> str | None:
    try:
        rates = [float(p) for p in value.split(",")]
    except ValueError:
        return 'must be comma-separated probabilities, e.g. "0.9,0.7,0.5"'
    if not all(0 <= p <= 1 for p in rates):
        return "each probability must be within [0, 1]"
    if any(b > a for a, b in zip(rates, rates[1:])):
        return "must not increase (common/speculative.cpp: monotonically non-increasing)"
    return None


SETTINGS = (
    Setting(
        "spec_synth_len",
        (int, float),
        None,
        "benchmarking only: accept drafts at random so that the mean accepted "
        "length (the target token included) is this (--spec-synth-len); output is not valid text. For a "
        "random-weight model, whose drafts are never accepted otherwise",
        check=_synth_len_problem,
    ),
    Setting(
        "spec_synth_rates",
        str,
        None,
        "benchmarking only: per-position acceptance probabilities, one per "
        'drafted token, not increasing (--spec-synth-rates "0.9,0.7,0.5"); not with spec_synth_len',
        check=_synth_rates_problem,
    ),
)


def settings_problems(settings: Mapping[str, Any]) -> list[str]:
    """What the two settings refuse together (common/speculative.cpp: mutually exclusive)."""
    if settings.get("spec_synth_len") is not None and settings.get("spec_synth_rates") is not None:
        return ["spec_synth_len and spec_synth_rates: give one (llama.cpp: mutually exclusive)"]
    return []


# ------------------------------------------------------------------ rules


def has_nextn(path: Path) -> bool:
    """Whether the GGUF has MTP layers: common/speculative.cpp common_speculative_types_from_gguf
    looks for ``blk.<block_count - 1>.nextn.eh_proj.weight``."""
    f = read_gguf(path)
    arch = f.architecture
    count = f.get(f"{arch}.block_count")
    return count is not None and f.tensor(f"blk.{int(count) - 1}.nextn.eh_proj.weight") is not None


def check(
    config: TrialConfig,
    ctx: StudyContext,
    target: Path | None,
    draft: Callable[[str], Path | None],
    synth: Mapping[str, Any],
) -> list[str]:
    """What llama-server refuses, or runs as no speculation at all, for ``config``'s speculation.

    Args:
        target: The target's GGUF file, None while it is a format not made yet.
        draft: The file of a draft weights name (None: not made yet).
        synth: The backend's ``spec_synth_len``/``spec_synth_rates`` settings.
    """
    kind = config.option("spec_type", "none")
    name = config.option("draft")
    out = []
    if kind in DRAFT_MODEL_TYPES and name is None:
        out.append(
            f"spec_type {kind}: loads a draft model (-md), and the configuration has none: list draft "
            "weights in [[candidates]] draft (common/speculative.cpp: 'draft-simple requires a draft context')"
        )
    if name is not None and kind not in DRAFT_MODEL_TYPES:
        out.append(
            f"draft {name!r} with spec_type {kind}: the draft weights are loaded only by {', '.join(DRAFT_MODEL_TYPES)}"
        )
    if kind == "draft-mtp":
        if target is not None and not has_nextn(target):
            out.append(
                f"spec_type draft-mtp: {target.name} has no nextn (MTP) layers (common/speculative.cpp "
                "common_speculative_types_from_gguf: no blk.N.nextn.eh_proj.weight)"
            )
        if config.option("split_mode") == "tensor":
            # Reported with this build (issue 47): the MTP context shares the target model, whose
            # tensors a meta device splits; server-context.cpp guards neither.
            out.append(
                "spec_type draft-mtp with split_mode tensor: llama-server crashes (the MTP context runs "
                "on the target's split tensors); use split_mode layer"
            )
    n_max = int(config.option("spec_n_max", DEFAULT_N_MAX))
    n_min = int(config.option("spec_n_min", DEFAULT_N_MIN))
    if kind in DRAFT_TYPES and n_min > n_max:
        out.append(
            f"spec_n_min {n_min} > spec_n_max {n_max}: every draft is shorter than n_min and dropped "
            "(common/speculative.cpp: result.size() < n_min -> no draft)"
        )
    if (
        kind in DRAFT_TYPES
        and synth.get("spec_synth_len") is not None
        and not 1 <= synth["spec_synth_len"] <= n_max + 1
    ):
        out.append(
            f"spec_synth_len {synth['spec_synth_len']} with spec_n_max {n_max}: must be within "
            f"[1, {n_max + 1}] (common/speculative.cpp common_speculative_synth_rates_resolve)"
        )
    if kind in DRAFT_TYPES and synth.get("spec_synth_rates") is not None:
        count = len(str(synth["spec_synth_rates"]).split(","))
        if count != n_max:
            out.append(
                f"spec_synth_rates has {count} values and spec_n_max is {n_max}: llama.cpp wants one per "
                "drafted token (common_speculative_synth_rates_resolve)"
            )
    if name is not None and target is not None and (path := draft(name)) is not None:
        ours, theirs = read_gguf(target).get("tokenizer.ggml.model"), read_gguf(path).get("tokenizer.ggml.model")
        if ours != theirs:
            out.append(
                f"draft {name!r}: its vocabulary ({theirs}) is not the target's ({ours}) (common/speculative.cpp: "
                "'draft model vocab type must match target model to use speculation')"
            )
    return out


# ------------------------------------------------------------------ flags


def flags(config: TrialConfig, draft_path: Callable[[str], Path], synth: Mapping[str, Any]) -> list[str]:
    """llama-server's flags for ``config``'s speculation (none when it does not speculate)."""
    kind = config.option("spec_type", "none")
    if kind == "none":
        return []
    out = ["--spec-type", kind]
    name = config.option("draft")
    if name is not None:
        out += ["-md", str(draft_path(name))]
    for option, flag in (
        ("spec_n_max", "--spec-draft-n-max"),
        ("spec_n_min", "--spec-draft-n-min"),
        ("spec_p_min", "--spec-draft-p-min"),
    ):
        if config.option(option) is not None:
            out += [flag, str(config.option(option))]
    if config.option("spec_ngram_n") is not None and kind in NGRAM_SIZE_FLAGS:
        out += [NGRAM_SIZE_FLAGS[kind], str(int(config.option("spec_ngram_n")))]
    if config.option("draft_gpu_layers") is not None:
        out += ["-ngld", str(config.option("draft_gpu_layers"))]
    cache = config.option("draft_cache_type")
    if cache is not None:
        out += ["-ctkd", cache, "-ctvd", cache]
    if kind in DRAFT_TYPES:  # the synthetic acceptance is of a draft's tokens
        if synth.get("spec_synth_len") is not None:
            out += ["--spec-synth-len", str(synth["spec_synth_len"])]
        if synth.get("spec_synth_rates") is not None:
            out += ["--spec-synth-rates", str(synth["spec_synth_rates"])]
    return out
