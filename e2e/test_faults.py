"""Faults of the control plane itself, under steady client traffic through a router (issue 36).

Each case reports what a person running the fleet asks after an incident: requests failed, time to recover,
objects recreated, orphaned or duplicated. The operator runs under e2e/supervise.py, which starts it again when
it exits as a kubelet would its container (with the kubelet's back-off): an operator that could not renew its
Lease for its duration exits by design, as controller-runtime's do; once the fault ends, control-plane processes
that exit are started again as a kubelet does static pods (`static_pods`). KWOK, the nodes' agent, runs throughout.
Then etcd compacted and restarted and the API server restarted, so every watch resumes into 410 Gone; leader
failover: a standby replica beside the operator (`e2e/cluster operator start --standby`) finishes a rollout whose
leader was SIGKILLed; last, the faults of a GPU node under one stage of a pipeline group (NotReady, deleted), of a
GPU (an XID, through a simulator pod's simulated GPU state), and of a router replica SIGKILLed with streams open
(clients through the Service's ClusterIP, which the e2e cluster's kube-proxy routes).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
from kube import (
    CLUSTER_SCRIPT,
    NEXT_IMAGE,
    OWN_KINDS,
    SYSTEM_NAMESPACE,
    Requests,
    cluster_status,
    condition_status,
    delete_namespace_later,
    deploy,
    engine_pods,
    eventually,
    get,
    isvc,
    items,
    kubectl,
    new_namespace,
    router_url,
    start_operator,
    wait_deleted,
)
from test_pods import pod_runner_entry
from test_rollout import deploy_replicas, rollout_done, rollout_under_way, set_engine_image

from tensorfleet import contract, promtext
from tensorfleet.controller.observe import pod_ready
from tensorfleet.gpus import find_gpu

OUTAGE_S = 20.0
CONVERGE_S = 60.0  # a scale written after the outage is served within this
FAILOVER_S = 30.0  # a standby leads within this of its leader's death: the Lease's 15 s, and its polls


def control_plane(action: str, *only: str) -> float:
    started = time.monotonic()
    subprocess.run([str(CLUSTER_SCRIPT), "control-plane", action, *(f"--only={c}" for c in only)], check=True,
                   capture_output=True, timeout=300)
    return time.monotonic() - started


def operator_restarts() -> int:
    found = cluster_status()
    assert found and found["operator"]["running"], "needs the operator e2e/cluster runs (its supervisor counts its restarts)"
    return int(found["operator"]["restarts"])


def control_plane_pids() -> dict[str, int]:
    return {name: int(p["pid"]) for name, p in ((cluster_status() or {}).get("processes") or {}).items() if p.get("pid")}


Children = dict[tuple[str, str], tuple[str, list[str]]]


def children(name: str, namespace: str) -> Children:
    """(kind, name) -> (uid, the uids of its owners) of every object labelled with the InferenceService."""
    found = items(OWN_KINDS, namespace, f"{contract.LABEL_INFERENCE_SERVICE}={name}")
    return {(o["kind"], o["metadata"]["name"]): (o["metadata"]["uid"],
                                                 [r["uid"] for r in o["metadata"].get("ownerReferences") or []])
            for o in found}


def changed_children(before: Children, after: Children, owner: str) -> tuple[list[str], list[str], list[str]]:
    """(recreated, orphaned, added) children ("Kind/name") between two `children` readings; OWNER the
    InferenceService's uid."""
    recreated = sorted(f"{k}/{n}" for (k, n), (uid, _o) in before.items() if after.get((k, n), ("",))[0] != uid)
    orphaned = sorted(f"{k}/{n}" for (k, n), (_uid, owners) in after.items() if owners != [owner])
    added = sorted(f"{k}/{n}" for k, n in after.keys() - before.keys())
    return recreated, orphaned, added


@dataclass
class Service:
    name: str
    namespace: str
    model: str
    owner: str
    replicas: int


@pytest.fixture(scope="module")
def service() -> Iterator[Service]:
    """One simulator InferenceService the cases share (each scales it once, after its fault)."""
    namespace = new_namespace("faults")
    try:
        name, doc = deploy("simulator-cpu.yaml", namespace, replicas=1, autoscaling=None,
                           parallelism={"tensor": 1, "pipeline": 1})
        owner = (isvc(name, namespace) or {})["metadata"]["uid"]
        yield Service(name, namespace, doc["spec"]["model"]["servedName"], owner, 1)
    finally:
        delete_namespace_later(namespace)


def _router_engines(url: str) -> int:
    with urllib.request.urlopen(f"{url}/health", timeout=10) as answer:
        return int(json.load(answer)["healthy"])


def _signal_apiserver(sig: signal.Signals) -> float:
    found = cluster_status() or {}
    pid = ((found.get("processes") or {}).get("kube-apiserver") or {}).get("pid")
    assert pid, f"no kube-apiserver pid in e2e/cluster status: {found.get('processes')!r}"
    os.kill(int(pid), sig)
    return 0.0


