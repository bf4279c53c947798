"""The ``autotune`` command line: a thin layer over the library.

Exit status: 0 on success, 2 for bad input (with a message naming what was wrong), 1 for
other failures, 130 when interrupted.
"""

from __future__ import annotations

import importlib.resources
import json
import sys
from pathlib import Path
from typing import Any, Callable

import click

from autotune import plugins
from autotune.config import SEED_MAX, load_study_config, parse_duration, study_name_problem
from autotune.errors import ConfigError, handle_errors
from autotune.estimate import BACKEND_RULE
from autotune.toolkit import toml_text
from autotune.toolkit.fields import settings_given
from autotune.toolkit.paths import path_problem
from autotune.toolkit.terminal import echo, show_warnings, shown

# The study machinery (optuna, SQLAlchemy, the runner, the report) is imported inside the commands
# that use it: it takes about as long again as this module's own import, which `autotune --help`
# and `autotune estimate` (without --study) do not need.

DEFAULT_STUDY = "v100-qwen27b.toml"


def default_study_path() -> Path:
    """The default study (the digital twin's V100 study), shipped with the package."""
    return Path(str(importlib.resources.files("autotune_studies").joinpath(DEFAULT_STUDY)))


def _run(debug: bool, fn: Callable[[], Any]) -> Any:
    """Run a command's body under the one error-to-exit-status mapping."""
    with handle_errors(debug):
        return fn()


@click.group()
@click.option("--debug", is_flag=True, help="Show tracebacks of errors.")
@click.version_option(package_name="autotune")
@click.pass_context
def cli(ctx: click.Context, debug: bool) -> None:
    """Find the fastest way to serve an LLM on your GPU without breaking its memory or quality."""
    ctx.ensure_object(dict)
    ctx.obj["debug"] = debug
    show_warnings()


def _duration(ctx: click.Context, param: click.Parameter, value: str | None) -> float | None:
    if value is None:
        return None
    try:
        return parse_duration(value, source="--budget")
    except ConfigError as exc:
        raise click.BadParameter(str(exc)) from None


