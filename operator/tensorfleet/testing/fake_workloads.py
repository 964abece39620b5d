"""The StatefulSet and Deployment controllers and the kubelet, as far as the operator can tell: the emulator has no
controllers, so `FakeWorkloads` makes and readies pods for the operator's reaction to them (readiness, rollout,
scaling) to be tested. Design: docs/architecture.md#how-it-is-tested.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
from collections.abc import Callable
from typing import Any, Self

from tensorfleet import contract
from tensorfleet.testing.kube_emulator import ClusterEmulator, revision_of, rfc3339_now


class FakeWorkloads:
    """Pods appear for every StatefulSet ordinal with the template's labels plus `controller-revision-hash` and
    `apps.kubernetes.io/pod-index`; RollingUpdate StatefulSets replace outdated pods themselves, OnDelete ones
    leave that to the operator; pods turn Ready when `ready(pod)` says so, and the leader of a multi-stage group
    not before its workers are (a vLLM leader serves only after every stage joined its Ray cluster)."""

    def __init__(self, emulator: ClusterEmulator, ready: Callable[[dict[str, Any]], bool] | None = None,
                 interval: float = 0.05) -> None:
        self.emulator = emulator
        self.ready = ready or (lambda pod: True)
        self.interval = interval
        self._task: asyncio.Task[None] | None = None
        self._addresses = 0  # pod IPs handed out
        self._workers_ready: Callable[[dict[str, Any]], bool] = lambda pod: True

    async def __aenter__(self) -> Self:
        self._task = asyncio.create_task(self._loop())
        return self

    async def __aexit__(self, *_: object) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    async def _loop(self) -> None:
        while True:
            await self.sync()
            await asyncio.sleep(self.interval)

    async def sync(self) -> None:
        pods_by_owner: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}
        for pod in self.emulator.all("v1", "pods"):
            meta = pod["metadata"]
            pods_by_owner.setdefault((meta["namespace"], meta["name"].rsplit("-", 1)[0]), {})[meta["name"]] = pod
        self._workers_ready = _workers_ready(self.emulator.all("v1", "pods"))
        for sts in self.emulator.all("apps/v1", "statefulsets"):
            key = (sts["metadata"]["namespace"], sts["metadata"]["name"])
            await self._sync_statefulset(sts, pods_by_owner.get(key, {}))
        for deployment in self.emulator.all("apps/v1", "deployments"):
            replicas = deployment["spec"].get("replicas", 1)
            status = {"replicas": replicas, "readyReplicas": replicas, "availableReplicas": replicas,
                      "updatedReplicas": replicas, "observedGeneration": deployment["metadata"]["generation"]}
            if deployment.get("status") != status:
                await self.emulator.upsert("apps/v1", "deployments", {**deployment, "status": status})

    async def _sync_statefulset(self, sts: dict[str, Any], pods: dict[str, dict[str, Any]]) -> None:
        meta, spec = sts["metadata"], sts["spec"]
        namespace, name = meta["namespace"], meta["name"]
        template = spec["template"]
        revision = f"{name}-{revision_of(template)}"
        replicas = spec.get("replicas", 1)
        live: list[dict[str, Any]] = []
        for pod_name, pod in pods.items():
            index = int(pod_name.rsplit("-", 1)[1])
            outdated = pod["metadata"]["labels"].get("controller-revision-hash") != revision
            rolling = spec.get("updateStrategy", {}).get("type", "RollingUpdate") == "RollingUpdate"
            if index >= replicas or (outdated and rolling):
                await self.emulator.remove("v1", "pods", namespace, pod_name)
                continue
            live.append(await self._adopt_and_ready(sts, pod))
        for index in range(replicas):
            pod_name = f"{name}-{index}"
            if pod_name not in pods:
                labels = {**template["metadata"]["labels"], "controller-revision-hash": revision,
                          contract.LABEL_POD_INDEX: str(index)}
                pod = {"apiVersion": "v1", "kind": "Pod",
                       "metadata": {"name": pod_name, "namespace": namespace, "labels": labels,
                                    "ownerReferences": [self._owner(sts)]},
                       "spec": copy.deepcopy(template["spec"]),
                       "status": {"phase": "Pending", "conditions": [{"type": "Ready", "status": "False",
                                                                       "lastTransitionTime": rfc3339_now()}]}}
                live.append(await self.emulator.upsert("v1", "pods", pod))
        ready = sum(1 for p in live if _ready(p))
        updated = sum(1 for p in live if p["metadata"]["labels"].get("controller-revision-hash") == revision)
        status = {"replicas": len(live), "readyReplicas": ready, "updatedReplicas": updated,
                  "updateRevision": revision, "observedGeneration": meta["generation"]}
        if updated == len(live):
            status["currentRevision"] = revision
        if {k: v for k, v in (sts.get("status") or {}).items() if k != "currentRevision"} != \
                {k: v for k, v in status.items() if k != "currentRevision"}:
            await self.emulator.upsert("apps/v1", "statefulsets", {**sts, "status": {**(sts.get("status") or {}), **status}})

    async def _adopt_and_ready(self, sts: dict[str, Any], pod: dict[str, Any]) -> dict[str, Any]:
        changed = False
        refs = pod["metadata"].get("ownerReferences") or []
        if not any(r.get("controller") for r in refs):  # orphaned by a recreated StatefulSet
            pod["metadata"]["ownerReferences"] = [*refs, self._owner(sts)]
            changed = True
        # A leader turns Ready only once its workers are; one that serves stays so (its engine runs on).
        want = self.ready(pod) and (_ready(pod) or self._workers_ready(pod))
        if _ready(pod) != want:
            # As the kubelet does: lastTransitionTime moves when the status does.
            pod["status"] = {**pod.get("status", {}), "phase": "Running" if want else "Pending",
                             "conditions": [{"type": "Ready", "status": "True" if want else "False",
                                             "lastTransitionTime": rfc3339_now()}]}
            if want and not pod["status"].get("podIP"):
                # The kubelet reports the pod's address once its sandbox runs; one per pod, never reused.
                self._addresses += 1
                pod["status"]["podIP"] = f"10.244.{self._addresses // 250}.{self._addresses % 250 + 1}"
            changed = True
        if changed:
            return await self.emulator.upsert("v1", "pods", pod)
        return pod

    @staticmethod
    def _owner(sts: dict[str, Any]) -> dict[str, Any]:
        return {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": sts["metadata"]["name"],
                "uid": sts["metadata"]["uid"], "controller": True, "blockOwnerDeletion": True}


def _ready(pod: dict[str, Any]) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in pod.get("status", {}).get("conditions", []))


def _workers_ready(pods: list[dict[str, Any]]) -> Callable[[dict[str, Any]], bool]:
    """Whether a pod may turn Ready as far as its group goes: a leader (stage 0) once the pod of every other stage
    of its group (its TF_PIPELINE_PARALLEL_SIZE) exists and is Ready, as the last sync saw them; any other pod at
    once."""
    ready: set[tuple[str, str, str, str]] = set()
    for pod in pods:
        labels = pod["metadata"].get("labels") or {}
        if contract.LABEL_STAGE in labels and _ready(pod):
            ready.add((pod["metadata"]["namespace"], labels.get(contract.LABEL_INFERENCE_SERVICE, ""),
                       labels.get(contract.LABEL_POD_INDEX, ""), labels[contract.LABEL_STAGE]))

    def workers_ready(pod: dict[str, Any]) -> bool:
        labels = pod["metadata"].get("labels") or {}
        if labels.get(contract.LABEL_STAGE) != "0":
            return True
        env = {e.get("name"): e.get("value") for c in pod["spec"].get("containers") or [] for e in c.get("env") or []}
        stages = int(env.get(contract.ENV_PIPELINE_PARALLEL) or 1)
        key = (pod["metadata"]["namespace"], labels.get(contract.LABEL_INFERENCE_SERVICE, ""),
               labels.get(contract.LABEL_POD_INDEX, ""))
        return all((*key, str(stage)) in ready for stage in range(1, stages))
    return workers_ready
