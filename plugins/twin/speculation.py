"""The twin's price of speculative decoding: what a draft, an MTP head or an n-gram lookup buys
a decode step, from the acceptance, the draft's cost and the verify pass's batch.

One cycle of speculation, per stream (llama-server's, ``tools/server/server.cpp``): the draft
proposes up to ``n_max`` tokens, one after the other; the target model then runs them all in one
verify pass (each slot's sampled token and its drafts in the same batch as every other slot's)
and keeps the drafts up to the first it disagrees with, plus its own token there. With a
per-token acceptance ``a`` (the chance a drafted token is kept, given the ones before it were),
a cycle yields

    E(a, n) = 1 + a + a^2 + ... + a^n = (1 - a^(n+1)) / (1 - a)

tokens. Its time is the drafting (the draft's own decode steps, priced by the same physics as
the target: a small model's step is its weights over the bandwidth plus its fixed kernels) and
the verify pass, one step of ``P * (1 + drafted)`` rows. At one stream that pass costs about
what a plain step does (the weights are read once, the matrix-vector kernels take up to 8 rows):
speculation pays. At many streams the step is already compute-bound, the extra rows cost their
full arithmetic, and llama-server drafts each slot in turn (the draft does not batch across
slots): speculation loses.

What the model assumes, each named where it is used (docs/twin.md, "Speculative decoding"):

* acceptance is a property of the text and the draft, not of the card: the twin takes it as a
  setting (``acceptance``, per spec type, defaults in :data:`DEFAULT_ACCEPTANCE`), since only a
  measurement on the user's own workload knows it (autotune's trials store the engine's counts,
  and once a study has measured a spec type its calibration prices later trials of that type at
  the measured acceptance: :func:`measured_acceptance`);
* ``p_min`` gates the draft on its own confidence, which the twin takes as calibrated and
  distributed as Beta(alpha, 1) with mean ``a`` (:func:`gated`): the gate stops drafting before
  unlikely tokens, shortening drafts (less cost) and losing some tokens that would have been kept;
* an MTP head is one more decoder layer of the target plus its output head (``nextn`` layers);
* an n-gram lookup costs the host a fixed time per slot (:data:`NGRAM_DRAFT_MS`);
* a cycle pays fixed host costs the kernels' physics does not see (:class:`CycleCosts`, fitted
  by :mod:`speculation_evidence` to two published rows): each draft pass of a model or an MTP
  head is a graph of its own (launch, synchronise, read back its token), and each verify cycle
  samples the drafts, keeps or drops them and rolls the rejected ones back out of the cache (a
  hybrid model's recurrent state too), slot after slot.
"""

from __future__ import annotations

import functools
import tomllib
from dataclasses import dataclass
from importlib import resources
from typing import Any, Mapping, Sequence

from autotune.api import Param
from autotune._builtin import kept

__all__ = [
    "DEFAULT_ACCEPTANCE",
    "SPEC_TYPES",
    "CycleCosts",
    "Speculation",
    "load_cycle_costs",
    "acceptance_for",
    "acceptance_problem",
    "expected_tokens",
    "family_of_type",
    "gated",
    "measured_acceptance",
    "parameters",
    "per_token",
    "rate_of",
    "rules",
]

#: The values of llama-server's ``--spec-type`` in the pinned build (its ``--help``), for an
#: engine model that does not declare them itself.
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

#: Per-token acceptance the twin assumes when the study gives none (``[backends.twin-*]
#: acceptance``), by family. Assumptions, not measurements of the user's text:
#: MTP 0.8: Qwen3.8-27B's MTP head on the qwen38-mtp probe prompts kept 0.889 of single drafts
#: and 0.647 at n-max 4 on an RTX 5090 (github.com/sudoingX/qwen38-mtp, sweeps/rtx-5090.md, the
#: power-cap sweep), which a = 0.85 reproduces at every n-max; prose runs lower, so 0.8.
#: draft 0.7: a same-family small draft (llama 3.1 8B with 3.2 1B: 72% of drafts at n-max 5,
#: github.com/ggml-org/llama.cpp/issues/5877), a little under MTP's head.
#: n-gram 0.3: a lookup in the prompt and the text so far; SGLang's NGRAM kept ~20% on open chat
#: (al-engr.com/qwen3.6-ngram-vs-nvfp4-mtp.html), code and repeated text far more.
DEFAULT_ACCEPTANCE: Mapping[str, float] = {"draft": 0.7, "mtp": 0.8, "ngram": 0.3}

#: Host time of one n-gram lookup per slot and cycle, in ms: a hash-map probe over the context's
#: tokens, no model. An assumption (small next to a step of any model).
NGRAM_DRAFT_MS = 0.05

