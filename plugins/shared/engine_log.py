"""What an engine process writes when it crashes, for every plugin that reads its log."""

from __future__ import annotations

import re

__all__ = ["DEBUGGER_LINE"]

# What ggml's crash handler prints after it: gdb's (or lldb's) backtrace of every thread. Its last
# lines ("#5 0x... in main ()", "[Inferior 1 (process 12) detached]") were stored as the reason.
DEBUGGER_LINE = re.compile(
    r"^(#\d+\s|\[New LWP|\[Thread debugging|\[Inferior \d|Using host libthread_db|"
    r"warning: (could not|Unable to|Error disabling)|\(gdb\)|ptrace:|No stack\.|"
    r"Could not attach|0x[0-9a-f]+ in )"
)
