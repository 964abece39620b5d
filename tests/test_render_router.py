"""Rendering, the router and the network around the engines: the Services, the router's Deployment (its
arguments, API keys from a Secret) and RBAC, and the NetworkPolicies that admit clients, the router, the gateway and
monitoring.
"""

from __future__ import annotations

import argparse
from typing import Any

import pytest
from test_render import (
    PIPELINE_1,
    PIPELINE_2,
    PIPELINE_3,
    ROUTER_AUTH,
    SIMULATOR,
    by_kind,
    document,
    matches,
    one,
    rendered,
)

from tensorfleet import contract
from tensorfleet.api import SpecError, load_inference_service
from tensorfleet.planner import make_plan
from tensorfleet.render import render
from tensorfleet.router import cli as router_cli

# --- Services, router, RBAC ------------------------------------------------------------


def test_services() -> None:
    objects = rendered(PIPELINE_2)
    workers = one(objects, "Service", "llama-workers")["spec"]
    assert workers["clusterIP"] == "None" and workers["publishNotReadyAddresses"] is True
    assert workers["ports"] == [{"name": "ray", "port": 6379, "targetPort": "ray", "protocol": "TCP"}]
    leaders = one(objects, "Service", "llama-engine")["spec"]
    assert leaders["clusterIP"] == "None" and leaders["publishNotReadyAddresses"] is False
    assert leaders["ports"] == [{"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP"}]
    front = one(objects, "Service", "llama")["spec"]
    assert front["type"] == "ClusterIP" and "clusterIP" not in front
    assert front["ports"] == [{"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"}]