def test_a_20s_outage_of_the_whole_control_plane(service: Service) -> None:
    """etcd, the API server, the controller manager and the scheduler killed, and started again 20 s later (the
    nodes' agents, KWOK and the pod runner, run on): the router serves from its last view; the operator, unable to
    renew its Lease, exits and its supervisor starts it again; a scale written once the API server is back is
    reconciled, and its new engine serving behind the router, within 60 s."""
    _through(service, "the control plane stopped", lambda: control_plane("stop"), lambda: control_plane("start"), 2)


@contextmanager
def static_pods() -> Iterator[None]:
    """Start again any control-plane process that exits, as the kubelet does a control plane's static pods, until
    the block ends: the controller manager and the scheduler exit by design when they cannot renew their leader
    Lease, which after an API server outage can happen a while after it is back."""
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(2.0):
            processes = ((cluster_status() or {}).get("processes") or {}).values()
            if any(not p.get("running") for p in processes):
                try:
                    control_plane("start")
                except (subprocess.SubprocessError, OSError) as exc:
                    print(f"static pods: e2e/cluster control-plane start failed: {exc}")
    thread = threading.Thread(target=watch, name="static-pods", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=120)


def _thaw() -> float:
    """SIGCONT the API server, then start what exited meanwhile, as the kubelet does a control plane's static pods:
    the controller manager and the scheduler exit by design when they cannot renew their leader Lease."""
    _signal_apiserver(signal.SIGCONT)
    return control_plane("start")


def test_a_20s_freeze_of_the_api_server(service: Service) -> None:
    """kube-apiserver SIGSTOPped: connections stay open and nothing answers. The operator's requests time out
    rather than hang, and a scale written once it answers again is served within 60 s."""
    _through(service, "kube-apiserver frozen (SIGSTOP)", lambda: _signal_apiserver(signal.SIGSTOP), _thaw, 1)


def _list_version(namespace: str) -> str:
    """The resourceVersion a LIST of InferenceServices is at now: where a watch started from it resumes."""
    found = json.loads(kubectl("get", "--raw", f"/apis/{contract.API_VERSION}/namespaces/{namespace}/{contract.PLURAL}"))
    return str(found["metadata"]["resourceVersion"])


