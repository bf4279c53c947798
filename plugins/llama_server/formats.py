"""The GGUF formats (``gguf:<TYPE>``): how one is written, and its weight bytes, predicted from the
architecture or read from a file's tensor table.

The callables of the ``GGUF`` declaration (:mod:`autotune_plugins.llama_server.declarations`),
through which :mod:`autotune.engine.formats` reads, spells and sizes a ``gguf:`` format; the
llama-server backend and the twin of llama.cpp use the functions directly too. The per-tensor
types are llama-quantize's (:mod:`autotune_plugins.llama_server.quant`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path

from autotune.api import ModelSpec
from autotune.api import WeightsBreakdown
from autotune._builtin import GgufFile, GgufTensor, read_gguf
from autotune_plugins.llama_server.quant import GGML_TYPES, GGUF_FILE_TYPES, TensorPlan, gguf_tensor_plan

__all__ = ["ACCEPTS", "bits_per_weight", "file_type", "format_of", "gguf_file_weights", "predict_gguf_weights", "quote"]

# The routed experts' matrices, as common/arg.cpp's --n-cpu-moe override names them
# ("blk\\.%d\\.ffn_(up|down|gate|gate_up)_(ch|)exps"); shared experts (``_shexp``) are not among them.
_EXPERTS_RX = re.compile(r"\.ffn_(up|down|gate|gate_up)_(ch|)exps\b")
ACCEPTS = f"gguf:<TYPE> with TYPE in {', '.join(GGUF_FILE_TYPES)}"


def file_type(variant: str) -> str:
    """A written file type -> llama-quantize's spelling (``q4_k_m`` -> ``Q4_K_M``).

    Raises:
        ValueError: Not a file type llama-quantize makes (of those :mod:`.quant` knows).
    """
    name = variant.upper()
    if name not in GGUF_FILE_TYPES:
        raise ValueError(variant)
    return name


def _gguf_breakdown(
    tensors: Iterable[TensorPlan | GgufTensor], n_layers: int | None, head_is_embedding: bool
) -> WeightsBreakdown:
    """GGUF tensors summed by where llama.cpp puts them: layers, embedding, head, the rest.

    ``embedding_on_gpu`` is False: llama.cpp keeps token_embd in host memory whatever ``-ngl``
    says (src/llama-model.cpp, load_tensors: "there is very little benefit to offloading the
    input layer, so always keep it on the CPU"). A file without ``output.weight`` ties the head
    to the embedding, which the engine then loads a second time on the GPU as the head.

    Per layer it also counts the routed experts' matrices (``ffn_{gate,up,down}_exps``, and a
    fused ``ffn_gate_up_exps``: what ``--n-cpu-moe`` keeps on the host, common/arg.cpp's
    ``llm_ffn_exps_block_regex``) and the largest matrix, which a GPU build stages on the card to
    run a host-resident layer's big batches (see :mod:`.memory`).
    """
    per_layer: dict[int, int] = {}
    experts: dict[int, int] = {}
    largest: dict[int, int] = {}
    largest_expert: dict[int, int] = {}
    emb = out = other = 0
    for t in tensors:
        if t.layer is not None:
            per_layer[t.layer] = per_layer.get(t.layer, 0) + t.n_bytes
            if len(t.shape) >= 2:
                largest[t.layer] = max(largest.get(t.layer, 0), t.n_bytes)
            if _EXPERTS_RX.search(t.name):
                experts[t.layer] = experts.get(t.layer, 0) + t.n_bytes
                largest_expert[t.layer] = max(largest_expert.get(t.layer, 0), t.n_bytes)
        elif t.name == "token_embd.weight":
            emb += t.n_bytes
        elif t.name == "output.weight":
            out += t.n_bytes
        else:
            other += t.n_bytes
    count = n_layers if n_layers is not None else max(per_layer, default=-1) + 1
    layers = tuple(per_layer.get(i, 0) for i in range(count))

    def by_layer(found: dict[int, int]) -> tuple[int, ...]:
        return tuple(found.get(i, 0) for i in range(count)) if found else ()

    return WeightsBreakdown(
        emb,
        out,
        layers,
        other,
        embedding_on_gpu=False,
        head_is_embedding=head_is_embedding,
        per_layer_expert_bytes=by_layer(experts),
        per_layer_largest_bytes=by_layer(largest),
        per_layer_largest_expert_bytes=by_layer(largest_expert),
    )


def predict_gguf_weights(model: ModelSpec, file_type: str) -> WeightsBreakdown:
    """Predicts the weight bytes of a GGUF file of ``file_type`` from the architecture alone.

    Sums :func:`~autotune_plugins.llama_server.quant.gguf_tensor_plan`, tensor by tensor;
    metadata (the tokenizer vocabulary, a few MB) is not counted. For the bytes of a file that
    exists, see :func:`gguf_file_weights`.

    Args:
        model: The model.
        file_type: A GGUF file type such as ``Q4_K_M``.

    Returns:
        The breakdown, with ``embedding_on_gpu=False`` and, for tied embeddings,
        ``head_is_embedding`` (see :class:`~autotune.engine.formats.WeightsBreakdown`).

    Raises:
        UnknownNameError: ``file_type`` is not known.
    """
    return _gguf_breakdown(gguf_tensor_plan(model, file_type), model.n_layers, model.tie_embeddings)


def gguf_file_weights(path: str | os.PathLike[str]) -> WeightsBreakdown:
    """The exact weight bytes of an existing GGUF file, from its tensor table.

    Args:
        path: A ``.gguf`` file.

    Returns:
        The breakdown by embedding / head / layer / other; ``total_bytes`` is the sum of the
        tensors (the file minus its header and alignment padding).

    Raises:
        ConfigError: The file is missing, unreadable or not a GGUF file.
    """
    header = read_gguf(path)
    return _gguf_breakdown(header.tensors, None, head_is_embedding=header.tensor("output.weight") is None)


def bits_per_weight(file_type: str, model: ModelSpec | None = None) -> float:
    """Bits per weight of a file type's decoder matrices, scales included.

    With ``model``, the average over its decoder matrices under the file type's mix (Q4_K_M is
    ~4.8 on Qwen2.5-7B); without, the base type's storage rate (Q4_K_M -> Q4_K -> 4.5).
    """
    if model is None:
        return GGML_TYPES[GGUF_FILE_TYPES[file_type].base].bits_per_weight
    tensors = [t for t in gguf_tensor_plan(model, file_type) if t.layer is not None and len(t.shape) == 2]
    return sum(t.n_bytes for t in tensors) * 8 / sum(t.n_elements for t in tensors)


def format_of(header: GgufFile) -> str | None:
    """A GGUF file as a format the speed and quality models know (``gguf:Q8_0``): its header's
    file type, else the type most of its layers' matrices have; None when neither is known."""
    if header.file_type is not None:
        return "gguf:" + header.file_type
    types = [t.ggml_type for t in header.tensors if t.layer is not None and len(t.shape) > 1]
    return "gguf:" + max(set(types), key=types.count) if types else None


def quote(source: Path) -> tuple[str, int] | None:
    """A GGUF file as the format its header states and its size (``("gguf:Q4_K_M", 4_683_073_952)``),
    for the model's quoted artifact sizes; None for anything else or a header without a file type."""
    if not (source.is_file() and source.suffix.lower() == ".gguf"):
        return None
    header = read_gguf(source)
    return (f"gguf:{header.file_type}", header.size) if header.file_type is not None else None
