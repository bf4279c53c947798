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
