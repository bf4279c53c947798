"""What optuna-dashboard shows of a study: objective names, a note per trial, the study's note,
and failed trials' engine logs.

The trial attributes stay machine-readable (``records``); the notes are for people: each
trial's is a short Markdown card (the configuration in words, the figures with their spread,
memory predicted and measured, the deploy command, why it was pruned or failed), and the
study's holds the summary. A failed trial's engine log is attached as an artifact of the study
(a finished trial's own attributes cannot change) where the storage is a file with room beside
it for artifacts.

The notes are written with optuna-dashboard's public ``save_note``. The runner knows nothing
of them: the CLI passes ``trial_notes`` to ``StudyRunner.run`` as its ``on_trial`` observer.
"""

from __future__ import annotations

import math
import re
import socket
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable

import optuna

from autotune.hardware.gpus import CPU_KEY
from autotune.engine.metric import metric_named
from autotune.study.records import TrialRecord, TrialState
from autotune.study.verdict import memory_text


def port_problem(host: str, port: int) -> str | None:
    """Why the dashboard cannot listen on ``host:port`` (None: it can).

    optuna-dashboard's server says "Listening on" before it binds, so a busy port was that line
    and then a traceback; binding here first, as its server does (SO_REUSEADDR, so a port left in
    TIME_WAIT is free), turns it into one line before anything is printed.
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        return f"--host {host}: cannot be resolved ({exc.strerror})"
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(address)
        except OSError as exc:
            return f"--port {port}: cannot listen on {host}:{port} ({exc.strerror or exc}); give another --port"
    return None


# optuna-dashboard shows each user attribute as one line that never wraps, so a trial whose
# metrics attribute is a 5,000-character JSON made its page 9,211 px wide. Schema 3 stores each
# field whole (any tool reads it as it is), so the page, not the value, is what changes here.
WRAP_ATTRIBUTES = b"<style>main p.MuiTypography-root{white-space:normal;overflow-wrap:anywhere}</style>"


def wrapping_pages(app: Callable[..., Any]) -> Callable[..., Any]:
    """optuna-dashboard's WSGI ``app`` with ``WRAP_ATTRIBUTES`` in its page's head (its
    Content-Security-Policy allows inline styles): every other response passes unchanged."""

    def wrapped(environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        if not environ.get("PATH_INFO", "").startswith("/dashboard"):
            return app(environ, start_response)
        said: dict[str, Any] = {}

        def hold(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Callable[[bytes], None]:
            said.update(status=status, headers=headers)  # sent below, once the body is known
            return lambda data: None

        answer = app(environ, hold)
        try:
            body = b"".join(answer)
        finally:  # the server closes what it is given (PEP 3333): here, the page's file, not a list
            getattr(answer, "close", lambda: None)()
        status, headers = said["status"], said["headers"]
        if b"</head>" in body:
            body = body.replace(b"</head>", WRAP_ATTRIBUTES + b"</head>", 1)
            headers = [(k, v) for k, v in headers if k.lower() != "content-length"]
            headers.append(("Content-Length", str(len(body))))
        start_response(status, headers)
        return [body]

    return wrapped


def serve(storage: Any, host: str, port: int, artifacts: Any = None) -> None:
    """Serve optuna-dashboard on ``storage`` until interrupted: its own WSGI application
    (``optuna_dashboard.wsgi``), its pages wrapped (``wrapping_pages``)."""
    import wsgiref.simple_server

    from optuna_dashboard import wsgi

    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    server_class = type("Server", (wsgiref.simple_server.WSGIServer,), {"address_family": family})
    with wsgiref.simple_server.make_server(
        host, port, wrapping_pages(wsgi(storage, artifact_store=artifacts)), server_class=server_class
    ) as server:
        server.serve_forever()


def artifact_store(url: str, create: bool = True) -> Any:
    """A file store beside a SQLite or journal storage (``<file>.artifacts/``); None for a
    database server (nowhere of ours to put files) or, when ``create`` is false, when the
    directory does not exist (a reader never creates it)."""
    from optuna.artifacts import FileSystemArtifactStore

    if url.startswith("sqlite:///"):
        path = url[len("sqlite:///") :]
    elif url.startswith("journal:"):
        path = url[len("journal:") :]
    else:
        return None
    if path in ("", ":memory:"):
        return None
    folder = Path(path).expanduser().with_name(Path(path).name + ".artifacts")
    if not folder.is_dir():
        if not create:
            return None
        folder.mkdir(parents=True, exist_ok=True)
    return FileSystemArtifactStore(str(folder))


def _gib(n: Any) -> str:
    return "-" if n is None else memory_text(n)  # a small model's 3 MiB is no "0.00 GiB"


def _figure(r: TrialRecord, key: str, label: str) -> str | None:
    m = r.metrics.get(key)
    if not m or m.get("median") is None:
        return None
    spread = m.get("spread")
    return f"{label} **{m['median']:.1f}** tok/s" + ("" if spread is None else f" (spread {100 * spread:.1f}%)")


def trial_card(r: TrialRecord, log_artifact: str | None = None) -> str:
    """A trial's note: a few Markdown lines a person reads instead of the attributes."""
    c = dict(r.config or {})
    options = ", ".join(f"{k} {v}" for k, v in c.items() if k not in ("backend", "weights", "ctx", "parallel"))
    # Every name is escaped: a weights file named "[click me](javascript:...)" is text, not a link.
    lines = [
        f"### {_escaped(str(c.get('backend', '?')))}: {_escaped(Path(str(c.get('weights', '?'))).name)}",
        _escaped(
            f"{c.get('parallel', '?')} parallel streams of {c.get('ctx', '?')} tokens each"
            + (f"; {options}" if options else "")
        ),
        "",
    ]
    if r.answered:
        lines.append(f"Answered from trial {r.answered_from}: {_escaped(str(r.prune_reason))}")
        return "\n".join(lines)
    figures = [
        f
        for f in (
            _figure(r, "aggregate_tok_s", "aggregate"),
            _figure(r, "per_user_tok_s", "per user"),
            _figure(r, "decode_tok_s", "one stream"),
        )
        if f
    ]
    if figures:
        lines.append("- " + ", ".join(figures))
    if r.values:
        violated = [k for k, v in r.constraints.items() if v > 0]
        lines.append(f"- score {r.values[0]:.1f}" + (f", **infeasible**: {', '.join(violated)}" if violated else ""))
    if r.quality_drop_points is not None:
        lines.append(f"- quality: {metric_named((r.quality or {}).get('metric')).drop_text(r.quality_drop_points)}")
    predicted = (r.predicted_vram or {}).get("total_bytes")
    if predicted is not None or r.measured_vram_bytes is not None:
        memory = "host memory" if (r.gpu or {}).get("key") == CPU_KEY else "VRAM"  # gpu = "cpu": no card
        lines.append(f"- {memory} predicted {_gib(predicted)}, measured {_gib(r.measured_vram_bytes)}")
    if r.state == TrialState.PRUNED:
        lines += _said("- **not launched**:", str(r.prune_reason))
    elif r.state == TrialState.FAIL:
        lines += _said("- **failed**:", r.fail_reason or "no reason recorded")
        if log_artifact:
            lines.append(f"- engine log: the study's artifact `{log_artifact}`")
    if r.deploy_command:
        lines += ["", "```", *_wrapped(r.deploy_command), "```"]
    return "\n".join(lines)


