"""The nodes under the engine pods that are not Ready, or were deleted, from the operator's watch of Nodes: only
their readiness is kept, so the memory is the size of the cluster's trouble, not of the cluster. A reconcile sees
them through `observe.Observation.nodes`. Design: docs/architecture.md#rollouts-and-group-restarts.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from tensorfleet.controller.diagnose import NodeState

# Deleted nodes remembered at most (the oldest forgotten first): the pod garbage collector removes what
# their pods leave behind 40 s later anyway, so only a burst of deletions could reach this.
GONE_KEPT = 1024


class NotReadyNodes:
    """Nodes whose Ready condition is not True, and nodes deleted, by name, as the watch last showed them."""

    def __init__(self) -> None:
        self._nodes: dict[str, NodeState] = {}

    def observed(self, node: Mapping[str, Any], now: str, *, deleted: bool = False) -> bool:
        """Take a Node from a watch event (NOW: the time, RFC 3339); whether what a reconcile sees changed.

        A node without a Ready condition yet (registering) is not tracked: no pod runs on it. A node deleted
        is kept as gone until a node of its name registers again: pods still bound to it are orphans."""
        name = (node.get("metadata") or {}).get("name") or ""
        if deleted:
            before = self._nodes.pop(name, None)
            self._nodes[name] = NodeState(name, "", "", "", before.since if before and before.gone else now, gone=True)
            gone = [n for n, state in self._nodes.items() if state.gone]
            for oldest in gone[:max(0, len(gone) - GONE_KEPT)]:
                del self._nodes[oldest]
            return before is None or not before.gone
        ready = next((c for c in (node.get("status") or {}).get("conditions") or [] if c.get("type") == "Ready"),
                     None)
        if ready is None or ready.get("status") == "True":
            return self._nodes.pop(name, None) is not None
        before = self._nodes.get(name)
        state = NodeState(name, str(ready.get("status") or ""), str(ready.get("reason") or ""),
                          str(ready.get("message") or ""), before.since if before is not None and not before.gone
                          else now)
        self._nodes[name] = state
        return state != before

    def under(self, pods: Iterable[Mapping[str, Any]]) -> dict[str, NodeState]:
        """The nodes of PODS that are not Ready or gone."""
        return {node: self._nodes[node] for pod in pods
                if (node := (pod.get("spec") or {}).get("nodeName") or "") in self._nodes}