def _etcd(path: str, body: dict[str, Any]) -> dict[str, Any]:
    """A call to etcd's gRPC gateway (JSON over HTTP on its client port)."""
    url = (cluster_status() or {}).get("etcd")
    assert url, "needs e2e/cluster's etcd client URL (e2e/cluster status --json: etcd)"
    request = urllib.request.Request(f"{url}{path}", data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as answer:
        return dict(json.load(answer))


def test_etcd_compacted_and_restarted_then_the_api_server_restarted(service: Service) -> None:
    """etcd compacted at its newest revision (physically: every older one gone) and restarted, then kube-apiserver
    restarted: its watch cache starts again past every revision a client held, so every watch resumes with 410
    Gone and must relist (the operator in-process when the API server is back within its Lease). A scale written
    once it is back is reconciled and served, nothing is recreated, no request through the router fails."""
    held: dict[str, str] = {}

    def begin() -> float:
        started = time.monotonic()
        held["version"] = _list_version(service.namespace)
        revision = _etcd("/v3/kv/range", {"key": "AA==", "limit": 1, "keys_only": True})["header"]["revision"]
        _etcd("/v3/kv/compaction", {"revision": revision, "physical": True})
        held["compacted"] = str(revision)
        control_plane("stop", "etcd")
        control_plane("start")
        control_plane("stop", "kube-apiserver")
        return time.monotonic() - started

    _through(service, "etcd compacted and restarted, then kube-apiserver restarted", begin,
             lambda: control_plane("start"), 1 if service.replicas == 2 else 2, outage=0.0)
    # What every watcher met: a watch from before the fault is refused as expired, not resumed.
    path = f"/apis/{contract.API_VERSION}/namespaces/{service.namespace}/{contract.PLURAL}"
    expired = subprocess.run(
        ["kubectl", "get", "--raw", f"{path}?watch=true&resourceVersion={held['version']}&timeoutSeconds=2"],
        capture_output=True, text=True, timeout=60, check=False)
    said = expired.stdout + expired.stderr
    print(f"a watch from resourceVersion {held['version']} (etcd compacted at {held['compacted']}): {said.strip()[:300]}")
    assert "410" in said or "Expired" in said or "too old" in said, said


def _through(service: Service, fault: str, begin: Callable[[], float], end: Callable[[], float],
             replicas: int, outage: float = OUTAGE_S) -> None:
    name, namespace = service.name, service.namespace
    before = children(name, namespace)
    assert before and all(owners == [service.owner] for _uid, owners in before.values()), before
    restarts, pids = operator_restarts(), control_plane_pids()
    url = router_url(name, namespace)
    with Requests(url, service.model) as load, ExitStack() as kubelet:
        eventually("three answers in a row through the router", lambda: load.codes[-3:] == [200] * 3, timeout=120)
        first = len(load.codes)
        try:
            began = begin()
            time.sleep(outage)
        finally:
            ended = end()
            kubelet.enter_context(static_pods())
        served_while_down = len(load.codes) - first
        back = time.monotonic()
        kubectl("scale", contract.PLURAL, name, "-n", namespace, f"--replicas={replicas}")

        def reconciled() -> dict[str, Any] | None:
            obj = isvc(name, namespace)
            sets = items("statefulsets", namespace, f"{contract.LABEL_INFERENCE_SERVICE}={name}")
            done = (obj is not None and (obj.get("status") or {}).get("observedGeneration") == obj["metadata"]["generation"]
                    and sets and all(s["spec"]["replicas"] == replicas for s in sets))
            return obj if done else None

        def served() -> dict[str, Any] | None:
            obj = isvc(name, namespace)
            status = (obj or {}).get("status") or {}
            done = (status.get("readyReplicas") == replicas and status.get("replicas") == replicas
                    and condition_status(obj, "Ready") == "True")
            # ... and the router, whose EndpointSlice watch went through the fault too, routes to them all.
            return obj if done and _router_engines(url) == replicas else None
        eventually(f"the scale to {replicas} reconciled within {CONVERGE_S:.0f}s of the API server's return",
                   reconciled, timeout=CONVERGE_S)
        took = time.monotonic() - back
        eventually(f"the scale to {replicas} served within {CONVERGE_S:.0f}s of the API server's return", served,
                   timeout=max(1.0, CONVERGE_S - took))
        served_in = time.monotonic() - back
        sent = len(load.codes)
        eventually("a few more requests after", lambda: len(load.codes) >= sent + 3, timeout=60)
    service.replicas = replicas
    during = load.codes[first:]
    failed = [code for code in during if code != 200]
    recreated, orphaned, added = changed_children(before, children(name, namespace), service.owner)
    restarted = operator_restarts() - restarts
    now = control_plane_pids()
    components = sorted(c for c, pid in pids.items() if now.get(c) != pid)
    print(f"\n{fault} for {outage:.0f}s (begun in {began:.1f}s, ended in {ended:.1f}s): {len(during)} requests "
          f"through the router ({served_while_down} during the fault), {len(failed)} failed; the scale to {replicas} "
          f"reconciled {took:.1f}s after, served "
          f"{served_in:.1f}s after; "
          f"operator restarts {restarted}; control plane started again: {components}; children recreated {recreated}, "
          f"orphaned {orphaned}, added {added}")
    assert served_while_down > 0, "no request was answered during the fault"
    assert not failed, f"{len(failed)} of {len(during)} requests failed: {failed[:10]}"
    assert not recreated and not orphaned and not added, (recreated, orphaned, added)


def _standby(action: str) -> None:
    subprocess.run([str(CLUSTER_SCRIPT), "operator", action, "--standby"], check=True, capture_output=True,
                   timeout=120)


def _holder() -> str | None:
    lease = get("lease", contract.OPERATOR_LEASE_NAME, SYSTEM_NAMESPACE) or {}
    return (lease.get("spec") or {}).get("holderIdentity")


def test_the_standby_operator_finishes_a_rollout_whose_leader_was_sigkilled() -> None:
    """Two operator replicas electing a leader through one Lease, as two pods of the chart's Deployment do: the
    leader SIGKILLed mid-rollout and not started again; the standby takes the Lease within its duration, finishes
    the rollout, and every child the leader wrote is kept (none recreated, added or orphaned); requests through
    the router are answered throughout."""
    found = cluster_status() or {}
    leader, standby = found["operator"], found.get("standby")
    assert leader.get("running") and standby is not None, "needs e2e/cluster's operator (and its --standby)"
    namespace = new_namespace("failover")
    replicas = 2   # the kill lands while the first group is replaced; the standby replaces the second
    killed = False
    try:
        name, pipeline = deploy_replicas(namespace, replicas)
        owner = (isvc(name, namespace) or {})["metadata"]["uid"]
        model = (isvc(name, namespace) or {})["spec"]["model"]["servedName"]
        _standby("start")
        main = _holder()
        assert main == leader["name"], f"the first replica leads: {main}"
        before = children(name, namespace)
        with Requests(router_url(name, namespace), model) as load:
            eventually("three answers in a row through the router", lambda: load.codes[-3:] == [200] * 3, timeout=120)
            first = len(load.codes)
            set_engine_image(name, namespace, NEXT_IMAGE)
            eventually("the rollout under way", lambda: rollout_under_way(name, namespace, NEXT_IMAGE, replicas), every=0.1)
            subprocess.run([str(CLUSTER_SCRIPT), "operator", "kill"], check=True, capture_output=True, timeout=60)
            killed, at = True, time.monotonic()
            mid = (isvc(name, namespace) or {}).get("status", {}).get("updatedReplicas", 0) < replicas
            eventually("the standby holding the Lease", lambda: _holder() == standby["name"], timeout=FAILOVER_S,
                       every=0.2)
            took_over = time.monotonic() - at
            obj = eventually("the rollout finished by the standby",
                             lambda: rollout_done(name, namespace, NEXT_IMAGE, replicas), timeout=CONVERGE_S + FAILOVER_S)
            finished = time.monotonic() - at
            sent = len(load.codes)
            eventually("a few more requests after", lambda: len(load.codes) >= sent + 3, timeout=60)
        during = load.codes[first:]
        failed = [code for code in during if code != 200]
        recreated, orphaned, added = changed_children(before, children(name, namespace), owner)
        print(f"\nthe leader SIGKILLed mid-rollout ({'mid' if mid else 'AFTER'} rollout, {replicas} groups of "
              f"{pipeline}): the standby took the Lease {took_over:.1f}s after, the rollout finished {finished:.1f}s "
              f"after; {len(during)} requests through the router, {len(failed)} failed; children recreated "
              f"{recreated}, orphaned {orphaned}, added {added}")
        assert mid, "the rollout had finished before the leader was killed"
        assert not failed, f"{len(failed)} of {len(during)} requests failed: {failed[:10]}"
        assert not recreated and not orphaned and not added, (recreated, orphaned, added)
        assert (obj.get("status") or {}).get("observedGeneration") == obj["metadata"]["generation"]
    finally:
        # Back as the other tests found it: the first replica started again (a standby until the other goes), then
        # the standby stopped, which gives the Lease up on its way out.
        if killed:
            start_operator()
        _standby("stop")
        eventually("the first replica leading again", lambda: _holder() == leader["name"], timeout=FAILOVER_S)
        delete_namespace_later(namespace)


# A GPU type no other e2e test uses: the nodes of the node fault cases are their own.
NODE_LOSS_GPU = "H100-NVL-94GB"
NODE_FAULT_LABEL = "e2e.tensorfleet.dev/node-fault"
# KWOK's chaos stage (kustomize/stage/node/chaos) turns a node with this label NotReady, with the reason and
# message of these annotations, as a kubelet whose container runtime died reports it.
KWOK_NOT_READY = "node-not-ready.stage.kwok.x-k8s.io"


def _gpu_node(name: str, index: int) -> dict[str, Any]:
    """A KWOK node with one GPU of NODE_LOSS_GPU, as GPU feature discovery labels it: one engine pod fits."""
    gpu = find_gpu(NODE_LOSS_GPU)
    assert gpu is not None
    capacity = {"cpu": "64", "memory": "512Gi", "pods": "110", contract.GPU_RESOURCE: "1"}
    cidr = f"10.244.{200 + index}.0/24"
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "annotations": {"kwok.x-k8s.io/node": "fake"},
                         "labels": {"kubernetes.io/hostname": name, "type": "kwok", NODE_FAULT_LABEL: "",
                                    "nvidia.com/gpu.present": "true", "nvidia.com/gpu.product": gpu.product_labels[0],
                                    "nvidia.com/gpu.count": "1", "nvidia.com/gpu.memory": str(gpu.memory_mib)}},
            "spec": {"podCIDR": cidr, "podCIDRs": [cidr],
                     "taints": [{"key": contract.GPU_RESOURCE, "value": "present", "effect": "NoSchedule"}]},
            "status": {"capacity": capacity, "allocatable": capacity}}


