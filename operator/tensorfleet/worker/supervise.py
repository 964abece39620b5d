"""Running the engine as a child of the launcher, which stays PID 1 rather than exec it, to drain in-flight requests
before the engine's SIGTERM, reap Ray's orphaned daemons and watch the leader; the signal sequence ends in SIGKILL
of the engine's whole process group. Design: docs/architecture.md#the-engine-pod.
"""

from __future__ import annotations

import math
import os
import select
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from types import FrameType

from tensorfleet import contract
from tensorfleet.worker.errors import EXIT_NOT_FOUND, WorkerError

Log = Callable[[str], None]
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Signals:
    """Counts stop signals and wakes the launcher's waits; no lock is taken in the handler.

    A Python signal handler runs on the main thread between two bytecodes,
    possibly while that thread holds a lock: `threading.Event.set` there can
    wait forever on the Event's own lock, taken by a `wait` or `clear` the
    signal interrupted (a launcher stuck on SIGTERM until the grace period's
    SIGKILL). So the handler only counts and writes a byte to a pipe, and
    `wait` sleeps in select() on that pipe: a signal that lands before or
    during the select still ends it at once.
    """

    def __init__(self) -> None:
        self.count = 0
        self.last: int | None = None
        self._handled = 0
        self._pipe: tuple[int, int] | None = None
        # What signal.signal returns: a handler, SIG_DFL/SIG_IGN, or None (not installed from Python).
        self._previous: dict[int, Callable[[int, FrameType | None], object] | int | signal.Handlers | None] = {}

    def install(self) -> Signals:
        if self._pipe is None:
            read, write = os.pipe()
            os.set_blocking(read, False)
            os.set_blocking(write, False)
            self._pipe = (read, write)
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        if self._pipe is not None:
            for fd in self._pipe:
                os.close(fd)
            self._pipe = None

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        self.count += 1
        self.last = signum
        if self._pipe is not None:
            try:
                os.write(self._pipe[1], b"\0")
            except OSError:
                pass   # the pipe is full of wake-ups nobody has read yet: one more adds nothing

    @property
    def pending(self) -> bool:
        """A stop signal has arrived since the last `handled()`."""
        return self.count > self._handled

    def handled(self) -> None:
        """Every signal so far has been acted on: the next `wait` sleeps until a new one."""
        self._handled = self.count

    def wait(self, timeout: float) -> bool:
        """Sleep up to timeout seconds or until a stop signal is pending; return whether one is."""
        if self.pending:
            return True
        if self._pipe is None:
            time.sleep(timeout)
            return self.pending
        read = self._pipe[0]
        ready, _, _ = select.select([read], [], [], timeout)
        if ready:
            try:
                while os.read(read, 4096):
                    pass
            except BlockingIOError:
                pass
        return self.pending

    @property
    def stopping(self) -> bool:
        return self.count > 0


def exit_code(status: int) -> int:
    """A wait status as a shell reports it: the exit code, or 128 + the signal number."""
    code = os.waitstatus_to_exitcode(status)
    return 128 - code if code < 0 else code


def spawn(argv: Sequence[str], env: Mapping[str, str]) -> subprocess.Popen[bytes]:
    try:
        # Its own session: a terminal's Ctrl-C reaches the launcher only,
        # which decides when the engine gets it.
        return subprocess.Popen(list(argv), env=dict(env), start_new_session=True)
    except FileNotFoundError:
        raise WorkerError(f"{argv[0]}: command not found on PATH (needed to run `{' '.join(argv[:2])}`)", EXIT_NOT_FOUND) from None
    except PermissionError:
        raise WorkerError(f"{argv[0]}: not executable", EXIT_NOT_FOUND) from None


def _reap(proc: subprocess.Popen[bytes]) -> int | None:
    """Exit code of `proc` if it has exited; as PID 1 also reap every orphan."""
    if os.getpid() == 1:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            if pid == proc.pid:
                proc.returncode = exit_code(status)
        return proc.returncode
    try:
        pid, status = os.waitpid(proc.pid, os.WNOHANG)
    except ChildProcessError:
        return proc.returncode if proc.returncode is not None else 0
    if pid == proc.pid:
        proc.returncode = exit_code(status)
    return proc.returncode


