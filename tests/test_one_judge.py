"""One judge of "can it run / does it fit" (autotune/study/admission.py): `autotune init`, `autotune
estimate` and the study (its pre-search screen, its judge, its report's "why not a neighbour") give
the same verdict and the same GiB for the same configuration, before anything is measured and
after the study has learned a memory correction from a measured peak."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from click.testing import CliRunner

from autotune import hookimpl
from autotune.modelfiles.artifacts import Recipe
from autotune.engine.backend import BaseBackend, Measurement, MemoryEstimate, Param, StudyContext, TrialConfig
from autotune.cli import cli
from autotune.config import load_study_config
from autotune.engine.formats import weights_for
from autotune.study.explain import explain_best
from autotune.study import StudyRunner, judge_for, prepare_study, run_study
from autotune.study_writer import draft_study, render
from autotune_plugins.llama_server.declarations import GGUF
from autotune.engine.parts import part
from tests.fake_backends import ForwardingArtifacts
from tests.conftest import plugin_registered
from tests.fake_backends import GIB, stats_for

HUNGER = 8 * GIB  # what the engine holds beyond its backend's prediction (an unknown CUDA context, say)
KV_PER_TOKEN = {"f16": 56 * 1024, "q8_0": 56 * 1024 * 34 // 64}  # Qwen2.5-7B: 28 layers x 4 KV heads x 128


class Judged(BaseBackend):
    """Makes gguf formats (the made file holds the format's name, which it reads back), and uses
    HUNGER more than it predicts."""

    artifacts = part(ForwardingArtifacts)

    name = "fake-judged"
    engine = "judged-engine"
    weight_formats = (GGUF,)

    def artifact_recipe(self, fmt: str, source: Path, ctx: StudyContext) -> Recipe | None:
        if not fmt.startswith("gguf:"):
            return None

        def make(inputs: list[Path], out: Path, say: Callable[[str], None]) -> None:
            out.write_text(fmt)

        return Recipe(fmt, "maker-1", fmt.split(":")[1] + ".gguf", 1, make)

    def _format(self, weights: str, ctx: StudyContext) -> str:
        return weights if weights.startswith("gguf:") else ctx.path(weights).read_text()

    def check_weights(self, weights: str, ctx: StudyContext) -> str | None:
        return None if weights.startswith("gguf:") or ctx.path(weights).is_file() else f"{weights}: no such file"

    def parameters(self, space: Mapping[str, Sequence[Any]]) -> list[Param]:
        return [Param("cache_type", tuple(space.get("cache_type", ("f16", "q8_0"))), "cache", accepted=("f16", "q8_0"))]

    def estimate_memory(self, config: TrialConfig, ctx: StudyContext) -> MemoryEstimate:
        cache = dict(config.options).get("cache_type", "f16")
        return MemoryEstimate(
            weights_for(ctx.model, self._format(config.weights, ctx)).total_bytes,
            config.ctx * config.parallel * KV_PER_TOKEN[cache],
            GIB,
            0,
        )

    def run(self, config: TrialConfig, ctx: StudyContext) -> Measurement:
        peak = self.estimate_memory(config, ctx).total_bytes + HUNGER
        return Measurement(metrics=stats_for(10.0 * config.parallel, config.parallel), peak_vram_bytes=peak)

    def deploy_command(self, config: TrialConfig, ctx: StudyContext) -> str:
        return "serve"


class Plugin:
    @staticmethod
    @hookimpl
    def register_backends(register):
        register(Judged())


def _estimate(*args: str) -> dict[str, Any]:
    result = CliRunner().invoke(cli, ["estimate", "--backend", "fake-judged", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_init_estimate_and_the_study_give_one_verdict_and_the_same_gib(seven_b, tmp_path):
    storage = f"sqlite:///{tmp_path / 'judged.db'}"
    f16_file, q8_file = tmp_path / "F16.gguf", tmp_path / "Q8_0.gguf"
    f16_file.write_text("gguf:F16")
    q8_file.write_text("gguf:Q8_0")
    with plugin_registered(Plugin, "judged"):
        # init: F16 never fits a T4 (15.00 GiB less the 0.25 GiB default margin), even at its lightest.
        draft = draft_study(str(seven_b), gpu="t4", name="judged")
        assert draft.candidates["fake-judged"] == ["gguf:Q8_0", "gguf:Q6_K", "gguf:Q5_K_M", "gguf:Q4_K_M", "gguf:Q4_0"]
        (init_line,) = [why for why in draft.left_out if "gguf:F16" in why]
        out = tmp_path / "study.toml"
        text = render(draft, out)
        assert 'weights = ["gguf:Q8_0", ' in text
        # A user who lists F16 again: the study's pre-search screen drops it with init's figures.
        out.write_text(text.replace('weights = ["gguf:Q8_0", ', 'weights = ["gguf:F16", "gguf:Q8_0", '))
        prepared = prepare_study(load_study_config(out), storage=storage)
        budget = prepared.contexts["fake-judged"].vram_budget_bytes
        assert budget == 15 * GIB - 256 * 2**20

        # The screen's line is init's, and the study's judge has the same figures.
        (screen_line,) = [why for why in prepared.excluded if "gguf:F16" in why]
        assert init_line == f"{screen_line} = 15.00 GiB (Tesla T4's memory) - 0.25 GiB safety margin"
        lightest_f16 = TrialConfig("fake-judged", "gguf:F16", 2048, 1, (("cache_type", "q8_0"),))
        study_verdict = judge_for(prepared, None).judge(lightest_f16)
        assert study_verdict.kind == "over_budget"
        need = study_verdict.estimate.total_bytes
        assert f"needs {need / GIB:.2f} GiB" in screen_line and budget < need

        # estimate, of the made file, for the study's card, model and workload.
        before = _estimate(
            "--gpu",
            "t4",
            "--model",
            str(seven_b),
            "--weights",
            str(f16_file),
            "--ctx",
            "2048",
            "--cache",
            "q8_0",
            "--parallel",
            "1",
            "--prompt-tokens",
            "1024",
            "--output-tokens",
            "256",
        )
        assert before["verdict"] == "does not fit"
        assert before["vram"]["total_bytes"] == need and before["vram"]["budget_bytes"] == budget
        assert before["budget"]["safety_margin_bytes"] == 256 * 2**20

        # One measured trial teaches the study the engine's HUNGER ...
        best = TrialConfig("fake-judged", "gguf:Q4_K_M", 2048, 1, (("cache_type", "f16"),))
        StudyRunner(prepared).study.enqueue_trial(prepared.space.params_of(best))
        run_study(load_study_config(out), n_trials=1, storage=storage)
        prepared = prepare_study(load_study_config(out), storage=storage)
        runner = StudyRunner(prepared)

        # ... after which Q8_0, 8.65 GiB by the backend's model, needs 16.65 GiB: every judge says so.
        q8 = TrialConfig("fake-judged", "gguf:Q8_0", 2048, 1, (("cache_type", "f16"),))
        verdict = judge_for(prepared, runner.study).judge(q8)
        assert verdict.kind == "over_budget" and verdict.raw_total_bytes < budget
        need = verdict.estimate.total_bytes
        assert need == verdict.raw_total_bytes + HUNGER
        after = _estimate(
            "--study",
            "judged",
            "--storage",
            storage,
            "--model",
            str(seven_b),
            "--weights",
            str(q8_file),
            "--ctx",
            "2048",
            "--cache",
            "f16",
            "--parallel",
            "1",
        )
        assert after["verdict"] == "does not fit" and after["gpu"] == "t4"
        assert after["vram"]["total_bytes"] == need and after["vram"]["budget_bytes"] == budget
        assert after["vram"]["predicted_bytes"] == verdict.raw_total_bytes
        assert after["vram"]["correction_bytes"] == HUNGER and after["vram"]["correction_trials"] >= 1
        why = explain_best(prepared, runner.study, {"params": best.as_dict(), "values": [10.0]})
        assert [line for line in why if line.startswith("weights gguf:Q8_0:")] == [
            f"weights gguf:Q8_0: does not fit: needs {need / GIB:.2f} GiB > budget {budget / GIB:.2f} GiB"
        ]

        text = CliRunner().invoke(
            cli,
            [
                "estimate",
                "--backend",
                "fake-judged",
                "--study",
                "judged",
                "--storage",
                storage,
                "--model",
                str(seven_b),
                "--weights",
                str(q8_file),
                "--ctx",
                "2048",
                "--cache",
                "f16",
                "--parallel",
                "1",
            ],
        )
    assert text.exit_code == 0, text.output
    assert f"+ learned 8.00 = {need / GIB:.2f} GiB of budget {budget / GIB:.2f} GiB: DOES NOT FIT" in text.stdout
    assert "budget 14.75 GiB = 15.00 GiB (Tesla T4's memory, study 'judged') - 0.25 GiB safety margin" in text.stdout