#: llama-server's ``--spec-draft-n-max`` default (common/common.h), for a trial that names a spec
#: type and no n-max.
DEFAULT_N_MAX = 3


@dataclass(frozen=True)
class CycleCosts:
    """Fixed host costs of speculation per slot (``[speculation]`` of constants.toml).

    Attributes:
        draft_pass_us: One draft pass of a draft model or an MTP head beyond its kernels: its
            graph's launch, the synchronisation and the read-back of its token, in µs.
        verify_cycle_us: One verify cycle's bookkeeping: sampling the drafted positions, keeping
            or dropping them, removing the rejected ones from the cache (and a hybrid model's
            recurrent state), in µs.
    """

    draft_pass_us: float = 0.0
    verify_cycle_us: float = 0.0


@functools.lru_cache(maxsize=1)
def load_cycle_costs() -> CycleCosts:
    doc = tomllib.loads(resources.files(__package__).joinpath("constants.toml").read_text(encoding="utf-8"))
    return CycleCosts(**doc.get("speculation", {}))


def family_of_type(spec_type: str) -> str:
    """``none``, ``mtp``, ``ngram`` or ``draft`` (a separate draft model: simple, EAGLE-3, DFlash)."""
    if spec_type == "none":
        return "none"
    if spec_type == "draft-mtp":
        return "mtp"
    return "ngram" if spec_type.startswith("ngram") else "draft"


def expected_tokens(a: float, n: float) -> float:
    """Tokens one verify pass yields with per-token acceptance ``a`` and ``n`` drafted tokens:
    the kept drafts and the target's own token, ``(1 - a^(n+1)) / (1 - a)``."""
    if a >= 1.0:
        return n + 1.0
    return (1.0 - a ** (n + 1)) / (1.0 - a)


def rate_of(a: float, n: int) -> float:
    """The engine's acceptance rate (accepted / drafted, what llama-server counts and a trial's
    ``acceptance.rate`` stores) of ``n``-token drafts at per-token acceptance ``a``."""
    return (expected_tokens(a, n) - 1.0) / n


