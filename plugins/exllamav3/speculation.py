"""exllamav3's speculative decoding as search dimensions: the drafting mode, the draft weights,
the draft length, n-gram match length and the draft's cache; what the engine refuses; the
draft's memory; TabbyAPI's keys.

Every fact is exllamav3 1.6.5's (``generator/generator.py`` ``Generator.__init__``,
``generator/job.py``, ``model_init.py``, ``architecture/*.py``) or TabbyAPI's
(``config_sample.yml`` ``draft_model:``, ``backends/exllamav3/model.py``):

* The generator drafts with a draft model (``draft_model`` + ``draft_cache``), the target's own
  MTP head (TabbyAPI ``draft_mode: mtp`` loads ``Model.from_config(config, component="mtp")``
  as the draft model) or an n-gram lookup (``ngram_match_min > 0``); "Cannot use both draft
  model and n-gram draft" (asserted). ``num_draft_tokens`` defaults to the draft model's
  ``default_draft_size`` (4 where it has none), 4 for n-gram.
* The draft cache "must be same size as main cache" (asserted); TabbyAPI builds it with
  ``draft_cache_mode`` (FP16 or "K,V" bits) and the target's ``cache_size``.
* A job reserves its response plus one speculative window: ``max_new_tokens + 1 +
  max_draft_tokens`` (job.py), so the window is in every job's pages (:mod:`.generator_settings`).

Only a space that names ``spec_type`` searches speculation; the rest are conditional on it
(:class:`autotune.api.ConditionalParam`), drawn only for the modes that read them.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from autotune.api import ModelSpec, Param, TrialConfig
from autotune._builtin import ConditionalParam, ConfigError, kept

from autotune_plugins.exllamav3.generator_settings import normalize_cache_type

__all__ = [
    "DEFAULT_DRAFT_TOKENS",
    "DEFAULT_NGRAM_MATCH",
    "KEYS",
    "MODEL_MODES",
    "RULES",
    "SPEC_TYPES",
    "TABBY_DRAFT_MODE",
    "check",
    "draft_tokens",
    "mtp_layers",
    "ngram_match",
    "speculates",
]

# Ours -> TabbyAPI's draft_mode (common/config_models.py DraftModelConfig: model, disabled, mtp, ngram).
TABBY_DRAFT_MODE = {"none": "disabled", "draft": "model", "mtp": "mtp", "ngram": "ngram"}
SPEC_TYPES = tuple(TABBY_DRAFT_MODE)
# Modes whose drafter is a model with its own cache (the draft weights or the MTP head).
MODEL_MODES = ("draft", "mtp")
DEFAULT_DRAFT_TOKENS = 4  # Generator: draft_model.caps.get("default_draft_size", 4); n-gram 4
DEFAULT_NGRAM_MATCH = 2  # TabbyAPI config_sample.yml ngram_match_min: 2
KEYS = ("spec_type", "draft", "spec_n_max", "spec_ngram_n", "draft_cache_type")
RULES = (
    "spec_type draft: needs draft weights ([[candidates]] draft); draft weights only with spec_type draft",
    "spec_type mtp: the model's config.json declares MTP layers (num_nextn_predict_layers / mtp_num_hidden_layers)",
    "spec_type ngram: no draft model (generator: 'Cannot use both draft model and n-gram draft')",
    "draft weights: the target's vocabulary size",
)
# architecture/*.py whose model_classes register an "mtp" component, and the config key that
# counts its layers (the component is dropped when the count is 0). DeepseekV4 counts the
# compress_ratios past num_hidden_layers instead (deepseek_v4.py: nextn "is unreliable").
MTP_COUNT_KEYS = {
    "BailingMoeV3ForCausalLM": "num_nextn_predict_layers",
    "Glm4MoeLiteForCausalLM": "num_nextn_predict_layers",
    "Glm5NextForConditionalGeneration": "num_nextn_predict_layers",
    "GlmMoeDsaForCausalLM": "num_nextn_predict_layers",
    "HYV3ForCausalLM": "num_nextn_predict_layers",
    "MiMoV2ForCausalLM": "num_nextn_predict_layers",
    "NemotronHForCausalLM": "num_nextn_predict_layers",
    "NemotronH_Omni_Reasoning_V3": "num_nextn_predict_layers",
    "Qwen3_5ForConditionalGeneration": "mtp_num_hidden_layers",
    "Qwen3_5ForCausalLM": "mtp_num_hidden_layers",
    "Qwen3_5MoeForConditionalGeneration": "mtp_num_hidden_layers",
    "Qwen3_5MoeForCausalLM": "mtp_num_hidden_layers",
    "DeepseekV4ForCausalLM": "compress_ratios",
}


def speculates(config: TrialConfig) -> bool:
    return config.option("spec_type", "none") != "none"


def draft_tokens(config: TrialConfig) -> int:
    """``num_draft_tokens`` the generator gets (0: no speculation). Always passed explicitly, so
    that the speculative window each job reserves is known before the model loads."""
    if not speculates(config):
        return 0
    return int(config.option("spec_n_max", DEFAULT_DRAFT_TOKENS))


def ngram_match(config: TrialConfig) -> int:
    """``ngram_match_min`` (0: no n-gram drafting)."""
    return int(config.option("spec_ngram_n", DEFAULT_NGRAM_MATCH)) if config.option("spec_type") == "ngram" else 0


def parameters(space: Mapping[str, Sequence[Any]]) -> list[Param]:
    """The speculation dimensions the space names (none unless it names ``spec_type``)."""
    if "spec_type" not in space:
        return []
    params: list[Param] = [
        Param(
            "spec_type",
            kept(space, "spec_type", SPEC_TYPES),
            "drafting mode (TabbyAPI draft_mode: disabled, model, mtp, ngram)",
            accepted=SPEC_TYPES,
        )
    ]

    def on(name: str, choices: tuple[Any, ...], doc: str, modes: Sequence[str], accepted: tuple[Any, ...]) -> None:
        params.append(
            ConditionalParam(name, choices, doc, accepted=accepted, parent="spec_type", parent_values=tuple(modes))
        )

    if "draft" in space:
        on(
            "draft",
            tuple(w for w in space["draft"] if isinstance(w, str) and w),
            "draft weights (draft_model_name)",
            ("draft",),
            ("weights listed in [[candidates]] draft",),
        )
    if "spec_n_max" in space:
        on(
            "spec_n_max",
            tuple(v for v in space["spec_n_max"] if type(v) is int and 1 <= v <= 64),
            "tokens drafted per round (num_draft_tokens, TabbyAPI draft_num_tokens)",
            ("draft", "mtp", "ngram"),
            ("an integer 1..64",),
        )
    if "spec_ngram_n" in space:
        on(
            "spec_ngram_n",
            tuple(v for v in space["spec_ngram_n"] if type(v) is int and v >= 1),
            "least n-gram match that drafts (ngram_match_min)",
            ("ngram",),
            ("an integer >= 1",),
        )
    if "draft_cache_type" in space:
        on(
            "draft_cache_type",
            tuple(v for v in space["draft_cache_type"] if isinstance(v, str) and _is_cache(v)),
            "draft cache type (TabbyAPI draft_cache_mode)",
            MODEL_MODES,
            ("fp16", "k<K>v<V> with K, V from 2 to 8"),
        )
    return params


def mtp_layers(hf_config: Mapping[str, Any] | None) -> int | None:
    """The MTP layers the config declares (0: none; None: no config to read)."""
    if hf_config is None:
        return None
    arch = (hf_config.get("architectures") or [""])[0]
    key = MTP_COUNT_KEYS.get(arch)
    if key is None:
        return 0
    text = hf_config.get("text_config") or {}
    value = hf_config.get(key, text.get(key))
    if key == "compress_ratios":
        layers = hf_config.get("num_hidden_layers", text.get("num_hidden_layers", 0))
        return max(0, len(value or ()) - int(layers))
    return int(value or 0)


def check(
    config: TrialConfig, hf_config: Mapping[str, Any] | None, draft_model: ModelSpec | None, model: ModelSpec
) -> list[str]:
    """What exllamav3/TabbyAPI refuse, or serve as no speculation, for ``config``'s speculation.

    Args:
        hf_config: The target's config.json (None: not readable yet).
        draft_model: The draft weights' architecture (None: none, or not made yet).
        model: The target's architecture.
    """
    kind = config.option("spec_type", "none")
    name = config.option("draft")
    out = []
    if kind == "draft" and name is None:
        out.append(
            "spec_type draft: the configuration has no draft weights, and TabbyAPI's draft_mode model without "
            "draft_model_name disables drafting: list draft weights in [[candidates]] draft"
        )
    if name is not None and kind != "draft":
        out.append(
            f"draft {name!r} with spec_type {kind}: draft weights are loaded only by spec_type draft "
            "(exllamav3: 'Cannot use both draft model and n-gram draft'; mtp drafts with the target's head)"
        )
    if kind == "mtp" and (layers := mtp_layers(hf_config)) == 0:
        arch = ((hf_config or {}).get("architectures") or ["?"])[0]
        out.append(
            f"spec_type mtp: {arch} declares no MTP layers (exllamav3 registers an mtp component only for "
            f"{', '.join(sorted(set(MTP_COUNT_KEYS)))} with a nonzero layer count)"
        )
    if draft_model is not None and draft_model.vocab_size != model.vocab_size:
        out.append(
            f"draft {name!r}: vocabulary {draft_model.vocab_size} is not the target's {model.vocab_size} (the "
            "target verifies the draft's token ids)"
        )
    return out


def _is_cache(value: Any) -> bool:
    try:
        normalize_cache_type(value)
    except ConfigError:
        return False
    return True
