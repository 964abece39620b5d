"""The gateway (docs/gateway.md) on the real control plane: the chart's gateway pod (run as a process, like the
routers) in front of three InferenceServices' routers and simulator engines, two serving one model name with the
second at weight 10, called through the gateway Service's ClusterIP with the official openai SDK; and a gateway
run here with API keys, for the per-key limit across models.
"""

from __future__ import annotations

import collections
import concurrent.futures
import json
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import openai
from kube import SYSTEM_NAMESPACE, apply, eventually, get, wait_ready

from tensorfleet import contract
from tensorfleet.testing.loopback import free_port

GATEWAY_SERVICE = "tensorfleet-gateway"  # the chart's, release `tensorfleet`
IDLE_SECONDS = 30  # the API's least scaleToZeroAfterSeconds
CONVERSATIONS = 500


def sim(name: str, namespace: str, served: str, **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": {"name": "meta-llama/Llama-3.1-8B-Instruct", "servedName": served, "maxModelLen": 4096},
        "engine": {"kind": "simulator"}, "parallelism": {"tensor": 1}, "accelerator": {"type": "L4"},
        "replicas": 1, "router": {"replicas": 1}, **spec}
    if "autoscaling" in spec:
        body.pop("replicas")
    return {"apiVersion": contract.API_VERSION, "kind": contract.KIND,
            "metadata": {"name": name, "namespace": namespace}, "spec": body}


def opening(model: str, number: int, *later: str) -> dict[str, Any]:
    messages = [{"role": "system", "content": "Answer in one word."},
                {"role": "user", "content": f"Question {number}: what comes next?"}]
    for text in later:
        messages += [{"role": "assistant", "content": "Next."}, {"role": "user", "content": text}]
    return {"model": model, "messages": messages, "max_tokens": 1}


def post(url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], Any]:
    """The status, the headers (lower-cased names) and the JSON body of a chat completion at URL."""
    request = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=120) as answer:
            return answer.status, {k.lower(): v for k, v in answer.headers.items()}, json.loads(answer.read())
    except urllib.error.HTTPError as refused:
        return refused.code, {k.lower(): v for k, v in refused.headers.items()}, json.loads(refused.read() or b"{}")