def per_token(rate: float, n: int) -> float:
    """The per-token acceptance whose ``n``-token drafts the engine would count at ``rate``
    (inverse of :func:`rate_of`, which rises with ``a``)."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if rate_of(mid, n) < rate else (lo, mid)
    return (lo + hi) / 2


def gated(a: float, p_min: float) -> tuple[float, float]:
    """(the share of positions the ``p_min`` gate lets the draft propose, the share it proposes
    and the target keeps), per position.

    The draft's confidence ``p`` in its token is taken as calibrated (the target keeps it with
    probability ``p``) and distributed as Beta(alpha, 1), alpha = a / (1 - a), so that its mean
    is ``a``: P(p >= t) = 1 - t^alpha, and E[p; p >= t] = a (1 - t^(alpha + 1)). At p_min 0 every
    position is proposed and ``a`` of them kept."""
    if p_min <= 0.0:
        return 1.0, a
    if a >= 1.0:
        return 1.0, 1.0
    alpha = a / (1.0 - a)
    return 1.0 - p_min**alpha, a * (1.0 - p_min ** (alpha + 1.0))


@dataclass(frozen=True)
class Speculation:
    """One configuration's speculation as the physics prices it.

    Attributes:
        spec_type: llama-server's ``--spec-type`` value.
        n_max, n_min, p_min: ``--spec-draft-n-max``, ``-n-min``, ``-p-min``.
        acceptance: Per-token acceptance (see the module's docstring).
        draft: The draft's scenario for a separate draft model (a ``Scenario`` of the draft's
            model and weights on the same card); None for MTP and n-gram.
        draft_slots_batched: Whether the engine drafts every slot in one batch (False:
            llama-server drafts slot after slot).
        costs: The cycle's fixed host costs; None: the fitted ones (:func:`load_cycle_costs`).
    """

    spec_type: str
    n_max: int
    n_min: int
    p_min: float
    acceptance: float
    draft: Any = None
    draft_slots_batched: bool = False
    costs: CycleCosts | None = None

    @property
    def family(self) -> str:
        return family_of_type(self.spec_type)

    def cycle(self) -> tuple[float, float, float]:
        """(drafted tokens per cycle, draft steps run per cycle, tokens yielded per cycle), the
        means over cycles. The gate stops the draft at the first position it does not propose
        (that step was run); a draft shorter than ``n_min`` is dropped and the cycle is a plain
        step, its drafting spent."""
        keep, kept_ok = gated(self.acceptance, self.p_min)
        n = self.n_max
        drafted = sum(keep**i for i in range(1, n + 1))
        steps = drafted + (1.0 - keep**n)  # the step whose token the gate refused was run
        tokens = expected_tokens(kept_ok, n) if self.p_min > 0 else expected_tokens(self.acceptance, n)
        if self.n_min > 1 and keep < 1.0:
            long_enough = keep**self.n_min
            tokens = long_enough * tokens + (1.0 - long_enough)
            drafted *= long_enough
        return drafted, steps, tokens

    def seconds_per_token(
        self, s: Any, k: Any, host: Any, parallel: int, context_tokens: float, gpu_layers: int
    ) -> float:
        """Seconds of decode per generated token of each of ``parallel`` streams: one cycle's
        drafting and verify pass over the tokens it yields."""
        from autotune_plugins.twin import physics  # physics calls this method: imported at use

        drafted, steps, tokens = self.cycle()
        rows = parallel * (1.0 + drafted)
        verify = physics.step_seconds(
            physics.step_terms(s, k, host, parallel, context_tokens, gpu_layers, tokens_per_stream=rows / parallel)
        )
        draft_s = steps * self.draft_step_seconds(s, k, host, parallel, context_tokens, gpu_layers)
        return (verify + draft_s + self.host_seconds(steps, parallel)) / tokens

    def host_seconds(self, steps: float, parallel: int) -> float:
        """One cycle's fixed host costs over the ``parallel`` slots, ``steps`` draft passes each
        (an n-gram lookup has no graph to launch: :data:`NGRAM_DRAFT_MS` is its whole cost)."""
        c = self.costs or load_cycle_costs()
        passes = 0.0 if self.family == "ngram" else steps * c.draft_pass_us
        return parallel * (passes + c.verify_cycle_us) * 1e-6

    def draft_step_seconds(
        self, s: Any, k: Any, host: Any, parallel: int, context_tokens: float, gpu_layers: int
    ) -> float:
        """One draft step for all ``parallel`` slots."""
        from autotune_plugins.twin import physics

        if self.family == "ngram":
            return parallel * NGRAM_DRAFT_MS * 1e-3
        per_batch = parallel if self.draft_slots_batched else 1
        batches = 1 if self.draft_slots_batched else parallel
        if self.family == "mtp":
            t = mtp_step_seconds(s, k, host, per_batch, context_tokens)
        else:
            d = self.draft
            d_layers = physics.gpu_layer_split(d, k, physics.memory(d, k))
            t = physics.step_seconds(physics.step_terms(d, k, host, per_batch, context_tokens, d_layers))
        return batches * t


def mtp_step_seconds(s: Any, k: Any, host: Any, parallel: int, context_tokens: float) -> float:
    """One step of the MTP (nextn) head: one decoder layer of the target, its output head and
    the sampling, at the target's own kernels (the head's layer is the size of the mean layer;
    its fixed cost one layer's)."""
    from autotune_plugins.twin import physics

    w = s.weights
    layer = sum(w.per_layer_bytes) / max(len(w.per_layer_bytes), 1)
    g = s.gpu
    bw = g.mem_bandwidth_gb_s * 1e9 * physics.bandwidth_efficiency(g, k)
    kv = parallel * context_tokens * physics.kv_read_bytes_per_token(s, k) / s.model.n_layers
    t_mem = (layer + w.output_bytes + kv) / bw
    params = physics.linear_params(s.model) / s.model.n_layers + s.model.vocab_size * s.model.hidden_size
    t_comp = parallel * 2 * params / (physics.fp16_core_tflops(g) * 1e12 * k.decode_compute_efficiency)
    t_fixed = k.layer_us_ghz * 1e-6 / (g.boost_clock_mhz / 1000.0)
    t_serve = parallel * s.model.vocab_size * k.sample_ns_per_vocab * 1e-9 if s.harness == "server" else 0.0
    return t_fixed + t_serve + physics.soft_max(t_mem, t_comp)


# ----------------------------------------------------------------------------------- space


def _counted(space: Mapping[str, Sequence[Any]], name: str, low: int) -> tuple[int, ...]:
    return tuple(v for v in space[name] if type(v) is int and v >= low)