def _groups(name: str, namespace: str) -> dict[str, dict[str, Any]]:
    return {p["metadata"]["name"]: p for p in engine_pods(name, namespace)}


@dataclass
class PipelineFleet:
    """Two groups of pipeline 2 on six GPU nodes of their own, one engine pod a node (four pods and two spares),
    which the node cases share: each faults the node under stage 1 of one group, and the next finds the fleet whole
    again. The engines are simulators, so the pod runner runs them and requests flow through the router."""

    name: str
    namespace: str
    model: str
    pods: dict[str, dict[str, Any]] = field(default_factory=dict)
    lowest: int = 2                                     # the fewest ready groups watch() saw
    seen: set[str] = field(default_factory=set)         # Degraded and Progressing conditions it saw True

    def settle(self) -> None:
        """Wait for four Ready engine pods and both groups ready; remember the pods, forget what watch() saw."""
        self.pods = eventually("four engine pods Ready", lambda: (found := _groups(self.name, self.namespace))
                               and len(found) == 4 and all(pod_ready(p) for p in found.values()) and found)
        eventually("both groups ready", lambda: ((isvc(self.name, self.namespace) or {}).get("status") or {})
                   .get("readyReplicas") == 2, timeout=60)
        self.lowest, self.seen = 2, set()
        time.sleep(1.1)   # whole-second timestamps: what the fault brings must be visibly later than the groups

    def pod(self, stage: int, group: int) -> dict[str, Any]:
        return self.pods[f"{contract.stage_name(self.name, stage)}-{group}"]

    def watch(self) -> Callable[[], dict[str, Any]]:
        """A probe for eventually(): the service must stay Ready; it gathers the lowest readyReplicas seen and
        the Degraded and Progressing conditions that were True, and returns the status and the pods."""
        def probe() -> dict[str, Any]:
            obj = isvc(self.name, self.namespace) or {}
            status = obj.get("status") or {}
            assert condition_status(obj, "Ready") == "True", f"the service stopped being Ready: {status}"
            self.lowest = min(self.lowest, int(status.get("readyReplicas") or 0))
            self.seen.update(f"{c['type']}={c['status']} {c.get('reason')}: {c.get('message')}"
                             for c in status.get("conditions") or [] if c["type"] in ("Degraded", "Progressing")
                             and c["status"] == "True")
            return {"status": status, "pods": _groups(self.name, self.namespace)}
        return probe

    def restarted(self, group: int, pods: dict[str, dict[str, Any]], status: dict[str, Any], lost: str) -> bool:
        """GROUP restarted as a whole (a new leader: the worker's replacement alone, Ready before the operator
        restarts the group, is not a served group), its worker off node LOST, and both groups serving."""
        worker = pods.get(f"{contract.stage_name(self.name, 1)}-{group}")
        leader = pods.get(f"{contract.stage_name(self.name, 0)}-{group}", {}).get("metadata", {}).get("uid")
        return bool(len(pods) == 4 and worker and worker["spec"].get("nodeName") not in (None, lost)
                    and leader != self.pod(0, group)["metadata"]["uid"]
                    and all(pod_ready(p) for p in pods.values()) and status.get("readyReplicas") == 2)

    def untouched(self, group: int) -> bool:
        after = _groups(self.name, self.namespace)
        return all(after[n]["metadata"]["uid"] == p["metadata"]["uid"] for n, p in self.pods.items()
                   if n.endswith(f"-{group}"))

    def restart_events(self) -> list[str]:
        return [e["message"] for e in items("events", self.namespace) if e.get("reason") == "GroupRestarted"]

    @contextmanager
    def traffic(self) -> Iterator[Traffic]:
        """Steady requests through the router from before the block to a few after it; `during` the block's."""
        with Requests(router_url(self.name, self.namespace), self.model) as load:
            eventually("three answers in a row through the router", lambda: load.codes[-3:] == [200] * 3, timeout=120)
            found = Traffic(load, len(load.codes))
            yield found
            sent = len(load.codes)
            eventually("a few more requests after", lambda: len(load.codes) >= sent + 3, timeout=60)


