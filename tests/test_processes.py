"""autotune.processes: an engine's whole process group is registered, stopped and forgotten."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from autotune import processes


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone for our purposes
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def test_start_registers_and_stop_ends_the_group():
    # The engine starts a child of its own: stopping the engine must end both.
    script = "import subprocess, sys, time; c = subprocess.Popen(['sleep', '60']); print(c.pid, flush=True); time.sleep(60)"
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
