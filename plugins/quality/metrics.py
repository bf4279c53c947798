"""The quality metrics: ``mmlu`` and ``ceval`` through lm-eval, and the ``kld`` proxy.

Each asks the backend for a scorer on the artifact (``BaseBackend.scorer``), so it works with
every backend plugin that implements one. The study measures each artifact once: the cache key
holds everything quality depends on and nothing it does not (ctx, parallel, flash-attn).
"""

from __future__ import annotations

import functools
import hashlib
from typing import Any, Callable, ClassVar, Mapping

from autotune._builtin import ScoringUnsupportedError
from autotune.api import AutotuneError, BaseBackend, BaseMetric, MetricValue, StudyContext, TrialConfig
from autotune._builtin import QualityReference, is_format, normalize_format, source_hash

from autotune_plugins.quality import benchmarks, kld
from autotune_plugins.quality.adapter import lm_eval_missing

__all__ = ["BenchmarkMetric", "CevalMetric", "KldMetric", "MmluMetric", "artifact_hash"]

# Files up to this size are hashed whole; above it, sampled (see artifact_hash).
WHOLE_HASH_BYTES = 64 * 2**20
SAMPLE_CHUNKS = 16
CHUNK_BYTES = 1 * 2**20


@functools.lru_cache(maxsize=256)
def _file_hash(path: str, size: int, mtime_ns: int) -> str:
    h = hashlib.sha256(f"{size}:".encode())
    with open(path, "rb") as f:
        if size <= WHOLE_HASH_BYTES:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        else:
            # Sampled: the size plus 16 chunks of 1 MiB at fixed, evenly spaced offsets (first and
            # last included). Reading a 20 GB file whole takes about a minute and the study asks
            # for keys at every proposal; two quantizations of one model differ in every tensor
            # and in size, so the samples tell them apart.
            step = (size - CHUNK_BYTES) // (SAMPLE_CHUNKS - 1)
            for i in range(SAMPLE_CHUNKS):
                f.seek(i * step)
                h.update(f.read(CHUNK_BYTES))
    return h.hexdigest()[:20]


def artifact_hash(weights: str, ctx: StudyContext) -> str:
    """Content hash of a weights artifact: a file, a directory (EXL2), a format made from the
    study's source, or the reference itself.

    Relative paths are relative to the study file, as backends read them. A directory hashes
    its files' names and content hashes; a reference that is not a local path (a hub name) is
    hashed as text.
    """
    if is_format(weights) and ctx.source is not None:
        # Made from the study's source (autotune.modelfiles.artifacts): the source's content and the format
        # name it, known before the artifact is made (the key is asked at every proposal).
        return (
            "made:" + hashlib.sha256(f"{source_hash(ctx.source)}|{normalize_format(weights)}".encode()).hexdigest()[:20]
        )
    path = ctx.path(weights)
    if path.is_file():
        st = path.stat()
        return _file_hash(str(path.resolve()), st.st_size, st.st_mtime_ns)
    if path.is_dir():
        h = hashlib.sha256()
        for f in sorted(p for p in path.rglob("*") if p.is_file()):
            st = f.stat()
            h.update(f"{f.relative_to(path)}={_file_hash(str(f.resolve()), st.st_size, st.st_mtime_ns)};".encode())
        return h.hexdigest()[:20]
    return "name:" + hashlib.sha256(weights.encode()).hexdigest()[:20]


class _ScoringMetric(BaseMetric):
    """What the three metrics share: options, the scoring check, the cache key's artifact part."""

    defaults: ClassVar[dict[str, int]] = {"per_subject": 5, "shots": 5, "seed": 0}

    def __init__(self) -> None:
        self.options: dict[str, int] = dict(self.defaults)
        self.pool = "sample"  # where a paired measurement draws items: the seeded sample or the full set
        self.references: dict[str, QualityReference] = {}
        # Set by ``autotune quality`` to draw a progress bar: called with (done, total).
        self.progress: Callable[[int, int], None] | None = None

    def configure(self, options: Mapping[str, Any], references: Mapping[str, QualityReference]) -> None:
        self.options = {**self.defaults, **{k: int(v) for k, v in options.items() if k in self.defaults}}
        self.pool = str(options.get("pool", "sample"))
        self.references = dict(references)

    def supports(self, backend: BaseBackend) -> str | None:
        if backend.scoring is None:
            return _no_scoring(backend)
        return backend.scoring.problem()

    def artifact_key(self, config: TrialConfig, ctx: StudyContext) -> str:
        return f"{artifact_hash(config.weights, ctx)}|cache={config.option('cache_type')}"

    def open_scorer(self, config: TrialConfig, backend: BaseBackend, ctx: StudyContext):
        if backend.scoring is None:
            raise ScoringUnsupportedError(_no_scoring(backend))
        return backend.scoring.scorer(config.weights, config.option("cache_type"), ctx)


def _no_scoring(backend: BaseBackend) -> str:
    return f"backend '{backend.name}' has no scoring API (it declares no scoring part)"