@cli.command()
@click.argument("config", required=False, type=click.Path(dir_okay=True, path_type=Path))
@click.option("--budget", callback=_duration, help="Wall time for this run: 90s, 45m, 2h.")
@click.option("--trials", "n_trials", type=click.IntRange(min=1), help="Number of new trials for this run.")
@click.option(
    "--storage",
    help="Optuna storage URL (default: $AUTOTUNE_STORAGE, else the study file's, else sqlite:///<study name>.db).",
)
@click.option("--seed", type=click.IntRange(0, SEED_MAX), help="Sampler seed (default: the study file's).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
@click.option("--quiet", is_flag=True, help="No live progress display.")
@click.option(
    "--report",
    "report_path",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Write the HTML report (plots, every trial) to this file at the end.",
)
@click.pass_context
def study(
    ctx: click.Context,
    config: Path | None,
    budget: float | None,
    n_trials: int | None,
    storage: str | None,
    seed: int | None,
    as_json: bool,
    quiet: bool,
    report_path: Path | None,
) -> None:
    """Run (or continue) a study. With no CONFIG, the default digital-twin study."""
    from autotune.report.progress import LiveProgress, header_text
    from autotune.report.text import summary_json, summary_text
    from autotune.study.cost import forecast_line
    from autotune.study.prepare import prepare_study
    from autotune.study.runner import StudyRunner
    from autotune.study.storage import remember_run
    from autotune.report.dashboard import trial_notes

    def go() -> None:
        cfg = load_study_config(config if config is not None else default_study_path())
        if report_path is not None:  # found out now, not after the whole study ran
            problem = path_problem(report_path.absolute().parent, "directory")
            if problem:
                raise ConfigError(
                    f"--report {report_path}: {report_path.absolute().parent}: {problem} "
                    "(the report's directory must exist)"
                )
        prepared = prepare_study(cfg, storage=storage)
        runner = StudyRunner(prepared, seed=seed)
        remember_run(prepared.storage_url, cfg.name)
        plan_trials = n_trials
        plan_budget = budget
        if plan_trials is None and plan_budget is None:
            plan_trials, plan_budget = cfg.n_trials, cfg.budget_s
        costs = forecast_line(runner.forecast, plan_budget, runner.study.pruner)
        with LiveProgress(
            enabled=not quiet and sys.stderr.isatty(), n_trials=plan_trials, budget_s=plan_budget, quiet=quiet
        ) as live:
            live.note(
                header_text(prepared, config if config is not None else default_study_path(), plan_trials, plan_budget)
            )
            if costs:
                live.note(costs)
            summary = runner.run(
                budget_s=budget,
                n_trials=n_trials,
                callback=live.update,
                note=live.note,
                on_trial=trial_notes(prepared.storage_url),
            )
        if as_json:
            echo(json.dumps(summary_json(summary), indent=2, default=str))
        else:
            echo(summary_text(summary))
        from autotune.report.dashboard import annotate_study, deploy_commands

        try:  # the study's dashboard note is a copy of what was just printed: losing it loses nothing
            annotate_study(runner.study, summary_text(summary), deploy_commands(summary))
        except Exception as exc:  # noqa: BLE001
            echo(f"warning: no dashboard note for the study ({type(exc).__name__}: {exc})", err=True)
        if report_path is not None:
            from autotune.report.text import write_study_report

            echo(f"report: {write_study_report(runner.study, summary, report_path)}", err=True)
        else:
            from autotune.report.text import report_file_name
            from autotune.toolkit.shell import command_line

            hint = command_line(
                [
                    "autotune",
                    "report",
                    "--storage",
                    prepared.shown_storage,
                    "--study",
                    cfg.name,
                    "--out",
                    report_file_name(cfg.name),
                ]
            )
            echo(f"an HTML report of this study: {hint} (or --report PATH next time)", err=True)
        if summary.interrupted:
            echo("interrupted: the storage is consistent; run the same command again to continue", err=True)
            sys.exit(130)
        failed = summary.extra.get("systematic_failure")
        if failed:  # every next trial would fail alike: the cause and its remedy, as bad input is told
            echo(f"Error: {failed['text']}", err=True)
            sys.exit(2)
        if summary.best is None:
            # Nothing to deploy: a script reading `best --json` must not take this for a result.
            if summary.n_trials == 0:  # nothing was tried: "every configuration tried was refused" would be false
                echo(
                    "Error: no feasible configuration: no configuration was tried (why the search ended "
                    "says why); raise the budget, then run again",
                    err=True,
                )
            else:
                causes = "".join(f"\n  {line}" for line in summary.extra.get("no_feasible", []))
                echo(
                    "Error: no feasible configuration: every configuration tried was refused, failed or broke "
                    "a constraint; widen [space], relax the target, raise the budget or fix the failures, then run "
                    "again:" + causes,
                    err=True,
                )
            sys.exit(1)

    _run(ctx.obj["debug"], go)


def _reading(storage: str | None, study_file: Path | None, study_name: str | None) -> tuple[str, str | None]:
    """Where ``best``, ``report`` and ``dashboard`` read (``storage.reading_target``)."""
    from autotune.study.storage import reading_target

    url, name, _ = reading_target(storage, study_file, study_name, default_study_path())
    return url, name


_STUDY_FILE = click.argument("study_file", required=False, type=click.Path(exists=True, dir_okay=False, path_type=Path))
_READ_STORAGE = click.option(
    "--storage",
    help="Optuna storage URL (default: $AUTOTUNE_STORAGE, else STUDY_FILE's, "
    "else the study last run in this directory, else the default study's).",
)


@cli.command()
@_STUDY_FILE
@click.option(
    "--study", "study_name", help="Study name (default: STUDY_FILE's or the last run's, else the storage's only study)."
)
@_READ_STORAGE
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.pass_context
def best(
    ctx: click.Context, study_file: Path | None, study_name: str | None, storage: str | None, as_json: bool
) -> None:
    """The best trial of a study, its metrics and its deploy command."""
    from autotune.report.text import stored_summary, summary_json, summary_text

    def go() -> None:
        summary = stored_summary(*_reading(storage, study_file, study_name))
        echo(json.dumps(summary_json(summary), indent=2, default=str) if as_json else summary_text(summary))

    _run(ctx.obj["debug"], go)


@cli.command()
@_STUDY_FILE
@click.option(
    "--study", "study_name", help="Study name (default: STUDY_FILE's or the last run's, else the storage's only study)."
)
@_READ_STORAGE
@click.option(
    "--out",
    "out",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="HTML file to write [default: <study name>.html].",
)
@click.pass_context
def report(
    ctx: click.Context, study_file: Path | None, study_name: str | None, storage: str | None, out: Path | None
) -> None:
    """Write a study's report: one self-contained HTML file with the winner, plots and every trial."""
    from autotune.report.text import load_study, report_file_name, stored_summary, write_study_report

    def go() -> None:
        url, name = _reading(storage, study_file, study_name)
        study = load_study(url, name)
        summary = stored_summary(url, study.study_name)
        path = write_study_report(study, summary, out or report_file_name(study.study_name))
        echo(str(path))

    _run(ctx.obj["debug"], go)


def _listed(names: list[str], most: int = 12) -> str:
    """Names on one line; a long list (an engine may declare fifty cache types) cut, with the count
    (``--json`` has them all)."""
    shown = ", ".join(names[:most])
    return shown if len(names) <= most else f"{shown}, ... ({len(names)} in all; --json lists them)"


@cli.command("plugins")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_context
def plugins_cmd(ctx: click.Context, as_json: bool) -> None:
    """Every backend, metric and search strategy, with the plugin and distribution that provides it."""

    def go() -> None:
        found = plugins.describe()
        if as_json:
            echo(json.dumps(found, indent=2))
            return
        for kind in ("backends", "metrics", "strategies"):
            echo(f"{kind}:")
            for item in found[kind]:
                echo(f"  {item['name']:<22} {item['distribution']} ({item['plugin']})  {item['description']}")
                declared = [
                    f"{what} {_listed(item[key])}"
                    for key, what in (("formats", "formats"), ("cache_types", "cache types"))
                    if item.get(key)
                ]
                if declared:
                    echo(f"  {'':<22} {'; '.join(declared)}")
                for s in item.get("settings", ()):  # [backends.NAME] keys: accepted values, default, meaning
                    default = "" if s["default"] is None else f", default {toml_text.value(s['default'])}"
                    echo(f"  {'':<22} [backends.{item['name']}] {s['name']} = {s['accepted']}{default}: {s['help']}")
                for d in item.get("dimensions", ()):  # [space] keys: accepted values, then what each means
                    accepted = [json.dumps(v) if not isinstance(v, str) else v for v in d["accepted"]]
                    echo(f"  {'':<22} [space] {d['name']} = {_listed(accepted)}: {d['doc']}")
                for rule in item.get("rules", ()):
                    echo(f"  {'':<22} rule: {rule}")
            if not found[kind]:
                echo("  (none)")
        if found["broken"]:
            echo("broken (left out):")
            for item in found["broken"]:
                echo(f"  {item['plugin']:<22} {item['hook']}: {item['error']}")

    _run(ctx.obj["debug"], go)


@cli.command()
@_STUDY_FILE
@_READ_STORAGE
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=8080, show_default=True, type=click.IntRange(1, 65535))
@click.pass_context
def dashboard(ctx: click.Context, study_file: Path | None, storage: str | None, host: str, port: int) -> None:
    """Start optuna-dashboard on the study storage (localhost by default)."""

    def go() -> None:
        from autotune.report.dashboard import artifact_store, port_problem, serve
        from autotune.report.text import load_study
        from autotune.study.storage import mask_url, open_storage, study_names

        url, name = _reading(storage, study_file, None)
        store = open_storage(url, create=False)  # only reads: a mistyped path must not make a database
        for each in [name] if name else study_names(store, mask_url(url)):
            load_study(url, each)  # refuse a study of another schema before serving it
        busy = port_problem(host, port)
        if busy:
            raise ConfigError(busy)
        echo(f"optuna-dashboard for {mask_url(url)} on http://{host}:{port}/ (Ctrl-C to stop)", err=True)
        serve(store, host, port, artifact_store(url, create=False))

    _run(ctx.obj["debug"], go)


