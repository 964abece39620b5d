"""`tensorfleet router`: the command line of the load-aware OpenAI-compatible router, as the operator renders it (the
engine Service, the strategy, the ceiling, the served model; with spec.router.auth the API keys and per-key limits)
or as run by hand against `--backend` engines; each flag's help says what it bounds. Design:
docs/architecture.md#processes-and-what-crosses-between-them.
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

from tensorfleet import argtypes, contract, extras, vllm_defaults
from tensorfleet.router import NO_ENGINE_RETRY_SECONDS

log = logging.getLogger("tensorfleet.router")

MIB = 1024 * 1024


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "router", help="run the load-aware OpenAI-compatible router",
        description="Route OpenAI API requests over the ready engine leaders of an InferenceService.",
        epilog="No engine available: when no engine is healthy (all ejected after failures, or none known) a "
               "request gets 503 at once, with Retry-After: the seconds until the soonest engine's ejection ends "
               "(plus --health-interval if only a health check may probe it) or its next health check, at least 1; "
               f"{NO_ENGINE_RETRY_SECONDS} with no engine at all. During a cold start requests queue instead, up to --queue-timeout. A cold "
               "start is underway while --service's EndpointSlices have not been listed yet, while they list an "
               "endpoint that is neither ready nor terminating (a pod loading its model, its readiness probe not yet "
               "passed), or while an engine that joined has not yet answered a health check: for --backend engines "
               "until one first does, for discovered ones until their first check completes. "
               "API keys: with --api-keys every request but GET /health and /metrics (left open for probes and "
               "Prometheus; /metrics names tenants, never keys) needs `Authorization: Bearer KEY`, else 401 "
               "(code invalid_api_key). A key over its per-minute limits gets 429 (code rate_limit_exceeded) with "
               "Retry-After: the seconds until its bucket holds enough. Limits are per router process. While waiting "
               "for an engine, each key's requests queue apart and free slots go round the keys; a full queue "
               "refuses the newest request of the key with the most waiting, so no key can fill it for the others.",
    )
    where = p.add_argument_group("backends (at least one of --backend or --service)")
    where.add_argument("--backend", action="append", default=[], metavar="URL",
                       help="static engine base URL, e.g. http://10.0.0.7:8000 (repeatable); one never yet up is "
                            "waited for as starting while it answers, one refusing connections is not: requests "
                            "finding no other engine get 503 with Retry-After at once")
    where.add_argument("--service", help="headless engine Service whose EndpointSlices list the backends")
    where.add_argument("--prefill-backend", action="append", default=[], metavar="URL",
                       help="static prefill engine base URL (repeatable): prefill/decode disaggregation, the "
                            "--backend/--service engines decoding (router/prefill.py)")
    where.add_argument("--prefill-service", metavar="SERVICE",
                       help="headless Service whose EndpointSlices list the prefill engines (in --namespace)")
    where.add_argument("--prefill-max-concurrency-per-backend", type=argtypes.non_negative_int, default=0,
                       metavar="N", help="prefill halves in flight per prefill engine; beyond it a request's decode "
                                         "engine computes its prompt (0: --max-concurrency-per-backend)")
    where.add_argument("--peer", action="append", default=[], metavar="URL",
                       help="another replica of this router, e.g. http://10.0.0.9:8080 (repeatable): with "
                            "prefix-aware or cache-aware, replicas send each other which engine each prompt went "
                            "to and their load on each engine, as it changes, so a conversation's turns find its engine "
                            "whichever replica they reach and the replicas share one ceiling per engine; "
                            "posts to the placements path are taken from peers' addresses only (router/peers.py)")
    where.add_argument("--peer-service", metavar="SERVICE",
                       help="this router's own Service (in --namespace): its ready endpoints, less this pod's "
                            f"address (${contract.ENV_ROUTER_POD_IP}), are the peers, as --peer")
    where.add_argument("--namespace", help="namespace of --service (default: the pod's own)")
    where.add_argument("--kube-api", metavar="URL",
                       help="Kubernetes API base URL without credentials, e.g. http://127.0.0.1:8001 for kubectl "
                            "proxy (default: the pod's service account, else the kubeconfig)")
    p.add_argument("--strategy", choices=contract.ROUTER_STRATEGIES, default=contract.DEFAULT_ROUTER_STRATEGY)
    p.add_argument("--kv-events", action="store_true",
                   help=f"subscribe to every engine's KV-cache events (vLLM's ZeroMQ publisher on port "
                        f"{contract.KV_EVENTS_PORT}, replay on {contract.KV_EVENTS_REPLAY_PORT}) and keep an index of "
                        "the blocks each holds (tensorfleet_router_kv_index_blocks)")
    p.add_argument("--kv-events-endpoint", action="append", default=[], type=_kv_endpoint,
                   metavar="URL=PUB,REPLAY",
                   help="with --kv-events, where the engine at URL publishes (tcp://host:port) and replays, when not on "
                        "its own address's default ports (engines sharing a host); repeat per engine")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=contract.ROUTER_PORT)
    p.add_argument("--model", help="served model name; requests naming another model get 404")
    p.add_argument("--max-concurrency-per-backend", type=argtypes.positive_int, default=256,
                   help="requests in flight per engine before the router queues: what a replica is sized for "
                        "(the operator: what the plan's KV cache holds at a typical request size); with --peer or "
                        "--peer-service, the peers' requests on the engine count too")
    p.add_argument("--burst-concurrency-per-backend", type=argtypes.non_negative_int, default=0,
                   help="let an engine take up to this many while it reports room (nothing queued inside it, KV "
                        "cache below 90%%), moving its limit a quarter per health check; those beyond the ceiling "
                        "count as demand in tensorfleet_router_burst_requests (0: no burst, the ceiling holds)")
    p.add_argument("--max-queue", type=argtypes.non_negative_int, default=0,
                   help="requests queued at the router before 429 (0: twice the fleet's concurrency at the ceiling, at least 64)")
    p.add_argument("--queue-timeout", type=argtypes.positive_float, default=30.0,
                   help="seconds a request may wait for an engine slot (engines busy, or a cold start underway) "
                        "before 503; with no engine healthy and none starting it gets 503 at once; with cache-aware, "
                        "cheaper requests may go first for at most half of it (default: 30)")
    p.add_argument("--prompt-queue-tokens", type=argtypes.non_negative_int,
                   default=vllm_defaults.MAX_NUM_BATCHED_TOKENS, metavar="TOKENS",
                   help="cache-aware: prompt tokens this router may have queued on one engine with no first token "
                        "back, set to the engines' --max-num-batched-tokens (one step's prefill); a request no "
                        "engine has room for waits here and goes to the first engine to clear, shorter prompts "
                        "first; streamed answers only (0: no bound; default: %(default)s)")
    zero = p.add_argument_group("scale from zero (autoscaling.minReplicas 0; router/demand.py)")
    zero.add_argument("--demand-lease", metavar="NAME",
                      help="Lease (in --namespace) to renew when requests arrive, at once when one finds no engine: "
                           "the operator wakes a fleet at zero from it and counts idle time from it. Needs --service")
    zero.add_argument("--cold-start-timeout", type=argtypes.positive_float, default=600.0, metavar="SECONDS",
                      help="seconds a request that found no engine ready during a cold start (the fleet waking from "
                           "zero, its engines loading) may wait before 503 with Retry-After (default: 600)")
    p.add_argument("--retries", type=argtypes.non_negative_int, default=2,
                   help="other engines to try when one fails before any byte reached the client")
    p.add_argument("--health-interval", type=argtypes.positive_float, default=2.0,
                   help="seconds between active health checks and /metrics scrapes of each engine")
    p.add_argument("--health-timeout", type=argtypes.positive_float, default=2.0,
                   help="seconds an engine has to answer a health check; past it the engine is ejected at once as "
                        "unresponsive and requests waiting for its first byte move to other engines (default: 2)")
    p.add_argument("--backend-header", action="store_true",
                   help=f"name the engine that answered (its URL) in the {contract.BACKEND_HEADER} response header; "
                        "for tests and benchmarks, off by default since it shows clients internal addresses")
    engine = p.add_argument_group("engine timeouts (an attempt that times out before its first byte is retried "
                                  "on another engine)")
    engine.add_argument("--first-byte-timeout", type=argtypes.positive_float, default=30.0,
                        help="seconds an engine may take to send the first byte of an answer to a short prompt; "
                             "longer prompts add their prefill time (default: 30)")
    engine.add_argument("--prefill-tokens-per-second", type=argtypes.positive_float, default=1000.0,
                        help="a conservative prefill rate: each prompt token (estimated as 3 characters) adds "
                             "1/RATE seconds to the first-byte bound (default: 1000)")
    engine.add_argument("--decode-tokens-per-second", type=argtypes.positive_float, default=5.0,
                        help="a conservative per-request decode rate: an answer that is not streamed adds "
                             "max_tokens/RATE seconds to its bound, and has none without max_tokens (default: 5)")
    engine.add_argument("--stream-idle-timeout", type=argtypes.positive_float, default=30.0,
                        help="seconds a stream may go without a byte from its engine before it is resumed on another "
                             "engine, or ends with an SSE error event when it cannot be (and a client that reads "
                             "nothing for as long is disconnected) (default: 30)")
    engine.add_argument("--stream-resumptions", type=argtypes.non_negative_int, default=2,
                        help="times one stream whose engine stalls or fails mid-way may be continued on another "
                             "engine; 0 ends every such stream with an SSE error event (default: 2)")
    add_client_arguments(p, "router")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    p.set_defaults(func=run)


def add_client_arguments(p: argparse.ArgumentParser, who: str) -> None:
    """The flags of a process facing OpenAI clients (WHO: the router, the gateway): client limits, API keys and
    per-key limits, shutdown; read back by client_settings."""
    clients = p.add_argument_group("client limits")
    clients.add_argument("--max-body-bytes", type=argtypes.positive_int, default=16 * MIB,
                         help="largest request body; larger ones get 413 (default: 16 MiB)")
    clients.add_argument("--max-body-bytes-in-flight", type=argtypes.positive_int, default=64 * MIB,
                         help=f"request-body bytes the {who} holds at once over all requests; a request that would "
                              "pass it gets 503 with Retry-After; bodies over 1 MiB may fill only 3/4 of it "
                              "(default: 64 MiB)")
    clients.add_argument("--max-json-depth", type=argtypes.positive_int, default=64,
                         help="deepest nesting of JSON arrays and objects in a request body; deeper gets 400 "
                              "(default: 64)")
    clients.add_argument("--max-json-values", type=argtypes.positive_int, default=250_000,
                         help="most JSON values in a request body (counted as its commas and brackets, strings "
                              "included); more gets 400 (default: 250000)")
    clients.add_argument("--header-timeout", type=argtypes.positive_float, default=10.0,
                         help="seconds a request head may take from its first byte (or from the connection's "
                              "opening); past it 408 and the connection is closed (default: 10)")
    clients.add_argument("--body-timeout", type=argtypes.positive_float, default=30.0,
                         help="seconds a request body may take to arrive after its head; past it 408 (default: 30)")
    clients.add_argument("--idle-timeout", type=argtypes.positive_float, default=75.0,
                         help="seconds an idle keep-alive connection is kept; longer than the 60 s idle timeout of "
                              "common proxies and load balancers, so they close first (default: 75)")
    auth = p.add_argument_group(f"API keys and per-key limits (without --api-keys, anyone who reaches the {who} "
                                "may call it)")
    auth.add_argument("--api-keys", metavar="PATH",
                      help="require `Authorization: Bearer KEY` with one of these keys: PATH is a directory with one "
                           "file per tenant, the file's name the tenant and its content the key (a mounted Secret whose "
                           "data keys are tenant names), or a file of `tenant:key` lines; keys are kept hashed, never "
                           "logged, and read again when PATH changes, without a restart")
    auth.add_argument("--api-keys-reload-interval", type=argtypes.positive_float, default=5.0, metavar="SECONDS",
                      help="how often --api-keys is checked for changes (default: 5)")
    auth.add_argument("--requests-per-minute", type=argtypes.positive_int, metavar="N",
                      help="requests each key may send per minute: a token bucket holding a minute's worth, refilled "
                           "evenly; over it, 429 with Retry-After (default: no limit)")
    auth.add_argument("--tokens-per-minute", type=argtypes.positive_int, metavar="N",
                      help="tokens each key may use per minute: a request is admitted while its key's bucket holds its "
                           "estimate (prompt characters / 3, plus max_tokens times n for a generation; a full bucket for "
                           "an estimate above N), which is settled to the usage its answer reports (a stream: the "
                           f"engine's own running counts, which the {who} asks for); over it, 429 with Retry-After "
                           "(default: no limit)")
    auth.add_argument("--default-max-tokens", type=argtypes.positive_int, default=1024, metavar="N",
                      help="completion tokens a generation without max_tokens is charged at admission, until its "
                           "usage settles it (default: 1024)")
    stop = p.add_argument_group("shutdown (SIGTERM)")
    stop.add_argument("--drain-delay", type=argtypes.non_negative_float, default=float(contract.ROUTER_DRAIN_SECONDS),
                      help=f"seconds the {who} keeps accepting and serving after SIGTERM, while the pod leaves the "
                           f"Service's endpoints (what a preStop sleep would do) (default: {contract.ROUTER_DRAIN_SECONDS})")
    stop.add_argument("--shutdown-grace", type=argtypes.non_negative_float,
                      default=float(contract.ROUTER_SHUTDOWN_GRACE_SECONDS),
                      help="seconds in-flight requests then have to finish; streams still running end with an SSE "
                           f"error event, other requests with 503 (default: {contract.ROUTER_SHUTDOWN_GRACE_SECONDS})")


def client_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The ClientConfig fields, from the flags add_client_arguments added."""
    names = ("header_timeout", "body_timeout", "idle_timeout", "max_body_bytes", "max_body_bytes_in_flight",
             "max_json_depth", "max_json_values", "drain_delay", "shutdown_grace", "api_keys",
             "api_keys_reload_interval", "requests_per_minute", "tokens_per_minute", "default_max_tokens")
    return {name: getattr(args, name) for name in names}