def test_router() -> None:
    objects = rendered(PIPELINE_2)
    deployment = one(objects, "Deployment", "llama-router")
    assert deployment["spec"]["replicas"] == 2
    pod = deployment["spec"]["template"]["spec"]
    pod_selector = deployment["spec"]["selector"]["matchLabels"]
    assert pod["serviceAccountName"] == "llama-router"
    assert pod["automountServiceAccountToken"] is True
    [container] = pod["containers"]
    assert container["image"] == contract.CONTROL_PLANE_IMAGE
    assert container["command"] == list(contract.ROUTER_COMMAND)
    plan = make_plan(load_inference_service(PIPELINE_2).spec)
    # What the KV cache holds at 2048 tokens a request, under max-num-seqs 1024.
    concurrency = plan.kv_cache_tokens // 2048
    assert 1 < concurrency < plan.max_num_seqs == 1024
    assert container["args"] == [
        "--service", "llama-engine",
        "--namespace", "ml",
        # The other replicas: the router Service's ready endpoints, less the pod's own address.
        "--peer-service", "llama",
        "--strategy", "cache-aware",  # the default
        # vLLM engines publish their KV-cache events: the router indexes them.
        "--kv-events",
        "--port", "8080",
        "--max-concurrency-per-backend", str(concurrency),
        # The derived ceiling is a typical request's share: an engine with room may take up to max-num-seqs.
        "--burst-concurrency-per-backend", "1024",
        # One step's prefill on an 80 GB A100: vLLM's default budget there.
        "--prompt-queue-tokens", "8192",
        "--model", "llama-70b",
        "--drain-delay", "5",
        "--shutdown-grace", "60",
        # Twice the estimated load: 120 s engine start plus each GPU's weights at 500 MB/s.
        "--cold-start-timeout", str(2 * (120 + -(-plan.weight_bytes_per_gpu // 500_000_000))),
    ]
    # SIGTERM drains: 5 s still serving while the endpoints update, 60 s for in-flight requests, 10 s margin.
    assert pod["terminationGracePeriodSeconds"] == 75
    assert deployment["spec"]["strategy"] == {"type": "RollingUpdate",
                                              "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    assert container["ports"] == [{"name": "http", "containerPort": 8080, "protocol": "TCP"}]
    assert container["env"] == [{"name": "TENSORFLEET_POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]
    assert one(objects, "Service", "llama")["spec"]["selector"] == pod_selector
    assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert container["resources"] == {"requests": {"cpu": "250m", "memory": "256Mi"}, "limits": {"memory": "512Mi"}}
    security = container["securityContext"]
    assert security["runAsNonRoot"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["readOnlyRootFilesystem"] is True
    assert security["capabilities"] == {"drop": ["ALL"]}
    assert security["seccompProfile"] == {"type": "RuntimeDefault"}

    custom = document(router={
        "replicas": 3, "strategy": "prefix-aware", "image": "example/router:2",
        "resources": {"requests": {"cpu": "1"}, "limits": {"cpu": "2", "memory": "1Gi"}},
        "maxConcurrencyPerEngine": 48, "maxQueue": 500, "queueTimeoutSeconds": 10, "coldStartTimeoutSeconds": 90,
    })
    deployment = one(rendered(custom), "Deployment", "llama-router")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert deployment["spec"]["replicas"] == 3
    assert container["image"] == "example/router:2"
    assert container["args"][container["args"].index("--strategy") + 1] == "prefix-aware"
    assert container["args"][container["args"].index("--max-concurrency-per-backend") + 1] == "48"
    assert "--burst-concurrency-per-backend" not in container["args"]  # a ceiling the user set is a hard limit
    assert container["args"][-6:] == ["--max-queue", "500", "--queue-timeout", "10", "--cold-start-timeout", "90"]
    assert container["resources"] == {"requests": {"cpu": "1"}, "limits": {"cpu": "2", "memory": "1Gi"}}


def test_router_api_keys_come_from_the_secret_mounted_read_only() -> None:
    deployment = one(rendered(ROUTER_AUTH), "Deployment", "llama-router")
    pod = deployment["spec"]["template"]["spec"]
    [container] = pod["containers"]
    assert container["args"][-6:] == ["--api-keys", contract.ROUTER_API_KEYS_PATH, "--requests-per-minute", "600",
                                      "--tokens-per-minute", "200000"]
    # The Secret, never optional: a router without its keys does not start. Its files are readable by the
    # router's group only (fsGroup), and the router cannot write them.
    assert pod["volumes"] == [{"name": "api-keys", "secret": {"secretName": "llm-keys", "optional": False,
                                                                "defaultMode": 0o440}}]
    assert container["volumeMounts"] == [{"name": "api-keys", "mountPath": "/etc/tensorfleet/api-keys",
                                          "readOnly": True}]
    assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsGroup"] == contract.CONTROL_PLANE_UID
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    # Limits are optional; keys alone only authenticate. The flags are the router's own.
    only_keys = one(rendered(document(router={"auth": {"secretRef": {"name": "llm-keys"}}})), "Deployment",
                    "llama-router")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert only_keys[-2:] == ["--api-keys", contract.ROUTER_API_KEYS_PATH]
    parser = argparse.ArgumentParser()
    router_cli.register(parser.add_subparsers())
    parsed = parser.parse_args(["router", *container["args"]])
    assert (parsed.api_keys, parsed.requests_per_minute, parsed.tokens_per_minute) == (
        contract.ROUTER_API_KEYS_PATH, 600, 200000)
    # Without auth: no volume, no fsGroup, no key flags (the router's pod is as before).
    plain = one(rendered(PIPELINE_1), "Deployment", "llama-router")["spec"]["template"]["spec"]
    assert "volumes" not in plain and "fsGroup" not in plain["securityContext"]
    assert "volumeMounts" not in plain["containers"][0] and "--api-keys" not in plain["containers"][0]["args"]


@pytest.mark.parametrize(("auth", "says"), [
    ({}, "secretRef"),
    ({"secretRef": {"name": ""}}, "secretRef.name"),
    ({"secretRef": {"name": "k"}, "requestsPerMinute": 0}, "requestsPerMinute"),
    ({"secretRef": {"name": "k"}, "tokensPerMinute": -1}, "tokensPerMinute"),
    ({"secretRef": {"name": "k"}, "burst": 5}, "burst"),
])
def test_router_auth_is_checked(auth: dict[str, Any], says: str) -> None:
    with pytest.raises(SpecError) as caught:
        load_inference_service(document(router={"auth": auth}))
    assert "router.auth" in str(caught.value) and says in str(caught.value)


def test_router_rbac_is_minimal() -> None:
    objects = rendered(PIPELINE_1)
    role = one(objects, "Role", "llama-router")
    assert role["rules"] == [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["get", "list", "watch"]}]
    binding = one(objects, "RoleBinding", "llama-router")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "llama-router"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "llama-router", "namespace": "ml"}]
    assert not by_kind(objects, "ClusterRole") and not by_kind(objects, "ClusterRoleBinding")


# --- NetworkPolicies ----------------------------------------------------------------


def _peers_admit(rule: dict[str, Any], pod_labels: dict[str, str]) -> bool:
    """Whether a rule's `from` admits a pod with these labels in the policy's own namespace."""
    return any("podSelector" in peer and "namespaceSelector" not in peer
               and matches(peer["podSelector"].get("matchLabels", {}), pod_labels) for peer in rule["from"])


def _namespaces_in(rule: dict[str, Any]) -> set[str]:
    names: set[str] = set()
    for peer in rule["from"]:
        for expression in peer.get("namespaceSelector", {}).get("matchExpressions", []):
            assert expression["key"] == "kubernetes.io/metadata.name" and expression["operator"] == "In"
            names |= set(expression["values"])
    return names


def test_network_policies_isolate_engines_and_router() -> None:
    objects = rendered(PIPELINE_3)
    engine_policy = one(objects, "NetworkPolicy", "llama-engine")
    router_policy = one(objects, "NetworkPolicy", "llama-router")
    stage_pods = [s["spec"]["template"]["metadata"]["labels"] for s in by_kind(objects, "StatefulSet")]
    router_pods = one(objects, "Deployment", "llama-router")["spec"]["template"]["metadata"]["labels"]
    other_router = {**router_pods, "app.kubernetes.io/instance": "other", "tensorfleet.dev/inference-service": "other"}
    other_engine = {**stage_pods[0], "app.kubernetes.io/instance": "other", "tensorfleet.dev/inference-service": "other"}

    for policy in (engine_policy, router_policy):
        assert policy["apiVersion"] == "networking.k8s.io/v1"
        assert policy["spec"]["policyTypes"] == ["Ingress"], "egress stays open (model downloads, the API server)"
        assert "egress" not in policy["spec"]
    # The engine policy covers every stage's pods and no router pod.
    selected = engine_policy["spec"]["podSelector"]["matchLabels"]
    assert all(matches(selected, pods) for pods in stage_pods) and not matches(selected, router_pods)
    from_router, peers, monitoring = engine_policy["spec"]["ingress"]
    # The API port and the KV events' two, from this InferenceService's router pods only.
    assert from_router["ports"] == [{"protocol": "TCP", "port": port} for port in (
        contract.ENGINE_PORT, contract.KV_EVENTS_PORT, contract.KV_EVENTS_REPLAY_PORT)]
    assert _peers_admit(from_router, router_pods) and not _peers_admit(from_router, other_router)
    assert not any(_peers_admit(from_router, pods) for pods in stage_pods)
    # Every port (Ray, NCCL), between this InferenceService's engine pods only.
    assert "ports" not in peers
    assert all(_peers_admit(peers, pods) for pods in stage_pods)
    assert not _peers_admit(peers, router_pods) and not _peers_admit(peers, other_engine)
    # Metrics: vLLM's /metrics shares the API port; the GPU gauges have their own.
    assert monitoring["ports"] == [{"protocol": "TCP", "port": contract.ENGINE_PORT},
                                   {"protocol": "TCP", "port": contract.WORKER_METRICS_PORT}]
    assert _namespaces_in(monitoring) == {"monitoring"} and len(monitoring["from"]) == 1

    assert matches(router_policy["spec"]["podSelector"]["matchLabels"], router_pods)
    assert not any(matches(router_policy["spec"]["podSelector"]["matchLabels"], pods) for pods in stage_pods)
    (clients,) = router_policy["spec"]["ingress"]
    assert clients["ports"] == [{"protocol": "TCP", "port": contract.ROUTER_PORT}]
    # By default: any pod of the InferenceService's own namespace, and the monitoring namespace.
    assert {"podSelector": {}} in clients["from"]
    assert _namespaces_in(clients) == {"monitoring"}
    assert not any("ipBlock" in peer for peer in clients["from"])


def test_network_policy_settings() -> None:
    doc = document(networkPolicy={
        "clientNamespaces": ["ingress-nginx", "gateway"],
        "clientCIDRs": ["10.0.0.0/8", "2001:db8::/32"],
        "monitoringNamespaces": ["prometheus", "gateway"],
    })
    objects = rendered(doc)
    (clients,) = one(objects, "NetworkPolicy", "llama-router")["spec"]["ingress"]
    assert _namespaces_in(clients) == {"ingress-nginx", "gateway", "prometheus"}
    assert [p["ipBlock"] for p in clients["from"] if "ipBlock" in p] == [{"cidr": "10.0.0.0/8"}, {"cidr": "2001:db8::/32"}]
    monitoring = one(objects, "NetworkPolicy", "llama-engine")["spec"]["ingress"][2]
    assert _namespaces_in(monitoring) == {"prometheus", "gateway"}
    # Client namespaces reach the router only, never the engines.
    engine_rules = one(objects, "NetworkPolicy", "llama-engine")["spec"]["ingress"]
    assert "ingress-nginx" not in set().union(*(_namespaces_in(r) for r in engine_rules))

    quiet = rendered(document(networkPolicy={"monitoringNamespaces": []}))
    assert len(one(quiet, "NetworkPolicy", "llama-engine")["spec"]["ingress"]) == 2
    assert one(quiet, "NetworkPolicy", "llama-router")["spec"]["ingress"][0]["from"] == [{"podSelector": {}}]

    assert by_kind(rendered(document(networkPolicy={"enabled": False})), "NetworkPolicy") == []

    # The simulator's gauges of its simulated GPUs are scraped as a GPU pod's are.
    sim = one(rendered(SIMULATOR), "NetworkPolicy", "llama-engine")["spec"]["ingress"][2]
    assert sim["ports"] == [{"protocol": "TCP", "port": contract.ENGINE_PORT},
                            {"protocol": "TCP", "port": contract.WORKER_METRICS_PORT}]


def test_network_policies_come_before_the_pods_they_protect() -> None:
    kinds = [o["kind"] for o in rendered(PIPELINE_2)]
    last_policy = max(i for i, k in enumerate(kinds) if k == "NetworkPolicy")
    assert last_policy < kinds.index("StatefulSet") and last_policy < kinds.index("Deployment")


@pytest.mark.parametrize(("field", "value", "says"), [
    ("clientCIDRs", ["10.0.0.1/8"], "host bits set"),
    ("clientCIDRs", ["10.0.0.1"], "needs its prefix length"),
    ("clientCIDRs", ["anywhere"], "is not a CIDR"),
    ("clientNamespaces", ["Ingress_NGINX"], "clientNamespaces"),
    ("monitoringNamespaces", ["monitoring", "monitoring"], "listed more than once"),
    ("enable", True, "enable"),
])
def test_network_policy_mistakes_name_the_field(field: str, value: Any, says: str) -> None:
    from tensorfleet.api import SpecError

    with pytest.raises(SpecError) as caught:
        load_inference_service(document(networkPolicy={field: value}))
    assert "networkPolicy" in str(caught.value) and says in str(caught.value)


def test_the_routers_admit_the_gateway_beside_the_operator() -> None:
    isvc = load_inference_service(document())
    objects = render(isvc, make_plan(isvc.spec), operator_namespace="tensorfleet-system")
    (clients,) = one(objects, "NetworkPolicy", "llama-router")["spec"]["ingress"]
    gateway = {contract.LABEL_NAME: contract.APP_NAME, contract.LABEL_COMPONENT: contract.COMPONENT_GATEWAY}
    (peer,) = [p for p in clients["from"] if p.get("podSelector", {}).get("matchLabels") == gateway]
    assert peer["namespaceSelector"]["matchExpressions"][0]["values"] == ["tensorfleet-system"]
    assert clients["ports"] == [{"protocol": "TCP", "port": contract.ROUTER_PORT}]
    # Where the operator runs is not known (a printed render): no gateway is admitted from anywhere.
    (clients,) = one(rendered(document()), "NetworkPolicy", "llama-router")["spec"]["ingress"]
    assert not any(p.get("podSelector", {}).get("matchLabels") == gateway for p in clients["from"])