def test_one_endpoint_for_every_model_with_a_canary(namespace: str, tmp_path: Path) -> None:
    alpha, beta = f"{namespace}-alpha", f"{namespace}-beta"
    apply(sim("stable", namespace, alpha))
    apply(sim("canary", namespace, alpha, traffic={"weight": 10}))
    # beta goes to zero when idle: the gateway wakes it at the end.
    apply(sim("beta", namespace, beta, autoscaling={"minReplicas": 0, "maxReplicas": 1,
                                                    "scaleToZeroAfterSeconds": IDLE_SECONDS}))
    for name in ("stable", "canary", "beta"):
        wait_ready(name, namespace)
    vip = (get("service", GATEWAY_SERVICE, SYSTEM_NAMESPACE) or {}).get("spec", {}).get("clusterIP")
    assert vip and vip != "None", f"the chart installed no {GATEWAY_SERVICE} Service with a ClusterIP"
    url = f"http://{vip}"
    client = openai.OpenAI(base_url=url + "/v1", api_key="e2e-no-key", max_retries=0, timeout=120.0)

    def models() -> set[str]:
        try:
            return {m.id for m in client.models.list().data}
        except openai.APIError:  # the gateway's first list may not have seen them Ready yet
            return set()

    eventually("both models at the gateway", lambda: {alpha, beta} <= models())
    for model in (beta, alpha):
        answer = client.chat.completions.create(model=model, max_tokens=3,
                                                messages=[{"role": "user", "content": "hello"}])
        assert answer.model == model and answer.choices[0].message.content
    with client.chat.completions.create(model=alpha, max_tokens=5, stream=True,
                                        messages=[{"role": "user", "content": "count to five"}]) as stream:
        text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text
    try:
        client.chat.completions.create(model=f"{namespace}-gamma", messages=[{"role": "user", "content": "hi"}])
        raise AssertionError("a model no InferenceService serves was answered")
    except openai.NotFoundError as missing:
        assert missing.code == "model_not_found"

    # New conversations split 90/10; a later turn of each stays where its first went.
    def first(number: int) -> str:
        status, headers, body = post(url, opening(alpha, number))
        assert status == 200, body
        return headers[contract.BACKEND_HEADER]

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        firsts = list(pool.map(first, range(CONVERSATIONS)))
    where = collections.Counter(firsts)
    assert set(where) == {f"{namespace}/stable", f"{namespace}/canary"}, where
    assert abs(where[f"{namespace}/canary"] / CONVERSATIONS - 0.10) <= 0.04, where
    print(f"{CONVERSATIONS} new conversations through the gateway: {dict(where)}")

    def later(number: int) -> str:
        status, headers, body = post(url, opening(alpha, number, "and after that?"))
        assert status == 200, body
        return headers[contract.BACKEND_HEADER]

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        seconds = list(pool.map(later, range(0, CONVERSATIONS, 5)))
    assert seconds == firsts[::5]

    # status.traffic: the group, the weights' shares and what the gateway counted (read by the operator).
    def traffic(name: str) -> dict[str, Any]:
        return {m["name"]: m for m in ((get(contract.PLURAL, name, namespace) or {}).get("status", {})
                                       .get("traffic") or {}).get("members", [])}

    members = eventually("status.traffic with the gateway's counts", lambda: (found := traffic("stable"))
                         and sum(m.get("conversations", 0) for m in found.values()) >= CONVERSATIONS and found,
                         timeout=60)
    assert (members["stable"]["share"], members["canary"]["share"]) == ("90%", "10%")
    # Its own first turns, give or take the one-message chats above (each a conversation of its own).
    assert where[f"{namespace}/canary"] <= members["canary"]["conversations"] <= where[f"{namespace}/canary"] + 2
    assert traffic("canary") == members
    print(f"status.traffic: {list(members.values())}")

    # A gateway with API keys: one tenant's limit holds for every model, refused at the gateway.
    keys = tmp_path / "keys"
    keys.write_text("team-a:sk-e2e-team-a-0123\nteam-b:sk-e2e-team-b-4567\n")
    port = free_port()
    gateway = subprocess.Popen([str(Path(sys.executable).parent / "tensorfleet"), "gateway", "--namespace",
                                namespace, "--host", "127.0.0.1", "--port", str(port), "--api-keys", str(keys),
                                "--requests-per-minute", "2"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        local = f"http://127.0.0.1:{port}"

        def health() -> bool:
            if gateway.poll() is not None:
                raise RuntimeError(f"the keyed gateway exited: {gateway.stderr.read().decode() if gateway.stderr else ''}")
            try:
                with urllib.request.urlopen(local + contract.HEALTH_PATH, timeout=5) as answer:
                    return bool(json.loads(answer.read())["listed"])
            except OSError:  # not listening yet
                return False
        eventually("the keyed gateway listed the InferenceServices", health, timeout=60)
        team_a = {"Authorization": "Bearer sk-e2e-team-a-0123"}
        assert post(local, opening(alpha, 1), team_a)[0] == 200
        assert post(local, opening(alpha, 2), team_a)[0] == 200
        for model in (alpha, beta, f"{namespace}-gamma"):
            status, _, body = post(local, opening(model, 3), team_a)
            assert status == 429 and body["error"]["code"] == "rate_limit_exceeded", (model, status, body)
        assert post(local, opening(alpha, 4), {"Authorization": "Bearer sk-e2e-team-b-4567"})[0] == 200
        assert post(local, opening(alpha, 5), {"Authorization": "Bearer sk-wrong"})[0] == 401
    finally:
        gateway.terminate()
        gateway.wait(30)

    # beta, idle since its one chat, goes to zero; a request through the gateway wakes it.
    eventually("beta at zero", lambda: (obj := get(contract.PLURAL, "beta", namespace))
               and obj.get("status", {}).get("idleSince"), timeout=IDLE_SECONDS + 90)
    answer = client.chat.completions.create(model=beta, max_tokens=2, messages=[{"role": "user", "content": "wake"}])
    assert answer.model == beta and answer.choices[0].message.content
