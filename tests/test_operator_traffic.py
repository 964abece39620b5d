"""status.traffic: the operator's traffic groups on their own, then the real operator against the emulated API server
with a gateway's /metrics on loopback (two pods, on two loopback addresses) found through its EndpointSlice."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
from aiohttp import web
from conftest import sim_doc

from tensorfleet import contract
from tensorfleet.controller.traffic import TrafficGroups, conversations
from tensorfleet.httpapi import start_site
from tensorfleet.testing.loopback import free_port
from tensorfleet.testing.operator_harness import cluster, running_operator
from tensorfleet.testing.wait import eventually

GATEWAY_NS = "tensorfleet-system"


def obj(name: str, served: str, weight: int | None = None, namespace: str = "ml") -> dict[str, Any]:
    spec: dict[str, Any] = {"model": {"name": "org/m", "servedName": served}}
    if weight is not None:
        spec["traffic"] = {"weight": weight}
    return {"metadata": {"name": name, "namespace": namespace}, "spec": spec}


def test_groups_say_which_members_to_report_again() -> None:
    groups = TrafficGroups()
    assert groups.observed(obj("v1", "llama")) == {("ml", "v1")}
    assert groups.observed(obj("v2", "llama", 10)) == {("ml", "v1"), ("ml", "v2")}
    assert groups.observed(obj("v2", "llama", 10)) == set()  # nothing changed
    assert groups.observed(obj("other", "llama", namespace="b")) == {("b", "other")}  # another namespace
    assert groups.status("ml", "v1") == {"group": "llama", "members": [{"name": "v1", "share": "90%"},
                                                                       {"name": "v2", "share": "10%"}]}
    # v2 serves another name now: both groups it was and is in are reported again.
    assert groups.observed(obj("v2", "qwen", 10)) == {("ml", "v1"), ("ml", "v2")}
    assert groups.status("ml", "v1") == {"group": "llama", "members": [{"name": "v1", "share": "100%"}]}
    assert groups.status("ml", "v2") == {"group": "qwen", "members": [{"name": "v2", "share": "100%"}]}
    assert groups.observed(obj("v2", "qwen"), deleted=True) == set()  # its group is gone with it
    assert groups.status("ml", "v2") is None


def test_counts_show_what_each_member_got() -> None:
    groups = TrafficGroups()
    for name, weight in (("a", None), ("b", 10), ("c", None)):
        groups.observed(obj(name, "llama", weight))
    groups.observed(obj("solo", "qwen"))
    assert groups.counted({("ml", "a"): 40, ("ml", "b"): 10}) == {("ml", "a"), ("ml", "b"), ("ml", "c")}
    assert groups.counted({("ml", "a"): 40, ("ml", "b"): 10}) == set()
    status = groups.status("ml", "b")
    assert status is not None and status["members"] == [
        {"name": "a", "share": "45%", "conversations": 40, "observedShare": "80%"},
        {"name": "b", "share": "10%", "conversations": 10, "observedShare": "20%"},
        {"name": "c", "share": "45%", "conversations": 0, "observedShare": "0%"},
    ]
    assert groups.status("ml", "solo") == {"group": "qwen", "members": [{"name": "solo", "share": "100%",
                                                                        "conversations": 0}]}


def test_conversations_are_read_from_the_gateways_metrics() -> None:
    name = contract.GATEWAY_METRIC_CONVERSATIONS + "_total"
    text = (f"# TYPE {contract.GATEWAY_METRIC_CONVERSATIONS} counter\n"
            f'{name}{{namespace="ml",inferenceservice="a",group="llama"}} 7.0\n'
            f'{name}{{namespace="ml",inferenceservice="b",group="llama"}} 3.0\n'
            f'{name}{{namespace="ml",inferenceservice="b",group="sql"}} 2.0\n')
    assert conversations(text) == {("ml", "a"): 7, ("ml", "b"): 5}


@asynccontextmanager
async def gateway_pods(counts: dict[str, dict[str, int]]) -> AsyncIterator[int]:
    """A gateway's /metrics on 127.0.0.1 and 127.0.0.2 (one port): COUNTS[host] is each pod's count per member of
    the `demo` group in `default`."""
    port = free_port()
    runners = []
    for host, members in counts.items():
        lines = [f"# TYPE {contract.GATEWAY_METRIC_CONVERSATIONS} counter"]
        lines += [f'{contract.GATEWAY_METRIC_CONVERSATIONS}_total{{namespace="default",inferenceservice="{name}",'
                  f'group="demo"}} {value}' for name, value in members.items()]
        body = "\n".join(lines) + "\n"

        async def metrics(_: web.Request, body: str = body) -> web.Response:
            return web.Response(text=body, content_type="text/plain")

        app = web.Application()
        app.router.add_get(contract.METRICS_PATH, metrics)
        runners.append(await start_site(app, host, port))
    try:
        yield port
    finally:
        for runner in runners:
            await runner.cleanup()


@pytest.mark.asyncio
async def test_status_traffic_shows_the_weights_and_what_the_gateway_counted() -> None:
    served = {"model": {"servedName": "demo"}}
    async with cluster() as c, c.workloads(), \
            gateway_pods({"127.0.0.1": {"stable": 30, "canary": 4}, "127.0.0.2": {"stable": 60, "canary": 6}}) as port:
        await c.upsert("discovery.k8s.io/v1", "endpointslices", {
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": "tensorfleet-gateway-x1", "namespace": GATEWAY_NS,
                         "labels": {contract.ENDPOINTSLICE_SERVICE_LABEL: "tensorfleet-gateway"}},
            "addressType": "IPv4", "ports": [{"name": contract.PORT_NAME_HTTP, "port": port, "protocol": "TCP"}],
            "endpoints": [{"addresses": ["127.0.0.1"], "conditions": {"ready": True}},
                          {"addresses": ["127.0.0.2"], "conditions": {"ready": True}},
                          {"addresses": ["127.0.0.3"], "conditions": {"ready": False}}]})
        async with running_operator(c, gateway_service=(GATEWAY_NS, "tensorfleet-gateway"), gateway_poll_seconds=0.2):
            await c.create(sim_doc("stable", **served))
            await c.create(sim_doc("canary", traffic={"weight": 10}, **served))

            def traffic(name: str) -> Any:
                return ((c.isvc(name) or {}).get("status") or {}).get("traffic")

            want = {"group": "demo", "members": [
                {"name": "canary", "share": "10%", "conversations": 10, "observedShare": "10%"},
                {"name": "stable", "share": "90%", "conversations": 90, "observedShare": "90%"}]}
            await eventually(lambda: traffic("stable") == want and traffic("canary") == want,
                             message="status.traffic on both members")
            # A weight changed on one member is shown on the other too.
            await c.patch("canary", {"spec": {"traffic": {"weight": 30}}})
            await eventually(lambda: [m["share"] for m in traffic("stable")["members"]] == ["30%", "70%"],
                             message="the new shares on the member that did not change")
