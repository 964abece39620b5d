"""The e2e pod runner's Kubernetes client: just enough of one on the standard library (`Api`: JSON calls and
watches with the kubeconfig's credentials), and the errors the runner tells apart (`ApiError`; `Gone`, a watch's
resourceVersion too old to resume from). Part of the pod runner, e2e/podrunner.py; what it lists, watches and writes:
e2e/README.md#real-processes-for-control-plane-pods.
"""

from __future__ import annotations

import base64
import http.client
import json
import ssl
import subprocess
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any


class ApiError(Exception):
    def __init__(self, status: int, message: str, reason: str = "") -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status, self.reason = status, reason


class Gone(Exception):
    """The watch's resourceVersion is too old: list again."""


class Api:
    """Just enough of a Kubernetes client: JSON calls and watches, with the kubeconfig's credentials."""

    def __init__(self, kubeconfig: Path, kubectl: str, workdir: Path) -> None:
        done = subprocess.run([kubectl, f"--kubeconfig={kubeconfig}", "config", "view", "--raw", "--minify",
                               "-o", "json"], capture_output=True, text=True, check=True, timeout=30)
        config = json.loads(done.stdout)
        cluster, user = config["clusters"][0]["cluster"], config["users"][0]["user"]
        url = urllib.parse.urlsplit(cluster["server"])
        if url.scheme != "https" or url.hostname is None:
            raise RuntimeError(f"the pod runner needs an https API server, not {cluster['server']}")
        self.host, self.port = url.hostname, url.port or 443
        workdir.mkdir(parents=True, exist_ok=True)

        def material(data_key: str, file_key: str, source: dict[str, Any], name: str) -> str | None:
            if source.get(data_key):
                target = workdir / name
                target.write_bytes(base64.b64decode(source[data_key]))
                target.chmod(0o600)
                return str(target)
            return source.get(file_key)

        ca = material("certificate-authority-data", "certificate-authority", cluster, "ca.crt")
        self.context = ssl.create_default_context(cafile=ca)
        cert = material("client-certificate-data", "client-certificate", user, "client.crt")
        key = material("client-key-data", "client-key", user, "client.key")
        if cert:
            self.context.load_cert_chain(cert, key)
        self.token = user.get("token")

    def _connection(self, timeout: float) -> http.client.HTTPSConnection:
        return http.client.HTTPSConnection(self.host, self.port, context=self.context, timeout=timeout)

    def _headers(self, content_type: str | None) -> dict[str, str]:
        headers = {"Accept": "application/json", "User-Agent": "tensorfleet-e2e-podrunner"}
        if content_type:
            headers["Content-Type"] = content_type
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        return headers

    def call(self, method: str, path: str, body: Any = None, content_type: str = "application/json",
             timeout: float = 30.0) -> Any:
        connection = self._connection(timeout)
        try:
            payload = json.dumps(body).encode() if body is not None else None
            connection.request(method, path, body=payload, headers=self._headers(content_type if payload else None))
            answer = connection.getresponse()
            data = answer.read()
        finally:
            connection.close()
        if answer.status >= 400:
            try:
                status = json.loads(data)
                raise ApiError(answer.status, status.get("message", ""), status.get("reason", ""))
            except ValueError:
                raise ApiError(answer.status, data[:200].decode(errors="replace")) from None
        return json.loads(data) if data else None

    def watch(self, path: str, timeout: float) -> Iterator[dict[str, Any]]:
        connection = self._connection(timeout)
        try:
            connection.request("GET", path, headers=self._headers(None))
            answer = connection.getresponse()
            if answer.status >= 400:
                raise ApiError(answer.status, answer.read()[:200].decode(errors="replace"))
            while True:
                line = answer.readline()
                if not line:
                    return
                if line.strip():
                    yield json.loads(line)
        finally:
            connection.close()
