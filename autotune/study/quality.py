"""Quality in a study: each artifact measured once, and the drop against the reference.

A metric's value depends on the artifact (weights and the options that change numerics, as the
metric's ``cache_key`` says), never on ctx or parallel, so it is measured once per study and
kept in the study's attributes under a hash of that key; a resumed study, and every other
worker on a shared storage, reuses it. The drop formula lives here and nowhere else.

A metric that answers items (MMLU, C-Eval: ``BaseMetric.item_order``) is measured item by item,
and each artifact's stored record keeps every item's result, so the drop is paired: the mean of
per-item differences on the items both answered, with a McNemar-style standard error
(``autotune.study.paired``). With a bound (``[objective] max_drop_points``) it is sequential: both
artifacts answer one more batch of the seeded, subject-stratified order until the interval lies
clearly inside or outside the bound, or a cap is reached (``[quality] max_items``,
``max_seconds``); a configuration still undecided then counts as ``[quality] undecided`` says
(``reject`` by default; ``kld``: the KL divergence through a relation fitted on the study's own
paired drops). Each decision is stored (``QUALITY_PREFIX + "drop:"``) and summarised.
"""

from __future__ import annotations

import hashlib
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

import optuna

from autotune.engine.backend import BaseBackend, StudyContext, TrialConfig
from autotune.engine.metric import BaseMetric, signed_drop
from autotune.study import paired
from autotune.study.records import QUALITY_DECISION_PREFIX, QUALITY_PREFIX

if TYPE_CHECKING:  # pragma: no cover
    from autotune.study.prepared import PreparedStudy


@dataclass(frozen=True)
class Drop:
    """Accuracy points an artifact loses against the reference (negative: it scores better).

    Args:
        points: The drop.
        stderr_points: Its standard error (paired, when the metric answers items).
        admitted: Whether the study lets the configuration through on quality: from the paired
            verdict and the ``undecided`` policy; None when only the point estimate is known
            (the bound is then applied to it).
        reason: How it was decided, for a refusal's message.
    """

    points: float
    stderr_points: float | None
    admitted: bool | None = None
    reason: str = ""


def drop_between(metric: BaseMetric, mine: Mapping[str, Any], ref: Mapping[str, Any]) -> Drop:
    """The drop of one measured value against the reference's, in points (x100)."""
    sign = 1.0 if metric.higher_is_better else -1.0
    points = sign * (ref["value"] - mine["value"]) * 100.0
    se = None
    if mine.get("stderr") is not None and ref.get("stderr") is not None:
        # Two independent sample estimates: their difference's standard error adds in
        # quadrature (an overestimate when both used the same items, which is the safe side).
        se = 100.0 * (mine["stderr"] ** 2 + ref["stderr"] ** 2) ** 0.5
    return Drop(points, se)


