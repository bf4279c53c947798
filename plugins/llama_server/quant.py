"""llama.cpp's quantization, as data: the ggml tensor types (bytes per block) and, for each GGUF
file type (a ``llama-quantize`` target such as ``Q4_K_M``), which type every tensor of a model
gets (:func:`gguf_tensor_plan`).

:mod:`autotune_plugins.llama_server.formats` sums these plans into a model's weight bytes (the
``gguf:<TYPE>`` formats the llama-server backend declares).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

from autotune.api import ModelSpec
from autotune._builtin import UnknownNameError

__all__ = [
    "GGML_TYPES",
    "GGUF_FILE_TYPES",
    "GgmlType",
    "GgufFileType",
    "TensorPlan",
    "ggml_tensor_bytes",
    "gguf_tensor_plan",
]

# =============================================================================================
# GGML tensor types
# =============================================================================================


class GgmlType(NamedTuple):
    """A ggml tensor type's storage layout: ``block_bytes`` bytes per ``block_size`` elements."""

    name: str
    block_bytes: int
    block_size: int

    @property
    def bits_per_weight(self) -> float:
        """Storage bits per element, block scales included (Q4_K: 144 * 8 / 256 = 4.5)."""
        return self.block_bytes * 8 / self.block_size


# Block layouts from ggml's block structs (ggml/src/ggml-common.h), QK_K = 256, ggml_half = 2 B:
#   block_q8_0 {d; qs[32]}                            2 + 32            = 34 B / 32
#   block_q4_0 {d; qs[16]}                            2 + 16            = 18 B / 32
#   block_q4_1 {d, m; qs[16]}                         4 + 16            = 20 B / 32
#   block_q5_0 {d; qh[4]; qs[16]}                     2 + 4 + 16        = 22 B / 32
#   block_q5_1 {d, m; qh[4]; qs[16]}                  4 + 4 + 16        = 24 B / 32
#   block_q2_K {scales[16]; qs[64]; d, dmin}          16 + 64 + 4       = 84 B / 256
#   block_q3_K {hmask[32]; qs[64]; scales[12]; d}     32 + 64 + 12 + 2  = 110 B / 256
#   block_q4_K {d, dmin; scales[12]; qs[128]}         4 + 12 + 128      = 144 B / 256
#   block_q5_K {d, dmin; scales[12]; qh[32]; qs[128]} 4 + 12 + 32 + 128 = 176 B / 256
#   block_q6_K {ql[128]; qh[64]; scales[16]; d}       128 + 64 + 16 + 2 = 210 B / 256
# The static_asserts next to each struct in ggml-common.h pin these sizes. Q8_K exists too, but
# only as the activation format of k-quant dot products, never as a tensor in a file.
GGML_TYPES: dict[str, GgmlType] = {
    t.name: t
    for t in (
        GgmlType("F32", 4, 1),
        GgmlType("F16", 2, 1),
        GgmlType("BF16", 2, 1),
        GgmlType("Q8_0", 34, 32),
        GgmlType("Q4_0", 18, 32),
        GgmlType("Q4_1", 20, 32),
        GgmlType("Q5_0", 22, 32),
        GgmlType("Q5_1", 24, 32),
        GgmlType("IQ4_NL", 18, 32),
        GgmlType("Q2_K", 84, 256),
        GgmlType("Q3_K", 110, 256),
        GgmlType("Q4_K", 144, 256),
        GgmlType("Q5_K", 176, 256),
        GgmlType("Q6_K", 210, 256),
    )
}

_UNQUANTIZED = frozenset({"F32", "F16", "BF16"})


def ggml_tensor_bytes(ggml_type: str, n_elements: int) -> int:
    """Bytes a tensor of ``n_elements`` takes in ``ggml_type`` (whole blocks, as ggml stores rows).

    Args:
        ggml_type: A key of :data:`GGML_TYPES`.
        n_elements: Element count; a multiple of the block size for quantized types.

    Returns:
        The tensor's data size in bytes.
    """
    t = GGML_TYPES[ggml_type]
    return math.ceil(n_elements / t.block_size) * t.block_bytes


# =============================================================================================
# GGUF file types: which ggml type each tensor gets
# =============================================================================================


class GgufFileType(NamedTuple):
    """A llama.cpp file type (``llama-quantize`` target): its default tensor type and a note."""

    name: str
    base: str
    note: str


