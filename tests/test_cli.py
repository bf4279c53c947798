"""The command line: end-to-end runs of the default study, best, estimate, dashboard, exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

from autotune import hookimpl, plugins
from autotune.cli import cli

if __package__:  # tests/ is a package
    from .fake_backends import memory_dir
else:
    from fake_backends import memory_dir

SEEDS = (0, 1, 2, 3, 4)
# The article's row 5 (seed/ARTICLE.md): ExLlamaV2 at 3.3 bpw, Q8 cache, 4 streams of 4096 tokens, what
# the README's estimate asks about.
ARTICLE_ROW5 = {
    "backend": "twin-exllamav2",
    "weights": "exl2:3.3",
    "ctx": 4096,
    "cache_type": "q8",
    "flash_attn": True,
    "parallel": 4,
}
SUMMARY_KEYS = {"study", "storage", "n_trials", "n_complete", "n_failed", "n_pruned", "best"}
BEST_KEYS = {"params", "values", "metrics", "deploy_command"}


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("AUTOTUNE_LOAD_PLUGINS", None)  # the installed twin must autoload, as for a user
    return env


def _autotune(*args: str) -> list[str]:
    return [sys.executable, "-c", "from autotune.cli import main; main()", *args]


@pytest.fixture(scope="module")
def seed_runs(tmp_path_factory):
    """`autotune study --json --seed N` with no CONFIG, one child per seed, all at once."""
    cwd = tmp_path_factory.mktemp("seeds")
    scratch = memory_dir(tmp_path_factory.mktemp("storages"))
    store_dir = next(scratch)
    procs = {}
    try:
        for seed in SEEDS:
            storage = f"sqlite:///{store_dir / f'seed{seed}.db'}"
            procs[seed] = (
                storage,
                subprocess.Popen(
                    _autotune("study", "--storage", storage, "--json", "--quiet", "--seed", str(seed)),
                    cwd=cwd,
                    env=_env(),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                ),
            )
        runs = {}
        for seed, (storage, proc) in procs.items():
            out, err = proc.communicate(timeout=300)
            runs[seed] = {"rc": proc.returncode, "out": out, "err": err, "storage": storage}
        # The storage was given: nothing lands in the working directory.
        assert list(cwd.iterdir()) == []
        yield runs
    finally:
        for _, proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        scratch.close()


@pytest.mark.parametrize("seed", SEEDS)
def test_default_study_finds_the_article_configuration(seed_runs, seed):
    run = seed_runs[seed]
    assert run["rc"] == 0, run["err"]
    report = json.loads(run["out"])
    assert SUMMARY_KEYS <= set(report)
    assert report["study"] == "v100-qwen27b"
    assert report["storage"] == run["storage"]
    assert (
        report["n_trials"]
        == report["n_complete"] + report["n_failed"] + report["n_pruned"] + report["n_answered_from_storage"]
    )
    assert report["n_complete"] > 0 and report["n_failed"] == 0
    best = report["best"]
    assert BEST_KEYS <= set(best)
    # Issue 36: the article's optimum for every seed, in the mode that delivers it on the V100
    # (batched forward passes), with the twin's figures inside the article's ranges.
    assert best["params"] == ARTICLE_ROW5
    metrics = best["metrics"]
    assert 60.0 <= metrics["aggregate_tok_s"] <= 64.0  # row 5: 60-64 at 4 streams
    assert 38.0 <= metrics["decode_tok_s"] <= 42.0  # row 4: 38-42 single-stream
    assert metrics["aggregate_tok_s"] >= best["values"][0]  # the score is throughput minus a penalty
    assert metrics["per_user_tok_s"] >= 15.0  # the study's floor
    line = best["deploy_command"]
    assert "ExLlamaV2Cache(batch_size=4, max_seq_len=4096), cache mode Q8" in line and "exl2-3.3bpw" in line
    # ...and what the one server there is would give instead, in the same line.
    assert (
        f"TabbyAPI would take them one at a time, {metrics['decode_tok_s']:.1f} tok/s for the user being served" in line
    )


def test_best_reads_the_same_storage_and_agrees(twin_plugin, seed_runs):
    run = seed_runs[0]
    study_report = json.loads(run["out"])
    result = CliRunner().invoke(cli, ["best", "--storage", run["storage"], "--json"])
    assert result.exit_code == 0, result.output
    best_report = json.loads(result.stdout)
    assert best_report["best"] == study_report["best"]
    for key in ("study", "storage", "n_trials", "n_complete", "n_failed", "n_pruned"):
        assert best_report[key] == study_report[key], key
    text = CliRunner().invoke(cli, ["best", "--storage", run["storage"]])
    assert text.exit_code == 0
    assert "best (trial" in text.stdout and "weights=exl2:3.3" in text.stdout
    assert study_report["best"]["deploy_command"] in text.stdout
    # The twin's quality says what it is (issue 28: "twin-mmlu 0.9844, +0.94 points"): a share of
    # FP16's accuracy, and a drop as a drop.
    q = study_report["best"]["quality"]
    assert (
        f"  quality: predicted MMLU accuracy {q['value']:.2%} of FP16's, drop {q['drop_points']:.2f} points vs "
        f"{q['reference_weights']}\n"
    ) in text.stdout


def test_best_names_the_study_it_cannot_find(seed_runs):
    result = CliRunner().invoke(cli, ["best", "--storage", seed_runs[0]["storage"], "--study", "other", "--json"])
    assert result.exit_code == 2
    assert "--study 'other'" in result.stderr and "v100-qwen27b" in result.stderr


def test_estimate_json(twin_plugin, seed_runs):
    params = json.loads(seed_runs[0]["out"])["best"]["params"]
    result = CliRunner().invoke(
        cli,
        [
            "estimate",
            "--gpu",
            "v100-16gb",
            "--model",
            "qwen2.5-27b-article",
            "--backend",
            "exllamav2",
            "--weights",
            "exl2:3.3",
            "--ctx",
            "4096",
            "--cache",
            params["cache_type"],
            "--flash-attn",
            "--parallel",
            str(params["parallel"]),
            "--setting",
            "unpaged_parallel=batched",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    vram = report["vram"]
    assert {
        "weights_bytes",
        "kv_bytes",
        "buffers_bytes",
        "overhead_bytes",
        "total_bytes",
        "budget_bytes",
        "fits",
    } <= set(vram)
    assert (
        vram["total_bytes"] == vram["weights_bytes"] + vram["kv_bytes"] + vram["buffers_bytes"] + vram["overhead_bytes"]
    )
    assert vram["fits"] is True and vram["total_bytes"] <= vram["budget_bytes"]
    predicted = report["predicted"]
    assert {"decode_tok_s", "prefill_tok_s", "aggregate_tok_s", "per_user_tok_s", "roofline_tok_s"} <= set(predicted)
    assert predicted["roofline_tok_s"] > predicted["decode_tok_s"] > 0
    # The estimate and the study agree about the same configuration.
    best = json.loads(seed_runs[0]["out"])["best"]
    assert best["predicted_vram"]["total_bytes"] == vram["total_bytes"]
    assert predicted["aggregate_tok_s"] == pytest.approx(best["metrics"]["aggregate_tok_s"])
    assert report["config"] == best["params"]
    assert report["predictor"] == "twin-exllamav2"


def test_estimate_unknown_backend_lists_the_installed_ones(twin_plugin):
    result = CliRunner().invoke(
        cli,
        [
            "estimate",
            "--gpu",
            "v100-16gb",
            "--model",
            "qwen2.5-27b-article",
            "--backend",
            "exllama",
            "--weights",
            "exl2:3.3",
            "--ctx",
            "4096",
        ],
    )
    assert result.exit_code == 2
    assert "--backend 'exllama'" in result.stderr and "twin-exllamav2" in result.stderr
    assert "engines: exllamav2, exllamav3, llama.cpp, vllm" in result.stderr


README_ESTIMATE = [
    "estimate",
    "--gpu",
    "v100-16gb",
    "--model",
    "qwen2.5-27b-article",
    "--backend",
    "exllamav2",
    "--weights",
    "exl2:3.3",
    "--ctx",
    "4096",
    "--cache",
    "q8",
    "--flash-attn",
    "--parallel",
    "4",
]


def test_readme_estimate_reaches_the_twin_although_the_real_exllamav2_is_installed(twin_plugin):
    import autotune_plugins.exllamav2 as exllamav2

    plugins.register_plugin(exllamav2, name="exllamav2")
    try:
        result = CliRunner().invoke(cli, [*README_ESTIMATE, "--json"])
        text = CliRunner().invoke(cli, README_ESTIMATE)
    finally:
        plugins.unregister_plugin("exllamav2")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["config"] == ARTICLE_ROW5 and report["verdict"] == "fits"
    assert report["resolved"] == (
        "--backend exllamav2 with a format as weights: estimated by twin-exllamav2, the engine's digital twin"
    )
    assert text.exit_code == 0 and "estimated by twin-exllamav2" in text.stdout and ": fits" in text.stdout


def test_estimate_takes_a_backend_setting_and_names_what_is_accepted(twin_plugin):
    # The study file's [backends.twin-exllamav2] unpaged_parallel = "batched": the article's 4 streams.
    queued = json.loads(CliRunner().invoke(cli, [*README_ESTIMATE, "--json"]).stdout)["predicted"]
    batched = CliRunner().invoke(cli, [*README_ESTIMATE, "--setting", "unpaged_parallel=batched", "--json"])
    assert batched.exit_code == 0, batched.output
    assert json.loads(batched.stdout)["predicted"]["aggregate_tok_s"] > 1.5 * queued["aggregate_tok_s"]
    for bad, why in (
        ("unpaged=batched", "unpaged: unknown setting (accepted: "),
        ("unpaged_parallel=serial", "unpaged_parallel = 'serial': "),
        ("batched", "write NAME=VALUE"),
    ):
        result = CliRunner().invoke(cli, [*README_ESTIMATE, "--setting", bad])
        assert result.exit_code == 2 and "--setting" in result.stderr and why in result.stderr, result.output


def test_estimate_help_states_how_backend_names_resolve():
    result = CliRunner().invoke(cli, ["estimate", "--help"])
    assert result.exit_code == 0
    flat = " ".join(result.stdout.split())
    assert "an engine name (llama.cpp, exllamav2, vllm): either picks the engine" in flat
    assert "format (gguf:Q4_K_M, exl2:3.3) are estimated by that engine's digital twin" in flat
    assert "Exit status 2, after the estimate, when the configuration is invalid" in flat


def test_estimate_invalid_configuration_is_not_said_to_fit(twin_plugin):
    args = [
        "estimate",
        "--gpu",
        "a100-80gb",
        "--model",
        "qwen2.5-7b",
        "--backend",
        "llama.cpp",
        "--weights",
        "gguf:Q4_K_M",
        "--ctx",
        "40000",
    ]
    text = CliRunner().invoke(cli, args)
    assert text.exit_code == 2
    assert "fits" not in text.stdout.replace("would fit", "")  # memory alone may fit; the verdict is not "fits"
    assert "INVALID, the engine would not run it: ctx 40000 exceeds the model's context length 32768" in text.stdout
    assert text.stderr.strip() == "Error: invalid configuration: ctx 40000 exceeds the model's context length 32768"
    as_json = CliRunner().invoke(cli, [*args, "--json"])
    assert as_json.exit_code == 2
    report = json.loads(as_json.stdout)
    assert report["verdict"] == "invalid" and report["predicted"] is None
    assert report["invalid"] == ["ctx 40000 exceeds the model's context length 32768"]


def test_estimate_engine_refusal_exits_2(twin_plugin):
    result = CliRunner().invoke(
        cli,
        [
            "estimate",
            "--gpu",
            "v100-16gb",
            "--model",
            "qwen2.5-7b",
            "--backend",
            "vllm",
            "--weights",
            "gguf:Q4_K_M",
            "--ctx",
            "4096",
            "--cache",
            "auto",
        ],
    )
    assert result.exit_code == 2
    assert "REFUSED by the engine: vLLM" in result.stdout
    assert result.stderr.startswith("Error: the engine refuses this configuration: vLLM")


def test_estimate_missing_model_file_says_the_file_does_not_exist(twin_plugin):
    result = CliRunner().invoke(
        cli, ["estimate", "--gpu", "t4", "--model", "path/to/model.gguf", "--backend", "llama.cpp", "--ctx", "4096"]
    )
    assert result.exit_code == 2
    assert result.stderr.startswith(
        "Error: --model path/to/model.gguf: no such file or directory (nor a catalog model; "
        "the catalog has: qwen2.5-27b-article, "
    )
    assert "catalog key, not a file" not in result.output


def test_estimate_missing_weights_file_says_where_it_looked(twin_plugin, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(
        cli,
        [
            "estimate",
            "--gpu",
            "t4",
            "--model",
            "qwen2.5-7b",
            "--backend",
            "llama.cpp",
            "--weights",
            "q7b-Q4_K_M.gguf",
            "--ctx",
            "4096",
        ],
    )
    assert result.exit_code == 2
    assert (
        f"--weights 'q7b-Q4_K_M.gguf': no such file or directory (relative to the current directory {tmp_path})"
        in result.stderr
    )
    assert "study file" not in result.stderr


# `autotune dashboard` serving a study: tests/test_readme_usage.py runs it as the README types it.


# ------------------------------------------------------------------------ bad input: exit 2


@pytest.fixture
def bad_configs(tmp_path, default_study_path):
    text = default_study_path.read_text(encoding="utf-8")
    three = (
        text.replace("ctx = [2048, 4096, 8192, 16384]", "ctx = [0, 4096]")
        .replace("prompt_tokens = 1500", 'prompt_tokens = "many"')
        .replace('sampler = "tpe"', 'sampler = "bayes"')
    )
    assert three.count("many") == 1 and three.count("bayes") == 1 and three.count("[0, 4096]") == 1
    (tmp_path / "three.toml").write_text(three, encoding="utf-8")
    (tmp_path / "broken.toml").write_text("[study\nname = 'x'\n", encoding="utf-8")
    return {
        "missing": (tmp_path / "missing.toml", ["no such study file"]),
        "malformed": (tmp_path / "broken.toml", ["not valid TOML"]),
        "three": (tmp_path / "three.toml", ["[space] ctx", "[workload] prompt_tokens", "[study] sampler"]),
    }


@pytest.mark.parametrize("case", ["missing", "malformed", "three"])
def test_bad_study_file_exits_2_naming_the_file(bad_configs, case, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path, expected = bad_configs[case]
    result = CliRunner().invoke(cli, ["study", str(path), "--storage", f"sqlite:///{tmp_path / 's.db'}", "--json"])
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    assert str(path) in result.stderr
    for part in expected:
        assert part in result.stderr, part
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "s.db").exists()


def test_bad_study_file_exits_2_in_a_child_process(bad_configs, tmp_path):
    path, _ = bad_configs["three"]
    proc = subprocess.run(
        _autotune("study", str(path), "--storage", f"sqlite:///{tmp_path / 's.db'}"),
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 3 and all(str(path) in line for line in lines), proc.stderr


def test_unknown_backend_in_study_exits_2(tmp_path, default_study_path, twin_plugin):
    path = tmp_path / "b.toml"
    path.write_text(
        default_study_path.read_text(encoding="utf-8").replace('"twin-llama.cpp"', '"llama"'), encoding="utf-8"
    )
    result = CliRunner().invoke(cli, ["study", str(path), "--storage", f"sqlite:///{tmp_path / 's.db'}"])
    assert result.exit_code == 2
    assert f"{path}: [candidates.1] backend = 'llama': not installed" in result.stderr
    assert "installed: twin-exllamav2, twin-exllamav3, twin-llama.cpp, twin-vllm" in result.stderr


def test_budget_with_a_bad_unit_exits_2_with_the_format(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(cli, ["study", "--budget", "2hrs", "--storage", f"sqlite:///{tmp_path / 's.db'}"])
    assert result.exit_code == 2
    assert "--budget" in result.stderr
    assert "use a number with s, m or h, e.g. 90m or 2h" in result.stderr
    assert not (tmp_path / "s.db").exists()


def test_budget_error_quotes_the_bad_value(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(cli, ["study", "--budget", "2hrs"])
    assert result.exit_code == 2
    assert "'2hrs'" in result.stderr


class _DuplicateTwin:
    """A second plugin that registers a backend under a name the twin already uses."""

    @hookimpl
    def register_backends(self, register):
        import autotune_plugins.twin as twin

        register(twin.TwinExllamaV2())


def test_plugin_contract_violation_exits_1(twin_plugin):
    plugins.register_plugin(_DuplicateTwin(), name="twin-again")
    try:
        result = CliRunner().invoke(
            cli,
            [
                "estimate",
                "--gpu",
                "v100-16gb",
                "--model",
                "qwen2.5-27b-article",
                "--backend",
                "exllamav2",
                "--weights",
                "exl2:3.3",
                "--ctx",
                "4096",
            ],
        )
    finally:
        plugins.unregister_plugin("twin-again")
    assert result.exit_code == 1
    assert "backend name 'twin-exllamav2' is registered twice" in result.stderr
    assert "'twin'" in result.stderr and "'twin-again'" in result.stderr
    assert "Traceback" not in result.stderr


def test_plugins_json_lists_the_twin(twin_plugin):
    result = CliRunner().invoke(cli, ["plugins", "--json"])
    assert result.exit_code == 0
    found = json.loads(result.stdout)
    backends = {b["name"]: b for b in found["backends"]}
    assert set(backends) == {"twin-exllamav2", "twin-exllamav3", "twin-llama.cpp", "twin-vllm"}
    assert backends["twin-exllamav2"]["plugin"] == "twin"
    assert [m["name"] for m in found["metrics"]] == ["twin-mmlu"]


def test_plugins_text_cuts_a_long_declared_list_and_json_keeps_it_whole(twin_plugin):
    text = CliRunner().invoke(cli, ["plugins"]).stdout
    (line,) = [ln for ln in text.splitlines() if "formats exl3:<bpw>" in ln]  # twin-exllamav3: 50 types
    assert "cache types fp16, k8v8" in line and "... (50 in all; --json lists them)" in line
    found = json.loads(CliRunner().invoke(cli, ["plugins", "--json"]).stdout)
    (exl3,) = [b for b in found["backends"] if b["name"] == "twin-exllamav3"]
    assert len(exl3["cache_types"]) == 50


def test_study_prints_its_summary_when_the_dashboard_note_cannot_be_written(tmp_path, monkeypatch, twin_plugin):
    """optuna-dashboard missing (a machine given only the study's wheels): the study's note is a
    copy of the printed summary, so the study still ends with its summary and exit 0."""
    import autotune.report.dashboard

    def no_dashboard(study, text, commands=()):
        raise ModuleNotFoundError("No module named 'optuna_dashboard'")

    monkeypatch.setattr(autotune.report.dashboard, "annotate_study", no_dashboard)
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(
        cli, ["study", "--trials", "2", "--quiet", "--json", "--storage", f"sqlite:///{tmp_path / 's.db'}"]
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["n_trials"] >= 2
    assert "no dashboard note for the study (ModuleNotFoundError" in result.stderr


@pytest.mark.parametrize(
    "args",
    [
        ["study", "d/" * 2500 + "x.toml"],
        ["estimate", "--model", "m" * 5000 + ".gguf", "--backend", "twin-llama.cpp", "--gpu", "t4", "--ctx", "256"],
    ],
    ids=["study-file", "model-file"],
)
def test_a_path_too_long_for_the_filesystem_is_bad_input(args, twin_plugin):
    """ENAMETOOLONG was an OSError traceback (exit 1) wherever a path was first touched."""
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2, result.output
    assert "too long for the filesystem" in result.output and "characters)" in result.output
    assert "Traceback" not in result.output and len(result.output) < 500


def test_a_study_name_too_long_for_a_file_name_is_refused(tmp_path):
    from autotune.config import parse_study_config
    from autotune.errors import ConfigError

    doc = {
        "study": {"name": "n" * 5000},
        "hardware": {"gpu": "t4"},
        "model": {"ref": "qwen2.5-7b"},
        "workload": {"prompt_tokens": 64, "output_tokens": 32},
        "candidates": [{"backend": "twin-llama.cpp", "weights": ["gguf:Q8_0"]}],
        "space": {"ctx": [512], "parallel": [1]},
    }
    with pytest.raises(ConfigError, match=r"\[study\] name = 'n+': use letters, digits, '.', '_' or '-', at most 200"):
        parse_study_config(doc, source="long.toml", path=tmp_path / "long.toml")
    doc["study"]["name"] = "n" * 200
    assert parse_study_config(doc, source="ok.toml", path=tmp_path / "ok.toml").name == "n" * 200


def test_a_study_that_tried_nothing_does_not_say_everything_tried_was_refused(
    twin_plugin, default_study_path, tmp_path
):
    # Found with issue 28's words: a budget spent before the first trial (on a loaded 2-core
    # machine, by the baselines) printed "every configuration tried was refused" of 0 trials.
    result = CliRunner().invoke(
        cli,
        ["study", str(default_study_path), "--budget", "0.001s", "--storage", f"sqlite:///{tmp_path / 'nothing.db'}"],
    )
    assert result.exit_code == 1
    assert "0 trials: 0 complete" in result.output
    assert (
        "Error: no feasible configuration: no configuration was tried (why the search ended says why)" in result.output
    )
    assert "every configuration tried" not in result.output
