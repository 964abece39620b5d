"""The Services: Ray bootstrap DNS, leader discovery (and the prefill pool's), and the user-facing endpoint."""

from __future__ import annotations

from typing import Any

from tensorfleet import contract
from tensorfleet.render.meta import (
    Context,
    engine_selector,
    leader_selector,
    metadata,
    prefill_stage_selector,
    router_selector,
)


def _port(name: str, port: int, target: str) -> dict[str, Any]:
    # protocol is spelled out: it is part of the list-map key under
    # server-side apply.
    return {"name": name, "port": port, "targetPort": target, "protocol": "TCP"}


def _service(ctx: Context, name: str, component: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Service", "metadata": metadata(ctx, name, component), "spec": spec}


def workers_service(ctx: Context) -> dict[str, Any]:
    # Workers resolve the leader's per-pod DNS name before anything is
    # ready (Ray joins first, the model loads after), so not-ready pods
    # must be published.
    return _service(ctx, contract.workers_service_name(ctx.name), contract.COMPONENT_ENGINE, {
        "clusterIP": "None",
        "publishNotReadyAddresses": True,
        "selector": engine_selector(ctx.name),
        "ports": [_port(contract.PORT_NAME_RAY, contract.RAY_PORT, contract.PORT_NAME_RAY)],
    })


def engine_service(ctx: Context) -> dict[str, Any]:
    # Headless: the router balances over the individual leaders it finds in
    # this Service's EndpointSlices, which list ready leaders only.
    return _service(ctx, contract.engine_service_name(ctx.name), contract.COMPONENT_ENGINE, {
        "clusterIP": "None",
        "publishNotReadyAddresses": False,
        "selector": leader_selector(ctx.name),
        "ports": [_port(contract.PORT_NAME_HTTP, contract.ENGINE_PORT, contract.PORT_NAME_HTTP)],
    })


def prefill_engine_service(ctx: Context) -> dict[str, Any]:
    """With spec.prefill: the prefill pool's ready leaders, which the routers discover (--prefill-service)."""
    return _service(ctx, contract.prefill_engine_service_name(ctx.name), contract.COMPONENT_ENGINE, {
        "clusterIP": "None",
        "publishNotReadyAddresses": False,
        "selector": prefill_stage_selector(ctx.name, 0),
        "ports": [_port(contract.PORT_NAME_HTTP, contract.ENGINE_PORT, contract.PORT_NAME_HTTP)],
    })


def router_service(ctx: Context) -> dict[str, Any]:
    return _service(ctx, ctx.name, contract.COMPONENT_ROUTER, {
        "type": "ClusterIP",
        "selector": router_selector(ctx.name),
        "ports": [_port(contract.PORT_NAME_HTTP, contract.SERVICE_PORT, contract.PORT_NAME_HTTP)],
    })


def services(ctx: Context) -> list[dict[str, Any]]:
    prefill = [prefill_engine_service(ctx)] if ctx.spec.prefill is not None else []
    return [workers_service(ctx), engine_service(ctx), *prefill, router_service(ctx)]
