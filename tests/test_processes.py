"""autotune.toolkit.processes: an engine's whole process group is registered, stopped and forgotten."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from autotune.toolkit import processes


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone for our purposes
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def test_start_registers_and_stop_ends_the_group():
    # The engine starts a child of its own: stopping the engine must end both.
    script = (
        "import subprocess, sys, time; c = subprocess.Popen(['sleep', '60']); print(c.pid, flush=True); time.sleep(60)"
    )
    proc = processes.start([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    grandchild = int(proc.stdout.readline())
    assert proc in processes.live() and os.getpgid(proc.pid) == proc.pid  # a session of its own
    processes.stop(proc, timeout_s=5)
    deadline = time.monotonic() + 5
    while alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is not None and not alive(grandchild)
    assert proc not in processes.live()


def _ignores_sigterm() -> subprocess.Popen:
    proc = processes.start(["sh", "-c", "trap '' TERM; echo ready; sleep 60"], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"  # its trap is set
    return proc


def test_an_interrupt_during_the_grace_kills_the_group_at_once(monkeypatch):
    """Ctrl-C while a lingering engine is given its grace: the user wants out now, and the
    engine must not outlive the interrupt."""
    proc = _ignores_sigterm()
    wait = proc.wait

    def interrupted(timeout=None):
        if timeout is not None:
            raise KeyboardInterrupt  # as the signal handler raises inside the wait
        return wait()

    monkeypatch.setattr(proc, "wait", interrupted)
    started = time.monotonic()
    try:
        processes.stop(proc, timeout_s=30)
    except KeyboardInterrupt:
        pass
    else:
        raise AssertionError("the interrupt was swallowed")
    assert wait(timeout=5) == -9 and time.monotonic() - started < 5
    assert proc not in processes.live()


def test_a_group_that_outlives_sigkills_wait_does_not_raise(monkeypatch):
    """Stopping runs in ``finally`` blocks: a TimeoutExpired there would replace the error in
    flight (an interrupt looked like a failed trial, and the study went on)."""
    proc = _ignores_sigterm()
    wait = proc.wait

    def never(timeout=None):
        raise subprocess.TimeoutExpired(proc.args, timeout)

    monkeypatch.setattr(proc, "wait", never)
    processes.stop(proc, timeout_s=0.1)  # no exception
    assert wait(timeout=5) == -9  # SIGKILLed all the same


# A child that leaves a grandchild behind the way daemons do: fork, setsid (out of the child's
# process group and session), fork again, and the middle process exits (the grandchild is
# reparented to init, out of the child's tree). The grandchild's pid is written to PIDFILE.
DOUBLE_FORK = """
import os, sys, time
pidfile, then = sys.argv[1], sys.argv[2]
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)  # holds none of the child's pipes: what is tested is its life
        with open(pidfile + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.rename(pidfile + ".tmp", pidfile)
        time.sleep(30)
        os._exit(0)
    os._exit(0)
while not os.path.exists(pidfile):
    time.sleep(0.01)
if then == "hang":
    time.sleep(30)
"""


def escaped_grandchild(pidfile, group: int | None = None) -> int:
    deadline = time.monotonic() + 30
    while not pidfile.exists():
        assert time.monotonic() < deadline, "the grandchild never started"
        time.sleep(0.02)
    pid = int(pidfile.read_text())
    # A session of its own (its middle process's), so the group kill cannot reach it
    assert os.getsid(pid) != os.getsid(0) and (group is None or os.getpgid(pid) != group)
    return pid


def gone(pid: int, limit_s: float = 10.0) -> bool:
    deadline = time.monotonic() + limit_s
    while alive(pid):
        if time.monotonic() > deadline:
            os.kill(pid, 9)  # not left behind by a failing test
            return False
        time.sleep(0.05)
    return True


def test_a_grandchild_that_left_the_group_with_setsid_is_stopped_too(tmp_path):
    pidfile = tmp_path / "grandchild.pid"
    proc = processes.start([sys.executable, "-c", DOUBLE_FORK, str(pidfile), "hang"])
    grandchild = escaped_grandchild(pidfile, group=proc.pid)
    processes.stop(proc, timeout_s=5)
    assert gone(grandchild), "the setsid grandchild outlived stop()"


def test_run_ends_a_hanging_tool_and_everything_it_started(tmp_path):
    """A probe that hangs (a --version that never answers) is killed at its timeout with its
    children, escaped or not, and the caller gets TimeoutExpired, not a wait on their pipes."""
    pidfile = tmp_path / "grandchild.pid"
    script = "import subprocess, sys; print(subprocess.Popen(['sleep', '30']).pid, flush=True); exec(sys.argv[3])"
    try:
        processes.run(
            [sys.executable, "-c", script, str(pidfile), "hang", DOUBLE_FORK],
            timeout_s=2,
            capture_output=True,
            text=True,
        )
    except subprocess.TimeoutExpired as exc:
        child = int(exc.output.split()[0])
    else:
        raise AssertionError("the hanging tool returned")
    assert gone(child) and gone(escaped_grandchild(pidfile))
    assert not processes.live()


def test_what_a_finished_tool_leaves_running_is_stopped(tmp_path):
    """A converter or build step that exits 0 but left a daemon behind (artifacts.run_tool)."""
    from autotune.modelfiles.artifacts import run_tool

    pidfile = tmp_path / "grandchild.pid"
    run_tool([sys.executable, "-c", DOUBLE_FORK, str(pidfile), "exit"], "a converter", lambda _: None)
    assert gone(escaped_grandchild(pidfile)), "run_tool left the converter's daemon running"
    result = processes.run([sys.executable, "-c", DOUBLE_FORK, str(tmp_path / "again.pid"), "exit"], timeout_s=30)
    assert result.returncode == 0 and gone(escaped_grandchild(tmp_path / "again.pid"))


def test_a_silent_converter_is_said_to_be_running_and_an_interrupt_ends_it(tmp_path, monkeypatch):
    """A converter that prints nothing (one writing a large tensor, or stuck) was a study that
    showed nothing at all until it ended: the progress came only with its output lines."""
    from autotune.modelfiles import artifacts

    monkeypatch.setattr(artifacts, "PROGRESS_S", 0.2, raising=False)
    pids = tmp_path / "pids"
    tool = tmp_path / "tool"
    tool.write_text(
        f"#!{sys.executable}\nimport os, time\nopen({str(pids)!r}, 'w').write(str(os.getpid()))\ntime.sleep(3)\n"
    )  # before, it ran out unreported
    tool.chmod(0o755)
    said: list[str] = []

    def say(line: str) -> None:
        said.append(line)
        if pids.exists() and pids.read_text():
            raise KeyboardInterrupt  # Ctrl-C while it runs, delivered where the study waits

    with pytest.raises(KeyboardInterrupt):
        artifacts.run_tool([str(tool)], "convert m", say)
    assert said[0].startswith("  convert m: running for ") and said[0].endswith("(no output yet)")
    assert not processes.live() and not alive(int(pids.read_text()))
