"""The router's settings: one RouterConfig, made from router/cli.py's flags (or by tests) and read by every part, which
takes this one object rather than its own subset, so a setting keeps the name and the default its flag documents; its
client side (ClientConfig) is the gateway's too.
Design: docs/architecture.md#layers-one-way-only.
"""

from __future__ import annotations

from dataclasses import dataclass

from tensorfleet import contract, vllm_defaults
from tensorfleet.kube.connection import Connection
from tensorfleet.router.backends import BreakerPolicy


@dataclass
class ClientConfig:
    """What bounds the clients of the router and of the gateway, and their API keys and limits (admission.py)."""

    header_timeout: float = 10.0
    body_timeout: float = 30.0
    idle_timeout: float = 75.0
    max_body_bytes: int = 16 * 1024 * 1024
    max_body_bytes_in_flight: int = 64 * 1024 * 1024
    max_json_depth: int = 64
    max_json_values: int = 250_000
    # Shutdown.
    drain_delay: float = 5.0
    shutdown_grace: float = 60.0
    # API keys (router/tenants.py): a directory of one file per tenant, or a file of tenant:key lines.
    api_keys: str | None = None
    api_keys_reload_interval: float = 5.0
    requests_per_minute: int | None = None  # per tenant; None: no limit
    tokens_per_minute: int | None = None
    default_max_tokens: int = 1024  # charged at admission for a generation without max_tokens


@dataclass
class RouterConfig(ClientConfig):
    strategy: str = contract.DEFAULT_ROUTER_STRATEGY
    model: str | None = None
    max_concurrency_per_backend: int = 256
    # Up to this many per engine while the engine reports room (dispatch.py); 0: the ceiling above, no burst.
    burst_concurrency_per_backend: int = 0
    max_queue: int = 0
    queue_timeout: float = 30.0
    # The engines' chunked-prefill budget per step (vLLM's --max-num-batched-tokens): cache-aware sends an engine
    # at most this much prompt at a time (dispatch.py), counted at CHARS_PER_TOKEN; 0: no bound.
    prompt_queue_tokens: int = vllm_defaults.MAX_NUM_BATCHED_TOKENS
    retries: int = 2
    health_interval: float = 2.0
    health_timeout: float = 2.0
    connect_timeout: float = 3.0
    # An attempt's first byte: base + prompt tokens / prefill rate (+ max_tokens / decode rate unstreamed).
    first_byte_timeout: float = 30.0
    prefill_tokens_per_second: float = 1000.0
    decode_tokens_per_second: float = 5.0
    stream_idle_timeout: float = 30.0
    stream_resumptions: int = 2  # times one broken stream may be continued on another engine (router/resume.py)
    backend_header: bool = False  # name the engine that answered (its URL) in contract.BACKEND_HEADER
    static_backends: tuple[str, ...] = ()
    service: str | None = None
    namespace: str | None = None
    kube: Connection | None = None  # the API server that lists `service`'s EndpointSlices
    # Scale from zero (router/demand.py): the Lease this router renews on demand, and how long a request that
    # found no engine at all may wait for the fleet to wake before 503.
    demand_lease: str | None = None
    cold_start_timeout: float = 600.0
    breaker: BreakerPolicy | None = None
    # Prefill/decode disaggregation (router/prefill.py): the prefill engines, static or a Service's; their
    # per-engine ceiling (0: max_concurrency_per_backend).
    prefill_backends: tuple[str, ...] = ()
    prefill_service: str | None = None
    prefill_max_concurrency_per_backend: int = 0
    # The other router replicas (router/peers.py): static base URLs, and/or the router's own Service, whose ready
    # endpoints less this pod's address (own_address) are the peers.
    peers: tuple[str, ...] = ()
    peer_service: str | None = None
    own_address: str | None = None
    # Subscribe to every engine's KV events (vLLM engines publish them; router/kvfleet.py).
    kv_events: bool = False
    # Engines whose KV events are not on their address's contract ports (several engines on one host): engine URL
    # -> (publisher endpoint, replay endpoint).
    kv_event_endpoints: tuple[tuple[str, str, str], ...] = ()