class QualityBook:
    """The study's quality values: looked up, measured once (item by item where the metric
    answers items), turned into drops and verdicts.

    Args:
        prepared: The study (its metric, references, backends and contexts).
        study: The Optuna study whose attributes keep the measured values (None: nothing is
            stored, e.g. before a storage is open).
    """

    def __init__(self, prepared: "PreparedStudy", study: optuna.Study | None):
        self.prepared = prepared
        self.study = study
        self.metric = prepared.quality
        self.proxy = prepared.quality_proxy
        options = prepared.cfg.quality_options
        self.bound = prepared.cfg.objective.max_drop_points
        self.policy = str(options.get("undecided", "reject"))
        self.batch = options.get("batch")
        self.max_items = options.get("max_items")
        self.max_seconds = options.get("max_seconds")
        self.expected_agreement = float(options.get("expected_agreement", 0.9))
        self._local: dict[str, dict[str, Any]] = {}
        self._order: tuple[tuple[int, ...], int] | None = None
        self._order_digest = ""

    def _where(self, config: TrialConfig) -> tuple[BaseBackend, StudyContext]:
        return self.prepared.backend(config.backend), self.prepared.contexts[config.backend]

    @property
    def paired(self) -> bool:
        """Whether the metric answers items (then drops are paired and sequential)."""
        return self.metric is not None and type(self.metric).item_order is not BaseMetric.item_order

    def order(self) -> tuple[tuple[int, ...], int]:
        """The items a paired measurement draws, in order (capped at ``max_items``), and the batch."""
        if self._order is None:
            assert self.metric is not None
            found = self.metric.item_order()
            assert found is not None
            ids, strata = found
            ids = ids[: self.max_items] if self.max_items else ids
            self._order = (tuple(ids), int(self.batch or strata))
            # Part of each decision's key (a decision holds for one order and one batch),
            # hashed once: the judge asks for cached drops at every proposal.
            self._order_digest = hashlib.sha1(repr(self._order).encode()).hexdigest()[:16]
        return self._order

    def attr(self, config: TrialConfig, metric: BaseMetric | None = None) -> str:
        metric = metric or self.metric
        assert metric is not None
        key = metric.cache_key(config, *self._where(config))
        return QUALITY_PREFIX + hashlib.sha1(key.encode()).hexdigest()[:16]

    def cached(self, config: TrialConfig, metric: BaseMetric | None = None) -> dict[str, Any] | None:
        attr = self.attr(config, metric)
        self._read_stored(attr)
        return self._local.get(attr)

    def _read_stored(self, attr: str) -> None:
        """Bring ``attr`` from the study's attributes into ``_local`` if another run or worker
        stored it: one read (``Study.user_attrs`` reads and deep-copies them all each time)."""
        if attr not in self._local and self.study is not None:
            stored = self.study.user_attrs
            if attr in stored:
                self._local[attr] = stored[attr]

    def _store(self, attr: str, value: dict[str, Any]) -> None:
        if self.study is not None:
            self.study.set_user_attr(attr, value)
        self._local[attr] = value

    def measure(
        self, config: TrialConfig, items: tuple[int, ...] | None = None, metric: BaseMetric | None = None
    ) -> dict[str, Any]:
        """The metric's value for ``config``'s artifact, measured now unless already known.

        With ``items`` (a metric that answers items), only the items not yet answered are
        measured, and the stored record grows by them: its ``per_item`` keeps every answer,
        its value is the accuracy over all of them.
        """
        metric = metric or self.metric
        assert metric is not None
        backend, ctx = self._where(config)
        found = self.cached(config, metric)
        if items is None:
            if found is not None:
                return found
            value = metric.evaluate(config, backend, ctx)
            stored = {"key": metric.cache_key(config, backend, ctx), **value.to_dict()}
            self._store(self.attr(config, metric), stored)
            return stored
        have = set(found["per_item"]["item"]) if found is not None and "per_item" in found else set()
        missing = [i for i in items if i not in have]
        if not missing and found is not None:
            return found
        value = metric.evaluate_items(config, backend, ctx, missing)
        assert value.per_item is not None
        old = (
            found["per_item"]
            if found is not None and "per_item" in found
            else {"item": [], "correct": [], "margin": []}
        )
        merged = {k: list(old[k]) + list(value.per_item[k]) for k in ("item", "correct", "margin")}
        n = len(merged["item"])
        acc = sum(merged["correct"]) / n
        seconds = (found or {}).get("seconds") or 0.0
        stored = {
            "key": metric.cache_key(config, backend, ctx),
            "value": acc,
            "stderr": math.sqrt(acc * (1 - acc) / (n - 1)) if n > 1 else None,
            "n": n,
            "seconds": seconds + (value.seconds or 0.0),
            "details": value.details or {},
            "per_item": merged,
        }
        self._store(self.attr(config, metric), stored)
        return stored

    def reference(self, config: TrialConfig) -> TrialConfig | None:
        return self.prepared.reference.get(config.backend)

    def _decision_attr(self, config: TrialConfig) -> str:
        ref = self.reference(config)
        assert ref is not None and self.metric is not None
        self.order()
        key = f"{self.attr(config)}|{self.attr(ref)}|bound={self.bound}|policy={self.policy}|order={self._order_digest}"
        return QUALITY_DECISION_PREFIX + hashlib.sha1(key.encode()).hexdigest()[:16]

    def cached_drop(self, config: TrialConfig) -> Drop | None:
        """The drop when it is already known (nothing is measured): for a paired metric, the
        stored decision; otherwise both values."""
        ref = self.reference(config)
        if self.metric is None or ref is None:
            return None
        if self.paired:
            attr = self._decision_attr(config)
            self._read_stored(attr)
            found = self._local.get(attr)
            if found is None:
                return None
            return Drop(found["drop_points"], found["drop_stderr_points"], found["admitted"], found["how"])
        mine, theirs = self.cached(config), self.cached(ref)
        if mine is None or theirs is None:
            return None
        return drop_between(self.metric, mine, theirs)

    @staticmethod
    def _paired_drop(mine: Mapping[str, Any], theirs: Mapping[str, Any], items: tuple[int, ...]) -> paired.PairedDrop:
        def table(record: Mapping[str, Any]) -> dict[int, tuple[float, float]]:
            p = record["per_item"]
            return {i: (c, m) for i, c, m in zip(p["item"], p["correct"], p["margin"])}

        a, b = table(mine), table(theirs)
        ids = [i for i in items if i in a and i in b]
        return paired.paired_drop(
            [a[i][0] for i in ids], [b[i][0] for i in ids], [a[i][1] for i in ids], [b[i][1] for i in ids]
        )

    def sequential(self, config: TrialConfig) -> dict[str, Any]:
        """Measure ``config`` and its reference on the same items, batch by batch, until the
        paired drop is decided against the bound or a cap is reached; store the decision."""
        ref = self.reference(config)
        assert ref is not None
        order, batch = self.order()
        cap = len(order)
        # No bound: nothing to decide early. A first look needs two items for an error at all.
        n = min(max(batch, 2), cap) if self.bound is not None else cap
        started = time.monotonic()
        while True:
            items = order[:n]
            mine, theirs = self.measure(config, items), self.measure(ref, items)
            drop = self._paired_drop(mine, theirs, items)
            out_of_time = self.max_seconds is not None and time.monotonic() - started >= self.max_seconds
            final = n >= cap or out_of_time
            verdict = (
                paired.decide(drop.points, drop.stderr_points, self.bound, final) if self.bound is not None else None
            )
            if verdict != paired.UNDECIDED or final:
                break
            n = min(n + batch, cap)
        decision: dict[str, Any] = {
            "weights": config.weights,
            "reference_weights": ref.weights,
            "metric": self.metric.name if self.metric else None,
            "drop_points": drop.points,
            "drop_stderr_points": drop.stderr_points,
            "unpaired_stderr_points": drop.unpaired_stderr_points,
            "margin_drop": drop.margin_drop,
            "margin_stderr": drop.margin_stderr,
            "items_used": drop.n,
            "discordant": drop.discordant,
            "verdict": verdict,
            "bound_points": self.bound,
            "cap_items": cap,
            "stopped_by": "decided"
            if verdict in (paired.WITHIN, paired.OVER)
            else ("seconds" if out_of_time else "items"),
            "value": _accuracy(mine, items),
            "reference_value": _accuracy(theirs, items),
        }
        if self.policy == "kld" and self.proxy is not None and self.bound is not None:
            # Every candidate's KLD, not only the undecided ones': the relation is fitted on
            # the decided artifacts' paired drops.
            decision["kld"] = float(self.measure(config, metric=self.proxy)["value"])
        decision.update(self._admit(config, decision))
        self._store(self._decision_attr(config), decision)
        return decision

    def _admit(self, config: TrialConfig, d: Mapping[str, Any]) -> dict[str, Any]:
        """Whether the verdict (or the policy, when undecided) lets the configuration through."""
        verdict = d["verdict"]
        assert self.metric is not None
        interval = (
            f"{self.metric.drop_text(d['drop_points'])} ± {self.metric.amount_text(paired.Z_FINAL * d['drop_stderr_points'])} "
            f"on {d['items_used']} items"
        )
        if verdict is None:
            return {"admitted": None, "decided_by": "no bound", "how": f"paired drop {interval}"}
        if verdict == paired.WITHIN:
            return {"admitted": True, "decided_by": "paired", "how": f"within the bound: {interval}"}
        if verdict == paired.OVER:
            return {"admitted": False, "decided_by": "paired", "how": f"over the bound: {interval}"}
        if self.policy == "accept":
            return {
                "admitted": True,
                "decided_by": "policy accept",
                "how": f"undecided ({interval}), [quality] undecided = 'accept'",
            }
        if self.policy == "kld" and self.proxy is not None:
            return self._admit_by_kld(config, d["kld"], interval)
        return {
            "admitted": False,
            "decided_by": "policy reject",
            "how": f"undecided ({interval}), [quality] undecided = 'reject'",
        }

    def _admit_by_kld(self, config: TrialConfig, kld: float, interval: str) -> dict[str, Any]:
        """Judge an undecided configuration by its KLD, through the relation between KLD and the
        paired drop fitted on the study's other artifacts."""
        assert self.bound is not None
        points = []
        for found in self._decisions().values():
            if found.get("weights") != config.weights and found.get("kld") is not None:
                points.append((found["kld"], found["drop_points"], found["drop_stderr_points"]))
        relation = paired.fit_kld_relation([p[0] for p in points], [p[1] for p in points], [p[2] for p in points])
        out: dict[str, Any] = {"kld": kld}
        if relation is None:
            return {
                **out,
                "admitted": False,
                "decided_by": "kld (no relation): reject",
                "how": f"undecided ({interval}); the KLD relation needs {paired.MIN_RELATION_POINTS} other artifacts "
                f"with a paired drop and a KLD (has {len(points)}): rejected",
            }
        expected, se = relation.expected_drop(kld)
        lo, hi = expected - relation.t * se, expected + relation.t * se
        out.update(kld_relation=relation.to_dict(), kld_expected_drop_points=expected, kld_expected_stderr_points=se)
        # A KLD is no accuracy drop: it is turned into one only through the fitted relation, and
        # the text says so.
        shown = (
            f"KLD {kld:.4f} nats -> expected {signed_drop(expected)} (interval {lo:.2f} to {hi:.2f} points) through "
            f"the KLD-to-drop relation fitted on {relation.n} artifacts' paired drops"
        )
        if hi < self.bound:
            return {**out, "admitted": True, "decided_by": "kld", "how": f"undecided ({interval}); {shown}: within"}
        verdict = "over" if lo > self.bound else "still undecided"
        return {
            **out,
            "admitted": False,
            "decided_by": "kld",
            "how": f"undecided ({interval}); {shown}: {verdict}, rejected",
        }

    def _decisions(self) -> dict[str, dict[str, Any]]:
        found = {k: v for k, v in self._local.items() if k.startswith(QUALITY_DECISION_PREFIX)}
        if self.study is not None:
            found.update({k: v for k, v in self.study.user_attrs.items() if k.startswith(QUALITY_DECISION_PREFIX)})
        return found

    def power(self) -> str | None:
        """What the bound costs, said before the study starts: the items that find a candidate
        with no true drop within the bound (80% of the time) at the expected agreement, and
        the seconds that takes here, timed on the reference's first batch."""
        if not self.paired or self.bound is None or not self.prepared.reference:
            return None
        if self.bound <= 0:
            return f"quality: a bound of {self.bound:g} points cannot be shown within by any sample"
        order, batch = self.order()
        ref = next(iter(self.prepared.reference.values()))
        record = self.measure(ref, order[: min(batch, len(order))])
        per_item = (record.get("seconds") or 0.0) / max(record["n"], 1)
        needed = paired.items_needed(self.expected_agreement, self.bound)
        line = (
            f"quality: a {self.bound:g}-point bound at {self.expected_agreement:.0%} expected agreement needs about "
            f"{needed:,} items per candidate ({paired.POWER:.0%} power for a true drop of 0); "
            f"{per_item:.2f} s per item here: about {needed * per_item / 60:.0f} min per candidate; "
            f"the pool holds {len(order):,} items"
        )
        if needed > len(order):
            line += " (fewer: close calls end undecided, [quality] undecided = " + repr(self.policy) + ")"
        return line

    def trial_quality(self, config: TrialConfig) -> dict[str, Any]:
        """Measure ``config`` and its reference (each once) and describe the drop for the trial
        record; ``skipped`` with the reason when the metric cannot evaluate this backend."""
        assert self.metric is not None
        why = self.metric.supports(self.prepared.backend(config.backend))
        if why:
            return {"metric": self.metric.name, "skipped": why}
        ref = self.reference(config)
        assert ref is not None
        if self.paired:
            attr = self._decision_attr(config)
            d = self._local.get(attr) or (self.study.user_attrs.get(attr) if self.study is not None else None)
            if d is None:  # measured once per artifact: a resumed study answers from the storage
                d = self.sequential(config)
            return {
                "metric": self.metric.name,
                "value": d["value"],
                "n": d["items_used"],
                "reference_weights": ref.weights,
                "reference_value": d["reference_value"],
                "drop_points": d["drop_points"],
                "drop_stderr_points": d["drop_stderr_points"],
                "unpaired_stderr_points": d["unpaired_stderr_points"],
                "margin_drop": d["margin_drop"],
                "margin_stderr": d["margin_stderr"],
                "items_used": d["items_used"],
                "verdict": d["verdict"],
                "decided_by": d["decided_by"],
                "admitted": d["admitted"],
                "how": d["how"],
                **({"kld": d["kld"]} if "kld" in d else {}),
            }
        mine, theirs = self.measure(config), self.measure(ref)
        drop = drop_between(self.metric, mine, theirs)
        return {
            "metric": self.metric.name,
            "value": mine["value"],
            "stderr": mine.get("stderr"),
            "n": mine.get("n"),
            "reference_weights": ref.weights,
            "reference_value": theirs["value"],
            "drop_points": drop.points,
            "drop_stderr_points": drop.stderr_points,
        }


def _accuracy(record: Mapping[str, Any], items: tuple[int, ...]) -> float:
    chosen = set(items)
    p = record["per_item"]
    answered = [c for i, c in zip(p["item"], p["correct"]) if i in chosen]
    return sum(answered) / len(answered)