@dataclass
class Traffic:
    load: Requests
    first: int

    @property
    def during(self) -> list[int | str]:
        return self.load.codes[self.first:]


@pytest.fixture(scope="module")
def gpu_fleet() -> Iterator[PipelineFleet]:
    nodes = [f"e2e-node-fault-{i}" for i in range(6)]
    kubectl("apply", "--validate=false", "-f", "-",
            stdin=json.dumps({"apiVersion": "v1", "kind": "List", "items": [_gpu_node(n, i) for i, n in enumerate(nodes)]}))
    namespace = new_namespace("node-fault")
    try:
        eventually("the fault's nodes Ready", lambda: all(condition_status(get("node", n, None), "Ready") == "True"
                                                          for n in nodes), timeout=60)
        # Simulator pods ask for no GPU: pinned to the fault's nodes (and tolerating their GPU taint), each asks
        # for most of a node's CPUs so that no two share one, as one-GPU engine pods would not.
        name, doc = deploy("simulator-cpu.yaml", namespace, replicas=2, autoscaling=None,
                           parallelism={"tensor": 1, "pipeline": 2}, router={"replicas": 1},
                           engine={"kind": "simulator", "startupTimeoutSeconds": 300,
                                   "resources": {"requests": {"cpu": "40", "memory": "1Gi"}}},
                           accelerator={"type": NODE_LOSS_GPU, "nodeSelector": {NODE_FAULT_LABEL: ""},
                                        "tolerations": [{"key": contract.GPU_TAINT_KEY, "operator": "Exists",
                                                         "effect": "NoSchedule"}]})
        yield PipelineFleet(name, namespace, doc["spec"]["model"]["servedName"])
    finally:
        delete_namespace_later(namespace)
        wait_deleted()
        kubectl("delete", "nodes", "-l", NODE_FAULT_LABEL, "--wait=false", check=False)


def _node_not_ready(fleet: PipelineFleet, down: str, at: float) -> tuple[float, float, str, bool]:
    """(seconds until Degraded named the node, until group 0 served again off it, Degraded's message, whether
    Degraded cleared after)."""
    probe = fleet.watch()

    def said() -> str | None:
        found = probe()
        now: dict[str, Any] = next((c for c in found["status"].get("conditions") or []
                                    if c["type"] == "Degraded"), {})
        return str(now.get("message")) if now.get("status") == "True" and now.get("reason") == "NodeNotReady" \
            else None
    degraded = eventually("Degraded names the node", said, timeout=60, every=0.5)
    noticed = time.monotonic() - at
    eventually("group 0 restarted and serving again off the node",
               lambda: fleet.restarted(0, **(seen := probe()), lost=down) and seen, timeout=180, every=1.0)
    took = time.monotonic() - at
    settled = eventually("Degraded clear", lambda: (c := [x for x in probe()["status"].get("conditions") or []
                                                          if x["type"] == "Degraded"]) and c[0]["status"] == "False",
                         timeout=60)
    return noticed, took, degraded, bool(settled)


