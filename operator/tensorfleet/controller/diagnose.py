"""Why a pod is not Ready, in the kubelet's and the scheduler's own words: `diagnose(pod)` turns what they wrote on it
into a `Diagnosis` (the reason `kubectl get pods` shows, and a one-line detail a person can act on) for the causes
that will not go away on their own, and `SEVERITY` ranks them, the earliest in a pod's life worst. Pure functions.
Design: docs/architecture.md#status-and-diagnosis.
"""

from __future__ import annotations

import re
import signal
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

UNSCHEDULABLE = "Unschedulable"
NODE_NOT_READY = "NodeNotReady"
OOM_KILLED = "OOMKilled"
CRASH_LOOP = "CrashLoopBackOff"
POD_FAILED = "PodFailed"
READINESS_LOST = "ReadinessLost"

# Container waiting reasons that will not fix themselves.
STUCK_REASONS = frozenset({
    "CrashLoopBackOff", "ImagePullBackOff", "ErrImagePull", "InvalidImageName",
    "CreateContainerConfigError", "CreateContainerError", "RunContainerError",
})

# Worst first: the earlier in a pod's life a cause stops it, the worse, since it hides whatever would come after
# it (docs/architecture.md#status-and-diagnosis).
# Reasons in one entry rank the same: the kubelet alternates between ErrImagePull and ImagePullBackOff.
SEVERITY: tuple[tuple[str, ...], ...] = (
    (UNSCHEDULABLE,), (NODE_NOT_READY,),
    ("InvalidImageName",), ("ErrImagePull", "ImagePullBackOff"),
    ("CreateContainerConfigError",), ("CreateContainerError",), ("RunContainerError",),
    (OOM_KILLED,), (CRASH_LOOP,), (READINESS_LOST,),
)
_RANK = {reason: rank for rank, tied in enumerate(SEVERITY) for reason in tied}


def rank(reason: str) -> int:
    """Where `reason` stands in SEVERITY (0 is the worst); a Failed pod's reason (Evicted, ...) comes last,
    since its controller replaces it."""
    return _RANK.get(reason, len(SEVERITY))

DETAIL_LIMIT = 240
_GRPC = re.compile(r"rpc error: code = \w+ desc = ")
_PREEMPTION = re.compile(r"\s*preemption: .*$")


