#!/usr/bin/env python3
"""The e2e cluster's Git server: git's own smart-HTTP server (`git http-backend`, fetch and push) behind
Python's http.server, so Flux's source-controller clones over HTTP what tests and people push.

    python3 e2e/gitserver.py --root DIR --host 127.0.0.1 --port N

Every bare repository under DIR is served at http://HOST:N/NAME.git (GIT_HTTP_EXPORT_ALL); pushes are taken
anonymously where the repository allows them (`http.receivepack true`, which e2e/gitops.py sets on the one
it makes). A request body may come chunked (git sends large pushes so) or gzip-encoded (git http-backend
inflates it). Loopback only; e2e/gitops.py has the long form. Only the Python standard library.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

BACKEND_TIMEOUT_S = 300
MAX_BODY = 256 << 20  # a push of the e2e repository is a few KiB; this bounds a broken client


def backend() -> str:
    """git's http-backend program (in `git --exec-path`)."""
    done = subprocess.run(["git", "--exec-path"], capture_output=True, text=True, check=True)
    found = Path(done.stdout.strip()) / "git-http-backend"
    if not found.is_file():
        raise RuntimeError(f"{found} is missing: install git with its http-backend")
    return str(found)


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    root: Path
    program: str

    def do_GET(self) -> None:
        self._serve()

    def do_POST(self) -> None:
        self._serve()

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks: list[bytes] = []
            size = 0
            while True:
                length = int(self.rfile.readline().split(b";", 1)[0].strip() or b"0", 16)
                if length == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):  # trailers
                        pass
                    return b"".join(chunks)
                size += length
                if size > MAX_BODY:
                    raise ValueError("request body too large")
                chunks.append(self.rfile.read(length))
                self.rfile.readline()
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY:
            raise ValueError("request body too large")
        return self.rfile.read(length) if length else b""

    def _serve(self) -> None:
        url = urlsplit(self.path)
        try:
            body = self._body()
        except ValueError as exc:
            self.send_error(400, str(exc))
            return
        env = {
            "PATH": "/usr/bin:/bin", "GIT_PROJECT_ROOT": str(self.root), "GIT_HTTP_EXPORT_ALL": "1",
            "GATEWAY_INTERFACE": "CGI/1.1", "SERVER_PROTOCOL": "HTTP/1.1", "REQUEST_METHOD": self.command,
            "PATH_INFO": url.path, "QUERY_STRING": url.query, "REMOTE_ADDR": self.client_address[0],
            "CONTENT_TYPE": self.headers.get("Content-Type", ""), "CONTENT_LENGTH": str(len(body)),
        }
        for name, value in self.headers.items():
            if name.lower() not in ("content-type", "content-length", "transfer-encoding"):
                env["HTTP_" + name.upper().replace("-", "_")] = value
        if "Git-Protocol" in self.headers:  # protocol v2, as git's own http-backend setup passes it
            env["GIT_PROTOCOL"] = self.headers["Git-Protocol"]
        try:
            done = subprocess.run([self.program], input=body, capture_output=True, env=env,
                                  timeout=BACKEND_TIMEOUT_S, check=False)
        except subprocess.TimeoutExpired:
            self.send_error(504, "git http-backend timed out")
            return
        ends = [(done.stdout.find(sep), sep) for sep in (b"\r\n\r\n", b"\n\n") if sep in done.stdout]
        at, sep = min(ends) if ends else (len(done.stdout), b"")
        head, payload = done.stdout[:at], done.stdout[at + len(sep):]
        status, headers = 200, []
        for line in head.decode("latin-1").splitlines():
            name, _, value = line.partition(":")
            if name.lower() == "status":
                status = int(value.split()[0])
            elif name:
                headers.append((name, value.strip()))
        if done.returncode != 0 and not done.stdout:
            status, payload = 500, done.stderr[-2000:]
            headers = [("Content-Type", "text/plain")]
        self.send_response(status)
        for name, value in headers:
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, format: str, *args: object) -> None:
        sys.stderr.write(f"gitserver: {self.address_string()} {format % args}\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, required=True, help="the folder of the bare repositories")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    if shutil.which("git") is None:
        sys.stderr.write("gitserver: git is not installed\n")
        return 1
    Handler.root, Handler.program = args.root.resolve(), backend()
    server = ThreadingHTTPServer((args.host, args.port), Handler)
    sys.stderr.write(f"gitserver: serving {Handler.root} at http://{args.host}:{args.port}/\n")
    sys.stderr.flush()
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
