"""The gateway's model table: every InferenceService it watches, by the OpenAI model names it serves (its served name
and its LoRA adapters' names), grouped per namespace and name into traffic groups with each member's share
(api/traffic.py), and the ready router endpoints of each. Pure: gateway/watch.py feeds it the API server's objects.
A name served in two namespaces, or as a base model and as an adapter of another, is ambiguous and refused by name.
Design: docs/gateway.md#the-model-table.
"""

from __future__ import annotations

import calendar
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from tensorfleet.api.traffic import served_and_weight, shares

ServiceKey = tuple[str, str]  # (namespace, name)


def _as_str(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def _ready(status: Mapping[str, Any]) -> bool:
    for condition in status.get("conditions") or []:
        if isinstance(condition, Mapping) and condition.get("type") == "Ready":
            return condition.get("status") == "True"
    return False


def _created(metadata: Mapping[str, Any]) -> int:
    stamp = _as_str(metadata.get("creationTimestamp"))
    try:
        return calendar.timegm(time.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ")) if stamp else 0
    except ValueError:
        return 0


@dataclass(frozen=True)
class Service:
    """What the gateway reads of one InferenceService."""

    namespace: str
    name: str
    served: str                   # spec.model.servedName, else spec.model.name
    root: str                     # spec.model.name
    weight: int | None            # spec.traffic.weight
    adapters: tuple[str, ...]     # spec.adapters[].name
    ready: bool                   # the Ready condition (True at zero too: a request wakes it)
    created: int = 0              # metadata.creationTimestamp, epoch seconds
    max_model_len: int | None = None  # status.plan.maxModelLen

    @property
    def key(self) -> ServiceKey:
        return self.namespace, self.name

    @property
    def label(self) -> str:
        return f"{self.namespace}/{self.name}"


def service_of(obj: Mapping[str, Any]) -> Service | None:
    """The Service an InferenceService object describes; None for one without a namespace, name or model."""
    metadata = obj.get("metadata") or {}
    spec = obj.get("spec") or {}
    status = obj.get("status") or {}
    namespace, name, group = _as_str(metadata.get("namespace")), _as_str(metadata.get("name")), served_and_weight(obj)
    if namespace is None or name is None or group is None:
        return None
    served, weight = group
    adapters = tuple(sorted({a["name"] for a in spec.get("adapters") or []
                             if isinstance(a, Mapping) and _as_str(a.get("name"))}))
    plan = status.get("plan") or {}
    max_len = plan.get("maxModelLen") if isinstance(plan, Mapping) else None
    return Service(namespace, name, served, spec["model"]["name"], weight, adapters, _ready(status),
                   _created(metadata), max_len if isinstance(max_len, int) else None)


@dataclass(frozen=True)
class Group:
    """The InferenceServices one model name reaches in one namespace, with each one's share of new conversations."""

    model: str
    namespace: str
    members: tuple[Service, ...]
    shares: Mapping[ServiceKey, float]
    parent: str | None = None  # an adapter's base model (its members' served name)

    def candidates(self) -> list[tuple[str, float]]:
        """(name, share) of the members a new conversation may go to: the Ready ones when any member is (a member
        that is not Ready, unless held at zero, would only keep it waiting), else every member."""
        ready = [m for m in self.members if m.ready]
        return [(m.name, self.shares[m.key]) for m in (ready or self.members)]

    def member(self, name: str) -> Service:
        return next(m for m in self.members if m.name == name)

    @property
    def listed(self) -> bool:
        """Shown by /v1/models: some member is Ready."""
        return any(m.ready for m in self.members)


@dataclass(frozen=True)
class Ambiguous:
    """A model name the gateway cannot route: WHERE says which InferenceServices serve it."""

    model: str
    where: tuple[str, ...]

    @property
    def message(self) -> str:
        return (f"the model `{self.model}` is served by InferenceServices that are not one traffic group "
                f"({', '.join(self.where)}): one name per namespace, and never both a model and an adapter; rename "
                "one (spec.model.servedName, spec.adapters[].name) or give the gateway one namespace")


@dataclass
class ModelTable:
    """Models by name, rebuilt whenever the InferenceServices or their routers change."""

    services: dict[ServiceKey, Service] = field(default_factory=dict)
    routers: dict[ServiceKey, tuple[str, ...]] = field(default_factory=dict)
    models: dict[str, Group | Ambiguous] = field(default_factory=dict)

    # --- input ----------------------------------------------------------------------------------------------
    def replace_services(self, objects: Iterable[Mapping[str, Any]], namespace: str | None = None) -> None:
        """A list's whole truth for NAMESPACE (None: every namespace)."""
        self.services = {k: s for k, s in self.services.items() if namespace is not None and k[0] != namespace}
        for obj in objects:
            service = service_of(obj)
            if service is not None:
                self.services[service.key] = service
        self._rebuild()

    def put_service(self, obj: Mapping[str, Any]) -> None:
        service = service_of(obj)
        if service is not None and self.services.get(service.key) != service:
            self.services[service.key] = service
            self._rebuild()

    def drop_service(self, obj: Mapping[str, Any]) -> None:
        metadata = obj.get("metadata") or {}
        if self.services.pop((metadata.get("namespace", ""), metadata.get("name", "")), None) is not None:
            self._rebuild()

    def set_routers(self, routers: Mapping[ServiceKey, tuple[str, ...]]) -> None:
        self.routers = dict(routers)

    # --- output ---------------------------------------------------------------------------------------------
    def lookup(self, model: str) -> Group | Ambiguous | None:
        return self.models.get(model)

    def router_urls(self, key: ServiceKey) -> tuple[str, ...]:
        return self.routers.get(key, ())

    def listing(self) -> list[dict[str, Any]]:
        """/v1/models' `data`: each listed model once, adapters with their parent, as vLLM lists them."""
        out = []
        for name, entry in sorted(self.models.items()):
            if not isinstance(entry, Group) or not entry.listed:
                continue
            first = min(entry.members, key=lambda m: m.created)
            item: dict[str, Any] = {"id": name, "object": "model", "created": first.created,
                                    "owned_by": "tensorfleet", "root": name if entry.parent else first.root,
                                    "parent": entry.parent}
            lengths = [m.max_model_len for m in entry.members if m.max_model_len]
            if lengths and entry.parent is None:
                item["max_model_len"] = min(lengths)
            out.append(item)
        return out

    def _rebuild(self) -> None:
        claims: dict[str, dict[tuple[str, str, str], list[Service]]] = {}
        for service in self.services.values():
            claims.setdefault(service.served, {}).setdefault((service.namespace, "model", service.served),
                                                             []).append(service)
            for adapter in service.adapters:
                claims.setdefault(adapter, {}).setdefault((service.namespace, "adapter", service.served),
                                                          []).append(service)
        models: dict[str, Group | Ambiguous] = {}
        for name, owners in claims.items():
            if len(owners) > 1:
                models[name] = Ambiguous(name, tuple(sorted(s.label for group in owners.values() for s in group)))
                continue
            (namespace, what, served), members = next(iter(owners.items()))
            ordered = tuple(sorted(members, key=lambda s: s.name))
            models[name] = Group(name, namespace, ordered, shares({m.key: m.weight for m in ordered}),
                                 parent=served if what == "adapter" else None)
        self.models = models
