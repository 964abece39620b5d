"""Run one command as a kubelet runs a container with `restartPolicy: Always`: whenever it exits it starts again,
after the kubelet's crash-loop back-off (10 s, doubled at each restart up to 300 s, back to 10 s once a run
lasted 10 minutes). `e2e/cluster` runs the operator under it, so an operator that exits by design (it lost its
Lease while the API server was away) comes back as its pod would (e2e/README.md).

It is stopped through its process group (`e2e/cluster` signals the group, which reaches the command too): on
SIGTERM or SIGINT it waits for the command to end and does not start it again; SIGKILL ends both. Each start and
exit is appended to the --status file as a JSON line (`e2e/cluster status` counts the restarts).
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType

BACKOFF_INITIAL_S = 10.0
BACKOFF_MAX_S = 300.0
BACKOFF_RESET_AFTER_S = 600.0  # a run this long counts as healthy: the next crash waits the initial back-off


def record(status: Path, **event: object) -> None:
    with status.open("a") as out:
        out.write(json.dumps({"time": round(time.time(), 3), **event}) + "\n")


def events(status: Path) -> list[str]:
    """The events recorded so far, in order ("started", "exited"); none when the file is absent."""
    try:
        lines = status.read_text().splitlines()
    except FileNotFoundError:
        return []
    found = []
    for line in lines:
        try:
            found.append(str(json.loads(line).get("event")))
        except ValueError:
            continue  # a line being written as we read
    return found


def restarts(status: Path) -> int:
    """How many times the command was started again (0 when the file is absent)."""
    return max(0, events(status).count("started") - 1)


def say(message: str) -> None:
    sys.stderr.write(f"supervise: {message}\n")
    sys.stderr.flush()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--status", type=Path, required=True, help="file the starts and exits are appended to")
    parser.add_argument("--backoff", type=float, default=BACKOFF_INITIAL_S,
                        help=f"seconds before the first restart, doubled at each (default {BACKOFF_INITIAL_S:g}, "
                             "the kubelet's)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARG ...]")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given after --")
    stopping = False

    def stop(_signum: int, _frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True  # the command got the same signal from the group's; let it end

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    backoff = args.backoff
    while True:
        started = time.monotonic()
        child = subprocess.Popen(command)
        record(args.status, event="started", pid=child.pid)
        code = child.wait()
        ran = time.monotonic() - started
        record(args.status, event="exited", pid=child.pid, code=code, ran=round(ran, 3))
        if stopping:
            return 0
        if ran >= BACKOFF_RESET_AFTER_S:
            backoff = args.backoff
        say(f"{command[0]} (pid {child.pid}) exited with {code} after {ran:.1f}s; starting it again in {backoff:g}s")
        deadline = time.monotonic() + backoff
        while not stopping and time.monotonic() < deadline:
            time.sleep(0.2)
        if stopping:
            return 0
        backoff = min(backoff * 2, BACKOFF_MAX_S)


if __name__ == "__main__":
    sys.exit(main())
