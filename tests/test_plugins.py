"""The plugin contract: each hook, the registry's rules, loading through entry points, and the
example plugin installed as a third party would install it.

Every hookspec needs a ``test_hook_<name>`` here (``test_every_hookspec_has_a_test``), as in
datasette's tests/test_plugins.py.
"""

from __future__ import annotations

from dataclasses import replace

import contextlib
import dataclasses
import importlib.util
import inspect
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import click
import optuna
import pytest
from click.testing import CliRunner

from autotune import hookimpl, hookspecs, plugins
from autotune.cli import cli as cli_group
from autotune.engine.backend import BaseBackend, Measurement, MemoryEstimate, Param, StudyContext, TrialConfig, Workload
from autotune.engine.backend_records import Setting
from autotune.errors import BackendError, PluginError, UnknownNameError
from autotune.hardware.gpus import get_gpu
from autotune.measure import Protocol, Stat
from autotune.engine.metric import BaseMetric, MetricValue
from autotune.modelfiles.models import get_model
from autotune.engine.strategy import BaseStrategy

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "autotune-example-plugin"


# ------------------------------------------------------------------------------------------
# Throwaway plugins
# ------------------------------------------------------------------------------------------


class ThrowawayBackend(BaseBackend):
    name = "throwaway"
    engine = "throwaway-engine"
    weight_families = ("gguf",)
    description = "a backend that only exists in tests"
    settings = (
        Setting("paged", (bool, str), "auto", "paged attention", choices=("auto", True, False)),
        Setting("extra", list, [], "more arguments"),
        Setting("binary", str, None, "the executable (absent: PATH)"),
    )

    def parameters(self, space):
        return [Param("mode", ("a",), "one mode")]

    def estimate_memory(self, config, ctx):
        return MemoryEstimate(1, 1, 1, 1)

    def run(self, config, ctx):
        return Measurement(
            metrics={k: Stat((1.0,), unit="tok/s") for k in ("decode_tok_s", "aggregate_tok_s", "per_user_tok_s")}
        )

    def deploy_command(self, config, ctx):
        return "true"


class ThrowawayMetric(BaseMetric):
    name = "throwaway-metric"
    description = "a metric that only exists in tests"

    def evaluate(self, config, backend, ctx):
        return MetricValue(value=0.5, n=2)


def cheapest(config: TrialConfig) -> tuple:
    return (config.ctx, config.parallel, config.key)


class SortedOrder(BaseStrategy):
    """Before each launch, the smallest configuration the study has not evaluated."""

    name = "throwaway-sorted"
    description = "a strategy that only exists in tests"
    takes_prior = False
    queues_each_launch = True

    def sampler(self, seed):
        return optuna.samplers.RandomSampler(seed=seed)

    def queue_next(self, search, n):
        done = search.evaluated_keys()
        todo = [c for c in search.configurations() if c.key not in done]
        if not todo:
            return False
        search.enqueue(min(todo, key=cheapest))
        return True


def strategies_plugin(*strategies: BaseStrategy) -> object:
    class Plugin:
        @hookimpl
        def register_strategies(self, register):
            for strategy in strategies:
                register(strategy)

    return Plugin()


def named_backend(name: str) -> BaseBackend:
    """An instance of ThrowawayBackend under another registry name."""
    return type("Named", (ThrowawayBackend,), {"name": name})()


@contextlib.contextmanager
def registered(plugin: object, name: str) -> Iterator[object]:
    """Register ``plugin`` for the block and unregister it even when the block fails."""
    plugins.register_plugin(plugin, name=name, source="throwaway-dist")
    try:
        yield plugin
    finally:
        plugins.unregister_plugin(name)


def backends_plugin(*backends: BaseBackend) -> object:
    class Plugin:
        @hookimpl
        def register_backends(self, register):
            for backend in backends:
                register(backend)

    return Plugin()


# ------------------------------------------------------------------------------------------
# One test per hook
# ------------------------------------------------------------------------------------------


