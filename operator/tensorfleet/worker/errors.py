"""Exit codes and the one error type users see (one line, no traceback)."""

from __future__ import annotations

EXIT_OK = 0
EXIT_UNHEALTHY = 1          # health: a GPU check failed
EXIT_CONFIG = 2             # bad env or flags
EXIT_TIMEOUT = 3            # launcher: the group did not form before the deadline
EXIT_NO_NVML = 3            # health: NVML unavailable, GPUs cannot be checked
EXIT_LEADER_LOST = 4        # launcher (stage > 0): the leader went away; restart and rejoin
EXIT_START_FAILED = 5       # launcher: `ray start --head` failed
EXIT_NOT_FOUND = 127        # a command the launcher runs is not installed


class WorkerError(Exception):
    """A problem the user or the cluster caused: printed as one line, then exit `code`."""

    def __init__(self, message: str, code: int = EXIT_CONFIG) -> None:
        super().__init__(message)
        self.code = code
