"""Multi-fidelity: with ``[study] probe_margin`` a launch whose first run is far below the leader
stops there, is recorded as pruned with its probe figures, and is never the best."""

from __future__ import annotations

from typing import Mapping

import optuna
import pytest

from autotune.engine.backend import Measurement, StudyContext, TrialConfig
from autotune.config import load_study_config
from autotune.errors import ConfigError
from autotune.measure import PROBE_STOP, Protocol, repeat_until_stable_many
from autotune.study import open_storage, run_study
from autotune.study.records import TrialRecord

if __package__:
    from .fake_backends import FakeBackend, memory_dir, registered, write_study
else:
    from fake_backends import FakeBackend, memory_dir, registered, write_study


class RepeatingBackend(FakeBackend):
    """Measures through the shared protocol, counting the runs it really does."""

    name = "fake-repeating"

    def __init__(self, speeds: Mapping[str, float]):
        super().__init__()
        self.speeds = dict(speeds)
        self.runs: dict[str, int] = {}

    def run(self, config: TrialConfig, ctx: StudyContext) -> Measurement:
        self._log(config)

        def sample() -> dict[str, float]:
            self.runs[config.weights] = self.runs.get(config.weights, 0) + 1
            aggregate = self.speeds[config.weights] * (1 + 0.001 * self.runs[config.weights])  # a little spread
            return {
                "aggregate_tok_s": aggregate,
                "per_user_tok_s": aggregate / config.parallel,
                "decode_tok_s": aggregate,
            }

        units = {"aggregate_tok_s": "tok/s", "per_user_tok_s": "tok/s", "decode_tok_s": "tok/s"}
        return Measurement(
            metrics=repeat_until_stable_many(sample, ctx.protocol, units, "aggregate_tok_s", probe=ctx.probe)
        )


@pytest.fixture
def storage(tmp_path):
    for scratch in memory_dir(tmp_path):
        yield f"sqlite:///{scratch / 'probe.db'}"


def study(tmp_path, extra: str):
    path = write_study(
        tmp_path / "probe.toml",
        "fake-repeating",
        ["fast", "close", "slow"],
        parallel=(1,),
        sampler="grid",
        study_extra=extra,
    )
    # The grid's order is seeded; put the leader first so the others are probed against it.
    path.write_text(path.read_text() + "\n[measure]\nwarmup_runs = 0\nmin_runs = 3\nmax_runs = 3\n")
    return path


def run(tmp_path, storage, extra):
    backend = RepeatingBackend({"fast": 100.0, "close": 90.0, "slow": 50.0})
    with registered(backend):
        summary = run_study(load_study_config(study(tmp_path, extra)), storage=storage)
    return backend, summary


def test_a_probe_far_below_the_leader_stops_the_launch_after_one_run(tmp_path, storage):
    backend, summary = run(tmp_path, storage, "finish_top = 0\nprobe_margin = 0.2")
    st = optuna.load_study(study_name="fake-study", storage=open_storage(storage))
    by_weights = {TrialRecord.of(t).config["weights"]: t for t in st.trials}
    assert [c.weights for c in backend.calls] == ["fast", "slow", "close"]  # the seeded grid's order
    slow = by_weights["slow"]
    assert backend.runs == {"fast": 3, "slow": 1, "close": 3}  # slow stopped by its probe; close is 10% behind
    assert slow.state == optuna.trial.TrialState.PRUNED and slow.user_attrs["probe"] is True
    assert slow.intermediate_values == {0: pytest.approx(50.05)}
    assert TrialRecord.of(slow).prune_reason.startswith(
        "probe: 50.0 in the first run, more than 20% below the leader's"
    )
    assert TrialRecord.of(slow).metrics["aggregate_tok_s"]["stop_reason"] == PROBE_STOP
    assert summary.best["params"]["weights"] == "fast"


def test_the_probe_prunes_whatever_the_order_once_a_leader_exists(tmp_path, storage):
    """Every launch after the leader's that is more than the margin behind stops at its probe."""
    backend, _ = run(tmp_path, storage, "finish_top = 0\nprobe_margin = 0.05")
    order = [c.weights for c in backend.calls]
    first = order[0]
    for w in order[1:]:
        behind = {"fast": 100.0, "close": 90.0, "slow": 50.0}
        leader = max(behind[x] for x in order[: order.index(w)])
        assert backend.runs[w] == (1 if behind[w] < 0.95 * leader else 3), (order, w)
    assert backend.runs[first] == 3  # nothing to compare the first launch with


def test_without_probe_margin_every_launch_is_measured_in_full(tmp_path, storage):
    backend, _ = run(tmp_path, storage, "finish_top = 0")
    assert backend.runs == {"fast": 3, "close": 3, "slow": 3}


def test_probe_margin_must_be_a_fraction(tmp_path):
    with pytest.raises(ConfigError, match=r"probe_margin.*between 0 and 1"):
        load_study_config(study(tmp_path, "probe_margin = 1.5"))


def test_protocol_stops_after_the_first_run_when_the_probe_says_so():
    heard = []

    def probe(first):
        heard.append(dict(first))
        return False

    stats = repeat_until_stable_many(
        lambda: {"x": 1.0}, Protocol(warmup_runs=1, min_runs=3, max_runs=5), {"x": "u"}, "x", probe=probe
    )
    assert stats["x"].n == 1 and stats["x"].stop_reason == PROBE_STOP and heard == [{"x": 1.0}]
    assert "probe" in stats["x"].warning
