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


def test_an_engine_that_ignores_sigterm_is_killed_with_its_processes_after_kill_after() -> None:
    """vLLM loading weights or compiling does not act on SIGTERM: kill_after seconds after the launcher sent it,
    the engine and every process of its group (vLLM's engine core, its workers) get SIGKILL."""
    out = _run("""
        from tensorfleet.worker.supervise import run_child
        import tempfile
        pids = tempfile.mktemp()
        engine = ("import os, signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                  "core = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
                  "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)']); "
                  f"open({pids!r}, 'w').write(str(core.pid)); time.sleep(600)")
        threading.Timer(1.5, lambda: os.kill(os.getpid(), signal.SIGTERM)).start()
        lines = []
        started = time.monotonic()
        code, _ = run_child([sys.executable, "-c", engine], os.environ, signals=signals, log=lines.append,
                            poll=0.05, kill_after=0.5)
        took = time.monotonic() - started
        core = int(open(pids).read())
        for _ in range(100):   # the engine core, orphaned, is reaped by init: gone within moments
            try:
                os.kill(core, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        else:
            raise AssertionError(f"the engine core {core} outlived the engine")
        print(code, round(took, 1))
        print(lines[-1])
    """)
    first, last = out.strip().splitlines()
    code, took = first.split()
    assert int(code) == 128 + 9
    assert 2.0 <= float(took) < 10, took
    assert "still runs 0.5s after SIGTERM: killing it" in last


def test_without_kill_after_only_a_third_signal_kills_the_engine() -> None:
    out = _run("""
        from tensorfleet.worker.supervise import run_child
        engine = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
        for delay in (1.0, 2.0, 3.0):
            threading.Timer(delay, lambda: os.kill(os.getpid(), signal.SIGTERM)).start()
        started = time.monotonic()
        code, _ = run_child([sys.executable, "-c", engine], os.environ, signals=signals, log=lambda _: None, poll=0.05)
        print(code, round(time.monotonic() - started, 1))
    """)
    code, took = out.split()
    assert int(code) == 128 + 9 and float(took) >= 3.0
