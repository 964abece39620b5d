"""The chart's monitoring, checked against what the router and the engines really export.

Real `tensorfleet sim` and `tensorfleet router` processes are put under load
so that requests wait both at the router (its per-engine ceiling is 1) and
inside the engine (its max-num-seqs is 1). Their /metrics are scraped, and
each series is given the target labels Prometheus would give it: the pod
labels the operator renders, put through the relabelings of the chart's
PodMonitors, plus `namespace` and `pod`, which the Prometheus Operator adds
to every PodMonitor target. Each prometheus-adapter rule of the chart must
then find its series (seriesQuery) and, for the HPA's Object metric, sum
exactly the requests waiting at the router and in the engine for the
InferenceService the HPA describes.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

import aiohttp
import pytest
import yaml
from test_chart import CHART, RELEASE, by_kind, helm, render

from tensorfleet import contract, promtext
from tensorfleet.api import load_inference_service
from tensorfleet.planner import make_plan
from tensorfleet.render import render as render_isvc
from tensorfleet.testing.loopback import MODEL, free_port, sim_process, spawn_router, wait_healthy
from tensorfleet.testing.wait import eventually

NAMESPACE, NAME = "ml", "llama"
_SELECTOR = re.compile(r"(?P<name>[A-Za-z_:][A-Za-z0-9_:]*)?\{(?P<matchers>[^{}]*)\}")
_MATCHER = re.compile(r'\s*(?P<label>[A-Za-z_][A-Za-z0-9_]*)\s*(?P<op>=~|!~|!=|=)\s*"(?P<value>(?:[^"\\]|\\.)*)"\s*,?')

Series = tuple[str, dict[str, str], float]


def one(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    [found] = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    return found


def selectors(query: str) -> list[tuple[str | None, list[tuple[str, str, str]]]]:
    """The instant-vector selectors of a PromQL expression: (metric name or None, [(label, op, value)])."""
    found = []
    for match in _SELECTOR.finditer(query):
        text, matchers = match.group("matchers"), []
        position = 0
        while position < len(text.strip()):
            one_matcher = _MATCHER.match(text, position)
            assert one_matcher is not None, f"cannot read the matchers {text!r} in {query!r}"
            matchers.append((one_matcher.group("label"), one_matcher.group("op"), one_matcher.group("value")))
            position = one_matcher.end()
        found.append((match.group("name"), matchers))
    assert found, f"no selector in {query!r}"
    return found


def matches(name: str, labels: dict[str, str], selector_name: str | None, matchers: list[tuple[str, str, str]]) -> bool:
    """Whether one series is selected, with PromQL's semantics (an absent label is the empty string)."""
    if selector_name is not None and name != selector_name:
        return False
    values = {**labels, "__name__": name}
    for label, op, expected in matchers:
        actual = values.get(label, "")
        full = re.fullmatch(expected, actual) is not None
        if (op == "=" and actual != expected) or (op == "!=" and actual == expected) \
                or (op == "=~" and not full) or (op == "!~" and full):
            return False
    return True


def target_labels(pod_labels: dict[str, str], monitor: dict[str, Any], pod: str) -> dict[str, str]:
    """The labels Prometheus gives a target of MONITOR for a pod with POD_LABELS (the Prometheus Operator adds
    namespace and pod; the PodMonitor's relabelings do the rest)."""
    meta = {"__meta_kubernetes_pod_label_" + re.sub(r"[^A-Za-z0-9_]", "_", key): value
            for key, value in pod_labels.items()}
    labels = {"namespace": NAMESPACE, "pod": pod}
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert all(pod_labels.get(k) == v for k, v in selector.items()), f"{monitor['metadata']['name']} misses {pod}"
    [endpoint, *_] = monitor["spec"]["podMetricsEndpoints"]
    for rule in endpoint.get("relabelings", []):
        assert rule.get("action", "replace") == "replace"
        value = ";".join(meta.get(source, "") for source in rule["sourceLabels"])
        if value:
            labels[rule["targetLabel"]] = value
    return labels


def scrape(text: str, labels: dict[str, str]) -> list[Series]:
    return [(s.name, {**s.labels, **labels}, s.value) for s in promtext.samples(text)]


def template(query: str, series: str, matchers: str, group_by: str) -> str:
    return (query.replace("<<.Series>>", series).replace("<<.LabelMatchers>>", matchers)
            .replace("<<.GroupBy>>", group_by))


@pytest.fixture(scope="module")
def chart() -> Any:
    return helm.Chart.load(str(CHART))


@pytest.fixture(scope="module")
def objects() -> dict[str, Any]:
    """The operator's render of a scale-to-zero service, and the chart with its PodMonitors on."""
    isvc = load_inference_service({
        "apiVersion": contract.API_VERSION, "kind": contract.KIND,
        "metadata": {"name": NAME, "namespace": NAMESPACE},
        "spec": {"model": {"name": "meta-llama/Llama-3.1-8B-Instruct", "maxModelLen": 8192},
                 "accelerator": {"type": "H100-80GB"}, "autoscaling": {"minReplicas": 0, "maxReplicas": 4}},
    })
    return {"operator": render_isvc(isvc, make_plan(isvc.spec))}


