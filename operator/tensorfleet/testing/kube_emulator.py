"""kmock's KubernetesEmulator, extended once with the API-server behaviour the operator relies on, each gap filled as
the Kubernetes API documents it (`ClusterEmulator` lists them), and with faults injected into a share of one
client's writes (`Faults`). Design: docs/architecture.md#how-it-is-tested.
"""

from __future__ import annotations

import asyncio
import contextvars
import copy
import datetime
import itertools
import json
import random
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp.web
import jsonpatch
from kmock import KubernetesEmulator, KubernetesError, Payload, Request, ResourceInfo, resource

from tensorfleet.api.crd import crd
from tensorfleet.kube.resources import ALL_KINDS

APPLY = "application/apply-patch+yaml"
WRITE_METHODS = {"POST", "PATCH", "PUT", "DELETE"}
# Resources whose status lives in a subresource (everything but these).
NO_STATUS_SUBRESOURCE = {"events", "leases", "serviceaccounts", "roles", "rolebindings", "namespaces",
                         "customresourcedefinitions", "endpointslices", "networkpolicies"}
# scale subresource paths: plural -> (specReplicasPath, statusReplicasPath, labelSelectorPath)
STATEFULSET_MUTABLE = {"replicas", "template", "updateStrategy", "minReadySeconds", "ordinals", "revisionHistoryLimit",
                       "persistentVolumeClaimRetentionPolicy"}
# Plain bools with `omitempty` that the operator writes as false, per resource:
# the API server returns them absent.
OMITTED_WHEN_FALSE = {"services": ("spec.publishNotReadyAddresses",)}
# How long an Orphan deletion keeps the object, terminating, before the "garbage collector" removes it.
ORPHAN_DELAY = 0.3
SCALE_PATHS = {
    "inferenceservices": ("spec.replicas", "status.replicas", "status.selector"),
    "statefulsets": ("spec.replicas", "status.replicas", None),
    "deployments": ("spec.replicas", "status.replicas", None),
}
# The aiohttp request being served, for the watch streams `_read` writes itself:
# kmock's Request keeps it only in a private attribute. Set in `__call__`, which
# kmock's Server calls with it, and read in the same task.
_RAW_REQUEST: contextvars.ContextVar[aiohttp.web.BaseRequest] = contextvars.ContextVar("raw_request")


@dataclass
class Faults:
    """Fail a share of one client's writes (`user_agent`), deterministically per `seed`. `kinds` picks among 500,
    409 and timeout, after which the write may or may not have happened."""

    rate: float
    seed: int = 7
    kinds: tuple[str, ...] = ("500", "409", "timeout")
    hang_seconds: float = 3.0
    plurals: frozenset[str] | None = None  # None: every resource
    user_agent: str = "tensorfleet-operator"  # only this client's writes fail
    injected: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._random = random.Random(self.seed)

    def pick(self, plural: str) -> str | None:
        """None, "500", "409", "timeout-lost" (never stored) or "timeout-stored" (stored, answer lost)."""
        if self.plurals is not None and plural not in self.plurals:
            return None
        if self._random.random() >= self.rate:
            return None
        kind = self._random.choice(self.kinds)
        if kind == "timeout":
            kind = self._random.choice(("timeout-lost", "timeout-stored"))
        self.injected[kind] = self.injected.get(kind, 0) + 1
        return kind


def rfc3339_now() -> str:
    """The time now as the API server writes timestamps (RFC 3339, whole seconds)."""
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _get(obj: dict[str, Any], dotted: str) -> Any:
    node: Any = obj
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else None
        if node is None:
            return None
    return node


