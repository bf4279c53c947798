"""The memory model: what a configuration will hold in device memory, before it is launched.

Four parts, each from the most direct source there is:

* **weights** from the artifact itself: every tensor of a GGUF file (its type and shape, so its
  exact bytes), split into layers, output head and token embeddings, because engines place
  them differently (:func:`autotune.engine.formats.gguf_file_weights`; this module reads no files);
* **KV cache** from the model's shape, the cache type's bytes per value
  (:func:`autotune.engine.cache_types.kv_bytes_per_token`) and the engine's *slot layout*: how many cells
  each sequence gets, how they are padded, whether sequences share one pool
  (:class:`SlotLayout`); sliding-window layers hold only their window;
* **compute buffers**, the activations of one micro-batch as the engine's graph allocator
  reserves them (:class:`GraphBuffers`), with coefficients calibrated on the engine's own logs;
* **overhead**: the runtime's context (CUDA's, typically hundreds of MiB), a constant per
  backend, and a correction learned in each study from measured peaks
  (:func:`learned_correction`).

Everything here is engine-neutral: a backend plugin supplies its layout and its constants.
``ctx`` always means the context of one sequence (what one user's prompt plus answer needs).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, replace

from autotune.engine.backend import MemoryEstimate
from autotune.engine.cache_types import kv_bytes_per_token
from autotune.engine.declarations import CacheType
from autotune.modelfiles.models import ModelSpec

__all__ = [
    "GraphBuffers",
    "SlotLayout",
    "apply_correction",
    "kv_cache_bytes",
    "learned_correction",
]

MiB = 2**20


# ---------------------------------------------------------------------------------- KV cache


@dataclass(frozen=True)
class SlotLayout:
    """How an engine lays out the KV cache of ``parallel`` sequences of ``ctx`` tokens.

    Attributes:
        pad: Cells are allocated in multiples of this (llama.cpp: 256).
        unified: One pool shared by all sequences (padded once), instead of one stream of
            ``pad(ctx)`` cells per sequence.
        swa_extra: Cells a sliding-window layer holds beyond its window (the micro-batch in
            flight, for engines that keep it).
    """

    pad: int = 1
    unified: bool = False
    swa_extra: int = 0

    def _pad(self, n: int) -> int:
        return math.ceil(n / self.pad) * self.pad

    def cells_per_sequence(self, ctx: int) -> int:
        """Cells one sequence's stream holds (full-attention layers)."""
        return self._pad(ctx)

    def cells(self, ctx: int, parallel: int) -> int:
        """Cells of one full-attention layer, all sequences together."""
        if self.unified:
            return self._pad(ctx * parallel)
        return self._pad(ctx) * parallel

    def swa_cells(self, ctx: int, parallel: int, window: int) -> int:
        """Cells of one sliding-window layer: the window (plus extra) when shorter than ctx."""
        per_seq = min(self._pad(ctx), self._pad(window + self.swa_extra))
        return per_seq * parallel if not self.unified else min(self.cells(ctx, parallel), per_seq * parallel)


def kv_cache_bytes(
    model: ModelSpec,
    cache_type: str | CacheType,
    ctx: int,
    parallel: int,
    layout: SlotLayout,
    v_type: str | CacheType | None = None,
) -> tuple[int, int, str]:
    """KV-cache bytes of ``parallel`` sequences of ``ctx`` tokens in an engine's layout.

    Args:
        model: Layers, KV heads and head size (and sliding-window layers, if any).
        cache_type: K cache type (and V's, unless ``v_type`` is given): the engine's
            declaration, or a name the installed backends declare.
        ctx: Context of one sequence, in tokens.
        parallel: Sequences served at once.
        layout: The engine's slot layout.
        v_type: V cache type when it differs from K's.

    Returns:
        (bytes, cells of a full-attention layer, a one-line explanation).
    """
    cells = layout.cells(ctx, parallel)
    n_swa = model.n_swa_layers if model.sliding_window else 0
    full = kv_bytes_per_token(model, cache_type, v_type, n_layers=model.n_layers - n_swa) * cells
    swa = 0.0
    how = f"{cells} cells"
    if not layout.unified and parallel > 1:
        how = f"{cells} cells ({parallel} slots x {layout.cells_per_sequence(ctx)})"
    if n_swa:
        swa_cells = layout.swa_cells(ctx, parallel, int(model.sliding_window))
        swa = kv_bytes_per_token(model, cache_type, v_type, n_layers=n_swa) * swa_cells
        how += f"; {n_swa} sliding-window layers hold {swa_cells}"
    return int(full + swa), cells, how


