"""The twin on several cards: what a split over the cards costs, and what each card holds.

A configuration's placement dimensions (docs/study-file.md, "Several cards") say how the
model is split; read here as one :class:`Split`, whichever engine named them:

* ``split_mode`` ``none`` (one card, ``main_gpu``), ``layer`` (whole layers per card, in
  ``tensor_split`` proportions), ``tensor`` / ``row`` (every layer's matrices split over the
  cards); ``tensor_split`` "3,1"; ``main_gpu`` N;
* ``gpu_split`` (GiB per card, or "auto": in proportion to the cards' memory) with
  ``tensor_parallel`` true (a tensor split) or false (a layer split).

The costs (docs/twin.md, "Several cards"):

* Layer split: the cards run in sequence, each its share of the layers at its own speed (so a
  slow card bounds its stage by its share); one activation hand-off per boundary per step:
  ``tokens x hidden x 4 B`` (ggml's F32 activations) over the link, plus the link's latency.
* Tensor split: every card runs every layer's small kernels and its share of the matrices, the
  slowest card bounding each layer; two all-reduces per layer (after attention and after the
  MLP), each a ring: ``2 x size x (n - 1) / n`` bytes over the link at a fitted efficiency,
  plus a fitted per-sync latency (``[multicard]`` in constants.toml, fitted by
  ``multicard_evidence.py`` to llama.cpp's published 4x RTX 4090 figures).
* Row split: the matrices split as in a tensor split, but each of a layer's weight matrices
  (q, k, v, o, gate, up, down: :data:`ROW_SYNCS_PER_LAYER`) gathers its result on the main
  card, and attention runs there over the whole KV cache; its syncs cost what a tensor split's
  do (not fitted on row figures of their own).

What each card holds (:func:`per_device`): a layer split puts each layer's weights and KV on
its card, the head on the last; a tensor split divides weights and KV by the shares; each card
used pays the engine's buffers and context.
"""

from __future__ import annotations

import functools
import math
import tomllib
from dataclasses import dataclass, replace
from importlib import resources
from typing import Any, Sequence

from autotune.api import MemoryEstimate, TrialConfig
from autotune._builtin import GpuSpec, Link, get_link, slowest_link
from autotune_plugins.twin import physics, service

__all__ = [
    "ACTIVATION_BYTES",
    "MODES",
    "MulticardConstants",
    "Split",
    "cards_of",
    "load_multicard",
    "per_device",
    "predict",
    "split_of",
]

MODES = ("none", "layer", "tensor", "row")
# ggml passes the residual stream between devices as F32 (the hidden state's type in the graph).
ACTIVATION_BYTES = 4
# A row split gathers the output of each split matrix on the main card (ggml_cuda_op_mul_mat's
# split path): seven per dense layer, against a tensor split's two all-reduces.
ROW_SYNCS_PER_LAYER = 7


@dataclass(frozen=True)
class MulticardConstants:
    """The fitted costs of a tensor split (``[multicard]`` of constants.toml).

    Attributes:
        sync_us: Fixed cost of one all-reduce, microseconds (launch, event wait, small copies).
        allreduce_efficiency: Share of the link's bandwidth one all-reduce's ring moves at.
    """

    sync_us: float
    allreduce_efficiency: float


@functools.lru_cache(maxsize=1)
def load_multicard() -> MulticardConstants:
    doc = tomllib.loads(resources.files(__package__).joinpath("constants.toml").read_text(encoding="utf-8"))
    return MulticardConstants(**doc["multicard"])


@dataclass(frozen=True)
class Split:
    """How a configuration spreads over the study's cards.

    Attributes:
        cards: The study's cards, in device order.
        mode: ``none``, ``layer``, ``tensor`` or ``row``.
        shares: Each card's share, summing to 1 (0 for a card the split leaves out).
        main: The card of ``none``.
        link: What the cards send activations over.
    """

    cards: tuple[GpuSpec, ...]
    mode: str
    shares: tuple[float, ...]
    main: int
    link: Link

    @property
    def used(self) -> tuple[int, ...]:
        if self.mode == "none":
            return (self.main,)
        return tuple(i for i, share in enumerate(self.shares) if share > 0)

    def describe(self) -> str:
        if self.mode == "none":
            return f"one card (device {self.main}, {self.cards[self.main].name})"
        parts = ", ".join(f"{self.cards[i].name} {self.shares[i]:.0%}" for i in self.used)
        return f"{self.mode} split over {len(self.used)} cards ({parts}) on {self.link.name}"


def _proportions(value: Any, n: int) -> tuple[float, ...] | None:
    """``"3,1"``, ``"3/1"`` or a list of numbers as one share per card (None: not one)."""
    if isinstance(value, str):
        try:
            value = [float(v) for v in value.replace("/", ",").split(",") if v.strip()]
        except ValueError:
            return None
    if not isinstance(value, (list, tuple)) or not value or len(value) > n:
        return None
    if any(isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0 for v in value) or not sum(value):
        return None
    full = [float(v) for v in value] + [0.0] * (n - len(value))
    return tuple(v / sum(full) for v in full)


