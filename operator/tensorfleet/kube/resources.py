"""Every Kubernetes resource the operator touches, and exactly the verbs it uses: the single source of the client's
API paths, the operator's watches and the chart's RBAC, so a verb not listed here is a verb the operator never
calls. Design: docs/architecture.md#the-kubernetes-layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tensorfleet import contract


@dataclass(frozen=True)
class Kind:
    group: str
    version: str
    plural: str
    kind: str
    verbs: tuple[str, ...]
    namespaced: bool = True
    subresources: tuple[tuple[str, tuple[str, ...]], ...] = ()

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    def path(self, namespace: str | None = None, name: str | None = None, subresource: str | None = None) -> str:
        base = f"/apis/{self.group}/{self.version}" if self.group else f"/api/{self.version}"
        if self.namespaced and namespace:
            base += f"/namespaces/{namespace}"
        base += f"/{self.plural}"
        if name:
            base += f"/{name}"
            if subresource:
                base += f"/{subresource}"
        return base


# Children are watched (kopf lists, then watches), read with get before one is
# created (is the name taken by an object that is not ours?), written by
# server-side apply (patch, plus create when the object is new) and pruned
# with delete.
_CHILD_VERBS = ("get", "list", "watch", "create", "patch", "delete")

INFERENCE_SERVICE = Kind(
    contract.GROUP, contract.VERSION, contract.PLURAL, contract.KIND, ("get", "list", "watch"),
    # ownerReferences with blockOwnerDeletion need update on the owner's finalizers.
    subresources=(("status", ("patch",)), ("finalizers", ("update",))),
)
SERVICE_ACCOUNT = Kind("", "v1", "serviceaccounts", "ServiceAccount", _CHILD_VERBS)
ROLE = Kind("rbac.authorization.k8s.io", "v1", "roles", "Role", _CHILD_VERBS)
ROLE_BINDING = Kind("rbac.authorization.k8s.io", "v1", "rolebindings", "RoleBinding", _CHILD_VERBS)
SERVICE = Kind("", "v1", "services", "Service", _CHILD_VERBS)
NETWORK_POLICY = Kind("networking.k8s.io", "v1", "networkpolicies", "NetworkPolicy", _CHILD_VERBS)
# Recreating one (an immutable field changed) also gets it, waiting for the garbage collector.
STATEFUL_SET = Kind("apps", "v1", "statefulsets", "StatefulSet", _CHILD_VERBS)
DEPLOYMENT = Kind("apps", "v1", "deployments", "Deployment", _CHILD_VERBS)
HPA = Kind("autoscaling", "v2", "horizontalpodautoscalers", "HorizontalPodAutoscaler", _CHILD_VERBS)
PDB = Kind("policy", "v1", "poddisruptionbudgets", "PodDisruptionBudget", _CHILD_VERBS)
# Engine pods' GPU claims under spec.accelerator.allocation deviceClass (Kubernetes 1.34+; on older clusters
# the watch finds no such resource and none is rendered unless a spec asks for one).
RESOURCE_CLAIM_TEMPLATE = Kind("resource.k8s.io", "v1", "resourceclaimtemplates", "ResourceClaimTemplate",
                               _CHILD_VERBS)
# Pods are read for group readiness and deleted to roll multi-node groups.
POD = Kind("", "v1", "pods", "Pod", ("list", "watch", "delete"))
EVENT = Kind("", "v1", "events", "Event", ("create",))
# The leader election's Lease (get, create, update), and each scale-to-zero service's demand Lease, a child.
LEASE = Kind("coordination.k8s.io", "v1", "leases", "Lease", (*_CHILD_VERBS, "update"))
# The router Role grants read access to EndpointSlices; RBAC lets a subject
# grant only what it holds itself, so the operator needs the same.
ENDPOINT_SLICE = Kind("discovery.k8s.io", "v1", "endpointslices", "EndpointSlice", ("get", "list", "watch"))
# Only readiness is read off Nodes: a pipeline stage on a node that stopped being Ready holds its group.
NODE = Kind("", "v1", "nodes", "Node", ("list", "watch"), namespaced=False)
# What NVIDIA's DRA driver offers per node (controller/devices.py): read, for claims no node can satisfy.
RESOURCE_SLICE = Kind("resource.k8s.io", "v1", "resourceslices", "ResourceSlice", ("list", "watch"), namespaced=False)
# kopf lists namespaces to expand namespace patterns and checks the CRD exists.
NAMESPACE = Kind("", "v1", "namespaces", "Namespace", ("list", "watch"), namespaced=False)
CRD = Kind("apiextensions.k8s.io", "v1", "customresourcedefinitions", "CustomResourceDefinition",
           ("list", "watch"), namespaced=False)

# What render() produces, in apply order; pruned children are found among these.
# NetworkPolicies go before the workloads so that no pod starts unisolated.
CHILD_KINDS: tuple[Kind, ...] = (SERVICE_ACCOUNT, ROLE, ROLE_BINDING, SERVICE, NETWORK_POLICY, PDB,
                                 RESOURCE_CLAIM_TEMPLATE, STATEFUL_SET, LEASE, DEPLOYMENT, HPA)
ALL_KINDS: tuple[Kind, ...] = (INFERENCE_SERVICE, *CHILD_KINDS, POD, EVENT, ENDPOINT_SLICE, NODE, RESOURCE_SLICE,
                               NAMESPACE, CRD)

_BY_API_KIND = {(k.api_version, k.kind): k for k in ALL_KINDS}


def kind_of(obj: dict[str, Any]) -> Kind:
    try:
        return _BY_API_KIND[(obj["apiVersion"], obj["kind"])]
    except KeyError:
        raise ValueError(f"the operator does not manage {obj.get('apiVersion')}/{obj.get('kind')}") from None


def rbac_rules() -> list[dict[str, Any]]:
    """The RBAC rules the operator needs: one per resource, no wildcards."""
    rules: list[dict[str, Any]] = []
    for kind in ALL_KINDS:
        rules.append({"apiGroups": [kind.group], "resources": [kind.plural], "verbs": list(kind.verbs)})
        for sub, verbs in kind.subresources:
            rules.append({"apiGroups": [kind.group], "resources": [f"{kind.plural}/{sub}"], "verbs": list(verbs)})
    return rules
