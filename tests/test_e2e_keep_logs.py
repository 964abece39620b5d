"""`e2e/cluster keep-logs`: what .ci/run calls when the e2e suite fails, before `down` removes the state folder."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

CLUSTER = Path(__file__).resolve().parent.parent / "e2e" / "cluster"


def test_keep_logs_copies_the_logs_out_of_the_state_folder_and_prints_their_tails(tmp_path: Path) -> None:
    state, cache = tmp_path / "state", tmp_path / "cache"
    (state / "monitoring").mkdir(parents=True)
    (state / "operator.log").write_text("".join(f"operator line {i}\n" for i in range(300)))
    (state / "podrunner.log").write_text("pod runner started\npod e2e/x: engine: exited\n")
    done = subprocess.run([sys.executable, str(CLUSTER), "keep-logs", "--tail", "5"], check=False, capture_output=True,
                          env={**os.environ, "TF_E2E_STATE": str(state), "TF_E2E_CACHE": str(cache)}, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    kept = cache / "e2e-cluster-failed-logs"
    assert sorted(p.name for p in kept.iterdir()) == ["operator.log", "podrunner.log"]
    lines = done.stdout.splitlines()
    assert lines[0] == f"== the last 5 lines of {kept / 'operator.log'}"
    assert lines[1:6] == [f"operator line {i}" for i in range(295, 300)]
    assert lines[6] == f"== the last 2 lines of {kept / 'podrunner.log'}"
    assert lines[7:] == ["pod runner started", "pod e2e/x: engine: exited"]
    assert f"logs kept in {kept}" in done.stderr