# The default ("base") tensor type of each file type is llama_ftype_get_default_type() in
# llama.cpp's src/llama-quant.cpp. The per-tensor exceptions are in _gguf_tensor_type below.
GGUF_FILE_TYPES: dict[str, GgufFileType] = {
    t.name: t
    for t in (
        GgufFileType("F32", "F32", "everything in F32"),
        GgufFileType("F16", "F16", "matrices in F16, norms and biases in F32"),
        GgufFileType("BF16", "BF16", "matrices in BF16, norms and biases in F32"),
        GgufFileType("Q8_0", "Q8_0", "everything in Q8_0, output too"),
        GgufFileType("Q6_K", "Q6_K", "everything in Q6_K"),
        GgufFileType("Q5_K_M", "Q5_K", "Q5_K; attn_v and ffn_down Q6_K on use_more_bits layers; output Q6_K"),
        GgufFileType("Q5_K_S", "Q5_K", "Q5_K; output Q6_K"),
        GgufFileType("Q5_1", "Q5_1", "Q5_1; output Q6_K"),
        GgufFileType("Q5_0", "Q5_0", "Q5_0; output Q6_K"),
        GgufFileType("Q4_K_M", "Q4_K", "Q4_K; attn_v and ffn_down Q6_K on use_more_bits layers; output Q6_K"),
        GgufFileType("Q4_K_S", "Q4_K", "Q4_K; attn_v Q5_K on layers 0-3, ffn_down Q5_K on the first 1/8; output Q6_K"),
        GgufFileType("Q4_1", "Q4_1", "Q4_1; output Q6_K"),
        GgufFileType("Q4_0", "Q4_0", "Q4_0; output Q6_K"),
        GgufFileType("Q3_K_L", "Q3_K", "Q3_K; attn_v, attn_output, ffn_down Q5_K; output Q6_K"),
        GgufFileType(
            "Q3_K_M",
            "Q3_K",
            "Q3_K; attn_v Q5_K (layers 0-1) else Q4_K, attn_output Q4_K, "
            "ffn_down Q5_K (first 1/16) else Q4_K; output Q6_K",
        ),
        GgufFileType("Q3_K_S", "Q3_K", "Q3_K; output Q6_K"),
        GgufFileType(
            "Q2_K", "Q2_K", "Q2_K; attn_v Q4_K (Q3_K without GQA >= 4), attn_output and ffn_down Q3_K; output Q6_K"
        ),
    )
}