def _send(proc: subprocess.Popen[bytes], sig: int) -> None:
    try:
        os.kill(proc.pid, sig)
    except ProcessLookupError:
        pass


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the child's process group (spawn gave it a session of its own, so its group is its pid)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        _send(proc, signal.SIGKILL)


def run_child(
    argv: Sequence[str],
    env: Mapping[str, str],
    *,
    signals: Signals,
    log: Log,
    poll: float = 0.5,
    drain: Callable[[], bool] | None = None,
    watch: Callable[[], str | None] | None = None,
    kill_after: float | None = None,
) -> tuple[int, str | None]:
    """Run argv until it exits; return (exit code, the watch's reason if it stopped the child). kill_after:
    seconds from the SIGTERM sent to the child to SIGKILL (None: only a third stop signal kills it)."""
    proc = spawn(argv, env)
    log(f"started `{' '.join(argv[:3])}` (pid {proc.pid})")
    forwarded = 0   # signals forwarded: 0 none, 1 SIGTERM, 2 SIGKILL
    termed = 0.0    # when the SIGTERM went
    reason: str | None = None
    while True:
        code = _reap(proc)
        if code is not None:
            return code, reason
        if signals.count >= 3 and forwarded < 2:
            log("third stop signal: killing the engine")
            _kill_group(proc)
            forwarded = 2
        elif forwarded == 1 and kill_after is not None and time.monotonic() - termed >= kill_after:
            log(f"`{argv[0]}` (pid {proc.pid}) still runs {kill_after:g}s after SIGTERM: killing it")
            _kill_group(proc)
            forwarded = 2
        elif signals.count >= 1 and forwarded < 1:
            if signals.count >= 2 or drain is None or drain():
                log(f"forwarding SIGTERM to `{argv[0]}` (pid {proc.pid})")
                _send(proc, signal.SIGTERM)
                forwarded, termed = 1, time.monotonic()
        elif not signals.stopping and watch is not None and reason is None:
            reason = watch()
            if reason:
                log(f"stopping `{argv[0]}` (pid {proc.pid}): the leader is gone")
                _send(proc, signal.SIGTERM)
                forwarded, termed = 1, time.monotonic()
        signals.wait(poll if forwarded != 1 or kill_after is None
                     else max(0.0, min(poll, termed + kill_after - time.monotonic())))
        if signals.stopping:
            # Wake early again only for a signal that arrives after this one.
            signals.handled()


def in_flight(port: int, timeout: float = 2.0) -> int | None:
    """Requests running + waiting in the engine, from its /metrics; None if it
    does not answer, or answers with what is not Prometheus text. A NaN or
    infinite gauge counts as 0."""
    from tensorfleet import promtext  # prometheus_client only when draining, not at launcher start

    url = f"http://127.0.0.1:{port}{contract.METRICS_PATH}"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            text = response.read().decode("utf-8", "replace")
        samples = promtext.samples(text)
    except (urllib.error.URLError, OSError, ValueError):
        return None
    names = (contract.VLLM_METRIC_RUNNING, contract.VLLM_METRIC_WAITING)
    return int(sum((s.value for s in samples if s.name in names and math.isfinite(s.value)), 0.0))


class EngineDrain:
    """Drain rule for the serving stage: SIGTERM only once no request is in flight.

    The pod is already out of its Services' ready endpoints while terminating,
    so the router sends nothing new; requests in flight finish first. If the
    engine's /metrics does not answer (still loading, or gone) there is
    nothing to wait for.
    """

    def __init__(self, port: int, *, log: Log, log_every: float, probe: Callable[[int], int | None] = in_flight) -> None:
        self.port, self.log, self.log_every, self.probe = port, log, log_every, probe
        self.started: float | None = None
        self.last_log: float | None = None

    def __call__(self) -> bool:
        now = time.monotonic()
        if self.started is None:
            self.started = now
        count = self.probe(self.port)
        if count is None or count <= 0:
            waited = f" after {now - self.started:.0f}s" if now - self.started >= 1 else ""
            self.log(f"no request in flight{waited}; stopping the engine")
            return True
        if self.last_log is None or now - self.last_log >= self.log_every:
            self.log(f"draining: {count} request(s) in flight; the engine stops when they finish "
                     "(the pod's termination grace period bounds the wait; signal again to stop now)")
            self.last_log = now
        return False
