"""NetworkPolicies (spec.networkPolicy), ingress only: `NAME-engine` admits the InferenceService's own router, its own
engine pods on every port (Ray, NCCL), the monitoring namespaces and, with LoRA adapters, the operator; `NAME-router`
admits its namespace, clientNamespaces, monitoringNamespaces, clientCIDRs and the chart's gateway pods beside the
operator.
Design: docs/security.md#the-clusters-network.
"""

from __future__ import annotations

from typing import Any

from tensorfleet import contract
from tensorfleet.render.engine import serves_gpu_metrics
from tensorfleet.render.meta import Context, engine_selector, metadata, publishes_kv_events, router_selector

# Set by the API server on every namespace (Kubernetes >= 1.22), immutable: selects namespaces by name.
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"


def engine_policy_name(name: str) -> str:
    """`NAME-engine`, like the engine Service and PodDisruptionBudget over the same pods."""
    return contract.engine_service_name(name)


def router_policy_name(name: str) -> str:
    """`NAME-router`, like the router's Deployment."""
    return contract.router_name(name)


def _namespaces(names: list[str]) -> dict[str, Any]:
    return {"namespaceSelector": {"matchExpressions": [
        {"key": NAMESPACE_NAME_LABEL, "operator": "In", "values": sorted(set(names))},
    ]}}


def _ports(*numbers: int) -> list[dict[str, Any]]:
    # protocol spelled out, as in every port the renderer writes (server-side apply list keys).
    return [{"protocol": "TCP", "port": number} for number in numbers]


def _policy(ctx: Context, name: str, component: str, pods: dict[str, str], rules: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata(ctx, name, component),
        "spec": {
            "podSelector": {"matchLabels": pods},
            "policyTypes": ["Ingress"],
            "ingress": rules,
        },
    }


def engine_policy(ctx: Context) -> dict[str, Any]:
    monitoring = ctx.spec.network_policy.monitoring_namespaces
    # The router calls the engine's API and, from vLLM engines, reads the KV events (and asks for replays).
    routed = (contract.ENGINE_PORT, contract.KV_EVENTS_PORT, contract.KV_EVENTS_REPLAY_PORT) if publishes_kv_events(ctx) \
        else (contract.ENGINE_PORT,)
    rules: list[dict[str, Any]] = [
        {"from": [{"podSelector": {"matchLabels": router_selector(ctx.name)}}], "ports": _ports(*routed)},
        # No ports: every port and protocol, between this InferenceService's engine pods only.
        {"from": [{"podSelector": {"matchLabels": engine_selector(ctx.name)}}]},
    ]
    if ctx.spec.lora_enabled:
        # The operator loads and unloads adapters through the engines' API (controller/adapters.py): its pods in
        # its own namespace when that is known, else in any (a bare podSelector would mean this namespace only).
        operator: dict[str, Any] = {"podSelector": {"matchLabels": {
            contract.LABEL_NAME: contract.APP_NAME, contract.LABEL_COMPONENT: contract.COMPONENT_OPERATOR}}}
        operator.update(_namespaces([ctx.operator_namespace]) if ctx.operator_namespace else {"namespaceSelector": {}})
        rules.append({"from": [operator], "ports": _ports(contract.ENGINE_PORT)})
    if monitoring:
        scraped = (contract.ENGINE_PORT, contract.WORKER_METRICS_PORT) if serves_gpu_metrics(ctx) \
            else (contract.ENGINE_PORT,)
        rules.append({"from": [_namespaces(monitoring)], "ports": _ports(*scraped)})
    return _policy(ctx, engine_policy_name(ctx.name), contract.COMPONENT_ENGINE,
                   engine_selector(ctx.name), rules)


def router_policy(ctx: Context) -> dict[str, Any]:
    spec = ctx.spec.network_policy
    # A bare podSelector selects pods of the policy's own namespace.
    peers: list[dict[str, Any]] = [{"podSelector": {}}]
    others = [*spec.client_namespaces, *spec.monitoring_namespaces]
    if others:
        peers.append(_namespaces(others))
    peers += [{"ipBlock": {"cidr": cidr}} for cidr in spec.client_cidrs]
    if ctx.operator_namespace:
        # The chart's gateway (gateway.enabled) runs beside the operator and forwards to every router.
        peers.append({"podSelector": {"matchLabels": {contract.LABEL_NAME: contract.APP_NAME,
                                                      contract.LABEL_COMPONENT: contract.COMPONENT_GATEWAY}},
                      **_namespaces([ctx.operator_namespace])})
    return _policy(ctx, router_policy_name(ctx.name), contract.COMPONENT_ROUTER, router_selector(ctx.name),
                   [{"from": peers, "ports": _ports(contract.ROUTER_PORT)}])


def network_policies(ctx: Context) -> list[dict[str, Any]]:
    if not ctx.spec.network_policy.enabled:
        return []
    return [engine_policy(ctx), router_policy(ctx)]
