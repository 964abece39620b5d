"""OpenAI-compatible HTTP pieces shared by the router and the engine simulator.

Error bodies follow OpenAI's shape, which vLLM also uses:
`{"error": {"message", "type", "param", "code"}}`. Clients (the openai SDK,
LangChain, curl users) parse that shape; a plain-text 500 breaks them.

Imported only by the long-running commands, so aiohttp is a top-level import
here; `tensorfleet plan` never loads this module.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from aiohttp import web

log = logging.getLogger("tensorfleet")

# The `type` OpenAI and vLLM put in the error body for each status.
ERROR_TYPES: Mapping[int, str] = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "BadRequestError",
    413: "BadRequestError",
    422: "BadRequestError",
    429: "RateLimitError",
    500: "InternalServerError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}

SSE_CONTENT_TYPE = "text/event-stream"
SSE_DONE = b"data: [DONE]\n\n"


def error_body(status: int, message: str, *, type_: str | None = None, param: str | None = None,
               code: str | int | None = None) -> dict[str, Any]:
    return {"error": {
        "message": message,
        "type": type_ or ERROR_TYPES.get(status, "APIError"),
        "param": param,
        "code": status if code is None else code,
    }}


def error_response(status: int, message: str, *, type_: str | None = None, param: str | None = None,
                   code: str | int | None = None, headers: Mapping[str, str] | None = None) -> web.Response:
    return web.Response(
        status=status,
        body=json.dumps(error_body(status, message, type_=type_, param=param, code=code)).encode(),
        content_type="application/json",
        headers=headers,
    )


def sse_event(payload: Mapping[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def install_fast_loop() -> bool:
    """Use uvloop when the `fast` extra is installed; returns whether it is."""
    try:
        import uvloop
    except ImportError:
        return False
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return True


async def start_site(app: web.Application, host: str, port: int) -> web.AppRunner:
    """Serve `app`; the caller owns the runner (`await runner.cleanup()`).

    handler_cancellation: a client that hangs up cancels its handler, which is
    how a disconnect reaches the engine and frees its GPU time (and how the
    router's counters go back down). aiohttp leaves it off by default.
    """
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=5.0)
    await runner.setup()
    # reuse_address: a restarted process can bind at once despite TIME_WAIT.
    site = web.TCPSite(runner, host, port, backlog=2048, reuse_address=True)
    await site.start()
    return runner


def run_server(make_app: Callable[[], Awaitable[web.Application]], host: str, port: int,
               describe: str) -> int:
    """Run an app until SIGTERM/SIGINT (what Kubernetes sends), then drain."""
    fast = install_fast_loop()

    async def main() -> None:
        app = await make_app()
        runner = await start_site(app, host, port)
        log.info("%s listening on %s:%d (event loop: %s)", describe, host, port, "uvloop" if fast else "asyncio")
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        log.info("%s shutting down", describe)
        await runner.cleanup()

    asyncio.run(main())
    return 0


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
