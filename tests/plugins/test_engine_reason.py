"""A trial's stored reason is the engine's own error line, not a debugger's backtrace (issue 41,
item 4): ggml's crash handler runs gdb after a failed assertion, and its last lines were stored."""

from __future__ import annotations

from autotune_plugins.llama_server.server import engine_reason

# What llama-server prints when ggml asserts (a CPU build with gdb installed): the assertion, then
# gdb attached to the dying process, every thread's frames, and the detach.
CRASH = """\
main: server is listening on http://127.0.0.1:40123 - starting the main loop
srv  update_slots: all slots are idle
/src/ggml/src/ggml-cpu/ops.cpp:4411: GGML_ASSERT(ne11 == ne02) failed
[New LWP 4242]
[New LWP 4243]
[Thread debugging using libthread_db enabled]
Using host libthread_db library "/lib/x86_64-linux-gnu/libthread_db.so.1".
0x00007f1c2e6ea42f in __GI___wait4 (pid=4244, stat_loc=0x0, options=0) at ../sysdeps/unix/sysv/linux/wait4.c:30
#0  0x00007f1c2e6ea42f in __GI___wait4 (pid=4244) at ../sysdeps/unix/sysv/linux/wait4.c:30
#1  0x00007f1c2ed1a2b1 in ggml_print_backtrace () from libggml-base.so
#2  0x00007f1c2ed1a3f6 in ggml_abort () from libggml-base.so
#3  0x000055d0c0a1b2c3 in main ()
[Inferior 1 (process 4241) detached]
"""


def test_the_assertion_is_the_reason_and_the_backtrace_is_not():
    reason = engine_reason(CRASH)
    assert reason.startswith("/src/ggml/src/ggml-cpu/ops.cpp:4411: GGML_ASSERT(ne11 == ne02) failed")
    assert "#0" not in reason and "Inferior" not in reason and "wait4" not in reason


def test_an_ordinary_error_line_is_still_the_reason():
    log = "load_model: loading\nerror: unknown value for --cache-type-k: q9_0\nmain: exiting\n"
    assert engine_reason(log) == "error: unknown value for --cache-type-k: q9_0"


def test_a_batch_smaller_than_the_slots_is_refused_before_launch_and_its_abort_reads_as_itself(tmp_path):
    """llama-server -np 2 -b 1 aborts at start in output_reserve and prints gdb's backtrace: the
    rule refuses it before launch, and the log's reason, had it run, is the assertion."""
    import shutil
    import subprocess

    from autotune.engine.backend import TrialConfig
    from autotune_plugins.llama_server.backend import LlamaServerBackend
    from tests.engine_fixtures import llama_server_binary
    from tests.plugins.test_openai_server import STORIES, make_ctx

    shutil.copy(STORIES, tmp_path / "m.gguf")
    ctx = make_ctx(tmp_path)
    opts = (("batch", 1), ("cache_type", "f16"), ("flash_attn", True))
    (reason,) = LlamaServerBackend().check(TrialConfig("llama-server", "m.gguf", 256, 2, opts), ctx)
    assert reason.startswith("batch 1 is smaller than parallel 2: llama.cpp aborts")
    assert LlamaServerBackend().check(TrialConfig("llama-server", "m.gguf", 256, 1, opts), ctx) == []
    proc = subprocess.run(
        [
            str(llama_server_binary()),
            "-m",
            str(tmp_path / "m.gguf"),
            "-c",
            "256",
            "-np",
            "2",
            "-b",
            "1",
            "-t",
            "1",
            "--port",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    said = engine_reason(proc.stdout + proc.stderr)
    assert "GGML_ASSERT(n_outputs_max <= cparams.n_outputs_max) failed" in said.split(" | ")[0]
    assert "#0" not in said and "Inferior" not in said