def one_line(text: str | None, limit: int = DETAIL_LIMIT) -> str:
    """`text` on one line of at most `limit` characters, keeping its head and its tail."""
    line = " ".join(_GRPC.sub("", text or "").split())
    if len(line) <= limit:
        return line
    keep = limit - 5
    head = line[: keep * 3 // 5]
    tail = line[len(line) - (keep - len(head)):]
    # Cut between words where there are any, so no word is left in pieces.
    if " " in head[len(head) // 2:]:
        head = head[: head.rindex(" ")]
    if " " in tail[: len(tail) // 2]:
        tail = tail[tail.index(" ") + 1:]
    return f"{head.rstrip()} ... {tail.lstrip()}"


def last_line(text: str | None) -> str:
    """The last non-empty line: where a Python traceback puts the exception."""
    lines = [line for line in (text or "").splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


@dataclass(frozen=True)
class Diagnosis:
    """Why one pod cannot become ready without someone acting."""

    pod: str
    reason: str          # CamelCase, as `kubectl get pods` shows it (OOMKilled for an OOM crash loop)
    detail: str          # one line: the kubelet's or the scheduler's words
    container: str | None = None
    restarts: int = 0

    @property
    def rank(self) -> int:
        return rank(self.reason)

    @property
    def line(self) -> str:
        """One line naming the pod, the reason and the detail (and how often it restarted)."""
        restarted = f" (restarted {self.restarts} time{'s' if self.restarts != 1 else ''})" if self.restarts else ""
        return f"pod {self.pod}: {self.reason}: {self.detail}{restarted}"


@dataclass(frozen=True)
class NodeState:
    """A Node that is not Ready, or deleted, as the operator last saw it. `since` is when the operator first
    saw it so (RFC 3339), not the condition's lastTransitionTime, which not every kubelet stand-in keeps."""

    name: str
    status: str          # the Ready condition's status: False or Unknown ("" when the node has none)
    reason: str
    message: str
    since: str
    gone: bool = False   # the Node was deleted: its pods are orphans no kubelet will ever stop or report

    @property
    def detail(self) -> str:
        if self.gone:
            return f"node {self.name} was deleted (seen at {self.since})"
        said = ": ".join(part for part in (self.reason, one_line(self.message, 120)) if part)
        return f"node {self.name} is not Ready (Ready={self.status or 'missing'}{f', {said}' if said else ''}) " \
               f"since {self.since}"


def _unschedulable(pod: dict[str, Any]) -> str | None:
    for condition in pod.get("status", {}).get("conditions") or []:
        if condition.get("type") == "PodScheduled" and condition.get("status") == "False" \
                and condition.get("reason") == UNSCHEDULABLE:
            return one_line(_PREEMPTION.sub("", condition.get("message") or "")) or "no node fits"
    return None


def _spec_container(pod: dict[str, Any], name: str | None) -> dict[str, Any]:
    spec = pod.get("spec", {})
    for container in [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]:
        if container.get("name") == name:
            return dict(container)
    return {}


def _exit(terminated: dict[str, Any]) -> str:
    code = terminated.get("exitCode")
    if code is None:
        return "exited"
    text = f"exited with code {code}"
    try:
        if int(code) > 128:
            text += f" ({signal.Signals(int(code) - 128).name})"
    except (TypeError, ValueError):
        pass
    return text


def _crash(pod: dict[str, Any], status: dict[str, Any]) -> tuple[str, str]:
    """(reason, detail) of a container in CrashLoopBackOff, from how it last ended."""
    name = status.get("name")
    terminated = (status.get("lastState") or {}).get("terminated") or {}
    if not terminated:
        return CRASH_LOOP, f"container {name} keeps exiting"
    said = last_line(terminated.get("message"))
    if terminated.get("reason") == OOM_KILLED:
        limit = ((_spec_container(pod, name).get("resources") or {}).get("limits") or {}).get("memory")
        code = terminated.get("exitCode")
        facts = [f"exit code {code}"] if code is not None else []
        facts.append(f"memory limit {limit}" if limit else "no memory limit: the node ran out")
        detail = f"container {name} ran out of memory ({', '.join(facts)})"
        return OOM_KILLED, one_line(f"{detail}: {said}" if said else detail)
    how = terminated.get("reason")
    detail = f"container {name} {_exit(terminated)}{f' ({how})' if how and how != 'Error' else ''}"
    return CRASH_LOOP, one_line(f"{detail}: {said}" if said else detail)


def _waiting(pod: dict[str, Any], status: dict[str, Any]) -> tuple[str, str] | None:
    waiting = (status.get("state") or {}).get("waiting") or {}
    reason = waiting.get("reason")
    if reason not in STUCK_REASONS:
        return None
    if reason == CRASH_LOOP:
        return _crash(pod, status)
    message = one_line(waiting.get("message"))
    image = status.get("image") or _spec_container(pod, status.get("name")).get("image")
    if reason in ("ErrImagePull", "ImagePullBackOff", "InvalidImageName") and image and image not in message:
        message = one_line(f'image "{image}": {message}' if message else f'image "{image}"')
    return reason, message or f"container {status.get('name')}"


def diagnose(pod: dict[str, Any], nodes: Mapping[str, NodeState] | None = None) -> Diagnosis | None:
    """Why `pod` cannot become ready without someone acting, or None. NODES: the nodes that are not Ready.

    Only causes that will not go away on their own count (STUCK_REASONS, the scheduler finding no node, a node
    that is not Ready, a pod that failed for good); a pod still pulling or starting is not diagnosed. Where each
    cause's words come from, as kubelet and kube-scheduler 1.36 write them:

    | reason | read from | detail |
    |---|---|---|
    | `Unschedulable` | `status.conditions[PodScheduled]` False, reason Unschedulable | the scheduler's message, without its `preemption:` sentence |
    | `NodeNotReady` | the Node named by `spec.nodeName`: its `Ready` condition not True, or the Node deleted | the node, since when the operator has seen it so, and the kubelet's (or the node controller's) reason and message, or that it was deleted |
    | `InvalidImageName`, `ErrImagePull`, `ImagePullBackOff` | `containerStatuses[].state.waiting` | the kubelet's message (in 1.36 it names the image and the registry's answer, during back-off too); the image is prefixed when the message does not name it |
    | `CreateContainerConfigError` | `state.waiting` | the kubelet's message: `secret "hf-token" not found`, `couldn't find key token in Secret llm/hf-token` |
    | `CreateContainerError`, `RunContainerError` | `state.waiting` | the kubelet's message |
    | `OOMKilled` | `state.waiting` CrashLoopBackOff and `lastState.terminated.reason` OOMKilled | exit code and the container's memory limit |
    | `CrashLoopBackOff` | `state.waiting` CrashLoopBackOff | `lastState.terminated`: exit code (and signal), reason, the last line of its termination message; the back-off message itself changes with every restart and says nothing of the cause |
    | `ReadinessLost` | `Ready` False, changed after the containers last started: the pod had served | when, and that its readiness probe (the launcher's `/health`: GPUs and engine) fails |
    | `Evicted`, ... | `status.phase` Failed | `status.reason` and `status.message` |
    """
    name = pod.get("metadata", {}).get("name", "?")
    status = pod.get("status", {})
    if status.get("phase") == "Failed":
        reason = status.get("reason") or POD_FAILED
        return Diagnosis(name, reason, one_line(status.get("message")) or "the pod failed")
    scheduler = _unschedulable(pod)
    if scheduler is not None:
        return Diagnosis(name, UNSCHEDULABLE, scheduler)
    node = (nodes or {}).get(pod.get("spec", {}).get("nodeName") or "")
    if node is not None:
        return Diagnosis(name, NODE_NOT_READY, node.detail)
    found: list[Diagnosis] = []
    # Init containers run first: one stuck there is what stops the pod.
    for container in [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]:
        cause = _waiting(pod, container)
        if cause is not None:
            found.append(Diagnosis(name, cause[0], cause[1], container.get("name"),
                                   int(container.get("restartCount") or 0)))
    if not found and readiness_lost(pod):
        since = (pod_condition(pod, "Ready") or {}).get("lastTransitionTime")
        return Diagnosis(name, READINESS_LOST, f"not Ready since {since}, after it had served: its readiness probe "
                         "(the launcher's /health, which names the GPU or engine check that failed) fails; "
                         f"`kubectl describe pod {name}` shows the probe's failures")
    return worst(found)


def pod_condition(pod: dict[str, Any], type_: str) -> dict[str, Any] | None:
    """The pod's condition of TYPE_, or None."""
    return next((c for c in pod.get("status", {}).get("conditions") or [] if c.get("type") == type_), None)


def readiness_lost(pod: dict[str, Any]) -> bool:
    """Whether POD was Ready since its containers last started and no longer is.

    A Ready condition moves only when its status changes, and the kubelet
    writes it False before it starts the containers; so a False one that
    changed after the latest container start can only have been True in
    between. Timestamps are whole seconds: an engine Ready and lost within
    the second it started is missed, which no model load allows."""
    ready = pod_condition(pod, "Ready")
    started = [str(running["startedAt"]) for c in pod.get("status", {}).get("containerStatuses") or []
               if (running := (c.get("state") or {}).get("running")) and running.get("startedAt")]
    return bool(ready is not None and ready.get("status") != "True" and started
                and (ready.get("lastTransitionTime") or "") > max(started))


def ranked(diagnoses: Iterable[Diagnosis]) -> list[Diagnosis]:
    """Worst first (SEVERITY); ties keep their order (the pods' order)."""
    return sorted(diagnoses, key=lambda d: d.rank)


def worst(diagnoses: Iterable[Diagnosis]) -> Diagnosis | None:
    found = ranked(diagnoses)
    return found[0] if found else None


def diagnose_all(pods: Iterable[dict[str, Any]], nodes: Mapping[str, NodeState] | None = None) -> list[Diagnosis]:
    """The diagnoses of `pods`, worst first (NODES: the nodes that are not Ready)."""
    return ranked(d for pod in pods if (d := diagnose(pod, nodes)) is not None)


def causes(diagnoses: Iterable[Diagnosis], max_pods: int = 3) -> list[tuple[str, str]]:
    """One (reason, message) per distinct cause, worst first: what to post as Warning events.

    Pods failing the same way (reason and detail) are one cause; the message
    names them. Nothing in it changes with every restart, so the event
    recorder's dedup holds while the cause does.
    """
    grouped: dict[tuple[str, str], list[str]] = {}
    for diagnosis in ranked(diagnoses):
        grouped.setdefault((diagnosis.reason, diagnosis.detail), []).append(diagnosis.pod)
    found = []
    for (reason, detail), pods in grouped.items():
        named = ", ".join(pods[:max_pods]) + (f" and {len(pods) - max_pods} more" if len(pods) > max_pods else "")
        found.append((reason, f"{detail} (pod{'s' if len(pods) > 1 else ''} {named})"))
    return found
