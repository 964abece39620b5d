"""Isolation on the real API server: the NetworkPolicies the operator renders are
accepted, owned and pruned, and every pod of an InferenceService is admitted in a
namespace that enforces Pod Security `restricted`.

PodSecurity is one of kube-apiserver's default admission plugins, so the
namespace label below makes the API server itself refuse any pod that breaks the
profile; the first test shows it does. KWOK runs no network plugin, so nothing
here enforces the NetworkPolicies' traffic rules: what this shows is that the
real API server's validation accepts them and the operator owns them.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import yaml
from kube import (
    SYSTEM_NAMESPACE,
    apply,
    deploy,
    engine_pods,
    eventually,
    example,
    isvc,
    items,
    kubectl,
    kubectl_result,
    wait_ready,
)

from tensorfleet import contract
from tensorfleet.api import load_inference_service
from tensorfleet.planner import make_plan
from tensorfleet.render import render

RESTRICTED = ("pod-security.kubernetes.io/enforce=restricted", "pod-security.kubernetes.io/enforce-version=latest")
POLICY_SETTINGS = {
    "clientNamespaces": ["ingress-nginx"],
    "clientCIDRs": ["10.0.0.0/8", "2001:db8::/32"],
    "monitoringNamespaces": ["monitoring", "prometheus"],
}


def _enforce_restricted(namespace: str) -> None:
    kubectl("label", "namespace", namespace, *RESTRICTED, "--overwrite")


def _rendered(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """What the operator renders: it runs beside the chart, in its namespace (the routers admit the gateway's
    pods from there)."""
    parsed = load_inference_service(doc)
    return render(parsed, make_plan(parsed.spec), operator_namespace=SYSTEM_NAMESPACE)


def _policies(name: str, namespace: str) -> dict[str, dict[str, Any]]:
    found = items("networkpolicies", namespace, f"{contract.LABEL_INFERENCE_SERVICE}={name}")
    return {p["metadata"]["name"]: p for p in found}


def test_the_api_server_enforces_restricted_here(namespace: str) -> None:
    """The profile is really enforced in such a namespace: a pod with no securityContext is refused."""
    _enforce_restricted(namespace)
    refused = kubectl_result("run", "plain", "-n", namespace, "--image=registry.example/plain:1", "--restart=Never",
                             "--dry-run=server")
    assert refused.returncode != 0, refused.stdout
    assert 'violates PodSecurity "restricted:latest"' in refused.stderr, refused.stderr
    # A workload whose pod template breaks it is stored with a warning (the dry run below looks for it).
    plain = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "plain", "namespace": namespace},
             "spec": {"selector": {"matchLabels": {"app": "plain"}}, "template": {
                 "metadata": {"labels": {"app": "plain"}},
                 "spec": {"containers": [{"name": "c", "image": "registry.example/plain:1"}]}}}}
    warned = kubectl_result("apply", "--dry-run=server", "-f", "-", stdin=yaml.safe_dump(plain))
    assert warned.returncode == 0 and 'would violate PodSecurity "restricted:latest"' in warned.stderr, warned.stderr


@pytest.mark.parametrize("file", ["llama-3.1-70b-a100.yaml", "simulator-cpu.yaml"])
def test_every_pod_is_admitted_under_restricted(namespace: str, file: str) -> None:
    _enforce_restricted(namespace)
    name, doc = deploy(file, namespace)
    pipeline = make_plan(load_inference_service(doc).spec).pipeline
    engines = engine_pods(name, namespace)
    assert len(engines) == pipeline, [p["metadata"]["name"] for p in engines]
    routers = items("pods", namespace, f"{contract.LABEL_INFERENCE_SERVICE}={name},"
                                       f"{contract.LABEL_COMPONENT}={contract.COMPONENT_ROUTER}")
    assert routers, "the router pods were admitted"
    for pod in [*engines, *routers]:
        assert pod["spec"]["securityContext"]["runAsNonRoot"] is True, pod["metadata"]["name"]
    # Nothing the workload controllers tried to create was refused.
    refused = kubectl("get", "events", "-n", namespace, "--field-selector", "reason=FailedCreate",
                      "-o", "jsonpath={.items[*].message}")
    assert refused.strip() == ""


def test_the_operator_owns_its_network_policies(namespace: str) -> None:
    name, doc = deploy("simulator-cpu.yaml", namespace, networkPolicy=POLICY_SETTINGS)
    uid = (isvc(name, namespace) or {})["metadata"]["uid"]
    live = _policies(name, namespace)
    want = {o["metadata"]["name"]: o for o in _rendered(doc) if o["kind"] == "NetworkPolicy"}
    assert set(live) == set(want) == {f"{name}-engine", f"{name}-router"}
    for policy_name, policy in live.items():
        # Stored as rendered: the real validation took every field, IPv6 CIDR included.
        assert policy["spec"] == want[policy_name]["spec"], policy_name
        (owner,) = policy["metadata"]["ownerReferences"]
        assert owner["uid"] == uid and owner["controller"] is True

    # Turned off explicitly: the operator prunes them; turned on again: back.
    apply({**doc, "spec": {**doc["spec"], "networkPolicy": {"enabled": False}}})
    eventually("the NetworkPolicies pruned", lambda: not _policies(name, namespace))
    wait_ready(name, namespace)
    apply(doc)
    eventually("the NetworkPolicies back", lambda: set(_policies(name, namespace)) == set(want))


@pytest.mark.parametrize("file", ["deepseek-v3-h200.yaml", "llama-3.1-405b-h100-multinode.yaml",
                                  "llama-3.1-8b-l4.yaml", "mixtral-8x7b-h100.yaml"])
def test_every_examples_objects_pass_server_validation(namespace: str, file: str) -> None:
    """What every other example renders, with every networkPolicy setting, is accepted (dry run) by the
    API server in a restricted namespace: the pod templates are checked at pod admission only, so the
    NetworkPolicies and workloads are sent through the server's own validation here."""
    _enforce_restricted(namespace)
    doc = example(file, namespace, networkPolicy=copy.deepcopy(POLICY_SETTINGS))
    doc["metadata"].pop("uid", None)
    objects = [o for o in _rendered(doc) if o["kind"] in ("NetworkPolicy", "StatefulSet", "Deployment")]
    assert any(o["kind"] == "NetworkPolicy" for o in objects)
    done = kubectl_result("apply", "--dry-run=server", "--validate=strict", "-f", "-",
                          stdin=yaml.safe_dump_all(objects))
    assert done.returncode == 0, done.stderr
    assert "would violate PodSecurity" not in done.stderr, done.stderr