_SHELL_WORD = re.compile(r"""(?:\$'(?:[^'\\]|\\.)*'|'[^']*'|"(?:[^"\\]|\\.)*"|\\.|[^\s'"\\])+""")


def _wrapped(command: str, width: int = 76) -> list[str]:
    """A deploy command as shell lines of at most ``width`` characters (a note's code block does
    not wrap, and one 300-character line makes the trial page that wide); its trailing comment
    goes on lines of its own, each part wrapped at ``width`` too (a backend's note can be a
    sentence of 170 characters)."""
    import textwrap

    line, _, comment = command.partition("  # ")
    out, current = [], ""
    # The words as deploy_line quoted them (shell.quote: '...', bash's $'...' for a control
    # character), kept as written: split and quoted again, a $'...' word would change.
    for word in _SHELL_WORD.findall(line):
        if current and len(current) + len(word) + 3 > width:
            out.append(current + " \\")
            current = "  "
        current += ("" if current.strip() == "" else " ") + word
    out.append(current)
    for part in comment.split("; ") if comment else ():
        out += [f"# {piece}" for piece in textwrap.wrap(part, width - 2, break_long_words=False)]
    return out


def save_note(target: optuna.Study | optuna.Trial, body: str) -> None:
    """optuna-dashboard's ``save_note`` of a study or a trial, imported on the first note (its
    server, plots and importance modules load with it: a study run without notes never pays)."""
    from optuna_dashboard import save_note as dashboard_save_note

    dashboard_save_note(target, body)


