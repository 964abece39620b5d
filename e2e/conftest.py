"""Real-cluster e2e: skipped, with the reason, when no reachable cluster is configured.

Not part of the default test run (pyproject's testpaths is ["tests"]); run it with
`python -m pytest e2e` after the steps in e2e/README.md.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess

import pytest

HOW = "see e2e/README.md: kind create cluster, docker build + kind load, then KUBECONFIG=... python -m pytest e2e"


@functools.cache
def _why_not() -> str | None:
    if not os.environ.get("KUBECONFIG"):
        return f"KUBECONFIG is not set, so there is no cluster to test against ({HOW})"
    if shutil.which("kubectl") is None:
        return f"kubectl is not on PATH ({HOW})"
    try:
        probe = subprocess.run(["kubectl", "version", "--request-timeout=5s", "-o", "json"],
                               capture_output=True, text=True, timeout=15)
    except subprocess.TimeoutExpired:
        return f"the cluster in KUBECONFIG={os.environ['KUBECONFIG']} did not answer within 15 s ({HOW})"
    if probe.returncode != 0 or '"serverVersion"' not in probe.stdout:
        detail = (probe.stderr.strip().splitlines() or ["no server version"])[-1]
        return f"the cluster in KUBECONFIG={os.environ['KUBECONFIG']} is unreachable: {detail} ({HOW})"
    try:
        import helm_python  # noqa: F401
    except ImportError:
        return "helm-python-sdk is not installed (pip install -e '.[dev]')"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = _why_not()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        item.add_marker(skip)


def pytest_report_header(config: pytest.Config) -> str:
    reason = _why_not()
    return f"e2e: {reason}" if reason else f"e2e: cluster in KUBECONFIG={os.environ['KUBECONFIG']}"