def cards_of(ctx: Any) -> tuple[GpuSpec, ...] | None:
    """The study's cards when it has several (``[hardware] gpus``, ``estimate --gpus``); None: one."""
    p = getattr(ctx, "placement", None)
    if p is None or len(p.cards) < 2:
        return None
    return tuple(c.spec for c in p.cards)


def split_of(config: TrialConfig, cards: Sequence[GpuSpec], interconnect: str | None = None) -> Split:
    """The configuration's split over ``cards`` (every card in proportion to its memory where
    the configuration says nothing, as llama.cpp splits by free memory without ``-ts``).

    Args:
        interconnect: A link key of the catalog (the twin's ``interconnect`` setting); None:
            the slowest of the cards' own PCIe links.
    """
    cards = tuple(cards)
    n = len(cards)
    link = get_link(interconnect) if interconnect else slowest_link(cards)
    by_memory = tuple(c.vram_bytes / sum(c.vram_bytes for c in cards) for c in cards)
    mode = config.option("split_mode")
    if mode is None:
        mode = "tensor" if config.option("tensor_parallel") else "layer"
    main = int(config.option("main_gpu", 0) or 0)
    shares = _proportions(config.option("tensor_split"), n)
    gpu_split = config.option("gpu_split")
    if shares is None and gpu_split not in (None, "auto"):
        shares = _proportions(gpu_split, n)
    return Split(cards, str(mode), shares or by_memory, min(main, n - 1), link)


def per_device(mem: MemoryEstimate, split: Split, per_layer: Sequence[float], head_bytes: float) -> MemoryEstimate:
    """``mem`` (the one-card estimate with every layer on the card) with each card's share.

    Args:
        per_layer: Each decoder layer's weight bytes on the card.
        head_bytes: The rest of the weights on the card (output head, norms).
    """
    n = len(split.cards)
    weights, kv = [0.0] * n, [0.0] * n
    if split.mode == "none":
        weights[split.main], kv[split.main] = mem.weights_bytes, mem.kv_bytes
    elif split.mode == "layer":
        bounds = [sum(split.shares[: i + 1]) for i in range(n)]
        layers = len(per_layer) or 1
        for il, b in enumerate(per_layer):
            d = next(i for i, point in enumerate(bounds) if (il + 0.5) / layers <= point + 1e-9)
            weights[d] += b
            kv[d] += mem.kv_bytes / layers
        weights[split.used[-1]] += max(0.0, mem.weights_bytes - sum(weights))  # the head, on the last card
    else:
        for d in range(n):
            weights[d] = mem.weights_bytes * split.shares[d]
            kv[d] = mem.kv_bytes * (split.shares[d] if split.mode == "tensor" else float(d == split.main))
    used = [d for d in range(n) if weights[d] or kv[d]] or [split.main]
    each = mem.buffers_bytes + mem.overhead_bytes
    shares = tuple(int(weights[d] + kv[d] + (each if d in used else 0)) for d in range(n))
    note = f"{split.describe()}: per card " + ", ".join(f"{d}: {b / 2**30:.2f} GiB" for d, b in enumerate(shares))
    return replace(
        mem,
        weights_bytes=int(sum(weights)),
        kv_bytes=int(sum(kv)),
        buffers_bytes=mem.buffers_bytes * len(used),
        overhead_bytes=mem.overhead_bytes * len(used),
        per_device_bytes=shares,
        notes=(*mem.notes, note),
    )


def handoff_s(split: Split, hidden: int, tokens: int) -> float:
    """One activation hand-off between two cards of a layer split."""
    return split.link.latency_us * 1e-6 + tokens * hidden * ACTIVATION_BYTES / split.link.bytes_per_s


def allreduce_s(split: Split, hidden: int, tokens: int, mk: MulticardConstants) -> float:
    """One ring all-reduce of ``tokens`` activations over the used cards."""
    n = len(split.used)
    size = tokens * hidden * ACTIVATION_BYTES
    return mk.sync_us * 1e-6 + 2 * size * (n - 1) / n / (split.link.bytes_per_s * mk.allreduce_efficiency)


def _on(s: physics.Scenario, card: GpuSpec) -> physics.Scenario:
    return replace(s, gpu=card, gpu_layers="all")


