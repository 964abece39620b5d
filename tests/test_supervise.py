"""e2e/supervise.py, which runs the e2e cluster's operator as a kubelet runs a container (restart on exit, with a
doubling back-off), run as a process here with a short back-off."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from conftest import ROOT

from tensorfleet.testing.wait import wait_for

SUPERVISE = ROOT / "e2e" / "supervise.py"


def _events(status: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in status.read_text().splitlines()] if status.is_file() else []


def _start(status: Path, *command: str, backoff: float = 0.2) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, str(SUPERVISE), "--status", str(status), "--backoff", str(backoff),
                             "--", *command], start_new_session=True, stderr=subprocess.PIPE)


def test_a_command_that_exits_is_started_again_after_a_doubling_back_off(tmp_path: Path) -> None:
    status = tmp_path / "status"
    supervisor = _start(status, sys.executable, "-c", "raise SystemExit(3)")
    try:
        wait_for(lambda: sum(e["event"] == "started" for e in _events(status)) >= 4)
    finally:
        os.killpg(supervisor.pid, signal.SIGTERM)
        assert supervisor.wait(timeout=10) == 0
    events = _events(status)
    exits = [e for e in events if e["event"] == "exited"]
    assert [e["code"] for e in exits[:3]] == [3, 3, 3]  # a fourth, if any, was the stop's SIGTERM
    starts = [float(e["time"]) for e in events if e["event"] == "started"]  # type: ignore[arg-type]
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    # 0.2 s, then 0.4, then 0.8 (plus the command's own run): each wait about twice the one before.
    assert gaps[0] >= 0.2 and gaps[1] >= 0.4 and gaps[2] >= 0.8, gaps
    assert gaps[2] > gaps[0] * 2.5, gaps
    assert supervisor.stderr is not None
    assert b"exited with 3" in supervisor.stderr.read()


def test_signalling_the_group_ends_the_command_and_the_supervisor_without_a_restart(tmp_path: Path) -> None:
    status = tmp_path / "status"
    supervisor = _start(status, sys.executable, "-c", "import time; time.sleep(60)")
    wait_for(lambda: _events(status))
    os.killpg(supervisor.pid, signal.SIGTERM)
    assert supervisor.wait(timeout=10) == 0
    events = _events(status)
    assert [e["event"] for e in events] == ["started", "exited"], events
    assert events[1]["code"] == -signal.SIGTERM


def test_sigkill_of_the_group_leaves_no_command_behind(tmp_path: Path) -> None:
    status = tmp_path / "status"
    supervisor = _start(status, sys.executable, "-c", "import time; time.sleep(60)")
    wait_for(lambda: _events(status))
    child = int(_events(status)[0]["pid"])  # type: ignore[call-overload]
    os.killpg(supervisor.pid, signal.SIGKILL)
    supervisor.wait(timeout=10)
    wait_for(lambda: not Path(f"/proc/{child}").exists() or "Z" in Path(f"/proc/{child}/stat").read_text().split()[2])
