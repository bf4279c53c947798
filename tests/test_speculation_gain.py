"""Speculation's gain against slots from trial records (autotune/study/speculation_gain.py)."""

from __future__ import annotations

from autotune.study.records import TrialRecord, TrialState
from autotune.study.speculation_gain import gain_lines, gains, verdict


def record(
    number: int,
    parallel: int,
    tok_s: float | None,
    state: TrialState = TrialState.COMPLETE,
    acceptance: dict | None = None,
    **options,
) -> TrialRecord:
    config = {"backend": "b", "weights": "w.gguf", "ctx": 4096, "parallel": parallel, "cache_type": "f16", **options}
    raw = {"acceptance": acceptance} if acceptance else {}
    metrics = {} if tok_s is None else {"aggregate_tok_s": {"median": tok_s}}
    return TrialRecord(number=number, state=state, values=None, constraints={}, raw=raw, config=config, metrics=metrics)


def test_the_best_speculation_per_slot_count_against_the_same_configuration_without():
    rows = [
        record(0, 1, 40.0),
        record(
            1, 1, 60.0, spec_type="draft-mtp", spec_n_max=2, acceptance={"drafted": 100, "accepted": 56, "rate": 0.56}
        ),
        record(2, 1, 52.0, spec_type="draft-mtp", spec_n_max=4),
        record(3, 4, 120.0),
        record(4, 4, 100.0, spec_type="draft-mtp", spec_n_max=2),
        record(5, 8, 180.0),
        record(6, 8, 150.0, spec_type="draft-mtp", spec_n_max=2),
        # Another cache type: its own pair, not compared with the f16 ones.
        record(7, 2, 100.0, cache_type="q8_0"),
        record(8, 2, 90.0, cache_type="q8_0", spec_type="ngram-mod"),
        # Nothing without speculation to compare with, a failed trial, an unmeasured one: left out.
        record(9, 16, 200.0, spec_type="draft-mtp"),
        record(10, 1, 999.0, TrialState.FAIL, spec_type="draft-mtp"),
        record(11, 1, None, spec_type="draft-mtp"),
    ]
    found = gains(rows)
    assert [(g.parallel, round(g.gain, 3)) for g in found] == [(1, 1.5), (2, 0.9), (4, 0.833), (8, 0.833)]
    one = found[0]
    assert (one.trial, one.baseline_trial, one.pairs, one.acceptance_rate) == (1, 0, 2, 0.56)
    assert one.speculation == {"spec_type": "draft-mtp", "spec_n_max": 2}
    assert verdict(found) == "speculation loses from 2 slots: x0.90 aggregate"
    lines = gain_lines(found)
    assert lines[1] == (
        "  parallel 1: x1.50 (60.0 vs 40.0; draft-mtp, n-max 2, acceptance 0.56; trials 1 vs 0, 2 pairs)"
    )


def test_verdict_wins_everywhere_loses_everywhere_or_in_between():
    win = gains(
        [
            record(0, 1, 10.0),
            record(1, 1, 20.0, spec_type="draft-mtp"),
            record(2, 2, 18.0),
            record(3, 2, 19.0, spec_type="draft-mtp"),
        ]
    )
    assert verdict(win) == "speculation wins at every slot count measured (1-2): x1.06 aggregate at worst"
    lose = gains([record(0, 1, 10.0), record(1, 1, 9.0, spec_type="ngram-simple")])
    assert verdict(lose) == "speculation loses at every slot count measured: x0.90 aggregate at 1"
    mixed = gains(
        [
            record(0, 1, 10.0),
            record(1, 1, 9.0, spec_type="draft-mtp"),
            record(2, 4, 10.0),
            record(3, 4, 12.0, spec_type="draft-mtp"),
        ]
    )
    assert verdict(mixed) == "speculation loses at 1 slot (not from a slot count on)"
    assert gains([record(0, 1, 10.0)]) == [] and verdict([]) is None
