"""e2e against a real control plane: the one `e2e/cluster up` starts, or any cluster in KUBECONFIG.

The suite expects the chart installed and the operator running (e2e/cluster up
does both; on another cluster, `helm install` first: see e2e/README.md).

Without a reachable cluster the tests are skipped with the reason, which is for
a person who runs `pytest e2e` without a cluster on purpose. With
TF_E2E_REQUIRE_CLUSTER=1 (which .ci/run sets) a missing cluster is an error and
the run fails instead.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
from collections.abc import Iterator

import pytest
from kube import delete_namespace_later, new_namespace, wait_deleted

HOW = "run `eval \"$(e2e/cluster up)\"` first (see e2e/README.md)"


@functools.cache
def why_not() -> str | None:
    if not os.environ.get("KUBECONFIG"):
        return f"KUBECONFIG is not set, so there is no cluster to test against; {HOW}"
    if shutil.which("kubectl") is None:
        return f"kubectl is not on PATH; {HOW}"
    try:
        probe = subprocess.run(["kubectl", "version", "--request-timeout=5s", "-o", "json"],
                               capture_output=True, text=True, timeout=15, check=False)
    except subprocess.TimeoutExpired:
        return f"the cluster in KUBECONFIG={os.environ['KUBECONFIG']} did not answer within 15 s; {HOW}"
    if probe.returncode != 0 or '"serverVersion"' not in probe.stdout:
        detail = (probe.stderr.strip().splitlines() or ["no server version"])[-1]
        return f"the cluster in KUBECONFIG={os.environ['KUBECONFIG']} is unreachable: {detail}; {HOW}"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # The fault tests stop, freeze and restart the control plane under everything on it: they run last.
    items.sort(key=lambda item: item.path.name == "test_faults.py")
    reason = why_not()
    if reason is None:
        return
    if os.environ.get("TF_E2E_REQUIRE_CLUSTER"):
        raise pytest.UsageError(f"TF_E2E_REQUIRE_CLUSTER is set but {reason}")
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        item.add_marker(skip)


def pytest_report_header(config: pytest.Config) -> str:
    reason = why_not()
    return f"e2e: {reason}" if reason else f"e2e: cluster in KUBECONFIG={os.environ['KUBECONFIG']}"


@pytest.fixture
def namespace(request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace for one test, deleted afterwards (waited for by `wait_deleted`)."""
    prefix = re.sub(r"[^a-z0-9]+", "-", request.node.name.removeprefix("test_").lower())[:30].strip("-")
    name = new_namespace(prefix)
    try:
        yield name
    finally:
        delete_namespace_later(name)


@pytest.fixture(scope="session", autouse=True)
def _namespaces_gone() -> Iterator[None]:
    """Every test namespace gone before the session ends (so `e2e/cluster down` finds a quiet cluster)."""
    yield
    wait_deleted()
