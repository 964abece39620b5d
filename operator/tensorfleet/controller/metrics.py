"""The operator's own Prometheus metrics (served by `tensorfleet run --metrics-port`)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from tensorfleet import contract

RECONCILES = Counter(
    contract.OPERATOR_METRIC_RECONCILES, "Reconciles of InferenceServices, by result.", ["result"],
)
RECONCILE_DURATION = Histogram(
    contract.OPERATOR_METRIC_RECONCILE_DURATION, "Time one reconcile takes.",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
API_REQUESTS = Counter(
    contract.OPERATOR_METRIC_API_REQUESTS, "Kubernetes API requests the reconciler made.", ["method", "kind"],
)
API_ERRORS = Counter(
    contract.OPERATOR_METRIC_API_ERRORS, "Kubernetes API requests that failed, by HTTP code (or network).",
    ["method", "kind", "code"],
)
MANAGED_OBJECTS = Gauge(
    contract.OPERATOR_METRIC_MANAGED_OBJECTS, "Child objects the operator manages, by kind.", ["kind"],
)
INFERENCE_SERVICES = Gauge(
    contract.OPERATOR_METRIC_INFERENCE_SERVICES, "InferenceServices known to this operator, by Ready status.", ["ready"],
)
QUEUE_DEPTH = Gauge(contract.OPERATOR_METRIC_QUEUE_DEPTH, "InferenceServices waiting to be reconciled.")
IS_LEADER = Gauge(contract.OPERATOR_METRIC_LEADER, "1 while this operator replica holds the leader lease.")
WATCH_EVENTS = Counter(
    contract.OPERATOR_METRIC_WATCH_EVENTS, "Watch events handled (the InferenceServices, their children and engine "
    "pods), by kind and type (ADDED, MODIFIED, DELETED; None for the initial listing).", ["kind", "type"],
)