def _set(obj: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    for part in parts[:-1]:
        obj = obj.setdefault(part, {})
    obj[parts[-1]] = value


def _merge(base: Any, patch: Any) -> Any:
    """JSON merge patch (RFC 7386): dicts merge, null deletes, everything else replaces."""
    if not isinstance(patch, dict) or not isinstance(base, dict):
        return copy.deepcopy(patch)
    out = dict(base)
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = _merge(base.get(key), value)
    return out


def _drop_omitted(live: Any, before: Any, now: Any) -> Any:
    """Remove from `live` the fields `before` (last apply) had and `now` omits."""
    if not isinstance(live, dict) or not isinstance(before, dict):
        return live
    out = dict(live)
    for key, old in before.items():
        if not isinstance(now, dict) or key not in now:
            out.pop(key, None)
        elif isinstance(old, dict):
            out[key] = _drop_omitted(live.get(key), old, now[key])
    return out


def _apply_defaults(schema: dict[str, Any], obj: Any) -> None:
    """Structural-schema defaulting: set absent fields that carry a `default`, recursively."""
    if not isinstance(obj, dict):
        return
    for name, child in (schema.get("properties") or {}).items():
        if name not in obj and "default" in child:
            obj[name] = copy.deepcopy(child["default"])
        if name in obj:
            _apply_defaults(child, obj[name])


_CRD_SCHEMAS = {crd()["spec"]["names"]["plural"]: crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]}


def _plural(request: Request) -> str:
    """The plural of a resource request (`_handle` sends only those on to the handlers below)."""
    assert request.resource is not None and request.resource.plural is not None, request
    return request.resource.plural


def _matches(labels: dict[str, str], selector: str) -> bool:
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if " in " in term or " notin " in term or "(" in term:
            raise KubernetesError(status=400, reason="BadRequest", message=f"set-based selector not emulated: {term}")
        if "!=" in term:
            key, value = term.split("!=", 1)
            if labels.get(key) == value:
                return False
        elif "=" in term:
            key, value = term.replace("==", "=").split("=", 1)
            if labels.get(key) != value:
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


