"""What a model is to the memory and speed models: ``ModelSpec``, the shape of one decoder-only
transformer, and the parameter count of a shape (``count_params``).

Its own module, below the readers that make one (``models``: the catalog, GGUF headers, Hugging
Face configs) and the declarations that take one (``engine/declarations.py``).
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from dataclasses import dataclass, field

from autotune.engine.shape_limits import SHAPE_LIMITS, shape_problem
from autotune.errors import ConfigError

# Architectures whose attention has biases on the q/k/v projections (and not on o_proj).
# Qwen2's modeling code builds q_proj/k_proj/v_proj with bias=True and o_proj with bias=False
# (transformers, models/qwen2/modeling_qwen2.py, Qwen2Attention.__init__).
QKV_BIAS_ARCHITECTURES = frozenset({"qwen2"})


@dataclass(frozen=True)
class ModelSpec:
    """The shape of one decoder-only transformer, as the memory and speed models see it.

    Attributes:
        key: Catalog key (e.g. ``qwen2.5-7b``), or the file stem for a model read from disk.
        name: Human-readable name.
        architecture: GGUF architecture name (``general.architecture``): "qwen2", "llama", ...
        n_layers: Number of decoder blocks.
        hidden_size: Width of the residual stream (``embedding_length`` in GGUF).
        n_heads: Query heads per layer.
        n_kv_heads: Key/value heads per layer (GQA); equals ``n_heads`` for plain MHA.
        head_dim: Width of one attention head. Not always ``hidden_size / n_heads``.
        ffn_size: Width of the MLP's intermediate layer.
        vocab_size: Number of tokens in the vocabulary (rows of the embedding matrix).
        n_params: Total parameter count, embeddings and output head included.
        tie_embeddings: True when the output head reuses the token-embedding matrix.
        max_context: The context length the model was trained/configured for.
        source: Where these numbers come from (a URL, a file path).
        artifact_bytes: Sizes of real artifacts, keyed by weights format (``gguf:Q4_K_M``,
            ``exl2:4.0``). Quoted sizes of real files are facts about artifacts, like a file
            header; :func:`autotune.engine.formats.weights_for` calibrates against them.
        sliding_window: Window of the sliding-window attention layers, in tokens, or None.
        n_swa_layers: How many layers use the sliding window (their KV cache stops growing
            at ``sliding_window`` tokens); 0 when none do.
        n_experts: Routed experts per block of a mixture-of-experts model; 0 for a dense one.
        n_experts_used: Experts each token is routed to.
        expert_ffn_size: MLP width of one expert.
    """

    key: str
    name: str
    architecture: str
    n_layers: int
    hidden_size: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_size: int
    vocab_size: int
    n_params: int
    tie_embeddings: bool
    max_context: int
    source: str
    # hash=False: a mapping is not hashable, and the shape fields identify a model anyway.
    artifact_bytes: Mapping[str, int] = field(default_factory=lambda: types.MappingProxyType({}), hash=False)
    sliding_window: int | None = None
    n_swa_layers: int = 0
    n_experts: int = 0
    n_experts_used: int = 0
    expert_ffn_size: int = 0

    def __post_init__(self) -> None:
        # Freeze the mapping so a spec shared through the cached catalog cannot be edited.
        if not isinstance(self.artifact_bytes, types.MappingProxyType):
            object.__setattr__(self, "artifact_bytes", types.MappingProxyType(dict(self.artifact_bytes)))
        bad = [why for name in SHAPE_LIMITS if (why := shape_problem(name, getattr(self, name), name))]
        if isinstance(self.n_params, bool) or not isinstance(self.n_params, int) or self.n_params <= 0:
            bad.append(f"n_params = {self.n_params!r}: must be a positive integer")
        max_swa = self.n_layers if isinstance(self.n_layers, int) else 0
        if not isinstance(self.n_swa_layers, int) or not 0 <= self.n_swa_layers <= max_swa:
            bad.append(f"n_swa_layers = {self.n_swa_layers!r}: must be between 0 and n_layers")
        experts = (self.n_experts, self.n_experts_used, self.expert_ffn_size)
        if not all(isinstance(v, int) and v >= 0 for v in experts):
            bad.append(f"experts {experts!r}: must be non-negative integers")
        elif self.n_experts and not (0 < self.n_experts_used <= self.n_experts and self.expert_ffn_size > 0):
            bad.append(
                f"n_experts = {self.n_experts}: needs 1 to {self.n_experts} experts used "
                f"(got {self.n_experts_used}) and an expert width (got {self.expert_ffn_size})"
            )
        if bad:
            raise ConfigError(f"model '{self.key}': " + "; ".join(bad))

    @property
    def is_moe(self) -> bool:
        """True for a mixture-of-experts model."""
        return self.n_experts > 0

    @property
    def mlp_width(self) -> int:
        """Width of one token's MLP activations: a MoE token runs ``n_experts_used`` experts of
        ``expert_ffn_size`` each, whatever the total number of experts."""
        return self.n_experts_used * self.expert_ffn_size if self.is_moe else self.ffn_size

    @property
    def kv_dim(self) -> int:
        """Width of K (and of V) per token and layer: ``n_kv_heads * head_dim``."""
        return self.n_kv_heads * self.head_dim

    @property
    def q_dim(self) -> int:
        """Width of Q per token and layer: ``n_heads * head_dim`` (may differ from hidden_size)."""
        return self.n_heads * self.head_dim

    @property
    def n_embedding_params(self) -> int:
        """Parameters of the token-embedding matrix: ``vocab_size * hidden_size``."""
        return self.vocab_size * self.hidden_size

    @property
    def has_qkv_bias(self) -> bool:
        """True when the q/k/v projections carry biases (Qwen2)."""
        return self.architecture in QKV_BIAS_ARCHITECTURES


def count_params(
    *,
    architecture: str,
    n_layers: int,
    hidden_size: int,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    ffn_size: int,
    vocab_size: int,
    tie_embeddings: bool,
    attention_bias: bool | None = None,
) -> int:
    """Counts the parameters of a llama-style decoder from its shape.

    Counted: token embeddings; per layer q/k/v/o projections (with q/k/v biases for Qwen2, or
    biases on all four when ``attention_bias`` is set, as Llama configs allow), the gated MLP
    (gate/up/down), two RMSNorm weights; the final norm; the output head unless tied.

    Args:
        architecture: GGUF architecture name; "qwen2" implies q/k/v biases.
        n_layers: Decoder blocks.
        hidden_size: Residual width.
        n_heads: Query heads.
        n_kv_heads: Key/value heads.
        head_dim: Width of one head.
        ffn_size: MLP intermediate width.
        vocab_size: Vocabulary size.
        tie_embeddings: Whether the output head shares the embedding matrix.
        attention_bias: Overrides the architecture's default for attention biases
            (``attention_bias`` in Llama configs: biases on q, k, v and o).

    Returns:
        The total parameter count.
    """
    q_dim = n_heads * head_dim
    kv_dim = n_kv_heads * head_dim
    per_layer = (
        hidden_size * q_dim  # q_proj
        + 2 * hidden_size * kv_dim  # k_proj, v_proj
        + q_dim * hidden_size  # o_proj
        + 3 * hidden_size * ffn_size  # gate_proj, up_proj, down_proj
        + 2 * hidden_size  # input_layernorm, post_attention_layernorm
    )
    if attention_bias is None and architecture in QKV_BIAS_ARCHITECTURES:
        per_layer += q_dim + 2 * kv_dim
    elif attention_bias:
        per_layer += q_dim + 2 * kv_dim + hidden_size
    embeddings = vocab_size * hidden_size
    head = 0 if tie_embeddings else vocab_size * hidden_size
    return embeddings + n_layers * per_layer + hidden_size + head