def test_a_gpu_node_not_ready_under_a_pipeline_group(gpu_fleet: PipelineFleet) -> None:
    """A GPU node holding stage 1 of group 0 stops being Ready (its kubelet reports the container runtime down;
    KWOK's chaos stage): Degraded names the node and its kubelet's words at once, the group stops counting as
    ready, and once the node has been NotReady for the operator's --node-not-ready-seconds (15 in the e2e chart
    values) the group is restarted as a whole on Ready nodes (the node controller's not-ready taint keeps the
    scheduler off it). Group 1 is left alone, the service stays Ready on it throughout, and no request through the
    router fails."""
    fleet = gpu_fleet
    fleet.settle()
    down = fleet.pod(1, 0)["spec"]["nodeName"]
    message = "container runtime network not ready: NetworkReady=false"
    with fleet.traffic() as load:
        kubectl("annotate", "node", down, f"{KWOK_NOT_READY}/reason=KubeletNotReady",
                f"{KWOK_NOT_READY}/message={message}", "--overwrite")
        kubectl("label", "node", down, f"{KWOK_NOT_READY}=true")
        at = time.monotonic()
        noticed, took, degraded, settled = _node_not_ready(fleet, down, at)
    failed = [code for code in load.during if code != 200]
    restarted, untouched = fleet.restart_events(), fleet.untouched(1)
    print(f"\na GPU node under stage 1 of group 0 NotReady: Degraded said so {noticed:.1f}s after; the group "
          f"served again off the node {took:.1f}s after (15 s of grace included); {len(load.during)} requests "
          f"through the router meanwhile, {len(failed)} failed; ready groups never below {fleet.lowest}; group 1 "
          f"untouched: {untouched}; GroupRestarted: {restarted}; Degraded meanwhile: {degraded!r}")
    assert not failed, f"{len(failed)} of {len(load.during)} requests failed: {failed[:10]}"
    assert f"node {down} is not Ready (Ready=False, KubeletNotReady: {message})" in degraded, degraded
    assert f"pod {contract.stage_name(fleet.name, 1)}-0" in degraded, degraded
    assert settled and fleet.lowest == 1, "group 0 must stop counting as ready while its node is down, and " \
                                          "group 1 must serve throughout"
    assert untouched, "group 1 was restarted too"
    assert any("group 0" in m and f"node {down} is not Ready" in m for m in restarted), restarted


def test_a_gpu_node_lost_under_a_pipeline_group(gpu_fleet: PipelineFleet) -> None:
    """A GPU node holding stage 1 of group 1 is deleted, as a cloud provider's node controller deletes a VM that
    died: the operator, which saw the deletion in its watch of Nodes, restarts that group as a whole at once (vLLM
    cannot take a lost stage back), deleting the orphaned pod with no grace period rather than waiting out the pod
    garbage collector's 40 s quarantine, so the StatefulSet makes it anew on the spare node. Group 0 is left alone,
    the service stays Ready on it throughout, and no request through the router fails."""
    fleet = gpu_fleet
    fleet.settle()
    lost = fleet.pod(1, 1)["spec"]["nodeName"]
    with fleet.traffic() as load:
        kubectl("delete", "node", lost, "--wait=false")
        at = time.monotonic()
        probe = fleet.watch()
        eventually("group 1 restarted and serving again on the spare node",
                   lambda: fleet.restarted(1, **(seen := probe()), lost=lost) and seen, timeout=180, every=1.0)
        took = time.monotonic() - at
    failed = [code for code in load.during if code != 200]
    restarted = [m for m in fleet.restart_events() if "group 1" in m]
    untouched = fleet.untouched(0)
    print(f"\na GPU node under stage 1 of group 1 deleted: the group served again on the spare node {took:.1f}s "
          f"after; {len(load.during)} requests through the "
          f"router meanwhile, {len(failed)} failed; ready groups never below "
          f"{fleet.lowest}; group 0 untouched: {untouched}; GroupRestarted: {restarted}; conditions meanwhile: "
          f"{sorted(fleet.seen)}")
    assert not failed, f"{len(failed)} of {len(load.during)} requests failed: {failed[:10]}"
    assert fleet.lowest >= 1, "the other group stopped serving"
    assert untouched, "group 0 was restarted too"
    assert any(f"node {lost} was deleted" in m for m in restarted), \
        f"group 1 must be restarted for its node's deletion, not after the pod garbage collector: {restarted}"


@dataclass
class SimFleet:
    name: str
    namespace: str
    model: str


@pytest.fixture(scope="module")
def sim_fleet() -> Iterator[SimFleet]:
    """A simulator InferenceService of 2 groups of pipeline 2 behind 2 router replicas, which the GPU fault and
    the router fault share."""
    namespace = new_namespace("sim-fault")
    try:
        name, doc = deploy("simulator-cpu.yaml", namespace, replicas=2, autoscaling=None,
                           parallelism={"tensor": 1, "pipeline": 2}, router={"replicas": 2})
        yield SimFleet(name, namespace, doc["spec"]["model"]["servedName"])
    finally:
        delete_namespace_later(namespace)