def test_the_adapter_rules_sum_every_waiting_request_the_processes_export(chart: Any, objects: dict[str, Any]) -> None:
    chart_objects = render(chart, {"monitoring": {"podMonitors": {"enabled": True}}})
    monitors = {m["spec"]["selector"]["matchLabels"][contract.LABEL_COMPONENT]: m
                for m in by_kind(chart_objects, "PodMonitor")}
    assert set(monitors) == {contract.COMPONENT_ENGINE, contract.COMPONENT_ROUTER}
    config = yaml.safe_load(one(chart_objects, "ConfigMap", f"{RELEASE}-tensorfleet-adapter-rules")
                            ["data"]["config.yaml"])
    rendered = objects["operator"]
    leader = one(rendered, "StatefulSet", contract.stage_name(NAME, 0))["spec"]["template"]["metadata"]["labels"]
    router_pod = one(rendered, "Deployment", contract.router_name(NAME))["spec"]["template"]["metadata"]["labels"]
    [hpa] = by_kind(rendered, "HorizontalPodAutoscaler")
    [metric] = hpa["spec"]["metrics"]
    assert metric["type"] == "Object" and metric["object"]["describedObject"]["name"] == NAME

    router_text, engine_text, waiting = asyncio.run(_under_load())
    series = [*scrape(router_text, target_labels(router_pod, monitors[contract.COMPONENT_ROUTER], "llama-router-x")),
              *scrape(engine_text, target_labels(leader, monitors[contract.COMPONENT_ENGINE], "llama-stage-0-0"))]
    assert waiting["router"] > 0 and waiting["engine"] > 0 and waiting["burst"] > 0, waiting

    rules = {rule["name"]["as"]: rule for rule in config["rules"]}
    for exposed, rule in rules.items():
        [(name, matchers)] = selectors(rule["seriesQuery"])
        assert any(matches(n, labels, name, matchers) for n, labels, _ in series), \
            f"rule {exposed}: seriesQuery {rule['seriesQuery']!r} selects no series the processes export"
        for label in rule["resources"]["overrides"]:
            assert all(label in labels for n, labels, _ in series if matches(n, labels, name, matchers)), \
                f"rule {exposed}: series lack the label {label!r} its resource override needs"

    pending = rules[metric["object"]["metric"]["name"]]
    overrides = pending["resources"]["overrides"]
    assert overrides[contract.METRIC_LABEL_INFERENCE_SERVICE] == {"group": contract.GROUP, "resource": contract.PLURAL}
    # What prometheus-adapter asks Prometheus for this InferenceService's Object metric.
    query = template(pending["metricsQuery"], contract.ROUTER_METRIC_PENDING,
                     f'namespace="{NAMESPACE}",{contract.METRIC_LABEL_INFERENCE_SERVICE}="{NAME}"',
                     f"namespace,{contract.METRIC_LABEL_INFERENCE_SERVICE}")
    selected = [(n, value) for n, labels, value in series
                if any(matches(n, labels, name, m) for name, m in selectors(query))]
    assert {n for n, _ in selected} == {contract.ROUTER_METRIC_PENDING, contract.ROUTER_METRIC_BURST,
                                        contract.VLLM_METRIC_WAITING}
    assert sum(value for _, value in selected) == waiting["router"] + waiting["burst"] + waiting["engine"]
    # Every request beyond the one the router's ceiling gives the engine: queued at the router, running beyond the
    # ceiling, or queued inside the engine.
    assert sum(value for _, value in selected) == REQUESTS - 1
    # Another InferenceService's series are not counted.
    other = template(pending["metricsQuery"], contract.ROUTER_METRIC_PENDING,
                     f'namespace="{NAMESPACE}",{contract.METRIC_LABEL_INFERENCE_SERVICE}="other"', "namespace")
    assert not [n for n, labels, _ in series if any(matches(n, labels, name, m) for name, m in selectors(other))]


REQUESTS = 6


async def _under_load() -> tuple[str, str, dict[str, float]]:
    """Both /metrics pages while requests wait at the router and in the engine, and the engine runs more than
    the router's ceiling."""
    async with sim_process("--max-num-seqs", "2", "--time-scale", "1") as (engine, _):
        port = free_port()
        # The router's ceiling is 1, but the engine reports room, so it bursts to 3: the engine runs 2 (one
        # beyond the ceiling) and queues the third; the rest wait at the router.
        with spawn_router(port, [engine], "--max-concurrency-per-backend", "1", "--burst-concurrency-per-backend",
                          "3", "--health-interval", "0.5"):
            url = f"http://127.0.0.1:{port}"
            await wait_healthy(url)
            async with aiohttp.ClientSession() as client:
                body = {"model": MODEL, "prompt": "hello", "max_tokens": 400}
                load = [asyncio.create_task(client.post(url + "/v1/completions", json=body))
                        for _ in range(REQUESTS)]
                waiting: dict[str, float] = {}

                async def both_waiting() -> bool:
                    async with client.get(url + "/metrics") as resp:
                        router_text = await resp.text()
                    async with client.get(engine + "/metrics") as resp:
                        engine_text = await resp.text()
                    waiting["router"] = promtext.value(router_text, contract.ROUTER_METRIC_PENDING) or 0.0
                    waiting["engine"] = promtext.value(engine_text, contract.VLLM_METRIC_WAITING) or 0.0
                    waiting["burst"] = promtext.value(router_text, contract.ROUTER_METRIC_BURST) or 0.0
                    waiting["texts"] = 0.0
                    pages.update(router=router_text, engine=engine_text)
                    return waiting["router"] > 0 and waiting["engine"] > 0 and waiting["burst"] > 0

                pages: dict[str, str] = {}
                try:
                    await eventually(both_waiting, timeout=20.0, interval=0.1)
                finally:
                    for task in load:
                        task.cancel()
                    await asyncio.gather(*load, return_exceptions=True)
                waiting.pop("texts")
                return pages["router"], pages["engine"], waiting
