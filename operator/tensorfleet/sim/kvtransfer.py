"""KV-cache transfer between simulated engines: prefill/decode disaggregation as vLLM's NixlConnector does it, the
prefill half holding the prompt's blocks under a handle until the decode half reads them over a side channel (here a
small HTTP server), the read timed on the simulated clock over `--kv-transfer-gbps`. Design:
docs/simulator.md#prefilldecode-disaggregation."""

from __future__ import annotations

import json
import logging
import os
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("tensorfleet.sim")

# vLLM's names (vllm/envs.py): where a prefill engine's side channel listens, as the decode engine reaches it.
SIDE_CHANNEL_HOST_ENV = "VLLM_NIXL_SIDE_CHANNEL_HOST"
SIDE_CHANNEL_PORT_ENV = "VLLM_NIXL_SIDE_CHANNEL_PORT"
DEFAULT_SIDE_CHANNEL_PORT = 5600
HOLD_SECONDS_ENV = "VLLM_NIXL_ABORT_REQUEST_TIMEOUT"
DEFAULT_HOLD_SECONDS = 480.0
READ_PATH = "/kv/read"
# The connector whose protocol the simulator speaks, and the roles vLLM's KVTransferConfig takes.
CONNECTOR = "NixlConnector"
ROLES = ("kv_both", "kv_producer", "kv_consumer")
# A link's speed when none is given: 100 Gb/s per GPU, a conservative RDMA NIC (H100 nodes often have 400).
DEFAULT_LINK_GBPS = 100.0


class TransferConfigError(ValueError):
    """--kv-transfer-config the simulator cannot run with; the message names the field."""


@dataclass(frozen=True)
class TransferConfig:
    """What `--kv-transfer-config` (vLLM's flag, JSON) and the side-channel environment say."""

    connector: str
    role: str
    side_channel_host: str
    side_channel_port: int
    link_bytes_per_s: float
    hold_seconds: float = DEFAULT_HOLD_SECONDS
    engine_id: str = field(default_factory=lambda: str(uuid.uuid4()))

    @property
    def produces(self) -> bool:
        return self.role in ("kv_both", "kv_producer")

    @property
    def consumes(self) -> bool:
        return self.role in ("kv_both", "kv_consumer")


def parse_config(text: str, *, listen_host: str, link_gbps: float = DEFAULT_LINK_GBPS,
                 environ: Mapping[str, str] = os.environ) -> TransferConfig:
    """TEXT: vLLM's --kv-transfer-config JSON. LISTEN_HOST: the server's --host, advertised as the side channel's
    host when the environment names none and it is a real address."""
    try:
        raw = json.loads(text)
    except ValueError as exc:
        raise TransferConfigError(f"--kv-transfer-config is not JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise TransferConfigError("--kv-transfer-config must be a JSON object")
    connector = raw.get("kv_connector")
    if connector != CONNECTOR:
        raise TransferConfigError(f"--kv-transfer-config: kv_connector {connector!r} is not simulated; the simulator "
                                  f"speaks {CONNECTOR}'s protocol")
    role = raw.get("kv_role", "kv_both")
    if role not in ROLES:
        raise TransferConfigError(f"--kv-transfer-config: kv_role {role!r} is not one of {', '.join(ROLES)}")
    if link_gbps <= 0:
        raise TransferConfigError("--kv-transfer-gbps must be positive")
    host = environ.get(SIDE_CHANNEL_HOST_ENV) or (listen_host if listen_host not in ("", "0.0.0.0", "::")
                                                  else "localhost")
    port_text = environ.get(SIDE_CHANNEL_PORT_ENV) or str(DEFAULT_SIDE_CHANNEL_PORT)
    hold_text = environ.get(HOLD_SECONDS_ENV) or str(DEFAULT_HOLD_SECONDS)
    try:
        port = int(port_text)
        hold = float(hold_text)
    except ValueError:
        raise TransferConfigError(f"{SIDE_CHANNEL_PORT_ENV}={port_text!r} / {HOLD_SECONDS_ENV}={hold_text!r}: "
                                  "not numbers") from None
    if not 0 < port < 65536 or hold <= 0:
        raise TransferConfigError(f"{SIDE_CHANNEL_PORT_ENV} must be a port and {HOLD_SECONDS_ENV} positive")
    return TransferConfig(connector=connector, role=role, side_channel_host=host, side_channel_port=port,
                          link_bytes_per_s=link_gbps * 1e9 / 8, hold_seconds=hold)


@dataclass(frozen=True)
class RemoteKV:
    """Where a decode half's KV is: what the prefill engine answered in `kv_transfer_params`."""

    engine_id: str
    block_ids: tuple[int, ...]
    host: str
    port: int

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> RemoteKV | None:
        """The remote KV that PARAMS name, or None when they name none whole (the decode engine then computes the
        prompt itself, as vLLM does)."""
        engine, blocks = params.get("remote_engine_id"), params.get("remote_block_ids")
        host, port = params.get("remote_host"), params.get("remote_port")
        if (not isinstance(engine, str) or not isinstance(host, str) or not isinstance(port, int)
                or isinstance(port, bool) or not isinstance(blocks, list) or not blocks
                or not all(isinstance(b, int) and not isinstance(b, bool) for b in blocks)):
            return None
        return cls(engine, tuple(blocks), host, port)


def wants_remote_decode(params: Any) -> bool:
    """The prefill half: the proxy asks this engine to compute the prompt and hold its KV for another."""
    return isinstance(params, Mapping) and params.get("do_remote_decode") is True


def wants_remote_prefill(params: Any) -> bool:
    """The decode half: the KV of the prompt was computed on another engine."""
    return isinstance(params, Mapping) and params.get("do_remote_prefill") is True
