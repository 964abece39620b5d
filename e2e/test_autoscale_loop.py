"""The autoscaling loop, closed for real: load at a real router process, the queue it holds scraped by
Prometheus, served by prometheus-adapter through the aggregator, read by the real HPA controller, written to
/scale, rolled out by the operator, and the new engine process found by the router through its EndpointSlices.
And scale from zero: a request to an idle service answered after the engine's simulated load, then the fleet
back at zero after the idle period.

Needs the pod runner (routers and simulator engines as real processes on their pod IPs) and the monitoring
stack of `e2e/cluster up` (both are part of it whenever it runs as root, as CI does); skipped, saying why,
where the cluster has no custom-metrics API.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from typing import Any

import pytest
from kube import apply, condition, eventually, example, get, items, kubectl, kubectl_result, router_url, wait_ready

from tensorfleet import contract

LOAD_SECONDS = 240       # the most the load runs, whatever happens
# Closed-loop clients, each asking for 120 tokens (about 8 s at the simulator's L4 pace): three times what one
# engine takes behind the router's ceiling of 2, so the router holds about 4 (the target is 2 per replica), and
# no request waits anywhere near the router's 30 s queue timeout: every answer must be a 200.
CLIENTS = 6
MAX_TOKENS = 120


def _stack_or_skip() -> None:
    if "v1beta1.custom.metrics.k8s.io" not in kubectl("get", "apiservices", "-o", "name"):
        pytest.skip("no custom-metrics API in this cluster (e2e/cluster up without the monitoring stack)")


def _post(url: str, body: dict[str, Any], timeout: float) -> tuple[int, bytes]:
    request = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _pending(name: str, namespace: str) -> float | None:
    path = (f"/apis/custom.metrics.k8s.io/v1beta1/namespaces/{namespace}/{contract.PLURAL}.{contract.GROUP}/"
            f"{name}/{contract.HPA_METRIC_PENDING}")
    done = kubectl_result("get", "--raw", path)
    if done.returncode:
        return None
    values = json.loads(done.stdout).get("items") or []
    return _quantity(values[0]["value"]) if values else None


def _quantity(value: str) -> float:
    return float(value[:-1]) / 1000 if value.endswith("m") else float(value)


def test_sustained_overload_behind_a_low_router_ceiling_scales_out_on_the_real_hpa(namespace: str) -> None:
    _stack_or_skip()
    doc = example("simulator-cpu.yaml", namespace, parallelism={"tensor": 1, "pipeline": 1},
                  autoscaling={"minReplicas": 1, "maxReplicas": 3, "targetPendingRequests": 2},
                  # A fraction of the engine's max-num-seqs: the queue is the router's, vLLM's waiting stays 0.
                  router={"replicas": 1, "maxConcurrencyPerEngine": 2})
    doc["spec"].pop("replicas", None)
    name = doc["metadata"]["name"]
    apply(doc)
    wait_ready(name, namespace)
    url = router_url(name, namespace)
    model = doc["spec"]["model"]["servedName"]
    status, _ = _post(url, {"model": model, "prompt": "hello", "max_tokens": 4}, timeout=30)
    assert status == 200, "the router pod answers on its pod IP"

    stop = threading.Event()
    deadline = time.monotonic() + LOAD_SECONDS
    failures: list[tuple[int, str]] = []

    def client() -> None:
        while not stop.is_set() and time.monotonic() < deadline:
            code, body = _post(url, {"model": model, "prompt": "tell me a long story", "max_tokens": MAX_TOKENS},
                               timeout=120)
            if code != 200:
                failures.append((code, body[:300].decode(errors="replace")))
    threads = [threading.Thread(target=client, daemon=True) for _ in range(CLIENTS)]
    for thread in threads:
        thread.start()
    try:
        # The signal: requests held at the router, summed for the InferenceService by the adapter's rule.
        pending = eventually("the adapter serving the router's queue", lambda: (v := _pending(name, namespace))
                             and v >= 2 and v, timeout=120)
        hpa = eventually("the HPA asking for more replicas", lambda: (h := get(
            "horizontalpodautoscaler", contract.hpa_name(name), namespace)) and
            (h.get("status") or {}).get("desiredReplicas", 0) > 1 and h, timeout=120)
        active = condition(hpa, "ScalingActive")
        assert active and active["status"] == "True", active
        obj = eventually("spec.replicas moved through /scale", lambda: (o := get(contract.PLURAL, name, namespace))
                         and o["spec"].get("replicas", 0) > 1 and o, timeout=60)
        eventually("a second engine Ready", lambda: ((get(contract.PLURAL, name, namespace) or {})
                                                     .get("status") or {}).get("readyReplicas", 0) > 1, timeout=120)
        # The router found it through the real EndpointSlices and routes to it.
        with urllib.request.urlopen(url + contract.HEALTH_PATH, timeout=10) as response:
            health = json.loads(response.read())
        assert health["backends"] > 1, health
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=130)
    assert not failures, f"clients saw errors: {failures[:10]}"
    print(f"pending seen by the adapter {pending:g}; HPA desired {hpa['status']['desiredReplicas']}; "
          f"spec.replicas {obj['spec']['replicas']}")


def test_a_request_to_an_idle_service_is_answered_after_a_cold_start_and_the_fleet_goes_back_to_zero(
        namespace: str) -> None:
    _stack_or_skip()
    idle_seconds = 30
    doc = example("simulator-cpu.yaml", namespace,
                  autoscaling={"minReplicas": 0, "maxReplicas": 2, "scaleToZeroAfterSeconds": idle_seconds},
                  engine={"kind": "simulator", "startupTimeoutSeconds": 300, "args": ["--startup-delay", "8"]})
    doc["spec"].pop("replicas", None)
    name = doc["metadata"]["name"]
    stages = doc["spec"]["parallelism"]["pipeline"]
    apply(doc)
    wait_ready(name, namespace)
    url = router_url(name, namespace)
    model = doc["spec"]["model"]["servedName"]

    def at_zero() -> bool:
        sts = [get("statefulset", contract.stage_name(name, k), namespace) or {} for k in range(stages)]
        selector = f"{contract.LABEL_INFERENCE_SERVICE}={name},{contract.LABEL_COMPONENT}={contract.COMPONENT_ENGINE}"
        return all(s.get("spec", {}).get("replicas") == 0 for s in sts) and not items("pods", namespace, selector)
    eventually("the idle fleet at zero, its engine processes gone", at_zero, timeout=idle_seconds + 120)

    started = time.monotonic()
    status, body = _post(url, {"model": model, "prompt": "are you there?", "max_tokens": 8}, timeout=240)
    cold_start = time.monotonic() - started
    assert status == 200, body[:500]
    assert json.loads(body)["choices"][0]["text"]
    assert cold_start >= 8, "answered only once an engine had loaded"
    print(f"cold start from zero: {cold_start:.1f}s (simulated load 8 s)")
    obj = get(contract.PLURAL, name, namespace) or {}
    assert "idleSince" not in (obj.get("status") or {})
    eventually("back at zero after the idle period", at_zero, timeout=idle_seconds + 120)
