"""`tensorfleet router`: the load-aware OpenAI-compatible router.

The operator renders it as
`tensorfleet router --service NAME-engine --namespace NS --strategy S --port 8080
 --max-concurrency-per-backend N --model SERVED_NAME`; `--backend URL`
(repeatable) replaces discovery with a fixed list.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

from tensorfleet import argtypes, contract, extras

log = logging.getLogger("tensorfleet.router")





def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "router", help="run the load-aware OpenAI-compatible router",
        description="Route OpenAI API requests over the ready engine leaders of an InferenceService.",
    )
    where = p.add_argument_group("backends (at least one of --backend or --service)")
    where.add_argument("--backend", action="append", default=[], metavar="URL",
                       help="static engine base URL, e.g. http://10.0.0.7:8000 (repeatable)")
    where.add_argument("--service", help="headless engine Service whose EndpointSlices list the backends")
    where.add_argument("--namespace", help="namespace of --service (default: the pod's own)")
    where.add_argument("--kube-api", metavar="URL",
                       help="Kubernetes API base URL without credentials, e.g. http://127.0.0.1:8001 for kubectl "
                            "proxy (default: the pod's service account, else the kubeconfig)")
    p.add_argument("--strategy", choices=contract.ROUTER_STRATEGIES, default=contract.DEFAULT_ROUTER_STRATEGY)
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=contract.ROUTER_PORT)
    p.add_argument("--model", help="served model name; requests naming another model get 404")
    p.add_argument("--max-concurrency-per-backend", type=argtypes.positive_int, default=256,
                   help="requests in flight per engine before the router queues (the plan's max-num-seqs)")
    p.add_argument("--max-queue", type=argtypes.non_negative_int, default=0,
                   help="requests queued at the router before 429 (0: twice the fleet's concurrency, at least 64)")
    p.add_argument("--queue-timeout", type=argtypes.positive_float, default=30.0,
                   help="seconds a request may wait for an engine slot before 503")
    p.add_argument("--retries", type=argtypes.non_negative_int, default=2,
                   help="other engines to try when one fails before any byte reached the client")
    p.add_argument("--health-interval", type=argtypes.positive_float, default=2.0,
                   help="seconds between active health checks and /metrics scrapes of each engine")
    p.add_argument("--max-body-bytes", type=argtypes.positive_int, default=16 * 1024 * 1024)
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    extras.require("tensorfleet router", "router")
    from aiohttp import web
    from prometheus_client import disable_created_metrics

    from tensorfleet.httpapi import run_server, setup_logging
    from tensorfleet.kube.connection import Connection, NoConfiguration
    from tensorfleet.router.app import Router, RouterConfig

    setup_logging(args.log_level)
    # `_created` samples double the series and no dashboard reads them.
    disable_created_metrics()
    if not args.backend and not args.service:
        raise SystemExit("error: --backend or --service: give static engine URLs or the engine Service to watch")
    kube = None
    if args.service:
        try:
            kube = Connection.for_url(args.kube_api) if args.kube_api else Connection.from_environment()
        except NoConfiguration as exc:
            raise SystemExit(f"error: --service {args.service}: {exc}; run in the cluster, or give --kube-api") from None
    config = RouterConfig(
        strategy=args.strategy,
        model=args.model,
        max_concurrency_per_backend=args.max_concurrency_per_backend,
        max_queue=args.max_queue,
        queue_timeout=args.queue_timeout,
        retries=args.retries,
        health_interval=args.health_interval,
        max_body_bytes=args.max_body_bytes,
        static_backends=tuple(args.backend),
        service=args.service,
        namespace=args.namespace,
        kube=kube,
    )

    async def make_app() -> web.Application:
        return Router(config).app()

    return run_server(make_app, args.host, args.port, f"router ({args.strategy})")