def parameters(space: Mapping[str, Sequence[Any]]) -> list[Param]:
    """llama-server's speculation options, each only when the study's ``[space]`` names it (a
    study that does not search speculation keeps its space as it was)."""
    params = []
    if "spec_type" in space:
        params.append(
            Param(
                "spec_type",
                kept(space, "spec_type", SPEC_TYPES),
                "speculative decoding (--spec-type)",
                accepted=SPEC_TYPES,
            )
        )
    if "spec_n_max" in space:
        params.append(
            Param(
                "spec_n_max",
                _counted(space, "spec_n_max", 1),
                "draft tokens per cycle at most (--spec-draft-n-max)",
                accepted=("an integer >= 1",),
            )
        )
    if "spec_n_min" in space:
        params.append(
            Param(
                "spec_n_min",
                _counted(space, "spec_n_min", 0),
                "fewest draft tokens a cycle uses (--spec-draft-n-min)",
                accepted=("an integer >= 0",),
            )
        )
    if "spec_p_min" in space:
        p_min = tuple(v for v in space["spec_p_min"] if type(v) in (int, float) and 0 <= v <= 1)
        params.append(
            Param(
                "spec_p_min",
                p_min,
                "the draft's confidence a drafted token needs (--spec-draft-p-min)",
                accepted=("a number 0..1",),
            )
        )
    if "draft" in space:
        params.append(
            Param(
                "draft",
                tuple(v for v in space["draft"] if isinstance(v, str)),
                "draft model weights (-md): a format of the study's model or a file",
                accepted=("a weights format or file",),
            )
        )
    if "draft_gpu_layers" in space:
        layers = tuple(v for v in space["draft_gpu_layers"] if v == "all" or (type(v) is int and v >= 0))
        params.append(
            Param("draft_gpu_layers", layers, "draft layers on the GPU (-ngld)", accepted=('"all"', "an integer >= 0"))
        )
    if "draft_cache_type" in space:
        params.append(
            Param(
                "draft_cache_type",
                tuple(v for v in space["draft_cache_type"] if isinstance(v, str)),
                "the draft's KV-cache type (-ctkd/-ctvd)",
                accepted=("a cache type of the engine",),
            )
        )
    return params


def rules(options: Mapping[str, Any]) -> list[str]:
    """Why llama-server would refuse these speculation options (empty: it starts)."""
    spec_type = options.get("spec_type", "none")
    reasons = []
    if family_of_type(str(spec_type)) == "draft" and not options.get("draft"):
        reasons.append(f"spec_type {spec_type!r} needs draft weights (-md): add draft to [space]")
    n_max, n_min = options.get("spec_n_max"), options.get("spec_n_min")
    if n_max is not None and n_min is not None and n_min > n_max:
        reasons.append(f"spec_n_min {n_min} > spec_n_max {n_max}: the draft could never be long enough")
    return reasons


def measured_acceptance(trials: Sequence[tuple[Mapping[str, Any], Mapping[str, float]]]) -> dict[str, dict[str, float]]:
    """Per spec type, the per-token acceptance the study's trials measured: each trial's engine
    counts (``acceptance_drafted``, ``acceptance_accepted`` beside its metrics) turned into a
    per-token ``a`` at its own n-max (:func:`per_token`), pooled weighted by tokens drafted, so
    that trials at different n-max agree on one property of the text and the draft."""
    pooled: dict[str, list[float]] = {}
    for options, metrics in trials:
        spec_type = str(options.get("spec_type", "none"))
        drafted, accepted = metrics.get("acceptance_drafted"), metrics.get("acceptance_accepted")
        if spec_type == "none" or not drafted or accepted is None:
            continue
        n_max = int(options.get("spec_n_max", DEFAULT_N_MAX))
        a = per_token(min(max(accepted / drafted, 0.0), 1.0), n_max)
        weight, total = pooled.setdefault(spec_type, [0.0, 0.0])
        pooled[spec_type] = [weight + drafted, total + drafted * a]
    return {t: {"per_token": round(total / weight, 4), "drafted": weight} for t, (weight, total) in pooled.items()}


def acceptance_problem(value: Any) -> str | None:
    """What is wrong with an ``acceptance`` setting: a number 0..1, or a table of them by spec
    type or family (draft, mtp, ngram)."""
    values = value.items() if isinstance(value, dict) else [("acceptance", value)]
    names = set(SPEC_TYPES) | set(DEFAULT_ACCEPTANCE)
    for key, v in values:
        if key != "acceptance" and key not in names:
            return f"{key!r} is no spec type or family (accepted: {', '.join(sorted(names))})"
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < 1:
            return f"{key} = {v!r}: must be a per-token acceptance, a number >= 0 and < 1"
    return None


def acceptance_for(setting: Any, spec_type: str) -> float:
    """The per-token acceptance of ``spec_type``: the setting's (a number, or a table by type
    then family), else the default of its family."""
    family = family_of_type(spec_type)
    if isinstance(setting, dict):
        for key in (spec_type, family):
            if key in setting:
                return float(setting[key])
    elif setting is not None:
        return float(setting)
    return DEFAULT_ACCEPTANCE[family]
