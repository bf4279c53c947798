"""The twin's online calibration (plugins/twin/calibration.py) on recorded H200 trials.

bench/results/h200_llama_study_trials.json: 35 llama-server trials of a synthetic Qwen2.5-7B
shape on an H200 (512 prompt + 128 output tokens; bench/results/h200_llama_study.md). Its GGUF
files are not here; each is given to the twin as its format.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from autotune.engine.backend import StudyContext, TrialConfig, Workload
from autotune.hardware.gpus import get_gpu
from autotune.measure import Protocol
from autotune.modelfiles.models import resolve_model
from autotune_plugins.twin import TwinLlamaCpp, calibration, load_constants
from tests.conftest import REPO

TRIALS = REPO / "bench" / "results" / "h200_llama_study_trials.json"
N_FIT = 5


def h200_ctx() -> StudyContext:
    return StudyContext(
        gpu=get_gpu("h200"),
        model=resolve_model("qwen2.5-7b"),
        workload=Workload(512, 128),
        vram_budget_bytes=140 * 2**30,
        protocol=Protocol(),
    )


def h200_trials() -> list[tuple[TrialConfig, dict[str, float]]]:
    out = []
    for t in json.loads(TRIALS.read_text(encoding="utf-8")):
        c = dict(t["config"], backend="twin-llama.cpp")
        # /tmp/p/m/q7b-Q4_K_M.gguf -> gguf:Q4_K_M
        c["weights"] = "gguf:" + c["weights"].rsplit("-", 1)[1].removesuffix(".gguf")
        out.append(
            (
                TrialConfig.from_dict(c),
                {"decode_tok_s": t["decode"], "aggregate_tok_s": t["agg"], "per_user_tok_s": t["per_user"]},
            )
        )
    return out


def errors_on(twin: TwinLlamaCpp, ctx: StudyContext, trials) -> float:
    predicted = [twin.predictor.predict(config, ctx) for config, _ in trials]
    return calibration.median_abs_error(predicted, trials)


def test_five_measured_configurations_improve_the_predictions_for_the_rest():
    twin, ctx = TwinLlamaCpp(), h200_ctx()
    trials = h200_trials()
    assert len(trials) == 35
    fitted_on, rest = trials[:N_FIT], trials[N_FIT:]  # the study's first five, in the order it measured them
    cal = twin.predictor.calibrate(fitted_on, ctx)
    assert cal is not None and cal["n"] == N_FIT and cal["gpu"] == "h200" and cal["engine"] == "llama.cpp"
    before = errors_on(twin, ctx, rest)
    after = errors_on(twin, replace(ctx, calibration=cal), rest)
    print(
        f"H200, {len(rest)} held-out trials: median abs error {before:.1%} -> {after:.1%} after calibrating on "
        f"{N_FIT}; constants {cal['before']} -> {cal['after']}"
    )
    assert after < before
    # On the trials it was fitted on, too (what the report shows).
    assert cal["median_abs_error_after"] < cal["median_abs_error_before"]


def test_one_measurement_barely_moves_the_constants():
    """Five constants are not determined by one trial: the prior keeps them near the published fit."""
    twin, ctx = TwinLlamaCpp(), h200_ctx()
    cal = twin.predictor.calibrate(h200_trials()[:1], ctx)
    for field, before in cal["before"].items():
        after = cal["after"][field]
        if before > 0:
            assert 0.8 < after / before < 1.25, (field, before, after)
        else:  # a term published at 0 stays negligible
            assert after < 0.2 * calibration.ZERO_SCALES[field], (field, after)


def test_the_calibration_applies_to_its_own_engine_and_card_only():
    twin, ctx = TwinLlamaCpp(), h200_ctx()
    config, _ = h200_trials()[0]
    cal = twin.predictor.calibrate(h200_trials()[:N_FIT], ctx)
    plain = twin.predictor.predict(config, ctx)
    assert twin.predictor.predict(config, replace(ctx, calibration=cal)) != plain
    assert twin.predictor.predict(config, replace(ctx, calibration=dict(cal, gpu="a100-80gb"))) == plain
    assert twin.predictor.predict(config, replace(ctx, calibration=dict(cal, engine="exllamav2"))) == plain


def test_fit_without_observations_keeps_the_published_constants():
    engines, host, _ = load_constants()
    k = engines["llama.cpp"]
    fitted, report = calibration.fit(k, host, [])
    assert fitted == k and report["n"] == 0 and report["median_abs_error_before"] is None


def test_a_robust_fit_is_not_dragged_by_one_disturbed_trial(monkeypatch):
    """One trial measured at a tenth of its speed (the card shared with another job) moves the
    fit much less than it moves a least-squares fit (measured: 11% against 27%), and hardly more
    than one at a third of its speed does (bounded influence)."""
    twin, ctx = TwinLlamaCpp(), h200_ctx()
    trials = h200_trials()[:12]

    def shift(slowdown: float) -> float:
        disturbed = [
            (c, {m: v / slowdown for m, v in metrics.items()}) if i == 0 else (c, metrics)
            for i, (c, metrics) in enumerate(trials)
        ]
        clean, dirty = twin.predictor.calibrate(trials, ctx)["after"], twin.predictor.calibrate(disturbed, ctx)["after"]
        return max(abs(dirty[f] / clean[f] - 1) for f in clean if clean[f] > 0)

    robust, robust_third = shift(10), shift(3)
    monkeypatch.setattr(calibration, "ROBUST_SCALE", 100.0)  # soft L1 that never leaves its quadratic part
    least_squares = shift(10)
    assert robust < 0.5 * least_squares, (robust, least_squares)
    assert robust < 1.2 * robust_third, (robust, robust_third)