def test_a_gpu_fault_under_a_pipeline_leader_under_traffic(sim_fleet: SimFleet) -> None:
    """A simulator InferenceService of 2 groups of pipeline 2 under steady requests through its router; XID 79
    (the GPU fell off the bus) set on the leader (stage 0) pod of group 0 through its simulated GPU state (the
    annotation its launcher reads as NVML, worker/simgpu.py): that pod's readiness drops (its launcher's /health,
    probed every 5 s, 3 failures), so the router stops sending to it, and the operator restarts group 0 as a whole
    (a leader whose Ready went False after its containers started had served: it has failed, not still starting);
    the new pods start without the fault and serve. Group 1 is untouched and no request fails. A worker's fault
    takes the rule a worker always had (its Ready went False after the leader formed the group)."""
    name, namespace = sim_fleet.name, sim_fleet.namespace
    pods = eventually("four engine pods Ready", lambda: (found := _groups(name, namespace)) and len(found) == 4
                      and all(pod_ready(p) for p in found.values()) and found, timeout=180)
    eventually("both groups ready", lambda: ((isvc(name, namespace) or {}).get("status") or {})
               .get("readyReplicas") == 2, timeout=60)
    faulty = f"{contract.stage_name(name, 0)}-0"
    leader = pods[faulty]["metadata"]["uid"]
    group_1 = {n: p["metadata"]["uid"] for n, p in pods.items() if n.endswith("-1")}
    url = router_url(name, namespace)
    with Requests(url, sim_fleet.model) as load:
        eventually("three answers in a row through the router", lambda: load.codes[-3:] == [200] * 3, timeout=120)
        first = len(load.codes)
        kubectl("annotate", "pod", faulty, "-n", namespace,
                f"{contract.ANNOTATION_SIMULATED_GPU_STATE}=" + json.dumps({"xids": [{"gpu": 0, "xid": 79}]}))
        at = time.monotonic()
        eventually("the faulty pod not Ready", lambda: not pod_ready(get("pod", faulty, namespace) or {}),
                   timeout=60)
        unready = time.monotonic() - at

        def served() -> bool:
            found = _groups(name, namespace)
            status = (isvc(name, namespace) or {}).get("status") or {}
            restarted = found.get(f"{contract.stage_name(name, 0)}-0", {}).get("metadata", {}).get("uid")
            return bool(len(found) == 4 and restarted not in (None, leader) and status.get("readyReplicas") == 2
                        and all(pod_ready(p) for p in found.values()) and _router_engines(url) == 2)
        eventually("group 0 restarted and serving again", served, timeout=180, every=1.0)
        took = time.monotonic() - at
        sent = len(load.codes)
        eventually("a few more requests after", lambda: len(load.codes) >= sent + 3, timeout=60)
    during = load.codes[first:]
    failed = [code for code in during if code != 200]
    after = _groups(name, namespace)
    untouched = all(after[n]["metadata"]["uid"] == uid for n, uid in group_1.items())
    restarts = [e["message"] for e in items("events", namespace) if e.get("reason") == "GroupRestarted"]
    print(f"\nXID 79 on the GPU of the leader of group 0: the pod left readiness {unready:.1f}s after, the group "
          f"served again {took:.1f}s after; {len(during)} requests through the router meanwhile, {len(failed)} "
          f"failed; group 1 untouched: {untouched}; GroupRestarted: {restarts}")
    assert not failed, f"{len(failed)} of {len(during)} requests failed: {failed[:10]}"
    assert untouched, "group 1 was restarted too"
    assert any("group 0" in m and f"pod {faulty} stopped being Ready" in m for m in restarts), restarts
    assert not (get("pod", faulty, namespace) or {}).get("metadata", {}).get("annotations", {}).get(
        contract.ANNOTATION_SIMULATED_GPU_STATE), "the replacement pod starts without the fault"


@dataclass
class _Stream:
    """One streamed chat completion through the Service, read in a thread until it ends or is told to stop."""

    chunks: int = 0
    after_kill: int = 0          # chunks read after the router was killed
    outcome: str = "open"        # "finished", "stopped", or the exception that ended it


def _router_in_flight(pod_ip: str) -> float:
    with urllib.request.urlopen(f"http://{pod_ip}:{contract.ROUTER_PORT}{contract.METRICS_PATH}", timeout=10) as answer:
        text = answer.read().decode()
    return sum(s.value for s in promtext.select(text, contract.ROUTER_METRIC_IN_FLIGHT))


