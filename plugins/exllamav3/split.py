"""exllamav3 across several cards: its split dimensions, their rules and TabbyAPI's keys for them.

The dimensions (``[space]`` keys, searched when the study names more than one card):

* ``gpu_split``: ``"auto"`` (TabbyAPI's ``gpu_split_auto: true``: exllamav3's autosplit loader
  fills each card in turn up to its free memory less ``autosplit_reserve``), or GiB per card
  as a string, ``"20,24"`` (TabbyAPI's ``gpu_split: [20, 24]``: ``load_gen(use_per_device=...)``;
  a card given 0 is left out);
* ``tensor_parallel``: true or false (TabbyAPI's ``tensor_parallel``; exllamav3's
  ``load_gen(tensor_p=True)``): every layer's attention heads and MLP channels split over the
  cards, the KV cache with its heads; false: whole layers per card.

The rules, read in exllamav3 1.6.5 (the wheel's ``exllamav3/model/model.py`` ``load_gen``,
``model/model_tp.py`` ``_load_tp``, ``modules/attn.py`` ``make_tp_allocation``) and TabbyAPI
(``backends/exllamav3/model.py``, ``config_sample.yml``):

* tensor parallel needs the architecture's ``caps["supports_tp"]`` ("Tensor-parallel is not
  currently implemented for ..."): :data:`NO_TP_ARCHITECTURES` lists the config.json
  architectures whose text model sets it false (each ``architecture/*.py``), and
  ``Mistral3ForConditionalGeneration`` with a ``mistral4`` text model (architecture/mistral4.py);
* tensor parallel splits K/V heads on 128-channel boundaries: a unit is the fewest heads whose
  width is a multiple of 128, and the K/V heads must divide into such units ("Model's K/V heads
  cannot divide into 128-channel tensors", modules/attn.py);
* one card: TabbyAPI turns the split off ("Disabling GPU split because one GPU is in use"), so
  a one-card study takes neither dimension;
* ``gpu_split`` names at most one figure per card (``use_per_device`` indexes the devices), at
  least one above 0 (``active_devices`` would be empty).

Where the bytes go on each card is the memory model's (:func:`.memory.per_card`).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from autotune.api import Param, StudyContext, TrialConfig

__all__ = [
    "AUTO",
    "KEYS",
    "NO_TP_ARCHITECTURES",
    "RULES",
    "check",
    "gpu_split_gib",
    "kv_units",
    "n_cards",
    "parameters",
    "space",
    "tabbyapi_split_args",
    "tp_problem",
]

AUTO = "auto"
KEYS = ("gpu_split", "tensor_parallel")
# The config.json architectures whose text model sets caps supports_tp False in exllamav3 1.6.5
# (architecture/afmoe.py, dflash.py, dflash2.py, dflash_laguna.py, gemma4_assistant.py,
# glm4_moe_lite.py, lfm2.py, lfm2_moe.py, lfm2_vl.py (its text model is lfm2's), muse_glimmer.py,
# olmo3.py, olmohybrid.py, qwen3_next.py); every other architecture keeps Model's default True.
NO_TP_ARCHITECTURES = frozenset(
    (
        "AfmoeForCausalLM",
        "DFlash2DraftModel",
        "DFlashDraftModel",
        "DFlashLagunaForCausalLM",
        "Gemma4AssistantForCausalLM",
        "Glm4MoeLiteForCausalLM",
        "Lfm2ForCausalLM",
        "Lfm2MoeForCausalLM",
        "Lfm2VlForConditionalGeneration",
        "MuseGlimmerAssistantModel",
        "MuseGlimmerForConditionalGeneration",
        "Olmo3ForCausalLM",
        "OlmoHybridForCausalLM",
        "Qwen3NextForCausalLM",
    )
)
# TabbyAPI's tensor_parallel_backend default (config_sample.yml: "native ... recommended for PCIe").
TP_BACKEND = "native"
# EXL3 tensors split on 128-channel boundaries (modules/attn.py make_tp_allocation).
TP_CHANNELS = 128

RULES = (
    'gpu_split: "auto" or GiB per card ("20,24"), at most one figure per card, one above 0; a one-card study '
    "takes neither split key (TabbyAPI turns the split off for one GPU)",
    "tensor_parallel: an architecture exllamav3 implements it for (caps supports_tp), K/V heads that divide into "
    "128-channel units",
)


def n_cards(ctx: StudyContext) -> int:
    """The cards the worker is given: the study's (one without ``[hardware] gpus``)."""
    p = getattr(ctx, "placement", None)
    return len(p.cards) if p is not None else 1


def gpu_split_gib(value: Any, n: int | None = None) -> tuple[float, ...] | None:
    """``"20,24"`` as GiB per card; ``()`` for ``"auto"``; None when it is neither (or names
    more than ``n`` cards, or none above 0)."""
    if value == AUTO:
        return ()
    if not isinstance(value, str):
        return None
    try:
        gib = tuple(float(v) for v in value.split(",") if v.strip())
    except ValueError:
        return None
    if not gib or any(v < 0 for v in gib) or not any(v > 0 for v in gib) or (n is not None and len(gib) > n):
        return None
    return gib