def _kv_endpoint(text: str) -> tuple[str, str, str]:
    url, _, sockets = text.partition("=")
    publisher, _, replay = sockets.partition(",")
    if not url.startswith(("http://", "https://")) or not publisher.startswith("tcp://") \
            or not replay.startswith("tcp://"):
        raise argparse.ArgumentTypeError(f"{text!r}: want ENGINE_URL=tcp://HOST:PORT,tcp://HOST:REPLAY_PORT")
    return url.rstrip("/"), publisher, replay


def run(args: argparse.Namespace) -> int:
    extras.require("tensorfleet router", "router")
    from aiohttp import web
    from prometheus_client import disable_created_metrics

    from tensorfleet.httpapi import run_server, setup_logging
    from tensorfleet.kube.connection import Connection, NoConfiguration
    from tensorfleet.router.app import Router, RouterConfig
    from tensorfleet.router.clients import client_limits
    from tensorfleet.router.tenants import KeysError

    setup_logging(args.log_level)
    # `_created` samples double the series and no dashboard reads them.
    disable_created_metrics()
    if not args.backend and not args.service:
        raise SystemExit("error: --backend or --service: give static engine URLs or the engine Service to watch")
    if (args.requests_per_minute or args.tokens_per_minute) and not args.api_keys:
        raise SystemExit("error: --requests-per-minute and --tokens-per-minute are per API key: give --api-keys")
    kube = None
    if args.demand_lease and not args.service:
        raise SystemExit("error: --demand-lease needs --service: the Lease lives with the engines' discovery")
    for service in (args.service, args.prefill_service, args.peer_service):
        if service and kube is None:
            try:
                kube = Connection.for_url(args.kube_api) if args.kube_api else Connection.from_environment()
            except NoConfiguration as exc:
                raise SystemExit(f"error: --service {service}: {exc}; run in the cluster, or give --kube-api") from None
    config = RouterConfig(
        **client_settings(args),
        strategy=args.strategy,
        kv_events=args.kv_events,
        kv_event_endpoints=tuple(args.kv_events_endpoint),
        model=args.model,
        max_concurrency_per_backend=args.max_concurrency_per_backend,
        burst_concurrency_per_backend=args.burst_concurrency_per_backend,
        max_queue=args.max_queue,
        queue_timeout=args.queue_timeout,
        prompt_queue_tokens=args.prompt_queue_tokens,
        retries=args.retries,
        health_interval=args.health_interval,
        health_timeout=args.health_timeout,
        first_byte_timeout=args.first_byte_timeout,
        prefill_tokens_per_second=args.prefill_tokens_per_second,
        decode_tokens_per_second=args.decode_tokens_per_second,
        stream_idle_timeout=args.stream_idle_timeout,
        stream_resumptions=args.stream_resumptions,
        backend_header=args.backend_header,
        static_backends=tuple(args.backend),
        service=args.service,
        namespace=args.namespace,
        kube=kube,
        demand_lease=args.demand_lease,
        cold_start_timeout=args.cold_start_timeout,
        prefill_backends=tuple(args.prefill_backend),
        prefill_service=args.prefill_service,
        prefill_max_concurrency_per_backend=args.prefill_max_concurrency_per_backend,
        peers=tuple(args.peer),
        peer_service=args.peer_service,
        own_address=os.environ.get(contract.ENV_ROUTER_POD_IP) or None,
    )

    try:
        router = Router(config)
    except KeysError as exc:
        raise SystemExit(f"error: --api-keys: {exc}") from None

    async def make_app() -> web.Application:
        return router.app()

    return run_server(make_app, args.host, args.port, f"router ({args.strategy})", limits=client_limits(config),
                      drain=router.drain)