def test_hook_register_backends():
    with registered(backends_plugin(ThrowawayBackend()), "throwaway-plugin"):
        backends = plugins.get_backends()
        assert isinstance(backends["throwaway"], ThrowawayBackend)
        assert plugins.get_backend("throwaway").name == "throwaway"
        assert {
            "name": "throwaway",
            "plugin": "throwaway-plugin",
            "distribution": "throwaway-dist",
            "description": "a backend that only exists in tests",
            "formats": [],
            "cache_types": [],
            # Its [backends.throwaway] keys, values as the study file writes them (TOML).
            "settings": [
                {
                    "name": "paged",
                    "accepted": 'one of "auto", true, false',
                    "default": "auto",
                    "help": "paged attention",
                },
                {"name": "extra", "accepted": "a list", "default": [], "help": "more arguments"},
                {"name": "binary", "accepted": "a string", "default": None, "help": "the executable (absent: PATH)"},
            ],
            # Its search dimensions, from parameters({}) (it declares no search_dimensions).
            "dimensions": [
                {"name": p.name, "accepted": list(p.accepted or p.choices), "doc": p.doc}
                for p in ThrowawayBackend().parameters({})
            ],
            "rules": [],
        } in plugins.describe()["backends"]
        text = CliRunner().invoke(cli_group, ["plugins"]).stdout
        listed = [line.strip() for line in text.splitlines() if "[backends.throwaway]" in line]
        assert listed == [
            '[backends.throwaway] paged = one of "auto", true, false, default "auto": paged attention',
            "[backends.throwaway] extra = a list, default []: more arguments",
            "[backends.throwaway] binary = a string: the executable (absent: PATH)",
        ]
    assert "throwaway" not in plugins.get_backends()


def test_hook_register_metrics():
    class Plugin:
        @hookimpl
        def register_metrics(self, register):
            register(ThrowawayMetric())

    with registered(Plugin(), "throwaway-metrics"):
        assert isinstance(plugins.get_metrics()["throwaway-metric"], ThrowawayMetric)
        assert plugins.get_metric("throwaway-metric").name == "throwaway-metric"
        found = plugins.describe()["metrics"]
        assert [m["plugin"] for m in found if m["name"] == "throwaway-metric"] == ["throwaway-metrics"]
    assert "throwaway-metric" not in plugins.get_metrics()


SORTED_TWIN_STUDY = """
[study]
name = "sorted-twin"
sampler = "throwaway-sorted"
finish_top = 0
baseline = false

[hardware]
gpu = "v100-16gb"
safety_margin_mib = 1792

[model]
ref = "qwen2.5-27b-article"

[workload]
prompt_tokens = 1500
output_tokens = 800

[[candidates]]
backend = "twin-llama.cpp"
weights = ["gguf:Q4_K_M", "gguf:Q2_K"]

[space]
ctx = [4096, 16384]
cache_type = ["f16", "q8_0"]
parallel = [1, 2, 16]
"""


def test_hook_register_strategies(twin_plugin, tmp_path):
    """A plugin's strategy is accepted as ``[study] sampler`` and drives a twin study: every
    launch is the one it queued."""
    from autotune.config import load_study_config
    from autotune.study import StudyRunner, prepare_study, records

    path = tmp_path / "sorted.toml"
    path.write_text(SORTED_TWIN_STUDY, encoding="utf-8")
    with registered(strategies_plugin(SortedOrder()), "throwaway-strategies"):
        assert isinstance(plugins.get_strategy("throwaway-sorted"), SortedOrder)
        assert {
            "name": "throwaway-sorted",
            "plugin": "throwaway-strategies",
            "distribution": "throwaway-dist",
            "description": "a strategy that only exists in tests",
        } in plugins.describe()["strategies"]
        prepared = prepare_study(load_study_config(path), storage=f"sqlite:///{tmp_path / 'sorted.db'}")
        runner = StudyRunner(prepared)
        assert not runner.uses_prior  # its own queue comes first
        summary = runner.run(n_trials=2)
        assert summary.n_measured == 2
        trials = records.records(runner.study)
        # Refused configurations are trials too (pruned): the trials are the strategy's order.
        assert [r.config_key for r in trials] == [c.key for c in sorted(prepared.space.enumerate(), key=cheapest)][
            : len(trials)
        ]
        assert len(trials) < 25  # no exploring configuration slipped in (EXPLORE_AFTER_IDLE)
        assert not any(r.from_prior or r.explore for r in trials)
    assert "throwaway-sorted" not in plugins.get_strategies()
    with pytest.raises(Exception, match=r"\[study\] sampler.*'throwaway-sorted'.*must be one of .*tpe.*twin"):
        load_study_config(path)