def parameters(space: Mapping[str, Sequence[Any]]) -> list[Param]:
    """The split dimensions the study names, exactly as given (a value exllamav3 would not take
    is left for the core to report with ``accepted``)."""
    params = []
    if "gpu_split" in space:
        params.append(
            Param(
                "gpu_split",
                tuple(v for v in space["gpu_split"] if gpu_split_gib(v) is not None),
                "GiB per card (TabbyAPI gpu_split), or auto (gpu_split_auto: each card filled in turn)",
                accepted=('"auto"', 'GiB per card as a string, e.g. "20,24"'),
            )
        )
    if "tensor_parallel" in space:
        params.append(
            Param(
                "tensor_parallel",
                tuple(v for v in space["tensor_parallel"] if isinstance(v, bool)),
                "heads and MLP channels split over the cards (TabbyAPI tensor_parallel); false: whole layers per card",
                accepted=("true", "false"),
            )
        )
    return params


def kv_units(head_dim: int, n_kv_heads: int) -> int | None:
    """How many units of K/V heads a tensor-parallel split deals out (None: they do not divide).

    modules/attn.py: the unit widens by doubling until ``width x head_dim`` is a multiple of 128,
    asserting each time that the heads still divide by two.
    """
    width, units = 1, n_kv_heads
    while (width * head_dim) % TP_CHANNELS:
        if units % 2:
            return None
        width, units = width * 2, units // 2
    return units


def tp_problem(model: Any, hf_config: Mapping[str, Any] | None) -> str | None:
    """Why exllamav3 would refuse to load ``model`` tensor-parallel (None: it would load).

    Args:
        model: The architecture (head counts).
        hf_config: The weights' config.json (None: not at hand, the architecture is not checked).
    """
    if hf_config is not None:
        archs = hf_config.get("architectures") or []
        arch = archs[0] if isinstance(archs, list) and archs else None
        text = hf_config.get("text_config") if isinstance(hf_config.get("text_config"), Mapping) else {}
        if arch in NO_TP_ARCHITECTURES or (
            arch == "Mistral3ForConditionalGeneration" and text.get("model_type") == "mistral4"
        ):
            return (
                f"tensor_parallel: exllamav3 1.6.5 does not implement it for {arch} (model/model.py: "
                '"Tensor-parallel is not currently implemented")'
            )
    if model.n_kv_heads and kv_units(model.head_dim, model.n_kv_heads) is None:
        return (
            f"tensor_parallel: {model.n_kv_heads} K/V heads of {model.head_dim} channels cannot divide into "
            "128-channel units (modules/attn.py)"
        )
    return None


def check(config: TrialConfig, ctx: StudyContext, model: Any, hf_config: Mapping[str, Any] | None) -> list[str]:
    """The split's rules (see the module's docstring): what exllamav3 or TabbyAPI would refuse."""
    n = n_cards(ctx)
    split, tp = config.option("gpu_split"), config.option("tensor_parallel")
    out = []
    if n < 2 and (split not in (None, AUTO) or tp):
        out.append(
            "gpu_split and tensor_parallel need several cards: TabbyAPI turns the split off for one GPU "
            "([hardware] gpus names several)"
        )
    if split is not None and gpu_split_gib(split, n) is None:
        out.append(
            f'gpu_split {split!r}: give "auto" or at most {n} GiB figures, one above 0, e.g. "{",".join(["20"] * n)}"'
        )
    if tp:
        problem = tp_problem(model, hf_config)
        if problem:
            out.append(problem)
    return out


def space(ctx: StudyContext, model: Any, hf_config: Mapping[str, Any] | None) -> dict[str, list[Any]]:
    """What a study on several cards searches when its ``[space]`` does not say: ``auto`` (the
    first card filled before the next) and the smallest card's budget on each (the layers
    spread evenly, so a slow card holds no more than its share); tensor parallel where the
    model loads so."""
    p = getattr(ctx, "placement", None)
    if p is None or len(p.cards) < 2:
        return {}
    even = int(min(p.budgets) / 2**30)
    splits = [AUTO] + ([",".join([str(even)] * len(p.cards))] if even >= 1 else [])
    return {"gpu_split": splits, "tensor_parallel": [False] + ([True] if tp_problem(model, hf_config) is None else [])}


def tabbyapi_split_args(gpu_split: str, tensor_parallel: bool) -> list[str]:
    """TabbyAPI's flags for the split (config.yml ``model:`` keys ``gpu_split_auto``, ``gpu_split``,
    ``tensor_parallel``, ``tensor_parallel_backend``, dashed by common/args.py; ``gpu_split``
    takes one figure per card);
    none for a configuration that names no split (a one-card line stays as it was)."""
    out: list[str] = []
    gib = gpu_split_gib(gpu_split) if gpu_split else None
    if gib == ():
        out += ["--gpu-split-auto", "true"]
    elif gib:
        out += ["--gpu-split-auto", "false", "--gpu-split", *(f"{g:g}" for g in gib)]
    if tensor_parallel:
        out += ["--tensor-parallel", "true", "--tensor-parallel-backend", TP_BACKEND]
    return out