# When a row's length is not a multiple of the type's block size, llama.cpp substitutes a type
# with 32-element blocks (tensor_type_fallback() in src/llama-quant.cpp), and F16 when even
# that does not divide. For the 32-block types llama.cpp has no fallback (it refuses to
# quantize); we use F16 there so that odd test models still get a size.
_FALLBACK = {"Q2_K": "Q4_0", "Q3_K": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


def _use_more_bits(i_layer: int, n_layers: int) -> bool:
    # llama.cpp's use_more_bits(): the first and last eighth of the layers and every third one in
    # between get more bits. C integer division, as in the source.
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


def _is_70b(model: ModelSpec) -> bool:
    # llama.cpp sets LLM_TYPE_70B from the layer count: 80 layers for qwen2, and for llama 80
    # layers with GQA (80 layers of plain MHA is LLaMA-1 65B) (src/llama-model.cpp, load_hparams).
    if model.n_layers != 80:
        return False
    return model.architecture != "llama" or model.n_heads != model.n_kv_heads


def _fit(ggml_type: str, ncols: int) -> str:
    """Applies llama.cpp's fallback when a row does not hold whole blocks of ``ggml_type``."""
    if ncols % GGML_TYPES[ggml_type].block_size == 0:
        return ggml_type
    fallback = _FALLBACK.get(ggml_type, "F16")
    return fallback if ncols % GGML_TYPES[fallback].block_size == 0 else "F16"


def _gguf_tensor_type(model: ModelSpec, file_type: str, tensor_class: str, i_layer: int, ncols: int) -> str:
    """The ggml type llama-quantize gives one weight matrix (simplified llama_tensor_get_type).

    Follows llama_tensor_get_type_impl() in llama.cpp's src/llama-quant.cpp for the file types in
    GGUF_FILE_TYPES and dense (non-MoE, non-Falcon) models, without an importance matrix:

    * output.weight (and token_embd when embeddings are tied, since it then serves as output):
      Q6_K unless the file type is Q8_0 (stays Q8_0); Q8_0 when the row does not hold whole
      blocks of the base type.
    * token_embd (untied): the base type.
    * attn_v: Q2_K -> Q4_K with GQA >= 4 else Q3_K; Q3_K_M -> Q5_K for the first 2 layers else
      Q4_K; Q3_K_L -> Q5_K; Q4_K_M/Q5_K_M -> Q6_K where use_more_bits(i, n); Q4_K_S -> Q5_K
      for layers 0-3. On 70B-class models, Q3_K/Q4_K become Q5_K (attn_v is 8x smaller there).
    * ffn_down: Q2_K -> Q3_K; Q3_K_M -> Q5_K below n/16 else Q4_K; Q3_K_L -> Q5_K;
      Q4_K_M/Q5_K_M -> Q6_K where use_more_bits(i, n); Q4_K_S -> Q5_K below n/8.
    * attn_output: Q2_K -> Q3_K; Q3_K_M -> Q4_K; Q3_K_L -> Q5_K.
    * everything else: the base type. Then the row-length fallback.

    Not modelled: importance-matrix-only rules (Q4_0/Q5_0 ffn_down -> Q4_1/Q5_1 on the first
    eighth of layers), MoE and Falcon special cases, IQ types.
    """
    base = GGUF_FILE_TYPES[file_type].base
    if base in _UNQUANTIZED:
        # llama-quantize only rewrites types when the target is quantized (ggml_is_quantized).
        return base
    n = model.n_layers
    new = base
    if tensor_class == "output" or (tensor_class == "token_embd" and model.tie_embeddings):
        if ncols % GGML_TYPES[base].block_size != 0:
            new = "Q8_0"
        elif base != "Q8_0":
            new = "Q6_K"
    elif tensor_class == "token_embd":
        new = base
    elif tensor_class == "attn_v":
        n_gqa = model.n_heads // model.n_kv_heads
        if file_type == "Q2_K":
            new = "Q4_K" if n_gqa >= 4 else "Q3_K"
        elif file_type == "Q3_K_M":
            new = "Q5_K" if i_layer < 2 else "Q4_K"
        elif file_type == "Q3_K_L":
            new = "Q5_K"
        elif file_type in ("Q4_K_M", "Q5_K_M") and _use_more_bits(i_layer, n):
            new = "Q6_K"
        elif file_type == "Q4_K_S" and i_layer < 4:
            new = "Q5_K"
        if _is_70b(model) and new in ("Q3_K", "Q4_K"):
            new = "Q5_K"
    elif tensor_class == "ffn_down":
        if file_type == "Q2_K":
            new = "Q3_K"
        elif file_type == "Q3_K_M":
            new = "Q5_K" if i_layer < n // 16 else "Q4_K"
        elif file_type == "Q3_K_L":
            new = "Q5_K"
        elif file_type in ("Q4_K_M", "Q5_K_M") and _use_more_bits(i_layer, n):
            new = "Q6_K"
        elif file_type == "Q4_K_S" and i_layer < n // 8:
            new = "Q5_K"
    elif tensor_class == "attn_output":
        new = {"Q2_K": "Q3_K", "Q3_K_M": "Q4_K", "Q3_K_L": "Q5_K"}.get(file_type, base)
    return _fit(new, ncols)


@dataclass(frozen=True)
class TensorPlan:
    """One tensor of a GGUF file as llama-quantize would write it.

    Attributes:
        name: GGUF tensor name (``blk.3.ffn_down.weight``).
        layer: Decoder layer index, or None for tensors outside the layers.
        shape: GGUF dimensions, ``ne[0]`` (row length) first.
        ggml_type: The tensor's ggml type.
        n_bytes: Data size in bytes.
    """

    name: str
    layer: int | None
    shape: tuple[int, ...]
    ggml_type: str
    n_bytes: int

    @property
    def n_elements(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)


def _gguf_type_name(file_type: str) -> str:
    name = file_type.upper()
    if name not in GGUF_FILE_TYPES:
        raise UnknownNameError(f"unknown GGUF file type '{file_type}' (use one of {', '.join(GGUF_FILE_TYPES)})")
    return name


# Architectures whose attention normalizes q and k per head (two [head_dim] F32 norms per layer).
_QK_NORM_ARCHS = frozenset({"qwen3", "qwen3moe"})


def gguf_tensor_plan(model: ModelSpec, file_type: str) -> list[TensorPlan]:
    """Lists the tensors of ``model`` in a GGUF file of ``file_type``, with type and size.

    Tensors (llama.cpp names; shapes ``[ne0, ne1]``, row length first): ``token_embd``
    [hidden, vocab]; per layer ``attn_norm`` and ``ffn_norm`` [hidden] (F32), ``attn_q``
    [hidden, q_dim], ``attn_k`` / ``attn_v`` [hidden, kv_dim] (with F32 biases for Qwen2),
    ``attn_output`` [q_dim, hidden], ``ffn_gate`` / ``ffn_up`` [hidden, ffn], ``ffn_down``
    [ffn, hidden]; ``output_norm`` [hidden] (F32); ``output`` [hidden, vocab] unless tied.
    One-dimensional tensors stay F32: llama-quantize only quantizes tensors of 2+ dimensions,
    and convert_hf_to_gguf.py writes 1-D tensors as F32.

    Args:
        model: The model.
        file_type: A key of :data:`GGUF_FILE_TYPES` (case-insensitive), e.g. ``Q4_K_M``.

    Returns:
        The tensors in file order.

    Raises:
        UnknownNameError: ``file_type`` is not a known GGUF file type.
    """
    ft = _gguf_type_name(file_type)
    h, q, kv, f, v = model.hidden_size, model.q_dim, model.kv_dim, model.ffn_size, model.vocab_size
    f32 = "F32"
    plan: list[TensorPlan] = []

    def add(name: str, layer: int | None, shape: tuple[int, ...], tensor_class: str | None) -> None:
        if len(shape) == 1 or tensor_class is None:
            ggml_type = f32
        else:
            ggml_type = _gguf_tensor_type(model, ft, tensor_class, layer or 0, shape[0])
        plan.append(TensorPlan(name, layer, shape, ggml_type, ggml_tensor_bytes(ggml_type, math.prod(shape))))

    add("token_embd.weight", None, (h, v), "token_embd")
    for i in range(model.n_layers):
        add(f"blk.{i}.attn_norm.weight", i, (h,), None)
        add(f"blk.{i}.attn_q.weight", i, (h, q), "attn_q")
        add(f"blk.{i}.attn_k.weight", i, (h, kv), "attn_k")
        add(f"blk.{i}.attn_v.weight", i, (h, kv), "attn_v")
        if model.has_qkv_bias:
            add(f"blk.{i}.attn_q.bias", i, (q,), None)
            add(f"blk.{i}.attn_k.bias", i, (kv,), None)
            add(f"blk.{i}.attn_v.bias", i, (kv,), None)
        add(f"blk.{i}.attn_output.weight", i, (q, h), "attn_output")
        if model.architecture in _QK_NORM_ARCHS:
            add(f"blk.{i}.attn_k_norm.weight", i, (model.head_dim,), None)
            add(f"blk.{i}.attn_q_norm.weight", i, (model.head_dim,), None)
        add(f"blk.{i}.ffn_norm.weight", i, (h,), None)
        if model.is_moe:
            e, fe = model.n_experts, model.expert_ffn_size
            # The router stays F32: llama-quantize never quantizes ffn_gate_inp. The merged
            # expert tensors take the dense rules of their names ("ffn_down" matches
            # ffn_down_exps, counted once per layer).
            add(f"blk.{i}.ffn_gate_inp.weight", i, (h, e), None)
            add(f"blk.{i}.ffn_gate_exps.weight", i, (h, fe, e), "ffn_gate")
            add(f"blk.{i}.ffn_down_exps.weight", i, (fe, h, e), "ffn_down")
            add(f"blk.{i}.ffn_up_exps.weight", i, (h, fe, e), "ffn_up")
            continue
        add(f"blk.{i}.ffn_gate.weight", i, (h, f), "ffn_gate")
        add(f"blk.{i}.ffn_up.weight", i, (h, f), "ffn_up")
        add(f"blk.{i}.ffn_down.weight", i, (f, h), "ffn_down")
    add("output_norm.weight", None, (h,), None)
    if not model.tie_embeddings:
        add("output.weight", None, (h, v), "output")
    return plan
