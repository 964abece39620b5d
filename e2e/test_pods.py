"""Pods of the control-plane image run as real processes on their pod IPs (e2e/podrunner.py).

`e2e/cluster up` (as root) starts the pod runner: for every pod whose containers
run the chart's control-plane image (routers, simulator engines) it does the
kubelet's part on this machine, in a network namespace that holds the pod's IP,
and writes the pod's status from its real readiness probe. These tests talk to
the pods from this host over their pod IPs, as a person with `curl` would.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from typing import Any

import pytest
from kube import (
    CLUSTER_SCRIPT,
    apply,
    cluster_status,
    condition_status,
    deploy,
    engine_pods,
    eventually,
    example,
    get,
    items,
    kubectl,
)

from tensorfleet import contract, promtext

SHORT = 120   # seconds: a pod's start, probes included, on a loaded two-core machine


def pod_runner_status() -> dict[str, Any]:
    status = cluster_status()
    runner = (status or {}).get("podRunner") or {}
    if not runner.get("running"):
        pytest.fail("needs the pod runner of `e2e/cluster up` (run as root, with the pod network): it runs the "
                    f"control-plane image's pods as processes on their pod IPs. status: {status!r}")
    return dict(runner)


def pod_runner_entry(namespace: str, name: str, uid: str | None = None) -> dict[str, Any] | None:
    for pod in pod_runner_status().get("pods") or []:
        if pod["namespace"] == namespace and pod["name"] == name and (uid is None or pod["uid"] == uid):
            return dict(pod)
    return None


def _http(url: str, body: dict[str, Any] | None = None, timeout: float = 10) -> tuple[int, str]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers={"content-type": "application/json"} if data else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


def _status(url: str) -> int | None:
    """The HTTP status URL answers with; None while nothing listens."""
    try:
        return _http(url, timeout=3)[0]
    except OSError:
        return None


def _pod(namespace: str, name: str) -> dict[str, Any] | None:
    return get("pod", name, namespace)


def _ready(pod: dict[str, Any] | None) -> bool:
    return condition_status(pod, "Ready") == "True"


def _container(pod: dict[str, Any]) -> dict[str, Any]:
    (status,) = pod["status"]["containerStatuses"]
    return dict(status)


def _router_pod(name: str, namespace: str) -> dict[str, Any]:
    selector = f"{contract.LABEL_INFERENCE_SERVICE}={name},{contract.LABEL_COMPONENT}={contract.COMPONENT_ROUTER}"
    pods = [p for p in items("pods", namespace, selector) if _ready(p)]
    assert pods, f"no ready router pod of {namespace}/{name}"
    return pods[0]


def _leaders(name: str, namespace: str) -> list[dict[str, Any]]:
    return [p for p in engine_pods(name, namespace) if p["metadata"]["labels"][contract.LABEL_STAGE] == "0"]


def _alive(pid: int) -> bool:
    try:
        stat = open(f"/proc/{pid}/stat").read()  # noqa: SIM115 - one read
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _netns_pids(netns: str) -> list[int]:
    done = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True, check=False, timeout=30)
    return [int(p) for p in done.stdout.split()] if done.returncode == 0 else []


def _netns_exists(netns: str) -> bool:
    done = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True, timeout=30)
    return any(line.split()[0] == netns for line in done.stdout.splitlines() if line.strip())


def _pod_logs(namespace: str, name: str) -> str:
    done = subprocess.run([str(CLUSTER_SCRIPT), "pods", "logs", f"{namespace}/{name}"],
                          capture_output=True, text=True, check=False, timeout=30)
    return done.stdout + done.stderr


def test_a_router_pod_answers_from_the_simulator_pod_it_found_in_the_endpointslices(namespace: str) -> None:
    pod_runner_status()
    # Pipeline 2: the stage-1 pod finds its leader by the StatefulSet hostname and passes its launcher's /health.
    name, doc = deploy("simulator-cpu.yaml", namespace, autoscaling=None, replicas=1)
    router = _router_pod(name, namespace)
    (leader,) = _leaders(name, namespace)
    router_url = f"http://{router['status']['podIP']}:{contract.ROUTER_PORT}"
    engine_url = f"http://{leader['status']['podIP']}:{contract.ENGINE_PORT}"

    # The router's only source of engines is --service: the EndpointSlices the real controller published.
    def healthy_backends() -> dict[str, float] | None:
        code, text = _http(f"{router_url}{contract.METRICS_PATH}")
        assert code == 200, (code, text[:200])
        found = {s.labels.get(contract.ROUTER_LABEL_BACKEND, ""): s.value
                 for s in promtext.select(text, contract.ROUTER_METRIC_BACKEND_HEALTHY)}
        return found if found == {engine_url: 1.0} else None
    eventually(f"the router at {router_url} to hold {engine_url} healthy", healthy_backends, timeout=SHORT)

    def served() -> float:
        code, text = _http(f"{engine_url}{contract.METRICS_PATH}")
        assert code == 200, (code, text[:200])
        return promtext.total(text, f"{contract.VLLM_METRIC_REQUEST_SUCCESS}_total")
    before = served()
    model = doc["spec"]["model"]["servedName"]
    code, text = _http(f"{router_url}/v1/chat/completions", {
        "model": model, "max_tokens": 8, "messages": [{"role": "user", "content": "Hello"}]}, timeout=60)
    assert code == 200, text
    reply = json.loads(text)
    assert reply["object"] == "chat.completion" and reply["model"] == model, reply
    assert reply["choices"][0]["message"]["content"]
    assert served() == before + 1, "the simulator process on the leader's pod IP served it"
    # Under its own ServiceAccount's token (the admission-added volume), which RBAC lets list them.
    router_log = _pod_logs(namespace, router["metadata"]["name"])
    for marker in ("401", "403", "Forbidden", "Unauthorized"):
        assert marker not in router_log, router_log[-2000:]


def test_router_pods_find_each_other_and_share_where_they_sent_each_prompt(namespace: str) -> None:
    pod_runner_status()
    router = {**example("simulator-cpu.yaml", namespace)["spec"]["router"], "replicas": 2}  # the example has 1
    name, doc = deploy("simulator-cpu.yaml", namespace, autoscaling=None, replicas=1, router=router)
    selector = f"{contract.LABEL_INFERENCE_SERVICE}={name},{contract.LABEL_COMPONENT}={contract.COMPONENT_ROUTER}"
    routers = eventually("two ready router pods", lambda: (p := [r for r in items("pods", namespace, selector)
                                                                 if _ready(r)]) and len(p) == 2 and p, timeout=SHORT)
    urls = [f"http://{r['status']['podIP']}:{contract.ROUTER_PORT}" for r in routers]
    model = doc["spec"]["model"]["servedName"]

    def placements(url: str) -> dict[str, float]:
        code, text = _http(f"{url}{contract.METRICS_PATH}")
        assert code == 200, (code, text[:200])
        return {s.labels[contract.ROUTER_LABEL_OUTCOME]: s.value for s in
                promtext.select(text, contract.ROUTER_METRIC_PEER_PLACEMENTS + "_total")}

    # Each router pod learns the other from the router Service's EndpointSlices (not itself: TENSORFLEET_POD_IP), and
    # the other takes its posts (from a peer's address). A prompt of several blocks, through each in turn.
    prompt = "Summarise the following text in one line. " + "The quick brown fox jumps over the lazy dog. " * 60
    for sender, receiver in ((urls[0], urls[1]), (urls[1], urls[0])):
        def told(sender: str = sender, receiver: str = receiver) -> bool:
            code, text = _http(f"{sender}/v1/chat/completions", {
                "model": model, "max_tokens": 4, "messages": [{"role": "user", "content": prompt}]}, timeout=60)
            assert code == 200, text
            time.sleep(1)
            return placements(receiver).get("received", 0) > 0
        eventually(f"{receiver} to hear from {sender}", told, timeout=SHORT)
    for url in urls:
        counts = placements(url)
        # Sent to one peer (never to itself), and every post delivered.
        assert counts["failed"] == 0 and counts["dropped"] == 0, (url, counts)
        assert counts["sent"] >= 1, (url, counts)
    eventually("every placement sent to be received", lambda: sum(placements(u)["sent"] for u in urls)
               == sum(placements(u)["received"] for u in urls), timeout=10)
    # Anyone else (this host) is refused.
    code, text = _http(f"{urls[0]}{contract.ROUTER_PEER_PATH}", {"from": "x", "placements": []})
    assert code == 403, (code, text)


def test_an_engine_pod_is_ready_only_while_its_simulator_answers_its_probe(namespace: str) -> None:
    pod_runner_status()
    # The simulator answers /health 503 for its simulated load time, as vLLM does while loading.
    pod_name, health = _deploy_loading(namespace, load=20)
    assert _status(health) == 200

    # The process exits (SIGKILL, as the OOM killer would): not Ready, restarted, Ready again after loading.
    runner_pod = eventually("the runner to report the engine's process", lambda: pod_runner_entry(namespace, pod_name))
    pid = runner_pod["containers"][0]["pid"]
    assert pid and _alive(pid)
    os.kill(pid, 9)
    seen_unready = eventually("the pod to turn not Ready", lambda: (p := _pod(namespace, pod_name)) and not _ready(p)
                              and p, timeout=30, every=0.2)
    assert _container(seen_unready)["ready"] is False
    restarted = eventually("the restart", lambda: (p := _pod(namespace, pod_name)) and
                           _container(p)["restartCount"] == 1 and p, timeout=SHORT)
    terminated = _container(restarted)["lastState"]["terminated"]
    assert terminated["exitCode"] == 137 and terminated["reason"] == "Error", terminated
    _ready_only_after_health(namespace, pod_name, health)


def _deploy_loading(namespace: str, load: int) -> tuple[str, str]:
    """simulator-cpu.yaml in one stage whose simulator loads for LOAD seconds, checked on its way to Ready;
    its engine pod's name and /health URL."""
    doc = example("simulator-cpu.yaml", namespace, parallelism={"tensor": 1, "pipeline": 1}, autoscaling=None,
                  replicas=1)
    doc["spec"]["engine"]["args"] = ["--startup-delay", str(load)]
    apply(doc)
    pod_name = f"{contract.stage_name(doc['metadata']['name'], 0)}-0"
    pod = eventually("the engine pod's IP", lambda: (p := _pod(namespace, pod_name)) and p["status"].get("podIP")
                     and p, timeout=SHORT)
    health = f"http://{pod['status']['podIP']}:{contract.ENGINE_PORT}{contract.HEALTH_PATH}"
    _ready_only_after_health(namespace, pod_name, health)
    return pod_name, health


