"""The gateway's settings: its clients' side is the router's (ClientConfig: limits, API keys, shutdown), the rest says
where the InferenceServices are and how long to wait for their routers. Made from gateway/cli.py's flags or by
tests. Design: docs/gateway.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from tensorfleet.kube.connection import Connection
from tensorfleet.router.config import ClientConfig


@dataclass
class GatewayConfig(ClientConfig):
    namespaces: tuple[str, ...] = ()  # the InferenceServices' namespaces; () for all
    kube: Connection | None = None    # None: the table is filled by the caller (tests)
    # A request whose InferenceService has no ready router yet waits this long for one (the router then waits
    # for the engines itself: a fleet at zero wakes), and the first list of InferenceServices as long.
    cold_start_timeout: float = 600.0
    connect_timeout: float = 3.0
    # A router's first byte: its own queue and cold-start waits come first, so longer than its bounds.
    first_byte_timeout: float = 900.0
    # A stream quiet this long is ended with an error event (the router resumes a stalled engine's streams
    # itself, after its own --stream-idle-timeout).
    stream_idle_timeout: float = 120.0
    backend_header: bool = False  # name the InferenceService that answered (namespace/name) in contract.BACKEND_HEADER
