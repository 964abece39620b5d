"""`tensorfleet gateway`: the command line of the one OpenAI endpoint across InferenceServices, as the chart runs it
(gateway.enabled) or as run by hand with a kubeconfig; its client flags are the router's. Design: docs/gateway.md.
"""

from __future__ import annotations

import argparse
from typing import Any

from tensorfleet import argtypes, contract, extras
from tensorfleet.router.cli import add_client_arguments, client_settings


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "gateway", help="run one OpenAI endpoint across InferenceServices",
        description="Route OpenAI API requests by their `model` to the router of the InferenceService serving it, "
                    "splitting new conversations between InferenceServices of one namespace that serve the same "
                    "name by their spec.traffic.weight.",
        epilog="GET /v1/models lists every model a Ready InferenceService serves (its served name, and its LoRA "
               "adapters with it as their parent); a model no InferenceService serves gets 404 at once (code "
               "model_not_found). A conversation is kept by the x-session-id header or `user`, else by its opening "
               "(the messages through the first user message): every turn of it goes to the InferenceService its "
               "first did while the weights stay. API keys and limits are the router's, per gateway process and "
               "shared by every model.",
    )
    p.add_argument("--namespace", "-n", action="append", default=[], metavar="NAMESPACE",
                   help="a namespace whose InferenceServices the gateway serves (repeatable; default: all)")
    p.add_argument("--route", action="append", default=[], type=_route, metavar="MODEL=URL",
                   help="serve MODEL from the router at URL, with no Kubernetes API (repeatable; a MODEL given twice "
                        "is a traffic group of equal shares): for running by hand and for benchmarks")
    p.add_argument("--kube-api", metavar="URL",
                   help="Kubernetes API base URL without credentials, e.g. http://127.0.0.1:8001 for kubectl proxy "
                        "(default: the pod's service account, else the kubeconfig)")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=contract.GATEWAY_PORT)
    p.add_argument("--cold-start-timeout", type=argtypes.positive_float, default=600.0, metavar="SECONDS",
                   help="seconds a request waits for its InferenceService's first ready router (a new one starting), "
                        "and for the gateway's first list of InferenceServices, before 503 with Retry-After; the "
                        "router then waits for its engines itself, waking a fleet at zero (default: 600)")
    p.add_argument("--connect-timeout", type=argtypes.positive_float, default=3.0, metavar="SECONDS",
                   help="seconds to connect to a router; a router refusing is skipped for another (default: 3)")
    p.add_argument("--first-byte-timeout", type=argtypes.positive_float, default=900.0, metavar="SECONDS",
                   help="seconds a router may take to answer, its own queue and cold-start waits included; past it "
                        "502 (default: 900)")
    p.add_argument("--stream-idle-timeout", type=argtypes.positive_float, default=120.0, metavar="SECONDS",
                   help="seconds a stream may go without a byte from the router, or with the client taking none, "
                        "before it ends (an SSE error event, or the client dropped) (default: 120)")
    p.add_argument("--backend-header", action="store_true",
                   help=f"name the InferenceService that answered (namespace/name) in the {contract.BACKEND_HEADER} "
                        "response header; for tests and debugging, off by default")
    add_client_arguments(p, "gateway")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    p.set_defaults(func=run)


def _route(text: str) -> tuple[str, str]:
    model, _, url = text.partition("=")
    if not model or not url.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(f"{text!r}: want MODEL=URL, e.g. llama=http://127.0.0.1:8080")
    return model, url.rstrip("/")


def static_table(routes: list[tuple[str, str]]) -> Any:
    """The model table of --route: each route an InferenceService `static/route-N`, Ready, its router at URL."""
    from tensorfleet.gateway.table import ModelTable

    table = ModelTable()
    objects = [{"metadata": {"namespace": "static", "name": f"route-{index}"},
                "spec": {"model": {"name": model}}, "status": {"conditions": [{"type": "Ready", "status": "True"}]}}
               for index, (model, _) in enumerate(routes)]
    table.replace_services(objects)
    table.set_routers({("static", f"route-{index}"): (url,) for index, (_, url) in enumerate(routes)})
    return table


def run(args: argparse.Namespace) -> int:
    extras.require("tensorfleet gateway", "router")
    from aiohttp import web
    from prometheus_client import disable_created_metrics

    from tensorfleet.gateway.app import Gateway
    from tensorfleet.gateway.config import GatewayConfig
    from tensorfleet.httpapi import run_server, setup_logging
    from tensorfleet.kube.connection import Connection, NoConfiguration
    from tensorfleet.router.clients import client_limits
    from tensorfleet.router.tenants import KeysError

    setup_logging(args.log_level)
    disable_created_metrics()
    if (args.requests_per_minute or args.tokens_per_minute) and not args.api_keys:
        raise SystemExit("error: --requests-per-minute and --tokens-per-minute are per API key: give --api-keys")
    kube = None
    if not args.route:
        try:
            kube = Connection.for_url(args.kube_api) if args.kube_api else Connection.from_environment()
        except NoConfiguration as exc:
            raise SystemExit(f"error: the gateway watches InferenceServices: {exc}; run in the cluster, give "
                             "--kube-api, or name routers with --route") from None
    elif args.kube_api or args.namespace:
        raise SystemExit("error: --route serves a fixed table: it takes no --kube-api or --namespace")
    config = GatewayConfig(**client_settings(args), namespaces=tuple(args.namespace), kube=kube,
                           cold_start_timeout=args.cold_start_timeout, connect_timeout=args.connect_timeout,
                           first_byte_timeout=args.first_byte_timeout, stream_idle_timeout=args.stream_idle_timeout,
                           backend_header=args.backend_header)
    try:
        gateway = Gateway(config, static_table(args.route) if args.route else None)
    except KeysError as exc:
        raise SystemExit(f"error: --api-keys: {exc}") from None

    async def make_app() -> web.Application:
        return gateway.app()

    return run_server(make_app, args.host, args.port, "gateway", limits=client_limits(config), drain=gateway.drain)
