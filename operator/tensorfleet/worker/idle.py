"""Stands in for a Ray worker in simulator mode: does nothing until SIGTERM/SIGINT, then exits 0."""

from __future__ import annotations

import signal
import sys


def main() -> int:
    def stop(_signum: int, _frame: object) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print("tensorfleet-worker idle: standing in for a Ray worker (simulator mode)", file=sys.stderr, flush=True)
    while True:
        signal.pause()


if __name__ == "__main__":
    raise SystemExit(main())
