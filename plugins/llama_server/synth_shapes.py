"""The shapes ``autotune synth`` writes: per-architecture constants, the spec and the tensor list.

A random-weight model is only as good as its tensor list: llama.cpp's loader checks every
name and shape (``create_tensor`` in ``src/models/<arch>.cpp``), so each architecture here
lists what its loader asks for, with the types ``convert_hf_to_gguf.py --outtype f16`` writes
(F16 matrices; F32 norms, biases and MoE routers). It imports no numpy: the CLI reads the
architectures from it on every invocation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from autotune._builtin import ConfigError

__all__ = ["ARCH_DEFAULTS", "SynthSpec", "TensorPlan", "tensor_plan"]

# Per-architecture constants of the real families, from their Hugging Face configs: Llama 3
# (rope_theta 500000, rms_norm_eps 1e-5), Qwen2/2.5 (rope_theta 1e6, rms_norm_eps 1e-6) and
# Qwen3 / Qwen3-MoE (the same, with RMS norms on each head's query and key instead of Q/K/V
# biases). They do not change speed or memory; they keep the file a plausible member of its
# family. Qwen3 ships Qwen2's tokenizer, so it reuses llama.cpp's Qwen2 vocab file.
ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {
        "rope_freq_base": 500000.0,
        "rms_eps": 1e-5,
        "vocab_file": "ggml-vocab-llama-bpe.gguf",
        "qkv_bias": False,
        "qk_norm": False,
        "moe": False,
    },
    "qwen2": {
        "rope_freq_base": 1000000.0,
        "rms_eps": 1e-6,
        "vocab_file": "ggml-vocab-qwen2.gguf",
        "qkv_bias": True,
        "qk_norm": False,
        "moe": False,
    },
    "qwen3": {
        "rope_freq_base": 1000000.0,
        "rms_eps": 1e-6,
        "vocab_file": "ggml-vocab-qwen2.gguf",
        "qkv_bias": False,
        "qk_norm": True,
        "moe": False,
    },
    "qwen3moe": {
        "rope_freq_base": 1000000.0,
        "rms_eps": 1e-6,
        "vocab_file": "ggml-vocab-qwen2.gguf",
        "qkv_bias": False,
        "qk_norm": True,
        "moe": True,
    },
}


@dataclass(frozen=True)
class SynthSpec:
    """The shape of a synthetic model.

    Attributes:
        arch: GGUF architecture, one of :data:`ARCH_DEFAULTS`.
        n_layers: Transformer blocks.
        hidden: Embedding width.
        n_heads: Query heads.
        n_kv_heads: Key/value heads; ``n_heads`` must be a multiple of it (GQA).
        ffn: Feed-forward width (of a dense block; written to the metadata of a MoE too, as
            its Hugging Face config's ``intermediate_size`` is).
        context_length: Trained context written to ``{arch}.context_length``.
        tie_embeddings: Leave out ``output.weight`` (the output head reuses the embeddings), as
            small Qwen2.5 models do.
        head_size: Width of one head when it is not ``hidden / n_heads`` (Qwen3: 128 for every
            size, e.g. 32 x 128 = 4096 query width on a 2048-wide Qwen3-30B-A3B); None for
            ``hidden / n_heads``.
        experts: Routed experts per MoE block (0 for a dense model).
        experts_used: Experts each token is routed to (``num_experts_per_tok``).
        expert_ffn: Feed-forward width of one expert (``moe_intermediate_size``).
    """

    arch: str
    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    ffn: int
    context_length: int = 32768
    tie_embeddings: bool = False
    head_size: int | None = None
    experts: int = 0
    experts_used: int = 0
    expert_ffn: int = 0

    def __post_init__(self) -> None:
        problems = []
        if self.arch not in ARCH_DEFAULTS:
            problems.append(f"arch {self.arch!r}: use one of {', '.join(sorted(ARCH_DEFAULTS))}")
        for name, (low, high, why) in LIMITS.items():
            value = getattr(self, name)
            if name == "head_size" and value is None:
                continue
            if not _is_int(value) or not low <= value <= high:
                problems.append(f"{name} = {value!r}: must be an integer {low}..{high} ({why})")
        if not problems:
            if self.head_size is None and self.hidden % self.n_heads:
                problems.append(
                    f"hidden = {self.hidden}: must be a multiple of heads ({self.n_heads}), or give the head size"
                )
            if self.n_heads % self.n_kv_heads:
                problems.append(f"kv_heads = {self.n_kv_heads}: must divide heads ({self.n_heads})")
            problems += self._expert_problems()
        if problems:
            raise ConfigError("synthetic model: " + "; ".join(problems))

    def _expert_problems(self) -> list[str]:
        fields = {"experts": self.experts, "experts_used": self.experts_used, "expert_ffn": self.expert_ffn}
        bad = [f"{k} = {v!r}: must be a non-negative integer" for k, v in fields.items() if not _is_int(v) or v < 0]
        if bad:
            return bad
        if not ARCH_DEFAULTS[self.arch]["moe"]:
            given = [k for k, v in fields.items() if v]
            return (
                [
                    f"{', '.join(given)}: {self.arch} is a dense architecture (a MoE one: "
                    f"{', '.join(a for a, d in sorted(ARCH_DEFAULTS.items()) if d['moe'])})"
                ]
                if given
                else []
            )
        problems = [f"{k}: {self.arch} needs it (a positive integer)" for k, v in fields.items() if not v]
        if not problems and self.experts_used > self.experts:
            problems.append(f"experts_used = {self.experts_used}: at most experts ({self.experts})")
        return problems

    @property
    def head_dim(self) -> int:
        return self.head_size or self.hidden // self.n_heads

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    @property
    def name(self) -> str:
        experts = f"-{self.experts}x{self.experts_used}E" if self.is_moe else ""
        return f"synthetic-{self.arch}-{self.n_layers}L-{self.hidden}H{experts}"


# What llama.cpp loads, per field of the shape: (lowest, highest, why). Checked before anything
# is planned or written: --layers 1000000000 took the host's memory planning tensors, and
# --head-dim 1000000 on a 256-wide model started writing 11.6 GiB.
LIMITS: dict[str, tuple[int, int, str]] = {
    "n_layers": (1, 512, "llama.cpp's LLAMA_MAX_LAYERS"),
    "hidden": (1, 65536, "4x the widest published model's"),
    "n_heads": (1, 1024, "query heads"),
    "n_kv_heads": (1, 1024, "key/value heads"),
    "ffn": (1, 262144, "4x the widest published feed-forward"),
    "context_length": (16, 2**31 - 1, "llama.cpp's n_ctx_train is a C int"),
    "head_size": (1, 1024, "the largest head llama.cpp's kernels take is 576, DeepSeek's"),
    "experts": (0, 512, "llama.cpp's LLAMA_MAX_EXPERTS"),
    "experts_used": (0, 512, "at most experts"),
    "expert_ffn": (0, 262144, "as ffn"),
}
SEED_RANGE = (0, 2**32 - 1)  # numpy's generator takes no negative seed


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class TensorPlan:
    """One tensor to write.

    Attributes:
        name: llama.cpp's tensor name (``blk.0.attn_q.weight``).
        shape: numpy (row-major) shape; GGUF stores it reversed (``ne[0]`` is the last axis).
        dtype: "float16" for matrices, "float32" for norms, biases and routers (numpy names).
        fill: "normal" (random, std ``WEIGHT_STD``) or "ones" (RMS-norm weights).
    """

    name: str
    shape: tuple[int, ...]
    dtype: Any
    fill: str

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.n_elements * _ITEMSIZE[self.dtype]


_ITEMSIZE = {"float16": 2, "float32": 4}


def tensor_plan(spec: SynthSpec, n_vocab: int) -> list[TensorPlan]:
    """The tensors of a model, in llama.cpp's order and with its names (``llm_tensor`` names).

    Args:
        spec: The model's shape.
        n_vocab: Vocabulary size (the tokenizer's token count).

    Returns:
        Every tensor: embeddings, each block's attention and MLP (or router and experts), final
        norm, output head.
    """
    h, q, kv, f = spec.hidden, spec.n_heads * spec.head_dim, spec.n_kv_heads * spec.head_dim, spec.ffn
    arch = ARCH_DEFAULTS[spec.arch]
    f16, f32 = "float16", "float32"
    plan = [TensorPlan("token_embd.weight", (n_vocab, h), f16, "normal")]
    for i in range(spec.n_layers):
        b = f"blk.{i}."
        plan += [
            TensorPlan(b + "attn_norm.weight", (h,), f32, "ones"),
            TensorPlan(b + "attn_q.weight", (q, h), f16, "normal"),
            TensorPlan(b + "attn_k.weight", (kv, h), f16, "normal"),
            TensorPlan(b + "attn_v.weight", (kv, h), f16, "normal"),
        ]
        if arch["qkv_bias"]:
            plan += [
                TensorPlan(b + "attn_q.bias", (q,), f32, "normal"),
                TensorPlan(b + "attn_k.bias", (kv,), f32, "normal"),
                TensorPlan(b + "attn_v.bias", (kv,), f32, "normal"),
            ]
        plan.append(TensorPlan(b + "attn_output.weight", (h, q), f16, "normal"))
        if arch["qk_norm"]:
            plan += [
                TensorPlan(b + "attn_k_norm.weight", (spec.head_dim,), f32, "ones"),
                TensorPlan(b + "attn_q_norm.weight", (spec.head_dim,), f32, "ones"),
            ]
        plan.append(TensorPlan(b + "ffn_norm.weight", (h,), f32, "ones"))
        if spec.is_moe:
            e, fe = spec.experts, spec.expert_ffn
            plan += [
                # The router stays F32, as convert_hf_to_gguf.py keeps FFN_GATE_INP and
                # llama-quantize never quantizes it.
                TensorPlan(b + "ffn_gate_inp.weight", (e, h), f32, "normal"),
                TensorPlan(b + "ffn_gate_exps.weight", (e, fe, h), f16, "normal"),
                TensorPlan(b + "ffn_down_exps.weight", (e, h, fe), f16, "normal"),
                TensorPlan(b + "ffn_up_exps.weight", (e, fe, h), f16, "normal"),
            ]
        else:
            plan += [
                TensorPlan(b + "ffn_gate.weight", (f, h), f16, "normal"),
                TensorPlan(b + "ffn_up.weight", (f, h), f16, "normal"),
                TensorPlan(b + "ffn_down.weight", (h, f), f16, "normal"),
            ]
    plan.append(TensorPlan("output_norm.weight", (h,), f32, "ones"))
    if not spec.tie_embeddings:
        plan.append(TensorPlan("output.weight", (n_vocab, h), f16, "normal"))
    return plan