def step_seconds(
    s: physics.Scenario,
    k: physics.EngineConstants,
    host: physics.HostConstants,
    split: Split,
    mk: MulticardConstants,
    parallel: int,
    context_tokens: float,
) -> tuple[float, dict[str, float]]:
    """One decode step of ``parallel`` streams over the split, and its terms (seconds)."""
    n_layers = s.model.n_layers
    per_card = {
        i: physics.step_terms(_on(s, split.cards[i]), k, host, parallel, context_tokens, n_layers) for i in split.used
    }
    main = per_card[split.used[0]]
    shared = main["serve"] + main["host"]
    if split.mode == "none" or len(split.used) == 1:
        return physics.step_seconds(main), {"cards": physics.step_seconds(main) - shared, "link": 0.0}
    if split.mode == "layer":
        cards = sum(
            split.shares[i] * (t["fixed"] + t["roofline"] + t["unfused_attention"]) for i, t in per_card.items()
        )
        link = (len(split.used) - 1) * handoff_s(split, s.model.hidden_size, parallel)
    elif split.mode == "tensor":
        cards = max(
            t["fixed"] + split.shares[i] * (t["roofline"] + t["unfused_attention"]) for i, t in per_card.items()
        )
        link = 2 * n_layers * allreduce_s(split, s.model.hidden_size, parallel, mk)
    else:  # row: the matrices split, attention on the main card over the whole cache
        kv = physics.kv_read_bytes_per_token(s, k) * parallel * context_tokens
        main_card = split.cards[split.main]
        attention = kv / (main_card.mem_bandwidth_gb_s * 1e9 * physics.bandwidth_efficiency(main_card, k))
        cards = max(
            t["fixed"] + split.shares[i] * (t["roofline"] + t["unfused_attention"]) for i, t in per_card.items()
        )
        cards += attention * (1 - split.shares[split.main])
        link = ROW_SYNCS_PER_LAYER * n_layers * allreduce_s(split, s.model.hidden_size, parallel, mk)
    return cards + link + shared, {"cards": cards, "link": link}


def prefill_tok_s(
    s: physics.Scenario, k: physics.EngineConstants, host: physics.HostConstants, split: Split, mk: MulticardConstants
) -> float:
    """Prompt tokens per second over the split: each card's tensor-core time for its share, in
    sequence (layer) or side by side (tensor), and the link's part per ubatch."""
    tokens = max(1, s.parallel * s.prompt_tokens)
    per_token = {i: 1.0 / physics.prefill_tok_s(_on(s, split.cards[i]), k, host, s.model.n_layers) for i in split.used}
    ubatches = math.ceil(tokens / max(1, s.ubatch))
    ub = min(tokens, max(1, s.ubatch))
    if split.mode == "none" or len(split.used) == 1:
        return 1.0 / per_token[split.used[0]]
    if split.mode == "layer":
        seconds = tokens * sum(split.shares[i] * t for i, t in per_token.items())
        seconds += ubatches * (len(split.used) - 1) * handoff_s(split, s.model.hidden_size, ub)
    else:
        syncs = 2 if split.mode == "tensor" else ROW_SYNCS_PER_LAYER
        seconds = tokens * max(split.shares[i] * t for i, t in per_token.items())
        seconds += ubatches * syncs * s.model.n_layers * allreduce_s(split, s.model.hidden_size, ub, mk)
    return tokens / seconds


def predict(
    s: physics.Scenario,
    k: physics.EngineConstants,
    host: physics.HostConstants,
    split: Split,
    mk: MulticardConstants | None = None,
) -> physics.Prediction:
    """:func:`physics.predict` for the split: every layer on the cards (the twin lets no layer
    of a several-card study spill to the host; the per-card budget refuses what does not fit)."""
    mk = mk or load_multicard()
    c_decode = s.prompt_tokens + s.output_tokens / 2
    jobs = min(s.jobs_at_once or s.parallel, s.parallel)
    t1, _ = step_seconds(s, k, host, split, mk, 1, c_decode)
    tp, terms = step_seconds(s, k, host, split, mk, jobs, c_decode)
    pf = prefill_tok_s(s, k, host, split, mk)
    request_s = k.request_ms * 1e-3 if s.harness == "server" else 0.0
    aggregate, per_user, ttft_s = service.served(s.parallel, jobs, s.prompt_tokens / pf, s.output_tokens, tp, request_s)
    one = physics.predict(_on(s, split.cards[split.used[0]]), k, host)
    bandwidth = sum(split.cards[i].mem_bandwidth_gb_s for i in split.used) * 1e9
    return replace(
        one,
        decode_tok_s=1.0 / t1,
        per_user_tok_s=per_user,
        aggregate_tok_s=aggregate,
        prefill_tok_s=pf,
        ttft_ms=1000.0 * ttft_s,
        roofline_tok_s=bandwidth / one.bytes_per_token,
        step_ms_single=1000.0 * t1,
        step_ms_parallel=1000.0 * tp,
        gpu_layers=s.model.n_layers,
        host_layers=0,
        terms_ms={name: 1000.0 * v for name, v in terms.items()},
    )