def _ready_only_after_health(namespace: str, pod_name: str, health: str) -> None:
    """Until the pod is Ready its simulator is seen loading (503) and the pod never Ready before it answers 200."""
    answers: list[int | None] = []
    deadline = time.monotonic() + SHORT
    while True:
        pod = _pod(namespace, pod_name)
        answer = _status(health)   # after reading the pod: a Ready pod must already answer 200
        if _ready(pod):
            assert answer == 200, f"pod {pod_name} Ready while /health answers {answer}; before: {answers}"
            break
        answers.append(answer)
        assert time.monotonic() < deadline, f"pod {pod_name} not Ready after {SHORT}s; /health: {answers[-10:]}"
        time.sleep(0.5)
    assert 503 in answers, f"never saw the simulator loading (/health 503) while not Ready: {answers}"
    assert pod is not None
    status = _container(pod)
    assert status["ready"] and status["started"] and "running" in status["state"], status


def test_deleting_engine_pods_stops_their_processes(namespace: str) -> None:
    pod_runner_status()
    name, _ = deploy("simulator-cpu.yaml", namespace, autoscaling=None, replicas=1)
    pods = {p["metadata"]["labels"][contract.LABEL_STAGE]: p for p in engine_pods(name, namespace)}
    watched = {}
    for stage, pod in pods.items():
        found = pod_runner_entry(namespace, pod["metadata"]["name"], pod["metadata"]["uid"])
        assert found, f"the runner runs no process for {pod['metadata']['name']}"
        pids = _netns_pids(found["netns"])
        assert found["containers"][0]["pid"] in pids, (found, pids)
        watched[stage] = (pod, found["netns"], pids)

    # The leader's simulator stops on SIGTERM; the stage-1 stand-in waits for its leader's requests up to the
    # grace period, so a 5 s one ends in SIGKILL.
    kubectl("delete", "pod", "-n", namespace, pods["0"]["metadata"]["name"], "--wait=false")
    kubectl("delete", "pod", "-n", namespace, pods["1"]["metadata"]["name"], "--grace-period=5", "--wait=false")
    for pod, netns, pids in watched.values():
        meta = pod["metadata"]

        def gone(meta: dict[str, Any] = meta, netns: str = netns, pids: list[int] = pids) -> bool:
            current = _pod(namespace, meta["name"])
            if current is not None and current["metadata"]["uid"] == meta["uid"]:
                return False
            return not any(_alive(pid) for pid in pids) and not _netns_exists(netns)
        eventually(f"{meta['name']} deleted, its processes {pids} and {netns} gone", gone, timeout=60)

    # The StatefulSets make new pods (new UIDs), which the runner starts and which turn Ready.
    def replaced() -> bool:
        fresh = engine_pods(name, namespace)
        old = {p["metadata"]["uid"] for p, _, _ in watched.values()}
        return len(fresh) == 2 and all(p["metadata"]["uid"] not in old and _ready(p) for p in fresh)
    eventually("both engine pods replaced and Ready", replaced, timeout=SHORT)


