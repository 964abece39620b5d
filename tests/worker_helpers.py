"""Helpers for the worker launcher tests: real pod envs from rendered specs,
fake `ray` / `vllm` executables, and running `tensorfleet-worker`."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import textwrap
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import yaml

from tensorfleet import contract
from tensorfleet.api import load_inference_service
from tensorfleet.planner import make_plan
from tensorfleet.render import render
from tensorfleet.testing.wait import poll

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
WORKER = str(Path(sys.executable).with_name("tensorfleet-worker"))
SECRET_VALUE = "hf_this_is_a_secret_token_value"
_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)|\$\$")


def example_docs() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for path in EXAMPLES:
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                out.append((path.stem, doc))
    return out


def rendered_engine_containers(doc: dict[str, Any]) -> list[tuple[int, dict[str, Any], dict[str, Any]]]:
    """(stage, container, statefulset) of every engine StatefulSet the document renders to."""
    isvc = load_inference_service(doc)
    objects = render(isvc, make_plan(isvc.spec))
    out = []
    for obj in objects:
        if obj["kind"] != "StatefulSet":
            continue
        labels = obj["metadata"]["labels"]
        # A prefill pool's StatefulSets (spec.prefill) number their stages apart from the decode pool's.
        stage = int(labels.get(contract.LABEL_STAGE, labels.get(contract.LABEL_PREFILL_STAGE, -1)))
        out.append((stage, obj["spec"]["template"]["spec"]["containers"][0], obj))
    return sorted(out, key=lambda item: item[0])


POD_IP = "10.244.1.7"  # what the kubelet fills in for status.podIP


def kubelet_env(container: dict[str, Any], *, namespace: str, pod_name: str, pod_index: int | None,
                secrets: dict[tuple[str, str], str] | None = None) -> dict[str, str]:
    """The env the kubelet would give the container: field refs, secret refs and $(VAR) expansion."""
    secrets = secrets or {}
    env: dict[str, str] = {}
    for item in container.get("env", []):
        name = item["name"]
        if "value" in item:
            def sub(match: re.Match[str]) -> str:
                if match.group(0) == "$$":
                    return "$"
                ref = match.group(1)
                return env[ref] if ref in env else match.group(0)
            env[name] = _REF.sub(sub, item["value"])
            continue
        source = item["valueFrom"]
        if "fieldRef" in source:
            path = source["fieldRef"]["fieldPath"]
            if path == "metadata.namespace":
                env[name] = namespace
            elif path == "metadata.name":
                env[name] = pod_name
            elif path == f"metadata.labels['{contract.LABEL_POD_INDEX}']":
                env[name] = "" if pod_index is None else str(pod_index)
            elif path == "status.podIP":
                env[name] = POD_IP
            else:
                raise AssertionError(f"unexpected fieldRef {path}")
        elif "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            env[name] = secrets.get((ref["name"], ref["key"]), SECRET_VALUE)
        else:
            raise AssertionError(f"unexpected valueFrom {source}")
    return env


def pod_env(doc: dict[str, Any], stage: int, group: int = 0) -> dict[str, str]:
    name = doc["metadata"]["name"]
    namespace = doc["metadata"].get("namespace", "default")
    for k, container, _ in rendered_engine_containers(doc):
        if k == stage:
            return kubelet_env(container, namespace=namespace, pod_name=f"{contract.stage_name(name, stage)}-{group}",
                               pod_index=group)
    raise AssertionError(f"no stage {stage}")


def base_env(extra: dict[str, str] | None = None, path_first: Path | None = None) -> dict[str, str]:
    """A clean process env for the launcher: PATH (fakes first), HOME, plus extra."""
    # The venv's console scripts (tensorfleet, tensorfleet-worker) are on PATH, as in the image.
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '/usr/bin:/bin')}"
    if path_first is not None:
        path = f"{path_first}{os.pathsep}{path}"
    env = {"PATH": path, "HOME": os.environ.get("HOME", "/tmp"), "LANG": "C.UTF-8"}
    env.update(extra or {})
    return env


def run_worker(args: list[str], env: dict[str, str], timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run([WORKER, *args], env=env, capture_output=True, text=True, timeout=timeout, check=False)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_get(url: str) -> tuple[int, str]:
    """(status, body) of a GET, an HTTP error's included."""
    try:
        with urllib.request.urlopen(url, timeout=5) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def wait_until(predicate: Any, timeout: float = 20.0, interval: float = 0.05) -> bool:
    """Whether PREDICATE came true within TIMEOUT (for `assert wait_until(...), what_went_wrong`)."""
    return poll(predicate, timeout, interval)[0]


# --- fake executables -------------------------------------------------------

