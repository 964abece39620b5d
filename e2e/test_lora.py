"""LoRA adapters on the real control plane: the example's engines (real simulator processes on their pod IPs)
get their adapters from the operator, the real router lists them in /v1/models and serves them by name, and an
adapter added to the manifest is loaded into the running engines without any engine pod being recreated.
Bad adapter specs are refused at `kubectl apply`, naming the field.

Needs the pod runner of `e2e/cluster up` (as root, as CI runs it): routers and simulator engines run as
processes, and the operator reaches the engines on their pod IPs.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

from kube import apply, engine_pods, eventually, example, get, kubectl_result, router_url, wait_ready
from test_pods import pod_runner_status

from tensorfleet import contract

EXAMPLE = "simulator-lora.yaml"


def _call(url: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")


def _models(url: str) -> dict[str, str | None]:
    status, body = _call(url, "/v1/models")
    assert status == 200, body
    return {m["id"]: m.get("parent") for m in body["data"]}


def _adapter_states(name: str, namespace: str) -> dict[str, tuple[str, int]]:
    status = (get(contract.PLURAL, name, namespace) or {}).get("status") or {}
    return {a["name"]: (a["state"], a["engines"]) for a in status.get("adapters") or []}


def _engine_pod_uids(name: str, namespace: str) -> dict[str, str]:
    return {p["metadata"]["name"]: p["metadata"]["uid"] for p in engine_pods(name, namespace)}


def test_the_examples_adapters_are_served_and_one_added_restarts_no_engine(namespace: str) -> None:
    pod_runner_status()  # fails, saying why, without the pod runner
    doc = example(EXAMPLE, namespace)
    name = doc["metadata"]["name"]
    served = doc["spec"]["model"]["servedName"]
    replicas = doc["spec"]["replicas"]
    adapters = [a["name"] for a in doc["spec"]["adapters"]]
    assert len(adapters) >= 3
    apply(doc)
    wait_ready(name, namespace)
    eventually("every adapter loaded on every engine",
               lambda: _adapter_states(name, namespace) == {a: ("Loaded", replicas) for a in adapters} or None,
               timeout=180)
    router = router_url(name, namespace)
    eventually("the router lists the base model and every adapter",
               lambda: _models(router) == {served: None, **{a: served for a in adapters}} or None, timeout=60)
    for adapter in adapters:
        status, body = _call(router, "/v1/completions", {"model": adapter, "prompt": "hello", "max_tokens": 4})
        assert status == 200 and body["model"] == adapter, body

    pods = _engine_pod_uids(name, namespace)
    assert len(pods) == replicas
    sts = get("statefulset", contract.stage_name(name, 0), namespace)
    assert sts is not None, "the engines' StatefulSet exists"
    generation = sts["metadata"]["generation"]
    added = {"name": "translator", "source": "example-org/llama-8b-translate-lora", "rank": 16}
    doc["spec"]["adapters"].append(added)
    apply(doc)
    eventually("the added adapter loaded on every engine",
               lambda: _adapter_states(name, namespace).get("translator") == ("Loaded", replicas) or None,
               timeout=120)
    eventually("the router serves the added adapter",
               lambda: _call(router, "/v1/completions", {"model": "translator", "prompt": "hi", "max_tokens": 2})[0]
               == 200 or None, timeout=60)
    assert "translator" in _models(router)
    assert _engine_pod_uids(name, namespace) == pods, "adding an adapter recreated engine pods"
    sts = get("statefulset", contract.stage_name(name, 0), namespace)
    assert sts is not None and sts["metadata"]["generation"] == generation

    # Removing one unloads it from the engines: the router answers 404 for it, naming it, once it has asked again.
    doc["spec"]["adapters"] = [a for a in doc["spec"]["adapters"] if a["name"] != "summarizer"]
    apply(doc)
    eventually("the removed adapter gone from status", lambda: "summarizer" not in _adapter_states(name, namespace)
               or None, timeout=60)

    def refused() -> bool | None:
        status, body = _call(router, "/v1/completions", {"model": "summarizer", "prompt": "x", "max_tokens": 1})
        return (status == 404 and "summarizer" in body["error"]["message"]) or None
    eventually("the router refuses the removed adapter", refused, timeout=60)
    assert _engine_pod_uids(name, namespace) == pods


def test_bad_adapter_specs_are_refused_at_apply_naming_the_field(namespace: str) -> None:
    base = example(EXAMPLE, namespace)
    served = base["spec"]["model"]["servedName"]
    cases = {
        "spec.adapters[1]": [{"name": "a", "source": "org/a"}, {"name": "a", "source": "org/b"}],
        "spec.adapters[0].name": [{"name": served, "source": "org/a"}],
        "spec.adapters[0].rank": [{"name": "big", "source": "org/big", "rank": 64}],
        "spec.adapters[0].source": [{"name": "odd", "source": "https://example.com/x"}],
    }
    for field, adapters in cases.items():
        doc = example(EXAMPLE, namespace, adapters=adapters)
        doc["metadata"]["name"] = "bad-lora"
        doc["spec"]["engine"]["lora"] = {"maxLoras": 2, "maxRank": 16}
        done = kubectl_result("apply", "-f", "-", stdin=json.dumps(doc))
        assert done.returncode != 0, f"{field}: accepted"
        assert field in done.stderr, (field, done.stderr)
    # A fixed maxLoras that leaves no KV cache for one sequence.
    doc = example(EXAMPLE, namespace)
    doc["metadata"]["name"] = "bad-lora"
    doc["spec"]["engine"]["lora"] = {"maxLoras": 256, "maxRank": 512}
    done = kubectl_result("apply", "-f", "-", stdin=json.dumps(doc))
    assert done.returncode != 0 and "spec.engine.lora.maxLoras" in done.stderr, done.stderr
    assert get(contract.PLURAL, "bad-lora", namespace) is None
