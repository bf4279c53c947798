"""Ctrl-C during a study ends it, even when Python drops the first interrupt."""

import gc
import os
import signal
import sys
import time

import pytest

from autotune.study.interrupts import Interrupted, Interrupts


class _FinalizedUnderSignal:
    """Its finalizer is where the signal's handler runs: Python prints what a ``__del__``
    raises as "Exception ignored" and goes on, as it did inside SQLAlchemy's registry."""

    def __del__(self):
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(10_000):  # bytecodes for the handler to run on, inside the finalizer
            pass


def test_an_interrupt_dropped_by_a_finalizer_is_raised_again(monkeypatch):
    dropped, redelivered = [], []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: dropped.append(u.exc_type))
    # The re-delivery itself is recorded, not timed: how soon a thread runs after its wait
    # follows the machine's load. The period stays the study's second: a shorter one (0.1 s)
    # came while the finalizer still ran on a loaded machine, and that delivery was dropped too.
    pthread_kill = signal.pthread_kill
    monkeypatch.setattr(signal, "pthread_kill", lambda *a: (redelivered.append(a), pthread_kill(*a)))
    interrupts = Interrupts()
    # What the process had: Python's default handler, or SIG_IGN where it was started in the
    # background by a non-interactive shell (SIGINT ignored from the start).
    before = signal.getsignal(signal.SIGINT)
    started = time.monotonic()
    with interrupts.installed():
        with pytest.raises(Interrupted):
            obj = _FinalizedUnderSignal()
            del obj
            gc.collect()
            while time.monotonic() - started < 10:
                time.sleep(0.01)
        interrupts.caught()
    assert dropped == [Interrupted]  # the first one was dropped...
    assert redelivered  # ...and the insisting thread delivered it again
    assert signal.getsignal(signal.SIGINT) is before  # given back as it was


def test_an_interrupt_while_deferred_is_raised_when_the_block_ends():
    interrupts = Interrupts()
    reached_end_of_block = False
    with interrupts.installed():
        with pytest.raises(Interrupted):
            with interrupts.deferred():
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.05)
                reached_end_of_block = True
        interrupts.caught()
    assert reached_end_of_block


def test_a_late_delivery_after_the_catch_is_ignored():
    interrupts = Interrupts()
    with interrupts.installed():
        with pytest.raises(Interrupted):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
        interrupts.caught()
        os.kill(os.getpid(), signal.SIGINT)  # as a re-delivery already on its way would
        time.sleep(0.05)
    interrupts.raise_if_interrupted()  # caught: nothing more to raise
