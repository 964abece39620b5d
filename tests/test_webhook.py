"""The admission webhook's bounds: what a caller inside the cluster can push at it.

Its port is open to the cluster (the API server cannot be selected by a
NetworkPolicy), and before these bounds a 1 MiB gzip bomb took the operator
from 69 to 544 MiB, and JSON nested 100,000 deep answered 500 with a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import logging
from collections.abc import AsyncIterator

import aiohttp
import pytest
from conftest import sim_doc

from tensorfleet.controller import webhook
from tensorfleet.controller.webhook import WebhookConfig
from tensorfleet.testing.loopback import free_port
from tensorfleet.testing.operator_harness import cluster, running_operator

pytestmark = pytest.mark.asyncio


@contextlib.asynccontextmanager
async def serving() -> AsyncIterator[str]:
    """A running operator with its webhook on plain HTTP; yields the webhook's URL."""
    port = free_port()
    async with cluster() as c, running_operator(c, webhook=WebhookConfig(addr="127.0.0.1", port=port, insecure=True)):
        for _ in range(200):
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.close()
                break
            except OSError:
                await asyncio.sleep(0.05)
        yield f"http://127.0.0.1:{port}{webhook.WEBHOOK_PATH}"


async def _post(url: str, data: bytes, **headers: str) -> tuple[int, str]:
    async with aiohttp.ClientSession() as session, session.post(
            url, data=data, headers={"Content-Type": "application/json", **headers}) as response:
        return response.status, await response.text()


def _review_bytes() -> bytes:
    import json

    return json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                       "request": {"uid": "u1", "operation": "CREATE", "namespace": "default",
                                   "object": sim_doc()}}).encode()


async def test_a_gzip_bomb_is_refused_unread() -> None:
    async with serving() as url:
        bomb = gzip.compress(b"[" * (64 * 1024 * 1024), compresslevel=9)  # 64 MiB of nesting in ~64 KiB
        status, body = await _post(url, bomb, **{"Content-Encoding": "gzip"})
        assert status == 415 and "compressed" in body
        status, body = await _post(url, _review_bytes())  # still serving
        assert status == 200 and '"allowed": true' in body.replace('":true', '": true')


async def test_an_oversized_body_is_refused() -> None:
    async with serving() as url:
        status, body = await _post(url, b" " * (webhook.MAX_BODY_BYTES + 1))
        assert status == 413, body


async def test_deep_json_is_a_400_without_a_traceback(caplog: pytest.LogCaptureFixture) -> None:
    async with serving() as url:
        caplog.set_level(logging.DEBUG)
        status, body = await _post(url, b"[" * 100_000 + b"]" * 100_000)
        assert status == 400 and "AdmissionReview" in body
        assert "Traceback" not in caplog.text and "RecursionError" not in caplog.text


async def test_a_body_arriving_in_many_chunks_is_read_whole() -> None:
    """A real AdmissionReview of a large object reaches the server in several TCP segments."""
    import json

    review = json.loads(_review_bytes())
    review["request"]["object"]["metadata"]["annotations"] = {"note": "x" * 300_000}
    data = json.dumps(review).encode()

    async def chunks() -> AsyncIterator[bytes]:
        for start in range(0, len(data), 16_384):
            yield data[start:start + 16_384]
            await asyncio.sleep(0)

    async with serving() as url, aiohttp.ClientSession() as session, session.post(
            url, data=chunks(), headers={"Content-Type": "application/json"}) as response:
        assert response.status == 200, await response.text()
        assert (await response.json())["response"]["allowed"] is True