SERVER = """
import json, os, socket, ssl, sys, urllib.request
from http.server import BaseHTTPRequestHandler, HTTPServer
secret, config, podinfo, scratch = sys.argv[1:5]
with open(os.path.join(scratch, "note"), "w") as f:
    f.write("written by the container")
def read(folder):
    return {n: open(os.path.join(folder, n)).read() for n in sorted(os.listdir(folder)) if not n.startswith("..")}
def whoami():
    sa = "/var/run/secrets/kubernetes.io/serviceaccount"
    url = "https://%s:%s/apis/authentication.k8s.io/v1/selfsubjectreviews" % (
        os.environ["KUBERNETES_SERVICE_HOST"], os.environ["KUBERNETES_SERVICE_PORT"])
    body = json.dumps({"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"}).encode()
    request = urllib.request.Request(url, data=body, headers={
        "Authorization": "Bearer " + open(sa + "/token").read(), "Content-Type": "application/json"})
    context = ssl.create_default_context(cafile=sa + "/ca.crt")
    with urllib.request.urlopen(request, context=context, timeout=10) as answer:
        return json.loads(answer.read())["status"]["userInfo"], open(sa + "/namespace").read()
class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path == "/ready":
            self.send_response(200); self.end_headers(); return
        user, namespace = whoami()
        out = {"env": dict(os.environ), "argv": sys.argv[1:], "secret": read(secret), "config": read(config),
               "podinfo": read(podinfo), "note": open(os.path.join(scratch, "note")).read(),
               "hostname": socket.gethostname(), "user": user, "namespace": namespace,
               "modes": {n: oct(os.stat(os.path.join(secret, n)).st_mode & 0o777) for n in os.listdir(secret)
                         if not n.startswith("..")}}
        data = json.dumps(out).encode()
        self.send_response(200); self.send_header("Content-Type", "application/json"); self.end_headers()
        self.wfile.write(data)
HTTPServer(("0.0.0.0", 8000), Handler).serve_forever()
"""