def annotate_trial(study: optuna.Study, trial: optuna.Trial, url: str | None = None) -> None:
    """Write the note of a finished trial (and attach its engine log if it failed with one)."""
    r = TrialRecord.of(study.get_trials(deepcopy=False)[trial.number])  # numbers run 0, 1, ... in a study
    log_name = None
    store = artifact_store(url) if url and r.state == TrialState.FAIL and r.log_tail else None
    if store is not None:
        from optuna.artifacts import upload_artifact

        with tempfile.TemporaryDirectory() as tmp:
            log_name = f"trial-{r.number}-engine.log"
            path = Path(tmp) / log_name
            path.write_text(str(r.log_tail))
            upload_artifact(artifact_store=store, file_path=str(path), study_or_trial=study, mimetype="text/plain")
    save_note(trial, trial_card(r, log_name))


def trial_notes(url: str | None) -> Callable[[optuna.Study, optuna.Trial], None]:
    """The observer the CLI passes to ``StudyRunner.run(on_trial=...)``: each finished trial's
    note (``annotate_trial``), its engine log attached where ``url`` has room for artifacts."""
    return lambda study, trial: annotate_trial(study, trial, url)


def deploy_commands(summary: Any) -> list[str]:
    """The shell lines a study's summary holds: the best's deploy command and each baseline's."""
    found = [(summary.best or {}).get("deploy_command")]
    found += [b.get("deploy_command") for b in (summary.extra.get("baseline") or {}).values()]
    return [c for c in found if c]


_MARKDOWN = set("\\`*_[]<>#|~!&()")


def _escaped(text: str) -> str:
    """``text`` as Markdown that shows it as it is (CommonMark: any ASCII punctuation may be
    backslash-escaped), a line that would start a list or a heading included."""
    out = "".join("\\" + ch if ch in _MARKDOWN else ch for ch in text)
    head, dot, rest = out.partition(". ")
    if dot and head.isdigit():  # "1. " starts an ordered list; "1\. " does not
        return f"{head}\\. {rest}"
    return "\\" + out if out[:1] in ("-", "+") else out


LONG_WORD = 80  # characters: a word this long does not wrap, and a note is as wide as its widest word


def _long(text: str) -> bool:
    return any(len(word) > LONG_WORD for word in text.split())


def _block(text: str, indent: str = "") -> list[str]:
    """``text`` as a code block of lines of at most 76 characters, a long word cut where the
    line is full (an engine's message with a 100-character hash made a trial page 1,423 px)."""
    import textwrap

    rows = [
        row
        for line in text.splitlines() or [""]
        for row in textwrap.wrap(line, 76, break_long_words=True, break_on_hyphens=False) or [""]
    ]
    # A fence longer than any run of backticks in the text, which then cannot close it.
    fence = "`" * max(3, 1 + max((len(run) for run in re.findall("`+", text)), default=0))
    return [f"{indent}{row}" for row in ["", fence, *rows, fence, ""]]


def _said(label: str, text: str, indent: str = "  ") -> list[str]:
    """A list item ``label`` and its ``text``: on the same line, or as a block under it where the
    text is long or holds a word too long to wrap."""
    if len(text) <= 200 and not _long(text):
        return [f"{label} {_escaped(text)}"]
    return [label, *_block(text, indent)]


def note_markdown(summary_text: str, commands: Iterable[str] = ()) -> str:
    """The printed summary as a note that wraps to the window: a line as a paragraph, an
    indented line as an item (its depth kept), a shell line (one of ``commands``) as a code
    block of short lines (``_wrapped``). A fenced block of the text as printed was as wide as
    its longest line: 4,448 px for a study whose deploy line is 400 characters."""
    commands = tuple(commands)
    out: list[str] = []
    for line in summary_text.splitlines():
        text = line.lstrip(" ")
        depth = (len(line) - len(text)) // 2
        label, command = text, None
        for c in commands:
            if text.endswith(c) and text[: -len(c)].endswith(": "):
                label, command = text[: -len(c)].rstrip(), c
                break
        indent = "  " * max(depth - 1, 0)
        if command is None and _long(label):  # its start as the line, the rest as a block
            head, sep, rest = label.partition(": ")
            label, command = (head + ":", rest) if sep and not _long(head) else ("", label)
            out.append(f"{indent}- {_escaped(label)}" if depth else f"\n{_escaped(label)}\n")
            out += _block(command, indent + ("  " if depth else ""))
            continue
        out.append(f"{indent}- {_escaped(label)}" if depth else f"\n{_escaped(label)}\n")
        if command:
            body = indent + ("  " if depth else "")
            out += ["", *(f"{body}{row}" for row in ["```", *_wrapped(command), "```"]), ""]
    return "\n".join(out).strip() + "\n"


def annotate_study(study: optuna.Study, summary_text: str, commands: Iterable[str] = ()) -> None:
    """The study's note: the summary a person would print with ``autotune best``, as Markdown
    that wraps (``note_markdown``); ``commands`` are its shell lines (``deploy_commands``)."""
    save_note(study, note_markdown(summary_text, commands))