class BenchmarkMetric(_ScoringMetric):
    """Accuracy on a multiple-choice benchmark through lm-eval, item by item: on a seeded
    per-subject subset (``evaluate``), or on the items a study's paired measurement draws
    (``item_order``, ``evaluate_items``)."""

    benchmark: ClassVar[str] = ""
    unit: ClassVar[str] = "accuracy"
    higher_is_better: ClassVar[bool] = True

    def cache_key(self, config: TrialConfig, backend: BaseBackend, ctx: StudyContext) -> str:
        # Results are kept item by item under full-set ids, so the sample (per_subject, seed)
        # and the pool are not part of the key: a study that grows its sample, or draws from
        # the full set, reuses every item already answered.
        return f"{self.name}|{self.artifact_key(config, ctx)}|benchmark={self.benchmark}|shots={self.options['shots']}|items=v2"

    def item_order(self) -> tuple[tuple[int, ...], int]:
        o = self.options
        order = benchmarks.stratified_order(self.benchmark, self.pool, o["per_subject"], o["seed"])
        return order, len(benchmarks.load_items(self.benchmark))

    def evaluate_items(
        self, config: TrialConfig, backend: BaseBackend, ctx: StudyContext, items: tuple[int, ...] | list[int]
    ) -> MetricValue:
        from autotune_plugins.quality.tasks import evaluate_items

        with self.open_scorer(config, backend, ctx) as scorer:
            return evaluate_items(scorer, self.benchmark, items, shots=self.options["shots"], progress=self.progress)

    def supports(self, backend: BaseBackend) -> str | None:
        why = super().supports(backend) or lm_eval_missing()
        if why:
            return why
        try:
            benchmarks.load_items(self.benchmark)
            benchmarks.load_items(self.benchmark, "dev")
        except AutotuneError as exc:
            return str(exc)
        return None

    def evaluate(self, config: TrialConfig, backend: BaseBackend, ctx: StudyContext) -> MetricValue:
        from autotune_plugins.quality.tasks import evaluate_benchmark

        with self.open_scorer(config, backend, ctx) as scorer:
            return evaluate_benchmark(
                scorer,
                self.benchmark,
                per_subject=self.options["per_subject"],
                shots=self.options["shots"],
                seed=self.options["seed"],
                progress=self.progress,
            )


class MmluMetric(BenchmarkMetric):
    name: ClassVar[str] = "mmlu"
    benchmark: ClassVar[str] = "mmlu"
    description: ClassVar[str] = "MMLU accuracy on a seeded per-subject sample (57 subjects), lm-eval, local data"


class CevalMetric(BenchmarkMetric):
    name: ClassVar[str] = "ceval"
    benchmark: ClassVar[str] = "ceval"
    description: ClassVar[str] = "C-Eval accuracy on a seeded per-subject sample (52 subjects), lm-eval, local data"


class KldMetric(_ScoringMetric):
    """Mean KL divergence of next-token distributions from the study's reference artifact.

    A study penalises it like accuracy, in "points" of 0.01 nats (its drop is 100 x the KLD
    difference): ``max_drop_points = 5`` allows a mean KLD of 0.05 nats, about what llama.cpp
    reports for a good 4-bit quantization of an 8B model. People are shown the KLD itself
    (``value_text``, ``drop_text``), never those points: they are no accuracy points, and only
    a relation fitted on paired accuracy drops turns a KLD into those (``[quality] undecided =
    "kld"``, which says so where it is used).
    """

    name: ClassVar[str] = "kld"
    unit: ClassVar[str] = "nats"
    higher_is_better: ClassVar[bool] = False
    description: ClassVar[str] = "mean KL divergence and top-1 agreement vs the reference artifact on a fixed text"
    defaults: ClassVar[dict[str, int]] = {}

    def value_text(self, value: float) -> str:
        return f"KLD {value:.4f} nats"

    drop_label: ClassVar[str] = "KLD from the reference (nats)"

    def drop_figure(self, points: float) -> float:
        return points / 100

    def amount_text(self, points: float) -> str:
        return f"{points / 100:.4f} nats"

    def drop_text(self, points: float) -> str:
        # The reference's KLD from itself is 0: the drop, in 0.01 nats, is the KLD.
        return f"KLD {points / 100:.4f} nats"

    def bound_text(self, points: float) -> str:
        return f"KLD {points / 100:.4f} nats (max_drop_points {points:g})"

    def compared_text(self, value: float, points: float, reference: str) -> str:
        return f"{self.value_text(value)} from {reference}"

    def __init__(self) -> None:
        super().__init__()
        self._reference_cache: dict[str, kld.ReferenceDistributions] = {}

    def _reference_of(self, config: TrialConfig) -> QualityReference:
        ref = self.references.get(config.backend)
        if ref is None:
            raise AutotuneError(
                f"metric 'kld' has no reference artifact for backend '{config.backend}' "
                f"(a study sets it; `autotune quality --benchmark kld` needs --reference)"
            )
        return ref

    def cache_key(self, config: TrialConfig, backend: BaseBackend, ctx: StudyContext) -> str:
        ref = self._reference_of(config)
        text = hashlib.sha256(kld.kld_text().encode()).hexdigest()[:12]
        return (
            f"{self.name}|{self.artifact_key(config, ctx)}|reference={self.artifact_key(ref.config, ref.ctx)}"
            f"|text={text}|window={kld.WINDOW}"
        )

    def reference_distributions(self, ref: QualityReference) -> kld.ReferenceDistributions:
        """The reference's distributions, computed once per process and reference."""
        key = self.artifact_key(ref.config, ref.ctx)
        if key not in self._reference_cache:
            with self.open_scorer(ref.config, ref.backend, ref.ctx) as scorer:
                self._reference_cache[key] = kld.reference_distributions(scorer)
        return self._reference_cache[key]

    def evaluate(self, config: TrialConfig, backend: BaseBackend, ctx: StudyContext) -> MetricValue:
        ref = self._reference_of(config)
        distributions = self.reference_distributions(ref)
        with self.open_scorer(config, backend, ctx) as scorer:
            return kld.compare(scorer, distributions, progress=self.progress)