def test_hook_register_engine_models(example_module, twin_plugin, echo_ctx):
    """An engine model registered by a third-party plugin gets a twin from its declaration alone
    (nothing of the twin edited): the same space and rule as its real backend, its memory model,
    speed predicted from its constants, and a deploy line."""
    from autotune.engine.model import engine_model

    with registered(example_module, "example"):
        assert plugins.get_engine_models()["example-echo"] is example_module.ECHO
        assert engine_model("example-echo") is example_module.ECHO
        backend, twin = plugins.get_backend("example-echo"), plugins.get_backend("twin-example-echo")
        assert type(twin).__name__ == "TwinExampleEcho" and twin.engine == backend.engine == "example-echo"
        assert (
            [p.choices for p in twin.parameters({"cache_type": ("q8_0", "fp16")})]
            == [p.choices for p in backend.parameters({"cache_type": ("q8_0", "fp16")})]
            == [("q8_0",)]
        )
        config = TrialConfig("twin-example-echo", "gguf:Q4_K_M", 8192, 2, (("cache_type", "f16"),))
        assert (
            twin.check(config, echo_ctx)
            == backend.check(config, echo_ctx)
            == ["ctx 8192 is beyond llama-2-7b's trained context of 4096"]
        )
        config = replace(config, ctx=2048)
        assert twin.check(config, echo_ctx) == []
        mem = twin.estimate_memory(config, echo_ctx)
        assert mem.overhead_bytes == example_module.OVERHEAD_BYTES
        assert mem.kv_bytes == int(example_module.kv_bytes_per_token(echo_ctx.model, "f16") * 2048 * 2)
        faster = twin.predictor.predict(replace(config, weights="gguf:Q4_0"), echo_ctx)["decode_tok_s"]
        assert faster > twin.predictor.predict(replace(config, weights="gguf:Q8_0"), echo_ctx)["decode_tok_s"] > 0
        assert "example-echo-serve" in twin.deploy_command(config, echo_ctx)
    assert "twin-example-echo" not in plugins.get_backends()


def test_hook_register_commands():
    class Plugin:
        @hookimpl
        def register_commands(self, cli):
            @cli.command()
            @click.argument("who")
            def greet(who):
                """Say hello."""
                click.echo(f"hello {who}")

    @click.group()
    def cli():
        """A fresh group, so the real one keeps its commands."""

    with registered(Plugin(), "throwaway-commands"):
        plugins.add_commands(cli)
    result = CliRunner().invoke(cli, ["greet", "world"])
    assert result.exit_code == 0, result.output
    assert result.output == "hello world\n"
    assert "greet" in CliRunner().invoke(cli, ["--help"]).output


def hookspec_names() -> list[str]:
    """Every hook of the contract (pluggy marks each spec with ``autotune_spec``)."""
    return sorted(
        name for name, fn in inspect.getmembers(hookspecs, inspect.isfunction) if hasattr(fn, "autotune_spec")
    )


def test_every_hookspec_has_a_test():
    names = hookspec_names()
    assert names, "no hookspecs found in autotune.hookspecs"
    missing = [name for name in names if f"test_hook_{name}" not in globals()]
    assert not missing, f"hooks without a test_hook_<name> in {__file__}: {', '.join(missing)}"


# ------------------------------------------------------------------------------------------
# Registry rules
# ------------------------------------------------------------------------------------------


def test_duplicate_backend_name_names_both_plugins():
    with (
        registered(backends_plugin(named_backend("dup")), "first-plugin"),
        registered(backends_plugin(named_backend("dup")), "second-plugin"),
    ):
        with pytest.raises(PluginError) as err:
            plugins.get_backends()
    message = str(err.value)
    assert "backend name 'dup' is registered twice" in message
    assert "'first-plugin'" in message and "'second-plugin'" in message