class ClusterEmulator(KubernetesEmulator):
    """kmock 0.8's emulator stores objects as plain dicts and merges patches. The real API server does more, and
    the operator's code is written for the real one, so each gap is filled here, as the Kubernetes API documents it:

    - object metadata: `uid`, `resourceVersion` (bumped on every write, a deletion included: the DELETED event
      carries the deletion's version), `generation` (1 on create, +1 when anything outside metadata and status
      changes) and `creationTimestamp` are set by the server;
    - server-side apply (PATCH with application/apply-patch+yaml) creates a missing object, and removes fields
      its field manager applied before and omits now (field ownership, for a single manager);
    - status subresource: writes to the main resource ignore `status`, writes to `/status` change only `status`;
    - scale subresource: `GET/PATCH/PUT .../scale` speak autoscaling/v1 Scale, mapped through specReplicasPath /
      statusReplicasPath / labelSelectorPath;
    - PUT replaces the object and fails with 409 when the body's resourceVersion is stale (optimistic
      concurrency);
    - DELETE honours `preconditions.uid` (409 on mismatch) and garbage-collects dependents by ownerReferences
      (Background/Foreground: deleted; Orphan: their ownerReference is removed). An Orphan deletion is not
      immediate, as with the real garbage collector: the object first gets the `orphan` finalizer and a
      deletionTimestamp and stays readable (writes to it are still validated), and goes ORPHAN_DELAY later,
      after its dependents were released (kube-apiserver 1.36 answered a StatefulSet re-applied at once with
      422, the old one still there);
    - StatefulSet spec fields other than STATEFULSET_MUTABLE are immutable (422 Invalid, as kube-apiserver 1.36
      answers);
    - defaults from the InferenceService CRD's structural schema are written into stored objects, as the API
      server does for custom resources;
    - Go's `omitempty`: a plain (non-pointer) bool written as `false` is stored and returned absent
      (OMITTED_WHEN_FALSE; seen on kube-apiserver 1.36 with the headless Service's
      `publishNotReadyAddresses: false`). Pointer bools such as `enableServiceLinks` or
      `automountServiceAccountToken` keep their `false`;
    - LIST and WATCH honour equality-based `labelSelector`s;
    - `/api/v1/namespaces` (which kmock 0.8 cannot parse) lists the namespaces that objects live in, as kopf
      expects when it watches chosen namespaces.

    `faults` (a Faults) fails a share of one client's writes.
    """

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self.faults: Faults | None = None
        self._rv = itertools.count(1)
        self._applied: dict[tuple[Any, ...], dict[str, Any]] = {}
        self._collecting: set[asyncio.Future[None]] = set()
        for kind in ALL_KINDS:
            subresources = set()
            if kind.plural not in NO_STATUS_SUBRESOURCE:
                subresources.add("status")
            if kind.plural in SCALE_PATHS:
                subresources.add("scale")
            self.resources[f"{kind.api_version}/{kind.plural}"] = ResourceInfo(
                kind=kind.kind, namespaced=kind.namespaced, subresources=subresources,
                verbs={"get", "list", "watch", "create", "patch", "update", "delete"})

    # --- helpers ---------------------------------------------------------------------

    def find(self, api_version: str, plural: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        """The stored object, for assertions (None when absent)."""
        key = (resource(f"{api_version}/{plural}"), namespace, name)
        if key in self.objects and not self.objects[key].deleted:
            return copy.deepcopy(self.objects[key].raw)
        return None

    def all(self, api_version: str, plural: str, namespace: str | None = None) -> list[dict[str, Any]]:
        res = resource(f"{api_version}/{plural}")
        return [copy.deepcopy(obj.raw) for (r, ns, _), obj in self.objects.items()
                if r == res and not obj.deleted and (namespace is None or ns == namespace)]

    def _stored(self, key: tuple[Any, ...]) -> dict[str, Any] | None:
        if key in self.objects and not self.objects[key].deleted:
            return copy.deepcopy(self.objects[key].raw)
        return None

    async def _store(self, key: tuple[Any, ...], obj: dict[str, Any], created: bool) -> None:
        schema = _CRD_SCHEMAS.get(key[0].plural)
        if schema is not None:
            _apply_defaults(schema, obj)
        for dotted in OMITTED_WHEN_FALSE.get(key[0].plural, ()):
            *path, leaf = dotted.split(".")
            parent = _get(obj, ".".join(path))
            if isinstance(parent, dict) and parent.get(leaf) is False:
                del parent[leaf]
        if key in self.objects and not self.objects[key].deleted:
            self.objects[key].history.append(obj)
        else:
            self.objects[key] = obj
        await self._buses[key[0]].put({"type": "ADDED" if created else "MODIFIED", "object": copy.deepcopy(obj)})

    def _new_metadata(self, obj: dict[str, Any], namespace: str | None) -> None:
        meta = obj.setdefault("metadata", {})
        if namespace:
            meta["namespace"] = namespace
        meta["uid"] = str(uuid.uuid4())
        meta["resourceVersion"] = str(next(self._rv))
        meta["generation"] = 1
        meta["creationTimestamp"] = rfc3339_now()

    def _successor(self, old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
        """`new` with the server-owned metadata of `old` and the generation rule applied."""
        if old.get("kind") == "StatefulSet":
            frozen = {k for k in {*old.get("spec", {}), *new.get("spec", {})} if k not in STATEFULSET_MUTABLE}
            if any(old.get("spec", {}).get(k) != new.get("spec", {}).get(k) for k in frozen):
                raise KubernetesError(status=422, reason="Invalid", message=(
                    "StatefulSet.apps is invalid: spec: Forbidden: updates to statefulset spec for fields other than "
                    "'replicas', 'ordinals', 'template', 'updateStrategy', 'revisionHistoryLimit', "
                    "'persistentVolumeClaimRetentionPolicy' and 'minReadySeconds' are forbidden"))
        meta = new.setdefault("metadata", {})
        for key in ("uid", "creationTimestamp", "namespace", "name", "deletionTimestamp"):
            if key in old.get("metadata", {}):
                meta[key] = old["metadata"][key]
        body_changed = {k: v for k, v in old.items() if k not in ("metadata", "status")} != \
                       {k: v for k, v in new.items() if k not in ("metadata", "status")}
        meta["generation"] = old["metadata"].get("generation", 1) + (1 if body_changed else 0)
        meta["resourceVersion"] = str(next(self._rv))
        return new

    @staticmethod
    def _response(obj: Payload, status: int = 200) -> aiohttp.web.Response:
        return aiohttp.web.json_response(obj, status=status)

    # --- namespaces ------------------------------------------------------------------

    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        if raw_request.path.rstrip("/") == "/api/v1/namespaces":
            return await self._namespaces(raw_request)
        token = _RAW_REQUEST.set(raw_request)
        try:
            return await super().__call__(raw_request)
        finally:
            _RAW_REQUEST.reset(token)

    async def _namespaces(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        names = sorted({ns for (_, ns, _), obj in self.objects.items() if ns and not obj.deleted} | {"default"})
        items = [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": n, "resourceVersion": "1"}}
                 for n in names]
        if raw_request.query.get("watch") != "true":
            return aiohttp.web.json_response({"apiVersion": "v1", "kind": "NamespaceList",
                                              "metadata": {"resourceVersion": "1"}, "items": items})
        response = aiohttp.web.StreamResponse()
        await response.prepare(raw_request)
        for item in items:
            await response.write(json.dumps({"type": "ADDED", "object": item}).encode() + b"\n")
        # New namespaces are not emulated; hold the stream until the client leaves.
        while raw_request.transport is not None and not raw_request.transport.is_closing():
            await asyncio.sleep(0.2)
        return response

    # --- dispatch ---------------------------------------------------------------------

    async def _handle(self, request: Request) -> aiohttp.web.StreamResponse:
        if request.resource is None or request.resource.plural is None:
            return await super()._handle(request)
        method = str(request.method.value).upper()
        faults = self.faults
        outcome = None
        agent = request.headers.get("User-Agent", "")
        if faults is not None and method in WRITE_METHODS and agent.startswith(faults.user_agent):
            outcome = faults.pick(request.resource.plural)
            if outcome == "500":
                raise KubernetesError(status=500, reason="InternalError", message="injected fault")
            if outcome == "409":
                raise KubernetesError(status=409, reason="Conflict", message="injected conflict")
            if outcome == "timeout-lost":
                await asyncio.sleep(faults.hang_seconds)
                raise KubernetesError(status=504, reason="Timeout", message="injected timeout")
        response = await self._dispatch(request, method)
        if faults is not None and outcome == "timeout-stored":
            await asyncio.sleep(faults.hang_seconds)
        return response

    async def _dispatch(self, request: Request, method: str) -> aiohttp.web.StreamResponse:
        if request.subresource == "scale":
            return await self._scale(request, method)
        if method == "POST" and request.name is None:
            return await self._create(request)
        if method == "PATCH" and request.name:
            return await self._patch(request)
        if method == "PUT" and request.name:
            return await self._put(request)
        if method == "DELETE" and request.name:
            return await self._delete(request)
        if method == "GET" and request.subresource is None:
            return await self._read(request)
        return await super()._handle(request)

    async def _read(self, request: Request) -> aiohttp.web.StreamResponse:
        """GET, LIST and WATCH straight from storage.

        kmock's generic path matches each request against its recorded history,
        which grows with every request; the benchmark's thousands of objects
        would make that quadratic. The semantics are kmock's own serve functions'.
        """
        if request.params.get("watch") == "true":
            raw = _RAW_REQUEST.get()
            response = aiohttp.web.StreamResponse()
            await response.prepare(raw)
            try:
                async for event in self._serve_watch(request):
                    if isinstance(event, dict):
                        await response.write(json.dumps(event).encode() + b"\n")
            except (ConnectionResetError, RuntimeError):
                pass  # the client went away
            return response
        if request.name is None:
            return self._response(await self._serve_list(request))
        return self._response(await self._serve_fetch(request))

    # --- writes ---------------------------------------------------------------------

    async def _create(self, request: Request) -> aiohttp.web.StreamResponse:
        obj = copy.deepcopy(request.data or {})
        namespace = request.namespace or obj.get("metadata", {}).get("namespace")
        key = (request.resource, namespace, obj.get("metadata", {}).get("name"))
        async with self._lock:
            if self._stored(key) is not None:
                raise KubernetesError(status=409, reason="AlreadyExists", message=f"{key[2]} already exists")
            self._new_metadata(obj, namespace)
            await self._store(key, obj, created=True)
        return self._response(obj, 201)

    async def _patch(self, request: Request) -> aiohttp.web.StreamResponse:
        key = (request.resource, request.namespace, request.name)
        body = copy.deepcopy(request.data or {})
        if isinstance(body, list):  # application/json-patch+json
            async with self._lock:
                live = self._stored(key)
                if live is None:
                    raise KubernetesError(status=404, reason="NotFound", message=f"{request.name} not found")
                new = self._successor(live, jsonpatch.apply_patch(live, body))
                await self._store(key, new, created=False)
            return self._response(new)
        is_apply = request.headers.get("Content-Type", "").startswith(APPLY)
        manager = request.params.get("fieldManager", "")
        plural = _plural(request)
        async with self._lock:
            live = self._stored(key)
            if live is None:
                if not is_apply:
                    raise KubernetesError(status=404, reason="NotFound", message=f"{request.name} not found")
                if plural not in NO_STATUS_SUBRESOURCE:
                    body.pop("status", None)
                self._new_metadata(body, request.namespace)
                self._applied[(*key, manager)] = copy.deepcopy(request.data)
                await self._store(key, body, created=True)
                return self._response(body, 201)
            if request.subresource == "status":
                new = _merge(live, {"status": body.get("status")})
            else:
                if plural not in NO_STATUS_SUBRESOURCE:
                    body.pop("status", None)
                if is_apply:
                    previous = self._applied.get((*key, manager), {})
                    live = _drop_omitted(live, previous, body)
                    self._applied[(*key, manager)] = copy.deepcopy(body)
                new = _merge(live, body)
            new = self._successor(live, new)
            await self._store(key, new, created=False)
        return self._response(new)

    async def _put(self, request: Request) -> aiohttp.web.StreamResponse:
        key = (request.resource, request.namespace, request.name)
        body = copy.deepcopy(request.data or {})
        async with self._lock:
            live = self._stored(key)
            if live is None:
                raise KubernetesError(status=404, reason="NotFound", message=f"{request.name} not found")
            wanted = body.get("metadata", {}).get("resourceVersion")
            if wanted and wanted != live["metadata"]["resourceVersion"]:
                raise KubernetesError(status=409, reason="Conflict",
                                      message="the object has been modified; please apply your changes to the latest version")
            if _plural(request) not in NO_STATUS_SUBRESOURCE:
                if "status" in live:
                    body["status"] = live["status"]
                else:
                    body.pop("status", None)
            new = self._successor(live, body)
            await self._store(key, new, created=False)
        return self._response(new)

    async def _delete(self, request: Request) -> aiohttp.web.StreamResponse:
        key = (request.resource, request.namespace, request.name)
        options = request.data if isinstance(request.data, dict) else {}
        policy = options.get("propagationPolicy") or request.params.get("propagationPolicy") or "Background"
        async with self._lock:
            live = self._stored(key)
            if live is None:
                raise KubernetesError(status=404, reason="NotFound", message=f"{request.name} not found")
            wanted_uid = (options.get("preconditions") or {}).get("uid")
            if wanted_uid and wanted_uid != live["metadata"]["uid"]:
                raise KubernetesError(status=409, reason="Conflict", message="precondition failed: uid differs")
            if live["metadata"].get("finalizers"):
                live["metadata"]["deletionTimestamp"] = rfc3339_now()
                live = self._successor(live, live)
                await self._store(key, live, created=False)
                return self._response(live)
            if policy == "Orphan":
                live["metadata"]["deletionTimestamp"] = rfc3339_now()
                live["metadata"]["finalizers"] = ["orphan"]
                live = self._successor(live, live)
                await self._store(key, live, created=False)
                self._collecting.add(asyncio.ensure_future(self._collect_orphaned(key, live["metadata"]["uid"])))
                return self._response(live)
            await self._remove(key, live, policy)
        return self._response(live)

    async def _collect_orphaned(self, key: tuple[Any, ...], uid: str) -> None:
        """The garbage collector's part of an Orphan deletion: release the dependents, then remove."""
        await asyncio.sleep(ORPHAN_DELAY)
        async with self._lock:
            live = self._stored(key)
            if live is not None and live["metadata"]["uid"] == uid:
                live["metadata"].pop("finalizers", None)
                await self._remove(key, live, "Orphan")

    async def _remove(self, key: tuple[Any, ...], live: dict[str, Any], policy: str) -> None:
        self.objects[key].delete()
        # As etcd does: the deletion is a revision of its own, and the DELETED event carries it.
        live["metadata"]["resourceVersion"] = str(next(self._rv))
        await self._buses[key[0]].put({"type": "DELETED", "object": copy.deepcopy(live)})
        uid = live["metadata"]["uid"]
        for dep_key, obj in list(self.objects.items()):
            if obj.deleted:
                continue
            dependent = copy.deepcopy(obj.raw)
            refs = dependent.get("metadata", {}).get("ownerReferences") or []
            if not any(ref.get("uid") == uid for ref in refs):
                continue
            if policy == "Orphan":
                dependent["metadata"]["ownerReferences"] = [r for r in refs if r.get("uid") != uid]
                await self._store(dep_key, self._successor(dependent, dependent), created=False)
            else:
                await self._remove(dep_key, dependent, policy)

    async def _scale(self, request: Request, method: str) -> aiohttp.web.StreamResponse:
        key = (request.resource, request.namespace, request.name)
        spec_path, status_path, selector_path = SCALE_PATHS[_plural(request)]
        async with self._lock:
            live = self._stored(key)
            if live is None:
                raise KubernetesError(status=404, reason="NotFound", message=f"{request.name} not found")
            if method in ("PATCH", "PUT"):
                replicas = _get(request.data or {}, "spec.replicas")
                new = copy.deepcopy(live)
                _set(new, spec_path, replicas)
                live = self._successor(live, new)
                await self._store(key, live, created=False)
        scale: dict[str, Any] = {
            "apiVersion": "autoscaling/v1", "kind": "Scale",
            "metadata": {k: live["metadata"][k] for k in ("name", "namespace", "uid", "resourceVersion")},
            "spec": {"replicas": _get(live, spec_path) or 0},
            "status": {"replicas": _get(live, status_path) or 0},
        }
        if selector_path and _get(live, selector_path):
            scale["status"]["selector"] = _get(live, selector_path)
        return self._response(scale)

    # --- other controllers' writes (no faults; for the test harness) -----------------

    async def upsert(self, api_version: str, plural: str, obj: dict[str, Any]) -> dict[str, Any]:
        meta = obj["metadata"]
        key = (resource(f"{api_version}/{plural}"), meta.get("namespace"), meta["name"])
        async with self._lock:
            live = self._stored(key)
            if live is None:
                obj = copy.deepcopy(obj)
                self._new_metadata(obj, meta.get("namespace"))
                await self._store(key, obj, created=True)
                return obj
            new = self._successor(live, copy.deepcopy(obj))
            await self._store(key, new, created=False)
            return new

    async def remove(self, api_version: str, plural: str, namespace: str | None, name: str) -> None:
        key = (resource(f"{api_version}/{plural}"), namespace, name)
        async with self._lock:
            live = self._stored(key)
            if live is not None:
                await self._remove(key, live, "Background")

    # --- reads --------------------------------------------------------------------------

    async def _serve_list(self, request: Request) -> Payload:
        result = await super()._serve_list(request)
        assert isinstance(result, dict), result  # kmock lists as {"metadata": ..., "items": [...]}
        selector = request.params.get("labelSelector")
        if selector:
            result["items"] = [item for item in result["items"]
                               if _matches(item.get("metadata", {}).get("labels") or {}, selector)]
        result["items"] = copy.deepcopy(result["items"])
        return result

    async def _serve_watch(self, request: Request) -> AsyncIterator[Payload]:
        selector = request.params.get("labelSelector")
        async for event in super()._serve_watch(request):
            if selector and isinstance(event, dict):
                labels = (event.get("object") or {}).get("metadata", {}).get("labels") or {}
                if not _matches(labels, selector):
                    continue
            yield event


def revision_of(template: dict[str, Any]) -> str:
    return uuid.uuid5(uuid.NAMESPACE_OID, json.dumps(template, sort_keys=True)).hex[:10]
