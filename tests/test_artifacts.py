"""The artifact cache: made once by the first trial that needs it, keyed by the source's content,
the tool's version and the format; failures, disk space and records (autotune/modelfiles/artifacts.py)."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import optuna
import pytest

from autotune.modelfiles import artifacts
from autotune.modelfiles.artifacts import ARTIFACTS_ENV, ArtifactError, Recipe, ensure, is_format, source_hash
from autotune.engine.backend import BaseBackend, Measurement, MemoryEstimate, Param, StudyContext, TrialConfig, Workload
from autotune.config import parse_study_config
from autotune.errors import AutotuneError, ConfigError
from autotune.hardware.gpus import get_gpu
from autotune.measure import Protocol
from autotune.modelfiles.models import get_model
from autotune.study.records import TrialRecord
from autotune.engine.parts import part
from tests.fake_backends import ForwardingArtifacts, ForwardingPredictor
from tests.fake_backends import stats_for

# Formats (gguf:, exl2:) are what the engine plugins declare.
pytestmark = pytest.mark.usefixtures("engine_plugins")


class MakingBackend(BaseBackend):
    """Makes ``fake:<n>``-free formats: any gguf:<TYPE> by writing the type into a file, from an
    F16 it makes first; ``gguf:Q2_K`` fails as a tool would."""

    artifacts = part(ForwardingArtifacts)

    name = "maker"
    engine = "maker-engine"

    def __init__(self) -> None:
        self.made: list[str] = []
        self.loaded: list[str] = []

    def artifact_recipe(self, fmt: str, source: Path, ctx: StudyContext) -> Recipe | None:
        if not fmt.startswith("gguf:"):
            return None
        qtype = fmt.split(":")[1]

        def make(inputs: list[Path], out: Path, say: Callable[[str], None]) -> None:
            self.made.append(fmt)
            if qtype == "Q2_K":
                raise AutotuneError("maker-quantize: error: unsupported tensor shape")
            out.write_text(f"{qtype} from {[p.name for p in inputs]}")

        return Recipe(
            fmt,
            "maker-1.0",
            f"{qtype}.bin",
            1000,
            make,
            needs=() if qtype == "F16" else ("gguf:F16",),
            description=f"maker {qtype}",
        )

    def parameters(self, space: Mapping[str, Sequence[Any]]) -> list[Param]:
        return []

    def estimate_memory(self, config: TrialConfig, ctx: StudyContext) -> MemoryEstimate:
        return MemoryEstimate(2**20, 0, 0, 0)

    def run(self, config: TrialConfig, ctx: StudyContext) -> Measurement:
        path = artifacts.artifact_path(ctx.source, self.artifact_recipe(config.weights, ctx.source, ctx))
        self.loaded.append(path.read_text())
        return Measurement(metrics=stats_for(10.0 + config.parallel, config.parallel))

    def deploy_command(self, config: TrialConfig, ctx: StudyContext) -> str:
        return f"maker-serve {config.weights}"


def plugin_of(*backends: BaseBackend) -> type:
    """A plugin registering ``backends``, for ``plugin_registered``."""
    from autotune import hookimpl

    class Plugin:
        @staticmethod
        @hookimpl
        def register_backends(register):
            for backend in backends:
                register(backend)

    return Plugin


@pytest.fixture(autouse=True)
def _fresh(tmp_path, monkeypatch):
    monkeypatch.setenv(ARTIFACTS_ENV, str(tmp_path / "cache"))
    artifacts._failed.clear()
    yield
    artifacts._failed.clear()


def context(source: Path) -> StudyContext:
    return StudyContext(
        gpu=get_gpu("t4"),
        model=get_model("qwen2.5-7b"),
        workload=Workload(8, 8),
        vram_budget_bytes=2**30,
        protocol=Protocol(),
        source=source,
    )


@pytest.fixture
def source(tmp_path) -> Path:
    d = tmp_path / "hf-model"
    d.mkdir()
    (d / "config.json").write_text('{"a": 1}')
    (d / "model.safetensors").write_bytes(b"weights")
    return d


def test_formats_and_files_are_told_apart():
    assert is_format("gguf:Q4_K_M") and is_format("exl2:4.0") and is_format("gguf:q8_0")
    assert not is_format("models/x.gguf") and not is_format("gguf:NOPE") and not is_format("C:/m.gguf")


def test_made_once_then_found_with_its_record(source):
    backend, lines = MakingBackend(), []
    first = ensure(backend, "gguf:Q8_0", context(source), lines.append)
    assert first.made_now and first.path.read_text() == "Q8_0 from ['hf-model', 'F16.bin']"
    assert backend.made == ["gguf:F16", "gguf:Q8_0"]  # the F16 it needs is an artifact of its own
    again = ensure(backend, "gguf:Q8_0", context(source), lines.append)
    assert backend.made == ["gguf:F16", "gguf:Q8_0"]  # nothing made the second time
    assert not again.made_now and again.path == first.path and again.sha256 == first.sha256
    assert again.make_seconds == first.make_seconds  # the seconds it took when it was made
    assert any("cache hit" in line for line in lines)
    manifest = json.loads(first.path.with_name("Q8_0.bin.json").read_text())
    assert manifest["source_sha256"] == source_hash(source) and manifest["tool"] == "maker-1.0"
    # Keyed by content: the same model copied elsewhere finds the same artifact.
    copy = source.parent / "copy-of-model"
    shutil.copytree(source, copy)
    assert ensure(backend, "gguf:Q8_0", context(copy)).path == first.path
    assert backend.made == ["gguf:F16", "gguf:Q8_0"]
    # A changed source is another source.
    (copy / "model.safetensors").write_bytes(b"other weights")
    assert ensure(backend, "gguf:Q8_0", context(copy)).path != first.path


def test_a_file_path_makes_nothing(source):
    assert ensure(MakingBackend(), "models/x.gguf", context(source)) is None


def test_a_failure_carries_the_tool_error_and_is_not_retried_in_the_run(source):
    backend = MakingBackend()
    with pytest.raises(ArtifactError, match="maker-quantize: error: unsupported tensor shape"):
        ensure(backend, "gguf:Q2_K", context(source))
    with pytest.raises(ArtifactError, match="unsupported tensor shape"):
        ensure(backend, "gguf:Q2_K", context(source))
    assert backend.made.count("gguf:Q2_K") == 1
    # Nothing half-made is left where a later run would take it for the artifact.
    entry = artifacts.artifact_path(source, backend.artifact_recipe("gguf:Q2_K", source, context(source))).parent
    assert [p.name for p in entry.glob("Q2_K.bin*")] == ["Q2_K.bin.lock"]


def test_disk_space_is_checked_before_making(source, monkeypatch):
    monkeypatch.setattr(artifacts, "_free_bytes", lambda directory: 500)
    with pytest.raises(
        ArtifactError, match=r"needs about 0\.00 GiB in .* but 0\.00 GiB is free.*AUTOTUNE_ARTIFACTS_DIR"
    ):
        ensure(MakingBackend(), "gguf:F16", context(source))


def test_without_a_source_the_error_says_what_to_add():
    with pytest.raises(ArtifactError, match=r"no \[model\] source"):
        ensure(MakingBackend(), "gguf:Q8_0", context(None))  # type: ignore[arg-type]


def test_a_study_makes_each_artifact_once_and_records_it(source, tmp_path):
    from autotune.study.prepare import prepare_study
    from autotune.study.runner import StudyRunner
    from tests.conftest import plugin_registered

    backend = MakingBackend()

    Plugin = plugin_of(backend)

    doc = {
        "study": {"name": "made", "sampler": "grid", "finish_top": 0},
        "hardware": {"gpu": "t4"},
        "model": {"source": str(source), "ref": "qwen2.5-7b"},
        "workload": {"prompt_tokens": 8, "output_tokens": 8},
        "candidates": [{"backend": "maker", "weights": ["gguf:Q8_0", "gguf:Q4_0", "gguf:Q2_K"]}],
        "space": {"ctx": [256], "parallel": [1, 2]},
    }
    with plugin_registered(Plugin, "maker-plugin"):
        cfg = parse_study_config(doc, source="made.toml", path=tmp_path / "made.toml")
        runner = StudyRunner(prepare_study(cfg, storage=f"sqlite:///{tmp_path / 'made.db'}"))
        runner.run(n_trials=10)
    assert sorted(backend.made) == ["gguf:F16", "gguf:Q2_K", "gguf:Q4_0", "gguf:Q8_0"]
    trials = runner.study.get_trials()
    done = [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert (
        len(done) == 4
        and sorted(backend.loaded)
        == ["Q4_0 from ['hf-model', 'F16.bin']"] * 2 + ["Q8_0 from ['hf-model', 'F16.bin']"] * 2
    )
    for t in done:
        (record,) = TrialRecord.of(t).artifacts
        assert record["weights"] == TrialRecord.of(t).config["weights"] and len(record["sha256"]) == 64
        assert Path(record["path"]).is_file() and record["make_seconds"] >= 0
    assert sum(TrialRecord.of(t).artifacts[0]["made_now"] for t in done) == 2  # one maker per artifact
    failed = [t for t in trials if t.state == optuna.trial.TrialState.FAIL]
    # The failed conversion fails the trials that need it (the grid queued both), with the tool's
    # error, and is not run again for the second: the study goes on.
    assert {TrialRecord.of(t).config["weights"] for t in failed} == {"gguf:Q2_K"} and len(failed) == 2
    assert all("maker-quantize: error: unsupported tensor shape" in TrialRecord.of(t).fail_reason for t in failed)
    assert backend.made.count("gguf:Q2_K") == 1


def test_a_format_without_a_source_is_an_error_naming_the_field(tmp_path):
    from autotune.study.prepare import prepare_study
    from tests.conftest import plugin_registered

    backend = MakingBackend()

    Plugin = plugin_of(backend)

    doc = {
        "hardware": {"gpu": "t4"},
        "model": {"ref": "qwen2.5-7b"},
        "workload": {"prompt_tokens": 8, "output_tokens": 8},
        "candidates": [{"backend": "maker", "weights": ["gguf:Q8_0"]}],
        "space": {"ctx": [256], "parallel": [1]},
    }
    with plugin_registered(Plugin, "maker-plugin"):
        with pytest.raises(
            AutotuneError, match=r"s\.toml: \[candidates\.0\] weights 'gguf:Q8_0': .*add \[model\] source"
        ):
            prepare_study(parse_study_config(doc, source="s.toml", path=tmp_path / "s.toml"))
        doc["model"]["source"] = str(tmp_path / "missing")
        with pytest.raises(AutotuneError, match=r"\[model\] source = .*missing.*: no such file or directory"):
            prepare_study(parse_study_config(doc, source="s.toml", path=tmp_path / "s.toml"))


def _set_record(path: Path, seconds: float, n_bytes: int) -> None:
    """What a making on this machine recorded (the seconds are the test's, not a clock's)."""
    manifest = path.with_name(path.name + ".json")
    record = json.loads(manifest.read_text())
    assert record["step"] == "maker" and record["bytes"] == path.stat().st_size  # written by ensure()
    manifest.write_text(json.dumps({**record, "make_seconds": seconds, "bytes": n_bytes}))


class GuessingBackend(MakingBackend):
    """MakingBackend whose recipes guess a rate: ``seconds_per_gib`` per GiB of 1000 bytes."""

    name = "guesser"

    def __init__(self, seconds_per_gib: float | None) -> None:
        super().__init__()
        self.guess = seconds_per_gib

    def artifact_recipe(self, fmt: str, source: Path, ctx: StudyContext) -> Recipe | None:
        from dataclasses import replace

        recipe = super().artifact_recipe(fmt, source, ctx)
        return None if recipe is None else replace(recipe, step="maker", seconds_per_gib=self.guess)

    def run(self, config: TrialConfig, ctx: StudyContext) -> Measurement:
        if not is_format(config.weights):
            return Measurement(metrics=stats_for(10.0 + config.parallel, config.parallel))
        return super().run(config, ctx)


def test_making_is_predicted_from_a_first_guess_then_from_this_machines_records(source):
    backend, ctx = GuessingBackend(seconds_per_gib=2**30), context(source)  # 1 s per byte: 1000 s each
    first = artifacts.predict_making(backend, "gguf:Q4_0", ctx)
    assert first.formats == ("gguf:F16", "gguf:Q4_0") and first.seconds == pytest.approx(2000)
    assert "first guess" in first.basis
    assert artifacts.predict_making(GuessingBackend(None), "gguf:Q8_0", ctx).seconds is None  # no way to tell
    f16 = ensure(backend, "gguf:F16", ctx)
    _set_record(f16.path, seconds=3.0, n_bytes=2**30)  # 3 s per GiB measured here
    second = artifacts.predict_making(backend, "gguf:Q4_0", ctx)
    assert second.formats == ("gguf:Q4_0",) and second.seconds == pytest.approx(3.0 * 1000 / 2**30)
    assert "1 maker run(s) on this machine" in second.basis
    assert artifacts.predict_making(backend, "gguf:F16", ctx) is None  # made: nothing to pay
    assert artifacts.predict_making(backend, str(source / "model.safetensors"), ctx) is None  # a file


def test_weights_too_long_to_make_in_the_budget_left_wait_for_a_later_run(source, tmp_path):
    """A budget is a promise: after a launch, a configuration whose weights would take longer to
    make than the budget has left is not started; it is not a failure of the configuration, and
    a later run with the time for it makes and measures it."""
    import random

    from autotune.report.text import summary_text
    from autotune.study.prepare import prepare_study
    from autotune.study.runner import StudyRunner
    from tests.conftest import plugin_registered

    backend = GuessingBackend(seconds_per_gib=2**30 * 10)  # 10 s per byte: 20,000 s for F16 then Q4_0
    (tmp_path / "ready.gguf").write_text("a file already made")

    Plugin = plugin_of(backend)

    doc = {
        "study": {"name": "deferred", "sampler": "grid", "finish_top": 0},
        "hardware": {"gpu": "t4"},
        "model": {"source": str(source), "ref": "qwen2.5-7b"},
        "workload": {"prompt_tokens": 8, "output_tokens": 8},
        "candidates": [{"backend": "guesser", "weights": [str(tmp_path / "ready.gguf"), "gguf:Q4_0"]}],
        "space": {"ctx": [256], "parallel": [1, 2]},
    }
    with plugin_registered(Plugin, "guesser-plugin"):
        cfg = parse_study_config(doc, source="d.toml", path=tmp_path / "d.toml")
        prepared = prepare_study(cfg, storage=f"sqlite:///{tmp_path / 'd.db'}")

        # A seed whose grid order launches the ready file first (the gate needs a launch to go by).
        def first_of(seed: int) -> TrialConfig:
            configs = list(prepared.space.enumerate())
            random.Random(seed).shuffle(configs)  # as the grid strategy orders them (default_strategies.GridStrategy)
            return configs[0]

        seed = next(s for s in range(100) if not is_format(first_of(s).weights))
        runner = StudyRunner(prepared, seed=seed)
        summary = runner.run(budget_s=600)
        assert backend.made == []  # nothing made: 20,000 s predicted against 600
        states = [t.state for t in runner.study.get_trials()]
        assert states.count(optuna.trial.TrialState.COMPLETE) == 2
        deferred = [t for t in runner.study.get_trials() if t.user_attrs.get("deferred")]
        assert len(deferred) == 2 and all(t.state == optuna.trial.TrialState.FAIL for t in deferred)
        assert (
            "not started: making gguf:F16 then gguf:Q4_0 would take about 20000 s"
            in TrialRecord.of(deferred[0]).fail_reason
        )
        assert summary.n_failed == 0 and "2 not started (their weights would take longer to make" in summary_text(
            summary
        )

        later = StudyRunner(prepare_study(cfg, storage=f"sqlite:///{tmp_path / 'd.db'}"))
        later.run(n_trials=5)  # no budget: the deferred configurations are made and measured
    assert sorted(backend.made) == ["gguf:F16", "gguf:Q4_0"]
    complete = [t for t in later.study.get_trials() if t.state == optuna.trial.TrialState.COMPLETE]
    assert {TrialRecord.of(t).config["weights"] for t in complete} == {str(tmp_path / "ready.gguf"), "gguf:Q4_0"}
    assert len(complete) == 4


class MakerTwin(BaseBackend):
    """A model of the maker's engine: predicts each weights' throughput, makes and runs nothing."""

    predictor = part(ForwardingPredictor)

    name = "maker-twin"
    engine = "maker-engine"

    def __init__(self, predicted: Mapping[str, float]) -> None:
        self.predicted = predicted  # weights (a format, or a file's name) -> aggregate tok/s

    def parameters(self, space: Mapping[str, Sequence[Any]]) -> list[Param]:
        return []

    def estimate_memory(self, config: TrialConfig, ctx: StudyContext) -> MemoryEstimate:
        return MemoryEstimate(2**20, 0, 0, 0)

    def predict(self, config: TrialConfig, ctx: StudyContext) -> Mapping[str, float] | None:
        name = config.weights if is_format(config.weights) else Path(config.weights).name
        return {"aggregate_tok_s": self.predicted[name]}

    def run(self, config: TrialConfig, ctx: StudyContext) -> Measurement:
        raise AssertionError("a model is never run")

    def deploy_command(self, config: TrialConfig, ctx: StudyContext) -> str:
        return "none"


@pytest.mark.parametrize(
    "q4_0, first",
    [(102.0, "ready.gguf"), (110.0, "gguf:Q4_0")],
    ids=["a near tie: the made file first", "clearly better: made first"],
)
def test_the_prior_measures_made_weights_before_near_equals_still_to_make(source, tmp_path, q4_0, first):
    from autotune.study.prepare import prepare_study
    from autotune.study.runner import StudyRunner
    from tests.conftest import plugin_registered

    maker, twin = GuessingBackend(seconds_per_gib=2**30), MakerTwin({"ready.gguf": 100.0, "gguf:Q4_0": q4_0})
    (tmp_path / "ready.gguf").write_text("a file already made")

    Plugin = plugin_of(maker, twin)

    doc = {
        "study": {"name": "prior-cost", "prior": True},
        "hardware": {"gpu": "t4"},
        "model": {"source": str(source), "ref": "qwen2.5-7b"},
        "workload": {"prompt_tokens": 8, "output_tokens": 8},
        "candidates": [{"backend": "guesser", "weights": [str(tmp_path / "ready.gguf"), "gguf:Q4_0"]}],
        "space": {"ctx": [256], "parallel": [1]},
    }
    with plugin_registered(Plugin, "maker-plugin"):
        cfg = parse_study_config(doc, source="p.toml", path=tmp_path / "p.toml")
        runner = StudyRunner(prepare_study(cfg, storage=f"sqlite:///{tmp_path / 'p.db'}"))
        assert runner.uses_prior and runner.queue.enqueue_prior() == 2
    queued = [
        TrialRecord.of(t).config["weights"]
        for t in runner.study.get_trials()
        if t.state == optuna.trial.TrialState.WAITING
    ]
    assert [Path(w).name if not is_format(w) else w for w in queued] == [
        first,
        ({"ready.gguf", "gguf:Q4_0"} - {first}).pop(),
    ]


def test_ties_band_from_their_best_and_only_above_zero():
    from autotune.study.prior import cheaper_first_among_ties

    def c(name: str) -> TrialConfig:
        return TrialConfig("maker", name, 256, 1)

    cost = {"a": 50.0, "b": 0.0, "c": float("inf"), "d": 0.0, "e": 9.0, "f": 0.0}
    ranked = [(c("a"), 100.0), (c("b"), 98.0), (c("c"), 97.5), (c("d"), 96.0), (c("e"), -1.0), (c("f"), -1.0)]
    order = [cfg.weights for cfg, _ in cheaper_first_among_ties(ranked, lambda cfg: cost[cfg.weights])]
    # a, b, c are within 3% of a (100); d is not (96 < 97) and starts its own band; at or under
    # zero nothing bands, so e keeps its place before f although f costs less.
    assert order == ["b", "a", "c", "d", "e", "f"]


def test_a_converter_that_fails_every_format_the_same_way_stops_the_study(source, tmp_path):
    # The case: the converter did not know the tokenizer, every format needs its F16, and
    # 217 trials failed with one message before the study ended with exit 0.
    from autotune.study.prepare import prepare_study
    from autotune.study.runner import StudyRunner
    from tests.conftest import plugin_registered

    class UnknownTokenizer(MakingBackend):
        def artifact_recipe(self, fmt, source, ctx):
            recipe = super().artifact_recipe(fmt, source, ctx)
            if recipe is None or fmt != "gguf:F16":
                return recipe

            def make(inputs, out, say):
                self.made.append(fmt)
                raise AutotuneError(
                    "convert_hf_to_gguf.py exited with code 1: NotImplementedError: BPE "
                    "pre-tokenizer was not recognized"
                )

            return dataclasses.replace(recipe, make=make)

    backend = UnknownTokenizer()
    doc = {
        "study": {"name": "made", "sampler": "grid", "finish_top": 0},
        "hardware": {"gpu": "t4"},
        "model": {"source": str(source), "ref": "qwen2.5-7b"},
        "workload": {"prompt_tokens": 8, "output_tokens": 8},
        "candidates": [
            {"backend": "maker", "weights": ["gguf:Q8_0", "gguf:Q6_K", "gguf:Q4_0", "gguf:Q3_K_M", "gguf:Q2_K"]}
        ],
        "space": {"ctx": [256], "parallel": [1, 2, 4]},
    }
    with plugin_registered(plugin_of(backend), "maker-plugin"):
        cfg = parse_study_config(doc, source="made.toml", path=tmp_path / "made.toml")
        runner = StudyRunner(prepare_study(cfg, storage=f"sqlite:///{tmp_path / 'made.db'}"))
        summary = runner.run(n_trials=15)
    failed = [t for t in runner.study.get_trials() if t.state == optuna.trial.TrialState.FAIL]
    assert len(failed) == 3 and backend.made == ["gguf:F16"]  # of 15 configurations; the converter ran once
    stop = summary.extra["systematic_failure"]
    assert stop["scope"] == "maker: making weights" and "BPE pre-tokenizer was not recognized" in stop["cause"]
    assert summary.extra["stopped"].startswith("stopped: maker: making weights: 3 failures in a row")


def test_a_making_whose_dry_run_fails_stops_the_study_before_its_first_trial(source, tmp_path):
    # Issue 28 item 4: what can be checked before the first trial is. The converter's dry run
    # (llama.cpp: --vocab-only) fails as every making would; the study is refused, exit 2, with
    # the cause and the candidate, and nothing is made or launched. Once the F16 is in the
    # cache no conversion will run, and neither does its check.
    from autotune.study.prepare import prepare_study
    from tests.conftest import plugin_registered

    checked: list[str] = []

    class UnknownTokenizer(MakingBackend):
        def artifact_recipe(self, fmt, source, ctx):
            recipe = super().artifact_recipe(fmt, source, ctx)
            if recipe is None or fmt != "gguf:F16":
                return recipe

            def check():
                checked.append(fmt)
                return "convert_hf_to_gguf.py failed: BPE pre-tokenizer was not recognized: use a newer converter"

            return dataclasses.replace(recipe, check=check)

    backend = UnknownTokenizer()
    doc = {
        "study": {"name": "made"},
        "hardware": {"gpu": "t4"},
        "model": {"source": str(source), "ref": "qwen2.5-7b"},
        "workload": {"prompt_tokens": 8, "output_tokens": 8},
        "candidates": [{"backend": "maker", "weights": ["gguf:Q8_0", "gguf:Q4_0", "gguf:F16"]}],
        "space": {"ctx": [256], "parallel": [1]},
    }
    with plugin_registered(plugin_of(backend), "maker-plugin"):
        cfg = parse_study_config(doc, source="made.toml", path=tmp_path / "made.toml")
        with pytest.raises(ConfigError) as raised:
            prepare_study(cfg, storage=f"sqlite:///{tmp_path / 'made.db'}")
        assert checked == ["gguf:F16"]  # three formats need it; its dry run ran once
        assert backend.made == [] and backend.loaded == []
        assert (
            "made.toml: [candidates.0] backend = 'maker': making gguf:F16 (maker F16) would fail: "
            "convert_hf_to_gguf.py failed: BPE pre-tokenizer was not recognized: use a newer converter"
        ) in str(raised.value)
        assert prepare_study(cfg, storage=f"sqlite:///{tmp_path / 'made.db'}", dry_runs=False).contexts

        artifacts.ensure(MakingBackend(), "gguf:F16", prepare_study(cfg, dry_runs=False).contexts["maker"])
        checked.clear()
        prepare_study(cfg, storage=f"sqlite:///{tmp_path / 'made.db'}")  # the F16 is made: nothing to check
        assert checked == []