@cli.group("storage")
def storage_group() -> None:
    """Maintain study storages."""


@storage_group.command("upgrade")
@click.argument("url")
@click.pass_context
def storage_upgrade(ctx: click.Context, url: str) -> None:
    """Rewrite the studies in URL that an older autotune stored to this one's schema, in place."""
    from autotune.study.upgrade import upgrade

    def go() -> None:
        for line in upgrade(url):
            echo(line)

    _run(ctx.find_root().obj["debug"], go)


@cli.command()
@click.option(
    "--gpu", "gpu_key", default=None, help="Catalog GPU key, or auto (NVML) [default: auto; with --study, the study's]."
)
@click.option(
    "--model",
    "model_ref",
    default=None,
    help="Catalog model key, a .gguf file or a model directory [required, except with --study: the study's].",
)
@click.option("--backend", "backend_name", required=True, help=BACKEND_RULE)
@click.option(
    "--weights",
    default=None,
    help="gguf:<TYPE>, exl2:<bpw>, or a weights file [default: --model, when it is a file or an EXL2 directory].",
)
@click.option("--ctx", "ctx_tokens", required=True, type=click.IntRange(min=1), help="Context per sequence.")
@click.option("--cache", "cache_type", default=None, help="KV-cache type (the engine's own names).")
@click.option(
    "--flash-attn/--no-flash-attn",
    default=None,
    help="Fused attention [default: the engine's own, on for every engine autotune runs].",
)
@click.option("--parallel", default=1, show_default=True, type=click.IntRange(min=1))
@click.option(
    "--prompt-tokens",
    default=None,
    type=click.IntRange(min=1),
    help="Prompt of one request [default: 1500; with --study, the study's].",
)
@click.option(
    "--output-tokens",
    default=None,
    type=click.IntRange(min=1),
    help="Answer of one request [default: 800; with --study, the study's].",
)
@click.option(
    "--study",
    "study_name",
    default=None,
    help="A stored study: its GPU, model and workload, its twin calibrated on its measured trials, its "
    "budget and the memory correction it learned judge.",
)
@click.option(
    "--storage", default=None, help="Where --study is (default: $AUTOTUNE_STORAGE, else sqlite:///<study name>.db)."
)
@click.option(
    "--setting",
    "settings",
    multiple=True,
    metavar="NAME=VALUE",
    help="A backend setting, as in the study file's [backends.NAME] (a TOML value; repeatable), e.g. "
    "unpaged_parallel=batched.",
)
@click.option(
    "--set",
    "dimensions",
    multiple=True,
    metavar="NAME=VALUE",
    help="A value of one of the backend's search dimensions ([space] keys; autotune plugins lists them), "
    "a TOML value or a plain word; repeatable, e.g. --set gpu_layers=20 --set split_mode=layer "
    "--set tensor_split=3,1.",
)
@click.option(
    "--gpus",
    default=None,
    metavar="KEY,KEY,...",
    help="Several cards, catalog keys in device order (as [hardware] gpus): each card's share is judged "
    "against its own memory less 256 MiB.",
)
@click.option(
    "--acceptance",
    type=float,
    default=None,
    metavar="RATE",
    help="With speculation set (--set spec_type=draft-mtp --set spec_n_max=2): the share of drafted tokens "
    "the engine accepts (accepted / drafted, as a trial's acceptance records it); the speed is "
    "predicted at it and compared with no speculation.",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_context
def estimate(
    ctx: click.Context,
    gpu_key: str | None,
    model_ref: str | None,
    backend_name: str,
    weights: str | None,
    ctx_tokens: int,
    cache_type: str | None,
    flash_attn: bool | None,
    parallel: int,
    prompt_tokens: int | None,
    output_tokens: int | None,
    study_name: str | None,
    storage: str | None,
    settings: tuple[str, ...],
    dimensions: tuple[str, ...],
    gpus: str | None,
    acceptance: float | None,
    as_json: bool,
) -> None:
    """Memory breakdown and predicted speed of one configuration (ctx is per sequence).

    Fits or not is the study's judge's verdict: the memory model (with the correction a
    --study learned) against the budget, the card's memory less the safety margin (256 MiB,
    or the study's).

    Exit status 2, after the estimate, when the configuration is invalid (a rule of the
    engine it breaks, e.g. ctx beyond the model's context) or the engine refuses it;
    0 when it fits and when it does not.
    """
    from autotune.estimate import estimate_config, estimate_text

    def go() -> None:
        if storage is not None and study_name is None:
            raise ConfigError("--storage is where --study is: give --study NAME too")
        result = estimate_config(
            gpu_key,
            model_ref,
            backend_name,
            weights,
            ctx_tokens,
            cache_type,
            flash_attn,
            parallel,
            prompt_tokens,
            output_tokens,
            study_name,
            storage,
            settings=settings_given(settings),
            dimensions=settings_given(dimensions),
            gpus=[g.strip() for g in gpus.split(",") if g.strip()] if gpus else None,
            acceptance=acceptance,
        )
        echo(json.dumps(result, indent=2) if as_json else estimate_text(result))
        if result["verdict"] == "invalid":
            raise ConfigError("invalid configuration: " + "; ".join(result["invalid"]))
        if result["verdict"] == "refused":
            raise ConfigError(f"the engine refuses this configuration: {result['refused']}")

    _run(ctx.obj["debug"], go)


@cli.command()
@click.argument("model", type=click.Path(exists=True, path_type=Path))
@click.option(
    "--gpu",
    "gpu_key",
    default="auto",
    show_default=True,
    help="auto (NVML; the CPU when there is no GPU), a catalog GPU key, or cpu.",
)
@click.option(
    "--out",
    type=click.Path(dir_okay=False, path_type=Path),
    default=Path("study.toml"),
    show_default=True,
    help="Where to write the study file.",
)
@click.option("--name", default=None, help="Study name (default: the model's file or directory name).")
@click.option("--force", is_flag=True, help="Replace an existing --out file.")
@click.pass_context
def init(ctx: click.Context, model: Path, gpu_key: str, out: Path, name: str | None, force: bool) -> None:
    """Write a study for MODEL (a Hugging Face directory or a full-precision .gguf) on this machine."""
    from autotune.study.prepare import prepare_study
    from autotune.study_writer import draft_study, render

    def go() -> None:
        if out.exists() and not force:
            raise ConfigError(f"--out {out}: already exists (pass --force to replace it)")
        # Found before the model is read and the backends asked, not as a traceback at the write.
        problem = path_problem(out.absolute().parent, "directory")
        if problem:
            raise ConfigError(
                f"--out {out}: {out.absolute().parent}: {problem} (the study file's directory must exist)"
            )
        if name is not None and study_name_problem(name):  # before the file is written, not after
            raise ConfigError(f"--name {name!r}: {study_name_problem(name)}")
        draft = draft_study(str(model), gpu_key, name)
        out.write_text(render(draft, out), encoding="utf-8")
        try:
            prepare_study(load_study_config(out), dry_runs=False)  # what `autotune study` will check first
        except ConfigError as exc:
            raise ConfigError(
                f"{out}: written, but it does not validate (a bug in autotune init; please report it):\n{exc}"
            ) from None
        echo(
            f"wrote {out}: {', '.join(f'{b} {len(w)} formats' for b, w in draft.candidates.items())} on "
            f"{draft.gpu.name}; ctx {draft.ctx[0]}..{draft.ctx[-1]}, parallel 1..16"
            + (f", quality {draft.quality} against the source" if draft.quality else "")
        )
        for note in draft.notes:
            echo(f"  note: {note}")
        for why in draft.left_out:
            echo(f"  left out: {why}")
        from autotune.toolkit.shell import command_line

        echo(
            f"next: {command_line(['autotune', 'study', out])}    "
            f"then: {command_line(['autotune', 'best', '--storage', f'sqlite:///{draft.name}.db'])}"
        )

    _run(ctx.obj["debug"], go)


plugins.add_commands(cli)


def main() -> None:
    """The ``autotune`` command. Click's own errors (a bad option, a path that does not exist)
    quote what was typed: shown through ``terminal.shown`` like every other line, so a pasted
    argument holding an escape sequence does not reach the terminal raw."""
    try:
        cli.main(obj={}, standalone_mode=False)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.Abort:
        echo("Aborted!", err=True)
        sys.exit(1)
    except click.ClickException as exc:
        exc.message = shown(exc.message)
        if isinstance(exc, click.BadParameter) and exc.param_hint is not None and isinstance(exc.param_hint, str):
            exc.param_hint = shown(exc.param_hint)
        exc.show()
        sys.exit(exc.exit_code)


if __name__ == "__main__":  # pragma: no cover
    main()
