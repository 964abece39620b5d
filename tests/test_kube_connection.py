"""Connection.from_environment: credentials from the kubernetes package's own loaders, sent as one bearer header.

The in-cluster loader is pointed at a service-account directory written here
(its module-level paths), the kubeconfig loader at a file; what the API
server would receive is read back from a loopback server.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import yaml
from aiohttp import web
from kubernetes.config import incluster_config, kube_config

from tensorfleet.kube.client import Kube
from tensorfleet.kube.connection import Connection, NoConfiguration, bearer_token
from tensorfleet.kube.resources import INFERENCE_SERVICE

TOKEN = "eyJhbGciOiJSUzI1NiJ9.eyJzdWIiOiJzeXN0ZW06c2VydmljZWFjY291bnQ6ZGVtbzpyb3V0ZXIifQ.c2lnbmF0dXJl"


@pytest.fixture
def service_account(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "serviceaccount"
    folder.mkdir()
    (folder / "token").write_text(TOKEN + "\n")
    (folder / "ca.crt").write_text("not read until a TLS connection is made\n")
    (folder / "namespace").write_text("demo")
    monkeypatch.setattr(incluster_config, "SERVICE_TOKEN_FILENAME", str(folder / "token"))
    monkeypatch.setattr(incluster_config, "SERVICE_CERT_FILENAME", str(folder / "ca.crt"))
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    return folder


def test_the_in_cluster_token_is_sent_once_with_its_scheme(service_account: Path) -> None:
    # The in-cluster loader writes "bearer <token>" (lower case); the header must not become "Bearer bearer ...".
    connection = Connection.from_environment()
    assert connection.server == "https://10.96.0.1:443"
    assert connection.token == TOKEN
    assert connection.ca_file == str(service_account / "ca.crt")


def test_a_kubeconfig_token_is_sent_as_is(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "k", "cluster": {"server": "https://127.0.0.1:6443", "insecure-skip-tls-verify": True}}],
        "users": [{"name": "u", "user": {"token": TOKEN}}],
        "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}]}))
    # The loader reads KUBECONFIG when the kubernetes package is imported.
    monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(path))
    connection = Connection.from_environment()
    assert (connection.server, connection.token, connection.insecure) == ("https://127.0.0.1:6443", TOKEN, True)


def test_an_authorization_that_is_not_a_bearer_token_is_refused_by_name() -> None:
    class Basic:
        def auth_settings(self) -> dict[str, object]:
            return {"BasicAuth": {"in": "header", "key": "authorization", "value": "Basic dXNlcjpwYXNz"}}

    with pytest.raises(NoConfiguration, match="not a bearer token"):
        bearer_token(Basic())


@pytest.mark.asyncio
async def test_the_api_server_receives_one_bearer_header(service_account: Path) -> None:
    seen: list[str | None] = []

    async def answer(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Authorization"))
        return web.json_response({"kind": "InferenceService", "metadata": {"name": "demo"}})

    app = web.Application()
    app.router.add_get("/{tail:.*}", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        connection = Connection.from_environment()
        connection.server = f"http://127.0.0.1:{port}"
        async with Kube(connection, timeout=5) as kube:
            await asyncio.wait_for(kube.get(INFERENCE_SERVICE, "demo", "demo"), 5)
    finally:
        await runner.cleanup()
    assert seen == [f"Bearer {TOKEN}"]