def test_duplicate_strategy_name_names_both_plugins():
    with registered(strategies_plugin(SortedOrder()), "s-one"), registered(strategies_plugin(SortedOrder()), "s-two"):
        with pytest.raises(PluginError, match="strategy name 'throwaway-sorted' is registered twice") as err:
            plugins.get_strategies()
    assert "'s-one'" in str(err.value) and "'s-two'" in str(err.value)


def test_core_strategies_are_registered_without_autoload():
    """Tests turn autoload off, as ``AUTOTUNE_LOAD_PLUGINS=`` does: the core's strategies stay."""
    assert {"tpe", "prior", "random", "nsga2", "grid"} <= set(plugins.get_strategies())
    assert "twin" not in plugins.get_strategies()  # the twin plugin's, not the core's


def test_duplicate_metric_name_names_both_plugins():
    def metrics_plugin():
        class Plugin:
            @hookimpl
            def register_metrics(self, register):
                register(ThrowawayMetric())

        return Plugin()

    with registered(metrics_plugin(), "m-one"), registered(metrics_plugin(), "m-two"):
        with pytest.raises(PluginError, match="metric name 'throwaway-metric' is registered twice") as err:
            plugins.get_metrics()
    assert "'m-one'" in str(err.value) and "'m-two'" in str(err.value)


@pytest.mark.parametrize("obj", [named_backend(""), object()], ids=["empty-name", "no-name-attribute"])
def test_registering_without_a_name_raises(obj):
    with registered(backends_plugin(obj), "nameless-plugin"):
        with pytest.raises(PluginError, match="plugin 'nameless-plugin' registered a backend without a name"):
            plugins.get_backends()


def test_get_backend_of_unknown_name_lists_installed_ones():
    with registered(backends_plugin(named_backend("alpha"), named_backend("beta")), "two-backends"):
        with pytest.raises(UnknownNameError) as err:
            plugins.get_backend("gamma")
    assert str(err.value) == "backend 'gamma' is not installed (installed: alpha, beta)"


def test_get_backend_with_nothing_installed_says_none():
    with pytest.raises(UnknownNameError, match=r"backend 'gamma' is not installed \(installed: none\)"):
        plugins.get_backend("gamma")


def test_unregister_after_a_failing_block():
    with pytest.raises(RuntimeError):
        with registered(backends_plugin(ThrowawayBackend()), "leaky"):
            raise RuntimeError("the test failed")
    assert plugins.pm.get_plugin("leaky") is None
    assert "throwaway" not in plugins.get_backends()


# ------------------------------------------------------------------------------------------
# Real entry points, in subprocesses (autoload is on there)
# ------------------------------------------------------------------------------------------


def autotune_cli(
    *args: str, env: dict[str, str] | None = None, input: str | None = None, timeout: float = 300
) -> subprocess.CompletedProcess:
    """``python -m autotune.cli ARGS`` in a fresh interpreter, from the repository root."""
    return subprocess.run(
        [sys.executable, "-m", "autotune.cli", *args],
        cwd=REPO,
        env=env,
        input=input,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("AUTOTUNE_LOAD_PLUGINS", "AUTOTUNE_TRACE_PLUGINS")}
    env.update(extra)
    return env


def plugins_json(env: dict[str, str]) -> dict:
    result = autotune_cli("plugins", "--json", env=env)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_a_broken_register_commands_is_reported_and_the_cli_works():
    class Broken:
        @hookimpl
        def register_commands(self, cli):
            @cli.command()
            def half():
                """Added before the plugin raised: must not stay."""

            raise RuntimeError("boom in register_commands")

    class Fine:
        @hookimpl
        def register_commands(self, cli):
            @cli.command()
            def fine():
                """Still registered."""
                click.echo("fine")

    @click.group()
    def cli():
        """A fresh group, so the real one keeps its commands."""

    @cli.command()
    def own():
        """The group's own command."""
        click.echo("own")

    with registered(Broken(), "throwaway-broken-commands"), registered(Fine(), "throwaway-fine-commands"):
        plugins.add_commands(cli)  # raised RuntimeError through pluggy's single hook call
        broken = plugins.broken_plugins()
    assert {
        "plugin": "throwaway-broken-commands",
        "hook": "register_commands",
        "error": "RuntimeError: boom in register_commands",
    } in broken
    assert set(cli.commands) == {"own", "fine"}
    assert CliRunner().invoke(cli, ["own"]).output == "own\n"
    assert CliRunner().invoke(cli, ["fine"]).output == "fine\n"