def test_a_router_replica_sigkilled_with_streams_open(sim_fleet: SimFleet) -> None:
    """Two router replicas behind the InferenceService's Service, whose ClusterIP kube-proxy routes
    (e2e/kubeproxy.py), and clients through that ClusterIP as pods reach it: the official openai SDK with its
    defaults (2 retries of a failed connection). Streams are opened until both routers hold some; one router's
    process is SIGKILLed (the OOM killer, a crash). New requests keep being answered through the other replica (a
    connection kube-proxy still sent to the dead pod before its endpoint left is refused, and the SDK sends it
    again); the streams the killed router held end with the error the SDK raises for a cut connection, those on
    the other replica flow on; the killed router's container restarts and serves again."""
    import openai

    name, namespace = sim_fleet.name, sim_fleet.namespace
    selector = f"{contract.LABEL_INFERENCE_SERVICE}={name},{contract.LABEL_COMPONENT}={contract.COMPONENT_ROUTER}"
    routers = eventually("two Ready router pods", lambda: (found := items("pods", namespace, selector))
                         and len(found) == 2 and all(pod_ready(p) for p in found) and found, timeout=120)
    vip = (get("service", name, namespace) or {}).get("spec", {}).get("clusterIP")
    assert vip and vip != "None", f"the Service {name} has no ClusterIP"
    model = sim_fleet.model
    client = openai.OpenAI(base_url=f"http://{vip}/v1", api_key="e2e-no-key", timeout=60.0)   # SDK defaults
    eventually("an answer through the ClusterIP", lambda: client.chat.completions.create(
        model=model, max_tokens=2, messages=[{"role": "user", "content": "hi"}]).choices, timeout=60)

    killed_at: list[float] = []
    stop = threading.Event()
    streams: list[_Stream] = []

    def read(stream: _Stream) -> None:
        try:
            with client.chat.completions.create(model=model, max_tokens=4000, stream=True, messages=[
                    {"role": "user", "content": "Tell me a long story."}]) as answer:
                for _chunk in answer:
                    stream.chunks += 1
                    stream.after_kill += 1 if killed_at else 0
                    if stop.is_set():
                        stream.outcome = "stopped"
                        return
            stream.outcome = "finished"
        except Exception as exc:  # noqa: BLE001 - what the client sees is the finding
            stream.outcome = f"{type(exc).__module__}.{type(exc).__name__}"

    readers: list[threading.Thread] = []
    ips = [p["status"]["podIP"] for p in routers]

    def spread() -> bool:
        """Another stream, until both routers hold some (kube-proxy picks an endpoint at random)."""
        if all(_router_in_flight(ip) >= 1 for ip in ips) and len(streams) >= 4:
            return True
        streams.append(_Stream())
        readers.append(threading.Thread(target=read, args=(streams[-1],), daemon=True))
        readers[-1].start()
        return False
    eventually("streams open on both routers", spread, timeout=60, every=0.5)
    eventually("every stream under way", lambda: all(s.chunks > 0 for s in streams), timeout=60)
    held = {ip: round(_router_in_flight(ip)) for ip in ips}
    victim = max(routers, key=lambda p: held[p["status"]["podIP"]])

    answered: list[float] = []
    failed: list[str] = []

    def steady() -> None:
        while not stop.is_set() and len(answered) + len(failed) < 2000:
            try:
                client.chat.completions.create(model=model, max_tokens=4,
                                               messages=[{"role": "user", "content": "Hello"}])
                answered.append(time.monotonic())
            except openai.APIError as exc:   # the SDK's own, a connection it gave up on included
                failed.append(f"{type(exc).__name__}: {exc}")
            time.sleep(0.05)
    steady_thread = threading.Thread(target=steady, daemon=True)
    steady_thread.start()
    try:
        eventually("requests answered before the kill", lambda: len(answered) >= 3, timeout=30)
        pid = ((pod_runner_entry(namespace, victim["metadata"]["name"]) or {}).get("containers") or [{}])[0].get("pid")
        assert pid, f"the pod runner reports no process for {victim['metadata']['name']}"
        os.kill(int(pid), signal.SIGKILL)
        killed_at.append(time.monotonic())
        before_kill = len(answered)
        eventually("the killed router's container restarted and Ready again",
                   lambda: (p := get("pod", victim["metadata"]["name"], namespace)) and pod_ready(p)
                   and max(c.get("restartCount", 0) for c in p["status"].get("containerStatuses") or []) >= 1,
                   timeout=90, every=0.5)
        back = time.monotonic() - killed_at[0]
        eventually("more requests after it is back", lambda: len(answered) >= before_kill + 20, timeout=60)
    finally:
        stop.set()
        steady_thread.join(timeout=90)
        for reader in readers:
            reader.join(timeout=90)
    broken = [s for s in streams if s.outcome not in ("stopped", "finished")]
    flowing = [s for s in streams if s.outcome in ("stopped", "finished") and s.after_kill > 0]
    print(f"\none of 2 routers SIGKILLed with {held[victim['status']['podIP']]} of {len(streams)} streams open on "
          f"it: {len(answered) - before_kill} requests answered after the kill, {len(failed)} failed; its "
          f"container restarted and was Ready {back:.1f}s after; streams cut: {len(broken)} "
          f"({sorted({s.outcome for s in broken})}), flowing on through the other replica: {len(flowing)}")
    assert not failed, f"{len(failed)} requests failed through the Service: {failed[:5]}"
    assert len(broken) == held[victim["status"]["podIP"]], [s.outcome for s in streams]
    assert len(flowing) == len(streams) - len(broken), [(s.outcome, s.after_kill) for s in streams]
    # A cut stream is an error the SDK raises mid-iteration (the connection ended before the stream's end):
    # the client should send the request again (docs/routing.md, "A router dies").
    assert all(s.outcome in ("httpx.RemoteProtocolError", "openai.APIConnectionError") for s in broken), \
        [s.outcome for s in broken]