# ------------------------------------------------------------------------- compute buffers


@dataclass(frozen=True)
class GraphBuffers:
    """Compute buffer of a graph-allocating engine (ggml's allocator reuses memory, so the
    buffer is the largest set of tensors alive at once, not their sum).

    Two phases compete for the peak, per micro-batch of ``ubatch`` tokens:

    * the MLP: ``ubatch x (ffn_coef x mlp + hidden_coef x hidden)`` activations of
      ``act_bytes`` each, ``mlp`` a token's MLP width (:attr:`ModelSpec.mlp_width`: the experts it
      is routed to, for a mixture of experts);
    * attention without a fused kernel: the score matrix ``ubatch x cells x heads`` in F32,
      plus ``attn_hidden_coef x hidden`` activations per token.

    Both hold the attention mask, ``cells x ubatch`` values of ``mask_bytes_fused`` (fused
    attention) or ``mask_bytes`` each; ``cells`` is one sequence's stream, since each stream
    gets its own slice of the micro-batch.

    Attributes:
        ffn_coef: MLP-width activations alive at the MLP's peak (gate, up, product).
        hidden_coef: Residual-width activations alive then.
        attn_hidden_coef: Residual-width activations alive next to unfused scores.
        act_bytes: Bytes per activation (F32: 4).
        mask_bytes: Bytes per mask value with unfused attention.
        mask_bytes_fused: Bytes per mask value with fused (flash) attention.
        source: What the coefficients were calibrated on.
        moe_ffn_coef: ``ffn_coef`` of a mixture of experts, where the engine's expert kernel
            keeps more MLP-wide copies alive (None: the same as a dense model's).
    """

    ffn_coef: float
    hidden_coef: float
    attn_hidden_coef: float
    act_bytes: int = 4
    mask_bytes: int = 4
    mask_bytes_fused: int = 2
    source: str = ""
    moe_ffn_coef: float | None = None

    def bytes(self, model: ModelSpec, cells_per_sequence: int, ubatch: int, flash_attn: bool) -> int:
        """The buffer for one configuration.

        Args:
            model: Hidden and MLP widths, attention heads.
            cells_per_sequence: KV cells of one sequence's stream (the scores' width).
            ubatch: Tokens per micro-batch.
            flash_attn: Fused attention (no score matrix, a half-size mask).
        """
        mask = cells_per_sequence * ubatch * (self.mask_bytes_fused if flash_attn else self.mask_bytes)
        ffn_coef = self.moe_ffn_coef if model.is_moe and self.moe_ffn_coef is not None else self.ffn_coef
        mlp = ubatch * (ffn_coef * model.mlp_width + self.hidden_coef * model.hidden_size) * self.act_bytes
        peak = mlp
        if not flash_attn:
            scores = ubatch * cells_per_sequence * model.n_heads * 4
            peak = max(peak, scores + ubatch * self.attn_hidden_coef * model.hidden_size * self.act_bytes)
        return int(peak + mask)


# -------------------------------------------------------------- learning from measurements


def learned_correction(residuals: Iterable[int], *, min_samples: int = 1) -> int | None:
    """What to add to a backend's predictions, from (measured - predicted) of measured trials.

    The median: one trial that shared the card with something else must not move it. The
    correction only ever raises a prediction: under-predicting launches configurations that
    do not fit, while over-predicting by the same amount merely skips borderline ones, and a
    measured peak can miss short-lived allocations.

    Args:
        residuals: Bytes, one per measured trial of the backend in this study.
        min_samples: Fewest measurements to learn from.

    Returns:
        Bytes to add (>= 0), or None when there is nothing to learn from yet.
    """
    values = list(residuals)
    if len(values) < min_samples:
        return None
    return max(0, int(statistics.median(values)))


def apply_correction(estimate: MemoryEstimate, correction: int | None, n: int) -> MemoryEstimate:
    """``estimate`` with a learned correction added to its overhead, and a note saying so."""
    if not correction:
        return estimate
    note = f"+{correction / MiB:.0f} MiB learned from {n} measured trial{'s' if n != 1 else ''} of this study"
    return replace(estimate, overhead_bytes=estimate.overhead_bytes + correction, notes=(*estimate.notes, note))