def test_load_plugins_allow_list():
    everything = plugins_json(clean_env())
    twin = [b for b in everything["backends"] if b["name"] == "twin-exllamav2"]
    assert len(twin) == 1, everything
    assert (twin[0]["plugin"], twin[0]["distribution"]) == ("twin", "autotune")

    nothing = plugins_json(clean_env(AUTOTUNE_LOAD_PLUGINS=""))
    assert {k: v for k, v in nothing.items() if k != "strategies"} == {"backends": [], "metrics": [], "broken": []}
    assert {s["plugin"] for s in nothing["strategies"]} == {"autotune"}  # the core's own, always there
    assert {s["name"]: s["plugin"] for s in everything["strategies"]}["twin"] == "twin"

    only_twin = plugins_json(clean_env(AUTOTUNE_LOAD_PLUGINS="twin"))
    assert {b["plugin"] for b in only_twin["backends"]} == {"twin"}
    assert "twin-exllamav2" in {b["name"] for b in only_twin["backends"]}


def test_trace_plugins_logs_hook_calls():
    result = autotune_cli("plugins", env=clean_env(AUTOTUNE_TRACE_PLUGINS="1", AUTOTUNE_LOAD_PLUGINS="twin"))
    assert result.returncode == 0, result.stderr
    assert "autotune trace: register_commands(" in result.stderr
    assert "autotune trace: register_backends of plugin 'twin' registered ['twin-exllamav2'" in result.stderr


# ------------------------------------------------------------------------------------------
# The example plugin
# ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def example_site(tmp_path_factory) -> Path:
    """The example plugin installed with pip into a directory of its own, offline.

    Built from a copy so that setuptools' build/ and egg-info land outside the repository.
    """
    root = tmp_path_factory.mktemp("example-plugin")
    source = root / "src"
    shutil.copytree(EXAMPLE, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    site = root / "site"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--target",
            str(site),
            str(source),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, (
        "could not build the example plugin offline (it needs setuptools >= 70.1, or an older one "
        f"plus the wheel package, in this environment):\n{result.stdout}\n{result.stderr}"
    )
    return site


def with_site(site: Path, **extra: str) -> dict[str, str]:
    env = clean_env(**extra)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), env.get("PYTHONPATH", "")) if p)
    return env


def test_example_plugin_installs_as_a_third_party_plugin(example_site):
    found = plugins_json(with_site(example_site))
    echo = [b for b in found["backends"] if b["name"] == "example-echo"]
    assert len(echo) == 1, found
    assert echo[0]["plugin"] == "example"
    assert echo[0]["distribution"] == "autotune-example-plugin"
    # The allow-list takes entry-point names: the example alone, without the twin.
    alone = plugins_json(with_site(example_site, AUTOTUNE_LOAD_PLUGINS="example"))
    assert [b["name"] for b in alone["backends"]] == ["example-echo"]


STUDY = """
[study]
name = "echo-t4"
seed = 3
sampler = "random"

[hardware]
gpu = "t4"

[model]
ref = "llama-2-7b"

[workload]
prompt_tokens = 64
output_tokens = 16

[measure]
warmup_runs = 1
min_runs = 2
max_runs = 4

[[candidates]]
backend = "example-echo"
weights = ["gguf:Q8_0", "gguf:Q4_K_M", "gguf:Q2_K"]

[space]
ctx = [256, 2048, 8192]
parallel = [1, 2, 4]
cache_type = ["f16", "q8_0"]

[backends.example-echo]
scale = 65536
"""