FAKE_RAY = r'''
import json, os, signal, sys, time

log = os.environ["FAKE_LOG"]
state_dir = os.environ["FAKE_DIR"]

def record(**entry):
    with open(log, "a") as fh:
        fh.write(json.dumps({"cmd": "ray", "argv": sys.argv[1:], "pid": os.getpid(), **entry}) + "\n")

def bump(name):
    path = os.path.join(state_dir, name)
    count = int(open(path).read()) + 1 if os.path.exists(path) else 1
    with open(path, "w") as fh:
        fh.write(str(count))
    return count

args = sys.argv[1:]
if args[:1] == ["status"]:
    record()
    count = bump("status-count")
    fail_until = int(os.environ.get("FAKE_RAY_STATUS_FAIL_UNTIL", "0"))
    if count <= fail_until:
        print("ConnectionError: Could not find any running Ray instance.", file=sys.stderr)
        sys.exit(1)
    workers = int(os.environ.get("FAKE_RAY_WORKERS", "1"))
    join_after = int(os.environ.get("FAKE_RAY_JOIN_AFTER", "1"))
    gpus_per_node = int(os.environ.get("FAKE_RAY_GPUS_PER_NODE", "8"))
    nodes = 1 + (workers if count >= join_after else 0)
    lines = ["======== Autoscaler status: 2025-01-01 00:00:00.000000 ========", "Node status",
             "---------------------------------------------------------------", "Active:"]
    lines += [f" 1 node_{i:056x}" for i in range(nodes)]
    lines += ["Pending:", " (no pending nodes)", "Recent failures:", " (no failures)", "",
              "Resources", "---------------------------------------------------------------", "Usage:",
              f" 0.0/{nodes * 16}.0 CPU", f" 0.0/{nodes * gpus_per_node}.0 GPU",
              " 0B/1.00TiB memory", "", "Demands:", " (no resource demands)"]
    print("\n".join(lines))
    sys.exit(0)
if args[:1] == ["stop"]:
    record()
    sys.exit(0)
if args[:1] == ["start"] and "--head" in args:
    record()
    sys.exit(int(os.environ.get("FAKE_RAY_HEAD_EXIT", "0")))
if args[:1] == ["start"] and "--block" in args:
    def on_term(signum, frame):
        record(event="terminated")
        sys.exit(0)
    signal.signal(signal.SIGTERM, on_term)
    record(event="started")
    exit_after = os.environ.get("FAKE_RAY_BLOCK_EXIT_AFTER")
    if exit_after:
        time.sleep(float(exit_after))
        record(event="lost-gcs")
        print("The node with node id ... has been marked dead because the GCS is unreachable", file=sys.stderr)
        sys.exit(1)
    while True:
        time.sleep(3600)
record(event="unknown")
sys.exit(2)
'''

FAKE_VLLM = r'''
import json, os, signal, sys, threading, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

log = os.environ["FAKE_LOG"]
state_dir = os.environ["FAKE_DIR"]

def record(**entry):
    with open(log, "a") as fh:
        fh.write(json.dumps({"cmd": "vllm", "argv": sys.argv[1:], "pid": os.getpid(), **entry}) + "\n")

record(event="started", env={k: v for k, v in os.environ.items() if k.startswith(("TF_", "HF_"))})
if os.environ.get("FAKE_VLLM_SERVE") != "1":
    sys.exit(int(os.environ.get("FAKE_VLLM_EXIT", "0")))

class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        running = 0 if os.path.exists(os.path.join(state_dir, "requests-done")) else 2
        record(event="metrics", running=running)
        body = f"vllm:num_requests_running{{model_name=\"m\"}} {running}.0\nvllm:num_requests_waiting{{model_name=\"m\"}} 0.0\n"
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.end_headers()
        self.wfile.write(body.encode())
    def log_message(self, *args):
        pass

server = ThreadingHTTPServer(("127.0.0.1", int(sys.argv[sys.argv.index("--port") + 1])), Handler)
def on_term(signum, frame):
    record(event="terminated")
    os._exit(0)
signal.signal(signal.SIGTERM, on_term)
threading.Thread(target=server.serve_forever, daemon=True).start()
while True:
    time.sleep(3600)
'''


def install_fakes(directory: Path) -> Path:
    """Write fake `ray` and `vllm` executables into directory/bin; return the bin dir."""
    bin_dir = directory / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name, body in (("ray", FAKE_RAY), ("vllm", FAKE_VLLM)):
        path = bin_dir / name
        path.write_text(f"#!{sys.executable}\n" + textwrap.dedent(body))
        path.chmod(0o755)
    return bin_dir


def read_log(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def calls(path: Path, cmd: str) -> Iterator[dict[str, Any]]:
    return (entry for entry in read_log(path) if entry["cmd"] == cmd)


class FakeEngine:
    """vLLM's /health on loopback, answering whatever `status` says, and /v1/completions answering
    `generate_status` once `generate` is set (it records each request's body)."""

    def __init__(self) -> None:
        self.status = 200
        self.generate_status = 200
        self.generate = threading.Event()
        self.generate.set()
        self.generations: list[dict[str, Any]] = []
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send_response(engine.status if self.path == contract.HEALTH_PATH else 404)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path != "/v1/completions":
                    self.send_response(404)
                else:
                    engine.generations.append(body)
                    engine.generate.wait(30)
                    self.send_response(engine.generate_status)
                payload = b'{"choices": []}'
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
