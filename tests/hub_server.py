"""A Hugging Face Hub stand-in on 127.0.0.1 serving tests/data/models, for huggingface_hub's real code path.

It answers what `hf_hub_download` and `get_hf_file_metadata` ask of the Hub:
`HEAD` and `GET {endpoint}/{repo_id}/resolve/{revision}/{filename}`, with the
`X-Repo-Commit` (the commit the revision resolves to), `ETag` and
`Content-Length` headers they require, and their error answers: an unknown
repository `401` + `X-Error-Code: RepoNotFound`, a gated one without the right
`Authorization: Bearer` token `403` + `GatedRepo`, an unknown revision `404` +
`RevisionNotFound`, a missing file `404` + `EntryNotFound`. Each repository has
one commit, `main`, whose hash is derived from the repository id. Every request
is recorded (method, path, Authorization header) for tests to assert on.
`fail_with` makes it answer every request with that status (a Hub that is
down), `delay_seconds` makes it answer that late (one that hangs).
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote

MODELS = Path(__file__).resolve().parent / "data" / "models"


def commit_of(repo_id: str) -> str:
    return hashlib.sha1(repo_id.encode()).hexdigest()


@dataclass
class FakeHub:
    root: Path = MODELS
    gated: dict[str, str] = field(default_factory=dict)     # repo id -> the token that opens it
    requests: list[tuple[str, str, str | None]] = field(default_factory=list)
    fail_with: int | None = None                            # answer every request with this status
    delay_seconds: float = 0.0                              # answer every request this late
    url: str = ""

    def repos(self) -> list[str]:
        return sorted(str(p.parent.relative_to(self.root)) for p in self.root.glob("*/*/config.json"))

    def answer(self, method: str, path: str, authorization: str | None) -> tuple[int, dict[str, str], bytes]:
        self.requests.append((method, path, authorization))
        if self.delay_seconds:
            time.sleep(self.delay_seconds)
        if self.fail_with is not None:
            return self.fail_with, {}, b""
        parts = unquote(path.split("?", 1)[0]).strip("/").split("/")
        if len(parts) < 5 or parts[2] != "resolve":
            return 404, {}, b"not found"
        repo_id, revision, filename = "/".join(parts[:2]), parts[3], "/".join(parts[4:])
        folder = self.root / repo_id
        if not (folder / "config.json").is_file() or ".." in parts:
            return 401, {"X-Error-Code": "RepoNotFound", "X-Error-Message": "Repository not found"}, b""
        if repo_id in self.gated and authorization != f"Bearer {self.gated[repo_id]}":
            return 403, {"X-Error-Code": "GatedRepo", "X-Error-Message": "Access to this model is restricted"}, b""
        commit = commit_of(repo_id)
        if revision not in ("main", commit):
            return 404, {"X-Error-Code": "RevisionNotFound", "X-Error-Message": "Invalid rev id"}, b""
        file = folder / filename
        if not file.is_file():
            return 404, {"X-Error-Code": "EntryNotFound", "X-Error-Message": "Entry not found",
                         "X-Repo-Commit": commit}, b""
        body = file.read_bytes()
        etag = hashlib.sha1(b"blob %d\0" % len(body) + body).hexdigest()   # git's blob id, as the Hub sends
        return 200, {"X-Repo-Commit": commit, "ETag": f'"{etag}"', "Content-Type": "application/json"}, body


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _serve(self, with_body: bool) -> None:
            status, headers, body = hub.answer(self.command, self.path, self.headers.get("Authorization"))
            self.send_response(status)
            for name, value in headers.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if with_body:
                self.wfile.write(body)

        def do_HEAD(self) -> None:
            self._serve(with_body=False)

        def do_GET(self) -> None:
            self._serve(with_body=True)

        def log_message(self, format: str, *args: object) -> None:
            pass

    return Handler


@contextmanager
def fake_hub(**options: object) -> Iterator[FakeHub]:
    """A FakeHub serving on a free 127.0.0.1 port; `hub.url` is the HF_ENDPOINT to give."""
    hub = FakeHub(**options)  # type: ignore[arg-type]
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(hub))
    hub.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    try:
        yield hub
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