def test_example_plugin_runs_a_real_study(example_site, tmp_path):
    study_file = tmp_path / "echo.toml"
    study_file.write_text(STUDY, encoding="utf-8")
    storage = f"sqlite:///{tmp_path / 'echo.db'}"
    env = with_site(example_site, AUTOTUNE_LOAD_PLUGINS="example")
    result = autotune_cli("study", str(study_file), "--trials", "4", "--storage", storage, "--json", "--quiet", env=env)
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["n_complete"] > 0, summary
    assert summary["n_measured"] == 4
    best = summary["best"]
    assert best["params"]["backend"] == "example-echo"
    for metric in ("decode_tok_s", "aggregate_tok_s", "per_user_tok_s", "prefill_tok_s", "ttft_ms"):
        assert best["metrics"][metric] > 0, best["metrics"]
    assert best["params"]["ctx"] <= 4096  # the example's check: llama-2-7b was trained for 4096
    assert best["predicted_vram"]["total_bytes"] <= get_gpu("t4").vram_bytes
    assert best["engine"]["version"].startswith("example-echo 0.1.0")

    # The deploy command is a command the plugin registered: run it, as a user would.
    command = shlex.split(best["deploy_command"])
    assert command[:2] == ["autotune", "example-echo-serve"]
    served = autotune_cli(*command[1:], "--max-tokens", "5", env=env, input="the quick brown fox\njumps\n")
    assert served.returncode == 0, served.stderr
    lines = served.stdout.splitlines()
    assert len(lines) == 2
    assert len(lines[0].split()) == 5 and set(lines[0].split()) <= {"the", "quick", "brown", "fox"}
    assert lines[1].split() == ["jumps"] * 5


# In-process checks of the example backend's rules, without installing it.


@pytest.fixture(scope="module")
def example_module():
    spec = importlib.util.spec_from_file_location("autotune_example_plugin", EXAMPLE / "autotune_example_plugin.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def echo_ctx() -> StudyContext:
    gpu = get_gpu("t4")
    return StudyContext(
        gpu=gpu,
        model=get_model("llama-2-7b"),
        workload=Workload(32, 8),
        vram_budget_bytes=gpu.vram_bytes - 256 * 2**20,
        protocol=Protocol(warmup_runs=0, min_runs=1, max_runs=2),
        settings={"scale": 65536},
    )


def echo_config(weights="gguf:Q4_K_M", ctx=2048, parallel=2, cache_type="f16") -> TrialConfig:
    return TrialConfig("example-echo", weights, ctx, parallel, (("cache_type", cache_type),))


def test_example_backend_rules(example_module, echo_ctx):
    with registered(example_module, "example"):
        backend = plugins.get_backend("example-echo")
    assert [p.choices for p in backend.parameters({"cache_type": ("q8_0", "fp16")})] == [("q8_0",)]
    assert [p.choices for p in backend.parameters({})] == [("f16", "q8_0")]
    assert backend.check_weights("gguf:Q4_K_M", echo_ctx) is None
    assert "not exl2" in backend.check_weights("exl2:4.0", echo_ctx)
    assert backend.check(echo_config(ctx=4096), echo_ctx) == []
    assert backend.check(echo_config(ctx=8192), echo_ctx) == ["ctx 8192 is beyond llama-2-7b's trained context of 4096"]

    def total(**kw) -> int:
        return backend.estimate_memory(echo_config(**kw), echo_ctx).total_bytes

    assert total(parallel=4) > total(parallel=2)
    assert total(ctx=4096) > total(ctx=2048)
    assert total(cache_type="q8_0") < total()
    assert total(weights="gguf:Q8_0") > total()
    mem = backend.estimate_memory(echo_config(), echo_ctx)
    assert mem.kv_bytes == 2 * 32 * 32 * 128 * 2 * 2048 * 2  # K+V x layers x kv heads x head dim x f16 x tokens
    assert "autotune example-echo-serve" in backend.deploy_command(echo_config(), echo_ctx)


def test_example_backend_measures_and_fails_as_a_backend(example_module, echo_ctx):
    backend = example_module.EchoBackend()
    measured = backend.run(echo_config(), echo_ctx)
    assert {"decode_tok_s", "aggregate_tok_s", "per_user_tok_s", "prefill_tok_s", "ttft_ms"} <= set(measured.metrics)
    assert all(stat.n >= 1 and stat.median > 0 for stat in measured.metrics.values())

    # 1/256 of the model hashes ~14 MB per token: the streams cannot finish in a millisecond.
    hurried = dataclasses.replace(echo_ctx, settings={"scale": 256, "timeout_s": 0.001})
    with pytest.raises(BackendError, match="^example-echo: ") as err:
        backend.run(echo_config(parallel=2), hurried)
    assert "loaded" in err.value.log_tail
