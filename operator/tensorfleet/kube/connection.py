"""Where the API server is and how to authenticate, from the `kubernetes` package's loaders: the in-cluster service
account (its token re-read as it rotates), else the kubeconfig, as kubectl does; kopf's login handler gets the
same Connection, so every request presents one identity. Design: docs/architecture.md#the-kubernetes-layer.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


def in_cluster_namespace() -> str | None:
    """The namespace of this pod's service account, or None outside a cluster."""
    try:
        return (SERVICE_ACCOUNT_DIR / "namespace").read_text().strip() or None
    except OSError:
        return None


def bearer_token(cfg: Any) -> str | None:
    """The bearer token a `kubernetes.client.Configuration` would send, without its scheme.

    The key's name differs across client versions, its header does not; and
    the scheme's case differs by loader (the in-cluster one writes `bearer `).
    """
    header = next((auth["value"] for auth in cfg.auth_settings().values()
                   if isinstance(auth, dict) and auth.get("in") == "header"
                   and auth.get("key", "").lower() == "authorization"), None)
    if not header:
        return None
    scheme, _, token = str(header).strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise NoConfiguration(f"the Kubernetes configuration's Authorization is not a bearer token ({scheme!r})")
    return token.strip()


class NoConfiguration(Exception):
    """Neither an in-cluster service account nor a kubeconfig was found."""


@dataclass
class Connection:
    """An API server address and the credentials for it."""

    server: str
    token: str | None = None
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    insecure: bool = False
    # Refreshes `token` (exec plugins, rotated in-cluster tokens); from the kubernetes client.
    refresh: Any = field(default=None, repr=False)

    @classmethod
    def for_url(cls, url: str) -> Connection:
        """A plain address with no credentials: `kubectl proxy`, or a test API server."""
        return cls(server=url.rstrip("/"))

    @classmethod
    def from_environment(cls, context: str | None = None) -> Connection:
        """In-cluster service account, else the kubeconfig (KUBECONFIG or ~/.kube/config)."""
        from kubernetes import client, config

        cfg = client.Configuration()
        try:
            config.load_incluster_config(client_configuration=cfg)
        except config.ConfigException:
            try:
                config.load_kube_config(context=context, client_configuration=cfg)
            except (config.ConfigException, OSError) as exc:
                raise NoConfiguration(
                    f"no Kubernetes configuration: not in a cluster and no usable kubeconfig ({exc})") from exc
        connection = cls(
            server=cfg.host.rstrip("/"),
            ca_file=cfg.ssl_ca_cert,
            cert_file=cfg.cert_file,
            key_file=cfg.key_file,
            insecure=not cfg.verify_ssl,
        )

        def refresh() -> None:
            if cfg.refresh_api_key_hook is not None:
                cfg.refresh_api_key_hook(cfg)
            connection.token = bearer_token(cfg)

        refresh()
        connection.refresh = refresh
        return connection

    def ssl_context(self) -> ssl.SSLContext | bool:
        """What aiohttp's connector takes: False for plain HTTP or when verification is off."""
        if not self.server.startswith("https"):
            return False
        if self.insecure:
            return False
        context = ssl.create_default_context(cafile=self.ca_file)
        if self.cert_file:
            context.load_cert_chain(self.cert_file, self.key_file)
        return context
