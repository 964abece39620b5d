"""Prefill/decode disaggregation on the real control plane: the GPU example's two pools scheduled on the GPU
types they ask for and Ready, and the simulator example's two pools (real processes on their pod IPs) serving
requests in two phases through the real router, the decode engine reading the prompt's KV cache from the
prefill engine's side channel.
"""

from __future__ import annotations

import json
import urllib.request
from typing import Any

from kube import apply, condition, engine_pods, eventually, example, items, nodes, router_url, wait_ready
from test_pods import pod_runner_status

from tensorfleet import contract
from tensorfleet.gpus import find_gpu


def _pools(name: str, namespace: str) -> dict[str, list[dict[str, Any]]]:
    pods: dict[str, list[dict[str, Any]]] = {contract.POOL_PREFILL: [], contract.POOL_DECODE: []}
    for pod in engine_pods(name, namespace):
        pods[pod["metadata"]["labels"][contract.LABEL_POOL]].append(pod)
    return pods


def _ready(pod: dict[str, Any]) -> bool:
    return (condition(pod, "Ready") or {}).get("status") == "True"


def test_the_gpu_example_runs_each_pool_on_its_gpu_type(namespace: str) -> None:
    doc = example("llama-3.1-70b-disaggregated.yaml", namespace)
    name = doc["metadata"]["name"]
    apply(doc)
    wait_ready(name, namespace)
    want = {contract.POOL_DECODE: (doc["spec"]["replicas"], doc["spec"]["accelerator"]["type"]),
            contract.POOL_PREFILL: (doc["spec"]["prefill"]["replicas"], doc["spec"]["prefill"]["accelerator"]["type"])}

    def placed() -> dict[str, list[dict[str, Any]]] | None:
        pools = _pools(name, namespace)
        ok = all(len(pools[pool]) == count and all(_ready(p) for p in pools[pool]) for pool, (count, _) in want.items())
        return pools if ok else None
    pools = eventually("both pools' pods Ready", placed)
    by_name = nodes()
    for pool, (_, accelerator) in want.items():
        gpu = find_gpu(accelerator)
        assert gpu is not None
        for pod in pools[pool]:
            labels = by_name[pod["spec"]["nodeName"]]["metadata"].get("labels", {})
            assert labels.get("nvidia.com/gpu.product") in gpu.product_labels, (pool, pod["metadata"]["name"], labels)
    assert {p["metadata"]["name"].rsplit("-", 1)[0] for p in pools[contract.POOL_PREFILL]} == {
        contract.prefill_stage_name(name, 0)}
    # The routers find the prefill leaders in their own Service; the decode pool's has none of them.
    prefill_ips = {p["status"]["podIP"] for p in pools[contract.POOL_PREFILL]}
    decode_ips = {p["status"]["podIP"] for p in pools[contract.POOL_DECODE]}

    def addresses(service: str) -> set[str]:
        selector = f"kubernetes.io/service-name={service}"
        return {a for s in items("endpointslices", namespace, selector) for e in s.get("endpoints") or []
                for a in e.get("addresses") or []}
    eventually("the prefill Service lists the prefill leaders",
               lambda: addresses(contract.prefill_engine_service_name(name)) == prefill_ips or None)
    assert addresses(contract.engine_service_name(name)) == decode_ips


def _metric(url: str, name: str, **labels: str) -> float:
    with urllib.request.urlopen(url + contract.METRICS_PATH, timeout=10) as response:
        text = response.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_the_simulator_example_serves_in_two_phases_through_the_router(namespace: str) -> None:
    pod_runner_status()  # fails, saying why, without the pod runner
    doc = example("simulator-disaggregated.yaml", namespace)
    name = doc["metadata"]["name"]
    apply(doc)
    wait_ready(name, namespace)
    eventually("the prefill engine Ready", lambda: all(_ready(p) for p in _pools(name, namespace)[contract.POOL_PREFILL])
               and _pools(name, namespace)[contract.POOL_PREFILL] or None, timeout=180)
    router = router_url(name, namespace)
    served = doc["spec"]["model"]["servedName"]
    prefill_ip = _pools(name, namespace)[contract.POOL_PREFILL][0]["status"]["podIP"]
    engine = f"http://{prefill_ip}:{contract.ENGINE_PORT}"

    def remote() -> float:
        return _metric(router, f"{contract.ROUTER_METRIC_PREFILL}_total", outcome="remote")

    def ask() -> bool | None:
        body = {"model": served, "prompt": "word " * 300, "max_tokens": 7}
        request = urllib.request.Request(router + "/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            answer = json.loads(response.read())
        assert answer["usage"]["completion_tokens"] == 7, answer
        return remote() > 0 or None
    # The router learns the prefill Service's endpoints through its EndpointSlices, then sends prompts there.
    eventually("a request's prompt computed by the prefill pool", ask, timeout=120, every=2)
    before = remote()
    for _ in range(3):
        assert ask()
    assert remote() >= before + 3
    # The prefill engine computed the prompts; the decode engine read their KV over the side channel.
    assert _metric(engine, "vllm:prompt_tokens_total") >= 4 * 300