def test_the_container_gets_the_env_volumes_and_identity_a_kubelet_gives_it(namespace: str) -> None:
    runner = pod_runner_status()
    image = runner["image"]
    kubectl("create", "secret", "generic", "creds", "-n", namespace, "--from-literal=password=s3cret",
            "--from-literal=user=alice")
    kubectl("create", "configmap", "settings", "-n", namespace, "--from-literal=mode=fast",
            "--from-literal=level=3")
    pod = {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "probe", "namespace": namespace,
                                                         "labels": {"app": "probe", "tier": "e2e"}},
        "spec": {
            "terminationGracePeriodSeconds": 5,
            "containers": [{
                "name": "app", "image": image,
                "command": ["python3", "-c", SERVER],
                "args": ["/etc/e2e/secret", "/etc/e2e/config", "/etc/podinfo", "/scratch"],
                "env": [
                    {"name": "LITERAL", "value": "a"},
                    {"name": "EXPANDED", "value": "$(LITERAL)-b-$(MISSING)"},
                    {"name": "ESCAPED", "value": "$$(LITERAL)"},
                    {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                    {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                    {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
                    {"name": "TIER", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['tier']"}}},
                    {"name": "MEMORY_MIB", "valueFrom": {"resourceFieldRef": {"resource": "limits.memory",
                                                                                "divisor": "1Mi"}}},
                    {"name": "CPU_MILLI", "valueFrom": {"resourceFieldRef": {"resource": "requests.cpu",
                                                                               "divisor": "1m"}}},
                    {"name": "PASSWORD", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "password"}}},
                    {"name": "MODE", "valueFrom": {"configMapKeyRef": {"name": "settings", "key": "mode"}}},
                    {"name": "ABSENT", "valueFrom": {"secretKeyRef": {"name": "nope", "key": "k", "optional": True}}},
                ],
                "envFrom": [{"configMapRef": {"name": "settings"}, "prefix": "CM_"}],
                "resources": {"requests": {"cpu": "250m", "memory": "32Mi"}, "limits": {"memory": "64Mi"}},
                "ports": [{"name": "http", "containerPort": 8000}],
                "readinessProbe": {"httpGet": {"path": "/ready", "port": "http"}, "periodSeconds": 1},
                "volumeMounts": [
                    {"name": "secret", "mountPath": "/etc/e2e/secret", "readOnly": True},
                    {"name": "config", "mountPath": "/etc/e2e/config"},
                    {"name": "podinfo", "mountPath": "/etc/podinfo"},
                    {"name": "scratch", "mountPath": "/scratch"},
                ],
            }],
            "volumes": [
                {"name": "secret", "secret": {"secretName": "creds", "defaultMode": 0o400,
                                              "items": [{"key": "password", "path": "pw"}]}},
                {"name": "config", "configMap": {"name": "settings"}},
                {"name": "podinfo", "downwardAPI": {"items": [
                    {"path": "labels", "fieldRef": {"fieldPath": "metadata.labels"}},
                    {"path": "name", "fieldRef": {"fieldPath": "metadata.name"}}]}},
                {"name": "scratch", "emptyDir": {}},
            ],
        },
    }
    apply(pod)
    ready = eventually("the pod Ready (its readiness probe answered)", lambda: (p := _pod(namespace, "probe"))
                       and _ready(p) and p, timeout=SHORT)
    ip = ready["status"]["podIP"]
    code, text = _http(f"http://{ip}:8000/", timeout=30)
    assert code == 200, text
    seen = json.loads(text)
    env = seen["env"]
    assert {k: env.get(k) for k in ("LITERAL", "EXPANDED", "ESCAPED", "POD_IP", "POD_NAME", "POD_NAMESPACE", "TIER",
                                    "MEMORY_MIB", "CPU_MILLI", "PASSWORD", "MODE", "CM_mode", "CM_level")} == {
        "LITERAL": "a", "EXPANDED": "a-b-$(MISSING)", "ESCAPED": "$(LITERAL)", "POD_IP": ip, "POD_NAME": "probe",
        "POD_NAMESPACE": namespace, "TIER": "e2e", "MEMORY_MIB": "64", "CPU_MILLI": "250", "PASSWORD": "s3cret",
        "MODE": "fast", "CM_mode": "fast", "CM_level": "3"}
    assert "ABSENT" not in env
    assert seen["hostname"] == "probe"
    assert seen["secret"] == {"pw": "s3cret"} and seen["modes"] == {"pw": "0o400"}
    assert seen["config"] == {"level": "3", "mode": "fast"}
    labels = "\n".join(f'{k}="{v}"' for k, v in sorted(ready["metadata"]["labels"].items()))
    assert 'app="probe"' in labels and seen["podinfo"] == {"labels": labels, "name": "probe"}
    assert seen["note"] == "written by the container"
    # The admission-added ServiceAccount volume: a token of the pod's own account, bound to this pod.
    assert seen["user"]["username"] == f"system:serviceaccount:{namespace}:default", seen["user"]
    assert seen["user"]["extra"]["authentication.kubernetes.io/pod-name"] == ["probe"], seen["user"]
    assert seen["user"]["extra"]["authentication.kubernetes.io/pod-uid"] == [ready["metadata"]["uid"]]
    assert seen["namespace"] == namespace

    # A Secret's new value reaches its volume (not the env, fixed at start), as the kubelet's sync does.
    apply({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "creds", "namespace": namespace},
           "stringData": {"password": "rotated", "user": "alice"}})

    def rotated() -> bool:
        found = json.loads(_http(f"http://{ip}:8000/", timeout=30)[1])
        return bool(found["secret"] == {"pw": "rotated"} and found["env"]["PASSWORD"] == "s3cret")
    eventually("the rotated Secret in the volume", rotated, timeout=60)
