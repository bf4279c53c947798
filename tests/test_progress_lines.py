"""What a study prints while it runs: a header, one line per trial with every searched value,
artifact lines once each, and why the search ended."""

from __future__ import annotations

import io
from types import SimpleNamespace

from click.testing import CliRunner
from rich.console import Console

from autotune.cli import cli
from autotune.report.progress import LiveProgress, config_text
from autotune.study.trial_phase import RunState, TrialPhase

if __package__:
    from .fake_backends import FakeBackend, registered, write_study
else:
    from fake_backends import FakeBackend, registered, write_study


def test_two_configurations_that_differ_in_any_value_print_different_lines():
    base = {"backend": "llama-server", "weights": "gguf:Q4_K_M", "ctx": 4096, "parallel": 2}
    variants = [
        dict(base, cache_type="f16", flash_attn=True),
        dict(base, cache_type="q8_0", flash_attn=True),
        dict(base, cache_type="q8_0", flash_attn=False),
        dict(base, cache_type="q8_0", flash_attn=False, gpu_layers=20),
        dict(base, cache_type="q8_0", flash_attn=False, gpu_layers=20, n_cpu_moe=4, ubatch=256, batch=1024),
    ]
    lines = [config_text(v) for v in variants]
    assert len(set(lines)) == len(lines)
    assert lines[-1] == (
        "llama-server gguf:Q4_K_M ctx 4096 x2 cache_type=q8_0 flash_attn=off gpu_layers=20 "
        "n_cpu_moe=4 ubatch=256 batch=1024"
    )
    progress = LiveProgress(enabled=False, n_trials=None, budget_s=None)
    progress.console = Console(file=(out := io.StringIO()), width=400)
    progress.update(
        SimpleNamespace(state="COMPLETE", answered_from=None, number=3, config=variants[1], value=12.5, reason=None)
    )
    assert (
        out.getvalue().strip() == "trial 3: llama-server gguf:Q4_K_M ctx 4096 x2 cache_type=q8_0 flash_attn=on -> 12.5"
    )


def test_an_artifact_line_is_said_once_per_run():
    said: list[str] = []
    phase = TrialPhase(
        SimpleNamespace(cfg=None), None, SimpleNamespace(quality=None), None, "", RunState(), said.append, lambda: None
    )
    for _ in range(3):
        phase._say_artifact("artifact gguf:Q4_0: cache hit, /cache/x.gguf")
    phase._say_artifact("artifact gguf:Q8_0: cache hit, /cache/y.gguf")
    assert said == ["artifact gguf:Q4_0: cache hit, /cache/x.gguf", "artifact gguf:Q8_0: cache hit, /cache/y.gguf"]


def test_a_run_starts_with_a_header_and_ends_with_why_it_stopped(tmp_path, tmp_storage):
    path = write_study(tmp_path / "s.toml", "fake", ["a"], parallel=(1, 2))
    with registered(FakeBackend()):
        result = CliRunner().invoke(cli, ["study", str(path), "--storage", tmp_storage, "--trials", "2"])
    assert result.exit_code == 0, result.output
    first = result.output.splitlines()[0]
    assert first.startswith(f"study {path} -> {tmp_storage}; engines: fake (") and "card: Tesla V100" in first
    assert first.endswith("; this run: up to 2 trials")
    assert "why the search ended: 2 trials measured, as asked" in result.output
