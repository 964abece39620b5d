"""What `helm install` of the chart left in the cluster, and what the operator's identity may do."""

from __future__ import annotations

import datetime
import re

from kube import SYSTEM_NAMESPACE, get, kubectl, kubectl_result, operator_service_account

from tensorfleet import contract
from tensorfleet.kube.resources import rbac_rules

# Rows every authenticated identity gets from the default system:basic-user binding.
DEFAULT_ROWS = {("selfsubjectreviews.authentication.k8s.io", "create"),
                ("selfsubjectaccessreviews.authorization.k8s.io", "create"),
                ("selfsubjectrulesreviews.authorization.k8s.io", "create")}


def test_the_chart_installed_the_crd_and_the_operator_holds_the_lease() -> None:
    crd = get("customresourcedefinition", contract.CRD_NAME, None)
    assert crd is not None, "the chart's crds/ installs the InferenceService CRD"
    established = [c for c in crd["status"]["conditions"] if c["type"] == "Established"]
    assert established and established[0]["status"] == "True"
    lease = get("lease", "tensorfleet-operator", SYSTEM_NAMESPACE)
    assert lease is not None, "the operator elects itself on its Lease"
    renewed = datetime.datetime.fromisoformat(lease["spec"]["renewTime"])
    age = datetime.datetime.now(datetime.UTC) - renewed
    assert age.total_seconds() < 3 * lease["spec"]["leaseDurationSeconds"], f"the Lease is stale ({age})"


def _granted(identity: str, namespace: str) -> set[tuple[str, str]]:
    table = kubectl("auth", "can-i", "--list", f"--as={identity}", "-n", namespace)
    rows: set[tuple[str, str]] = set()
    for line in table.splitlines()[1:]:
        match = re.match(r"^(\S+)\s+\[\]\s+\[\]\s+\[(.*)\]\s*$", line)
        if match:
            rows |= {(match.group(1), verb) for verb in match.group(2).split()}
    return rows


def test_the_operator_identity_holds_exactly_the_rbac_table() -> None:
    identity = operator_service_account()
    wanted: set[tuple[str, str]] = set()
    for rule in rbac_rules():
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                name = resource if not group else f"{resource.split('/')[0]}.{group}" + (
                    f"/{resource.split('/')[1]}" if "/" in resource else "")
                wanted |= {(name, verb) for verb in rule["verbs"]}
    assert _granted(identity, "default") - DEFAULT_ROWS == wanted


def test_the_operator_identity_cannot_read_secrets_or_escalate() -> None:
    identity = operator_service_account()
    for args in (("get", "secrets", "-A"), ("list", "secrets", "-A"), ("get", "secrets", "-n", SYSTEM_NAMESPACE),
                 ("create", "clusterroles"), ("create", "clusterrolebindings"), ("escalate", "roles", "-n", "default"),
                 ("bind", "roles", "-n", "default"), ("delete", "nodes"), ("create", "pods", "-n", "default"),
                 ("update", "inferenceservices.tensorfleet.dev", "-n", "default")):
        done = kubectl_result("auth", "can-i", *args, f"--as={identity}")
        assert done.stdout.strip() == "no", f"{identity} can {' '.join(args)}: {done.stdout.strip()}"
