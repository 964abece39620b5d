"""The e2e pod runner's pods and the runner itself: `PodWorker` does the kubelet's work for one pod in a thread of
its own (its network namespace, /etc/hosts, env and volumes, its init containers and then its containers, its
status, its deletion), and `Runner` lists and watches the pods on the nodes, starts a worker for each pod it runs,
keeps the pods' DNS names and the status file, and stops them all. Part of the pod runner, e2e/podrunner.py; what
it does per pod: e2e/README.md#real-processes-for-control-plane-pods.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import http.client
import json
import os
import shutil
import signal
import subprocess
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from podrunner_api import Api, ApiError, Gone
from podrunner_container import Container
from podrunner_image import LAUNCHER_BUNDLE_PATH, cache_dir, image_overlays, launcher_bundle
from podrunner_net import CLUSTER_NETNS, GATEWAY, NETNS_PREFIX, VETH_PREFIX, Relay, delete_netns, run_ip, sweep, tool
from podrunner_spec import (
    DEFAULT_GRACE,
    IMAGE_ENV,
    PODS_DIR,
    REFRESH_SECONDS,
    SHUTDOWN_GRACE_CAP,
    STATUS_FILE,
    VLLM_IMAGE_ENV,
    ConfigError,
    CpuPins,
    container_env,
    host_paths_under_private_tops,
    log_line,
    now_rfc3339,
    pod_private,
    runs,
)
from podrunner_volumes import TokenSource, VolumeError, volume_files, write_atomically

# --- a pod ---------------------------------------------------------------------------------------------


class PodWorker(threading.Thread):
    """The kubelet's work for one pod, in a thread of its own."""

    def __init__(self, runner: Runner, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        super().__init__(name=f"pod-{meta['namespace']}/{meta['name']}", daemon=True)
        self.runner, self.pod = runner, pod
        self.namespace, self.pod_name, self.uid = meta["namespace"], meta["name"], meta["uid"]
        self.key = f"{self.namespace}/{self.pod_name}"
        short = self.uid.replace("-", "")[:12]
        self.netns, self.veth = NETNS_PREFIX + short, VETH_PREFIX + short
        self.directory = runner.pods_dir / self.namespace / self.pod_name / self.uid
        self.wake = threading.Event()
        self.stopping = threading.Event()   # the runner stops, or the pod is gone: end without deleting it
        self.gone = False
        self.ip = ""
        self.relay: Relay | None = None
        self.init_containers: list[Container] = []
        self.containers: list[Container] = []
        self.tokens = TokenSource(runner.api, pod)
        self.volume_dirs: dict[str, Path] = {}
        self.volume_hashes: dict[str, str] = {}
        self.refreshed = 0.0
        self.conditions: dict[str, dict[str, Any]] = {}
        self.published: Any = None
        self.allocatable: dict[str, Any] | None = None
        self.hosts_text = ""
        spec = pod.get("spec") or {}
        self.hostname = (spec.get("hostname") or self.pod_name)[:63]

    def say(self, message: str) -> None:
        log_line(f"{self.key}: {message}")

    def update(self, pod: dict[str, Any]) -> None:
        self.pod = pod
        self.tokens.pod = pod
        self.wake.set()

    def run(self) -> None:
        deleted = False
        try:
            deleted = self._run()
        except Exception:  # noqa: BLE001 - a bug here must not take the other pods down
            self.say(f"failed:\n{traceback.format_exc()}")
        finally:
            self._teardown()
            self.runner.finished(self, deleted)

    def _deleting(self) -> bool:
        return bool(self.pod["metadata"].get("deletionTimestamp"))

    def _run(self) -> bool:
        while not self.pod.get("status", {}).get("podIP"):
            if self.stopping.is_set() or self._deleting():
                return self._deleting() and not self.stopping.is_set() and self._delete_pod()
            self.wake.wait(1)
            self.wake.clear()
        self.ip = self.pod["status"]["podIP"]
        # The conditions as the API holds them (KWOK's start stage wrote them with the IP, at the pod's creation
        # time), so that one keeps its lastTransitionTime until its status changes: the kubelet's status manager
        # takes the API's status as the old one, and has written Ready False before it starts a container.
        self.conditions = {c["type"]: dict(c) for c in self.pod["status"].get("conditions") or []
                           if c.get("type") and c.get("lastTransitionTime")}
        if self._deleting():
            return not self.stopping.is_set() and self._delete_pod()
        self.directory.mkdir(parents=True, exist_ok=True)
        self._network()
        self.write_hosts()
        (self.directory / "resolv.conf").write_text(
            "# No cluster DNS here: names resolve through /etc/hosts (e2e/podrunner.py); this server refuses.\n"
            f"nameserver 127.0.0.1\nsearch {self.namespace}.svc.cluster.local svc.cluster.local cluster.local\n"
            "options ndots:5 attempts:1 timeout:1\n")
        (self.directory / "tmp").mkdir(exist_ok=True)
        (self.directory / "tmp").chmod(0o1777)
        prior = {s["name"]: s for s in self.pod.get("status", {}).get("containerStatuses") or []}
        prior_init = {s["name"]: s for s in self.pod.get("status", {}).get("initContainerStatuses") or []}
        # Init containers run again whenever the runner (re)creates the pod's sandbox, as the kubelet's do:
        # their emptyDirs are new.
        self.init_containers = [Container(self, c, prior_init.get(c["name"]), init=True)
                                for c in self.pod["spec"].get("initContainers") or []]
        self.containers = [Container(self, c, prior.get(c["name"])) for c in self.pod["spec"]["containers"]]
        while not self.stopping.is_set() and not self._deleting():
            # Init containers in order, each to completion (exit 0) before the next; then the containers.
            pending = [c for c in self.init_containers if not c.succeeded()]
            if pending:
                pending[0].step()
                if pending[0].succeeded() and len(pending) > 1:
                    self.wake.set()
            else:
                for container in self.containers:
                    container.step()
            if time.monotonic() - self.refreshed >= REFRESH_SECONDS:
                self._refresh_volumes()
            try:
                self.publish()
            except (ApiError, OSError, http.client.HTTPException) as exc:
                self.say(f"status not written (next try in a moment): {exc}")
            self.wake.wait(0.5)
            self.wake.clear()
        deleting = self._deleting() and not self.stopping.is_set()
        grace = float(self.pod["metadata"].get("deletionGracePeriodSeconds")
                      if deleting and self.pod["metadata"].get("deletionGracePeriodSeconds") is not None
                      else self.pod["spec"].get("terminationGracePeriodSeconds", DEFAULT_GRACE))
        if self.runner.stopping.is_set() or self.gone:
            grace = min(grace, SHUTDOWN_GRACE_CAP)
        self._terminate(grace)
        if deleting:
            return self._delete_pod()
        if self.runner.stopping.is_set():
            with contextlib.suppress(ApiError, OSError):
                self.publish(timeout=5)
        return False

    def all_containers(self) -> list[Container]:
        return [*self.init_containers, *self.containers]

    def _terminate(self, grace: float) -> None:
        running = [c for c in self.all_containers() if c.proc is not None and c.proc.poll() is None]
        if not running:
            return
        self.say(f"stopping {', '.join(c.name for c in running)}: SIGTERM, {grace:g}s grace")
        for container in running:
            container.signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for container in running:
            container.wait_stopped(deadline)
        for container in running:
            if container.proc is not None and container.proc.poll() is None:
                self.say(f"{container.name}: still running after {grace:g}s; SIGKILL")
                container.kill()
        for container in running:
            container.wait_stopped(time.monotonic() + 10)
            if container.proc is not None:
                code = container.proc.poll()
                if code is not None:
                    container._exited(code)

    def _delete_pod(self) -> bool:
        """What the kubelet does once a deleted pod's containers stopped: remove the object, grace 0."""
        body = {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0,
                "preconditions": {"uid": self.uid}}
        try:
            self.runner.api.call("DELETE", f"/api/v1/namespaces/{self.namespace}/pods/{self.pod_name}", body)
            self.say("deleted")
        except ApiError as exc:
            if exc.status not in (404, 409):
                self.say(f"delete failed: {exc}")
        return True

    # -- network
    def _network(self) -> None:
        delete_netns(self.netns)   # a runner stopped mid-way may have left it
        steps = [
            ("netns", "add", self.netns),
            ("-n", self.netns, "link", "set", "lo", "up"),
            ("-n", CLUSTER_NETNS, "link", "add", self.veth, "type", "veth", "peer", "name", "eth0",
             "netns", self.netns),
            ("-n", self.netns, "addr", "add", f"{self.ip}/32", "dev", "eth0"),
            ("-n", self.netns, "link", "set", "eth0", "up"),
            ("-n", self.netns, "route", "add", GATEWAY, "dev", "eth0", "scope", "link"),
            ("-n", self.netns, "route", "add", "default", "via", GATEWAY, "dev", "eth0"),
            ("-n", CLUSTER_NETNS, "link", "set", self.veth, "up"),
        ]
        for step in steps:
            run_ip(*step)
        subprocess.run([tool("ip"), "netns", "exec", CLUSTER_NETNS, "sh", "-c",
                        f"echo 1 > /proc/sys/net/ipv4/conf/{self.veth}/proxy_arp"], check=True, timeout=30)
        # In tensorfleet-e2e every pod IP is a local address (table local, 10.244.0.0/16); a /32 in the
        # same table wins by prefix length and sends this pod's address down its veth instead.
        run_ip("-n", CLUSTER_NETNS, "route", "replace", f"{self.ip}/32", "dev", self.veth, "table", "local")
        self.relay = Relay(self.netns, self.runner.api.port)
        self.say(f"network namespace {self.netns}, {self.ip} on eth0")

    def _teardown(self) -> None:
        for container in self.all_containers():
            container.kill()
            container.wait_stopped(time.monotonic() + 5)
        if self.relay is not None:
            self.relay.close()
        if self.ip:
            delete_netns(self.netns)
            run_ip("-n", CLUSTER_NETNS, "route", "del", f"{self.ip}/32", "dev", self.veth, "table", "local",
                   check=False)
        for name in ("volumes", "tmp"):
            shutil.rmtree(self.directory / name, ignore_errors=True)

    def write_hosts(self) -> None:
        spec = self.pod["spec"]
        lines = ["# Kubernetes-managed hosts file (the e2e pod runner's: the kubelet's part and cluster DNS).",
                 "127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback",
                 "fe00::0\tip6-localnet", "fe00::0\tip6-mcastprefix", "fe00::1\tip6-allnodes",
                 "fe00::2\tip6-allrouters"]
        if spec.get("subdomain"):
            lines.append(f"{self.ip}\t{self.hostname}.{spec['subdomain']}.{self.namespace}.svc.cluster.local\t"
                         f"{self.hostname}")
        else:
            lines.append(f"{self.ip}\t{self.hostname}")
        aliases = spec.get("hostAliases") or []
        if aliases:
            lines.append("\n# Entries added by HostAliases.")
            lines += [f"{a['ip']}\t{chr(9).join(a.get('hostnames') or [])}" for a in aliases]
        lines.append("\n# Cluster DNS, as the e2e pod runner stands in for it: pods with hostname and subdomain.")
        lines += self.runner.dns_lines()
        text = "\n".join(lines) + "\n"
        if text == self.hosts_text:
            return
        path = self.directory / "hosts"
        # In place: the file is bind-mounted, a rename would leave the container with the old one.
        with open(path, "r+" if path.exists() else "w") as hosts:
            hosts.write(text)
            hosts.truncate()
        self.hosts_text = text

    # -- env and volumes
    def lookup(self, kind: str, name: str) -> dict[str, str] | None:
        plural = "secrets" if kind == "secret" else "configmaps"
        try:
            found = self.runner.api.call("GET", f"/api/v1/namespaces/{self.namespace}/{plural}/{name}")
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise ConfigError(f"{kind} {name!r}: {exc}") from None
        data: dict[str, str] = {}
        if kind == "secret":
            data.update({k: base64.b64decode(v).decode(errors="replace") for k, v in (found.get("data") or {}).items()})
        else:
            data.update(found.get("data") or {})
            data.update({k: base64.b64decode(v).decode(errors="replace")
                         for k, v in (found.get("binaryData") or {}).items()})
        return data

    def node_allocatable(self) -> dict[str, Any]:
        if self.allocatable is None:
            node = self.runner.api.call("GET", f"/api/v1/nodes/{self.pod['spec']['nodeName']}")
            self.allocatable = dict(node.get("status", {}).get("allocatable") or {})
        return self.allocatable

    def environment(self, container: dict[str, Any], vllm: bool = False) -> dict[str, str]:
        port = str(self.runner.api.port)
        # The master Service's variables, which the kubelet sets in every container; here the API server
        # is the relay on the pod's own loopback (the certificate names 127.0.0.1).
        master = {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": port,
                  "KUBERNETES_SERVICE_PORT_HTTPS": port, "KUBERNETES_PORT": f"tcp://127.0.0.1:{port}",
                  f"KUBERNETES_PORT_{port}_TCP": f"tcp://127.0.0.1:{port}"}
        try:
            resolved = container_env(self.pod, container, self.lookup, self.node_allocatable(), master)
        except (ApiError, OSError) as exc:
            raise ConfigError(str(exc)) from None
        # The compile caches of tensorfleet.testing.realvllm.compile_cache_env (this script runs on the system
        # Python, without the package).
        caches = {"VLLM_CACHE_ROOT": str(cache_dir() / "vllm-cpu" / "vllm-cache"),
                  "TORCHINDUCTOR_CACHE_DIR": str(cache_dir() / "vllm-cpu" / "inductor-cache")}
        image = {**VLLM_IMAGE_ENV, **caches} if vllm else IMAGE_ENV
        return {**image, "HOSTNAME": self.hostname, **resolved}

    def _materialise(self, volume: dict[str, Any]) -> Path:
        directory = self.directory / "volumes" / volume["name"]
        try:
            files = volume_files(self.pod, volume, self.lookup, self.tokens, self.node_allocatable())
        except (ConfigError, ApiError, OSError) as exc:
            raise VolumeError(str(exc)) from None
        if files is None:
            directory.mkdir(parents=True, exist_ok=True)
            directory.chmod(0o777)
            return Path(directory)
        digest = hashlib.sha256(json.dumps({k: [v[0].hex(), v[1]] for k, v in sorted(files.items())}).encode())
        if self.volume_hashes.get(volume["name"]) != digest.hexdigest():
            write_atomically(directory, files)
            self.volume_hashes[volume["name"]] = digest.hexdigest()
        return Path(directory)

    def mounts(self, container: dict[str, Any]) -> tuple[list[tuple[str, str]], list[list[Any]]]:
        """(rewrites, binds) for the container's volumeMounts, its volumes materialised first."""
        volumes = {v["name"]: v for v in self.pod["spec"].get("volumes") or []}
        rewrites: list[tuple[str, str]] = []
        binds: list[list[Any]] = [[str(self.directory / "tmp"), "/tmp", False, False],
                                  [str(self.directory / "hosts"), "/etc/hosts", False, True],
                                  [str(self.directory / "resolv.conf"), "/etc/resolv.conf", False, True]]
        for mount in container.get("volumeMounts") or []:
            volume = volumes.get(mount["name"])
            if volume is None:
                raise VolumeError(f'volume "{mount["name"]}" not found in the pod')
            try:
                source = self._materialise(volume)
            except VolumeError as exc:
                raise VolumeError(f'MountVolume.SetUp failed for volume "{mount["name"]}" : {exc}') from None
            self.volume_dirs[mount["name"]] = source
            if mount.get("subPath"):
                source = source / mount["subPath"]
            path = mount["mountPath"]
            real = os.path.realpath(path)
            if pod_private(real) or os.path.exists(real):
                binds.append([str(source), real, bool(mount.get("readOnly")), source.is_file()])
            else:
                rewrites.append((path.rstrip("/") or "/", str(source)))
        # This checkout and its virtualenv are the image's filesystem: where either lies under /tmp or /run
        # (a CI clone), the pod's own /tmp would hide it, so it is bound back at its own path.
        for path in host_paths_under_private_tops(self.runner.host_paths()):
            binds.append([path, path, False, False])
        binds[3:] = sorted(binds[3:], key=lambda b: b[1].count("/"))
        rewrites.sort(key=lambda r: -len(r[0]))
        return rewrites, binds

    def _refresh_volumes(self) -> None:
        self.refreshed = time.monotonic()
        for volume in self.pod["spec"].get("volumes") or []:
            if volume["name"] in self.volume_dirs and "emptyDir" not in volume:
                try:
                    self._materialise(volume)
                except VolumeError as exc:
                    self.say(f"volume {volume['name']}: not refreshed: {exc}")

    # -- status
    def _condition(self, kind: str, ok: bool, message: str, reason: str = "ContainersNotReady") -> dict[str, Any]:
        status = "True" if ok else "False"
        old = self.conditions.get(kind)
        since = old["lastTransitionTime"] if old and old["status"] == status else now_rfc3339()
        condition: dict[str, Any] = {"type": kind, "status": status, "lastTransitionTime": since,
                                     "reason": None, "message": None}   # null: a merge patch removes them
        if not ok:
            condition.update({"reason": reason, "message": message})
        self.conditions[kind] = condition
        return condition

    def publish(self, timeout: float = 30.0) -> None:
        statuses = [c.status() for c in self.containers]
        unready = [s["name"] for s in statuses if not s["ready"]]
        message = f"containers with unready status: [{' '.join(unready)}]"
        conditions = [self._condition(kind, not unready, message) for kind in ("ContainersReady", "Ready")]
        incomplete = [c.name for c in self.init_containers if not c.succeeded()]
        if self.init_containers:
            conditions.append(self._condition("Initialized", not incomplete,
                                              f"containers with incomplete status: [{' '.join(incomplete)}]",
                                              reason="ContainersNotInitialized"))
        if any(c.failed_for_good() for c in self.init_containers):
            phase = "Failed"
        elif incomplete:
            phase = "Pending"
        elif any(c.ever_started for c in self.containers):
            terminal = [c.terminated for c in self.containers
                        if c.proc is None and c.terminated and not c._restartable(c.terminated["exitCode"])]
            if len(terminal) == len(self.containers):
                phase = "Succeeded" if all(t["exitCode"] == 0 for t in terminal if t) else "Failed"
            else:
                phase = "Running"
        else:
            phase = "Pending"
        body: dict[str, Any] = {"status": {"phase": phase, "conditions": conditions, "containerStatuses": statuses}}
        if self.init_containers:
            body["status"]["initContainerStatuses"] = [c.status() for c in self.init_containers]
        if body == self.published:
            return
        self.runner.api.call("PATCH", f"/api/v1/namespaces/{self.namespace}/pods/{self.pod_name}/status", body,
                             content_type="application/strategic-merge-patch+json", timeout=timeout)
        self.published = body
        self.runner.dump()

    @staticmethod
    def _describe(c: Container) -> dict[str, Any]:
        return {"name": c.name, "pid": c.main_pid if c.proc is not None else None,
                "ready": c.succeeded() if c.init else bool(c.proc is not None and c.started_ok and c.ready),
                "restartCount": c.restart_count, "log": str(c.log_path),
                "image": c.spec.get("image", "")}

    def describe(self) -> dict[str, Any]:
        return {
            "namespace": self.namespace, "name": self.pod_name, "uid": self.uid, "podIP": self.ip,
            "netns": self.netns, "directory": str(self.directory),
            "containers": [self._describe(c) for c in self.containers],
            "initContainers": [self._describe(c) for c in self.init_containers],
        }


# --- the runner ----------------------------------------------------------------------------------------


class Runner:
    def __init__(self, state: Path, kubeconfig: Path, kubectl: str, image: str, vllm_python: str | None = None) -> None:
        self.state, self.image, self.vllm_python = state, image, vllm_python
        self.overlays: tuple[str, list[list[str]]] | None = None   # (bundle key folder, overlays)
        self.pods_dir = state / PODS_DIR
        self.api = Api(kubeconfig, kubectl, state / "podrunner-credentials")
        self.workers: dict[str, PodWorker] = {}
        self.deleted: set[str] = set()
        self.dns: dict[str, tuple[str, str]] = {}   # pod uid -> (ip, name.subdomain.namespace)
        self.lock = threading.RLock()
        self.stopping = threading.Event()
        self.ready = False
        self.cpus = CpuPins()

    # -- images
    def vllm_bin(self) -> str | None:
        """The bin folder of the real-vLLM venv that stands in for vLLM's image, when there is one."""
        if self.vllm_python and Path(self.vllm_python).is_file():
            return str(Path(self.vllm_python).parent)
        return None

    def host_paths(self) -> tuple[str, ...]:
        """What the containers of vLLM's image need of this machine besides this checkout: the e2e cache (the
        launcher bundle, the tiny model, the compile cache) and the real-vLLM venv."""
        paths = [str(cache_dir())]
        if self.vllm_python:
            paths.append(str(Path(self.vllm_python).parent.parent))
        return tuple(paths)

    def image_overlays(self) -> list[list[str]]:
        """The control-plane image's own files (the launcher bundle, built from this checkout as it is now)
        as overlays for a container of that image; none, said once in the log, when it cannot be built (the
        init container then fails as an image without the bundle does)."""
        try:
            root = launcher_bundle()
            overlays = image_overlays(root)
        except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
            log_line(f"the control-plane image's {LAUNCHER_BUNDLE_PATH} is not available to its containers: {exc}")
            return []
        with self.lock:
            if self.overlays is None or self.overlays[0] != str(root):
                log_line(f"the control-plane image's {LAUNCHER_BUNDLE_PATH}: {root / LAUNCHER_BUNDLE_PATH.lstrip('/')}")
                self.overlays = (str(root), overlays)
        return overlays

    # -- pods
    def observe(self, kind: str, pod: dict[str, Any]) -> None:
        meta = pod.get("metadata") or {}
        uid = meta.get("uid", "")
        with self.lock:
            self._dns(kind, pod)
            if uid in self.deleted:
                return
            worker = self.workers.get(uid)
            if kind == "DELETED":
                if worker is not None:
                    worker.gone = True
                    worker.update(pod)
                    worker.stopping.set()
                return
            if worker is not None:
                worker.update(pod)
            elif runs(pod, self.image) and not self.stopping.is_set():
                worker = PodWorker(self, pod)
                self.workers[uid] = worker
                worker.start()

    def _dns(self, kind: str, pod: dict[str, Any]) -> None:
        meta, spec = pod.get("metadata") or {}, pod.get("spec") or {}
        ip = (pod.get("status") or {}).get("podIP")
        entry = None
        if kind != "DELETED" and ip and spec.get("hostname") and spec.get("subdomain"):
            entry = (ip, f"{spec['hostname']}.{spec['subdomain']}.{meta.get('namespace')}")
        if self.dns.get(meta.get("uid", "")) == entry:
            return
        if entry is None:
            self.dns.pop(meta.get("uid", ""), None)
        else:
            self.dns[meta["uid"]] = entry
        for worker in list(self.workers.values()):
            if worker.ip:
                with contextlib.suppress(OSError):
                    worker.write_hosts()

    def dns_lines(self) -> list[str]:
        with self.lock:
            return [f"{ip}\t{name}.svc.cluster.local\t{name}.svc" for ip, name in sorted(self.dns.values())]

    def finished(self, worker: PodWorker, deleted: bool) -> None:
        with self.lock:
            if self.workers.get(worker.uid) is worker:
                del self.workers[worker.uid]
            if deleted:
                self.deleted.add(worker.uid)
        self.dump()

    def dump(self) -> None:
        with self.lock:
            pods = [w.describe() for w in self.workers.values()]
        document = {"pid": os.getpid(), "ready": self.ready, "image": self.image, "vllmPython": self.vllm_python,
                    "pods": sorted(pods, key=lambda p: (p["namespace"], p["name"]))}
        temporary = self.state / f".{STATUS_FILE}.{threading.get_ident()}"
        temporary.write_text(json.dumps(document, indent=2) + "\n")
        temporary.replace(self.state / STATUS_FILE)

    # -- list and watch
    def _list(self) -> str:
        found = self.api.call("GET", "/api/v1/pods?fieldSelector=spec.nodeName%21%3D", timeout=60)
        seen = set()
        for pod in found.get("items") or []:
            seen.add(pod["metadata"]["uid"])
            self.observe("ADDED", pod)
        with self.lock:
            vanished = [w.pod for uid, w in self.workers.items() if uid not in seen]
            for uid in list(self.dns):
                if uid not in seen:
                    self.dns.pop(uid)
        for pod in vanished:
            self.observe("DELETED", pod)
        return str(found["metadata"]["resourceVersion"])

    def watch(self) -> None:
        version = ""
        while not self.stopping.is_set():
            try:
                if not version:
                    version = self._list()
                    if not self.ready:
                        self.ready = True
                        self.dump()
                        log_line(f"listed the pods; running those of {self.image}, and of vLLM's images with "
                                 f"{self.vllm_python or 'no real vLLM (their containers wait: ErrImagePull)'}")
                path = (f"/api/v1/pods?watch=1&allowWatchBookmarks=true&timeoutSeconds=120"
                        f"&fieldSelector=spec.nodeName%21%3D&resourceVersion={version}")
                for event in self.api.watch(path, timeout=150):
                    kind, obj = event.get("type"), event.get("object") or {}
                    if kind == "ERROR":
                        if obj.get("code") == 410:
                            raise Gone()
                        raise ApiError(int(obj.get("code") or 500), obj.get("message", ""), obj.get("reason", ""))
                    version = obj.get("metadata", {}).get("resourceVersion") or version
                    if kind != "BOOKMARK":
                        self.observe(str(kind), obj)
                    if self.stopping.is_set():
                        return
            except Gone:
                log_line("watch: resourceVersion too old; listing again")
                version = ""
            except (ApiError, OSError, ValueError, http.client.HTTPException) as exc:
                log_line(f"watch: {exc.__class__.__name__}: {exc}; listing again in 1s")
                version = ""
                self.stopping.wait(1)

    # -- the process
    def prepare(self) -> None:
        stale = sweep()
        if stale:
            log_line(f"deleted network namespaces a previous runner left: {', '.join(stale)}")
        subprocess.run([tool("ip"), "netns", "exec", CLUSTER_NETNS, "sh", "-c",
                        "echo 1 > /proc/sys/net/ipv4/ip_forward"], check=True, timeout=30)

    def shutdown(self) -> None:
        self.stopping.set()
        with self.lock:
            workers = list(self.workers.values())
        for worker in workers:
            worker.stopping.set()
            worker.wake.set()
        deadline = time.monotonic() + SHUTDOWN_GRACE_CAP + 20
        for worker in workers:
            worker.join(max(0.1, deadline - time.monotonic()))
        sweep()
        self.ready = False
        self.dump()
