"""The launcher's stop signals: counted, and never able to hang the process that waits on them.

A Python signal handler runs on the main thread between two bytecodes, so it
can interrupt that thread while it holds a lock. The launcher once woke its
waits with `threading.Event.set()` from the handler: a SIGTERM landing inside
`Event.wait` or `Event.clear` then waited forever on the Event's own lock (seen
as a rare CI failure of test_second_sigterm_stops_at_once, and in a pod it is a
launcher stuck until the grace period's SIGKILL). The first test makes that
timing certain instead of rare: it raises SIGTERM at every line the waiting
thread runs. Each scenario runs in a child process, so a hang is a timeout
here, not a hung test run.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

PRELUDE = """
import os, signal, sys, threading, time
from tensorfleet.worker.supervise import Signals
signals = Signals().install()
"""


def _run(body: str, timeout: float = 60) -> str:
    done = subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(body)],
                          capture_output=True, text=True, timeout=timeout, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_signal_at_any_line_of_the_wait_never_hangs_it() -> None:
    out = _run("""
        def tracer(frame, event, arg):
            if event == "line":
                os.kill(os.getpid(), signal.SIGTERM)
            return tracer

        rounds = 0
        sys.settrace(tracer)
        for _ in range(200):
            signals.wait(0.001)
            signals.handled()
            rounds += 1
        sys.settrace(None)
        print(rounds, signals.count, signals.pending)
    """)
    rounds, count, pending = out.split()
    assert int(rounds) == 200
    assert int(count) >= 200   # the tracer did interrupt the waits
    assert pending in ("True", "False")


def test_a_signal_before_the_wait_is_pending_until_handled() -> None:
    out = _run("""
        assert not signals.pending and not signals.wait(0.01)
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)
        assert signals.count == 2 and signals.last == signal.SIGINT and signals.stopping
        assert signals.wait(3600)          # returns at once: a signal is unhandled
        signals.handled()
        assert not signals.pending and not signals.wait(0.01)
        signals.restore()                  # the previous handlers are back, the pipe is closed
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
        print("ok")
    """)
    assert out.strip() == "ok"


def test_a_signal_from_another_process_ends_a_long_wait() -> None:
    out = _run("""
        # A separate process signals this one while it sleeps in wait(600).
        child = __import__("subprocess").Popen(
            [sys.executable, "-c", f"import os, signal, time; time.sleep(0.3); os.kill({os.getpid()}, signal.SIGTERM)"])
        started = time.monotonic()
        woke = signals.wait(600)
        child.wait()
        print(woke, time.monotonic() - started)
    """)
    woke, waited = out.split()
    assert woke == "True"
    assert float(waited) < 60, f"the wait ran {waited}s: the signal did not end it"
