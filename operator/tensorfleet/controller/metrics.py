"""The operator's own Prometheus metrics (served by `tensorfleet run --metrics-port`)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

RECONCILES = Counter(
    "tensorfleet_reconciles_total", "Reconciles of InferenceServices, by result.", ["result"],
)
RECONCILE_DURATION = Histogram(
    "tensorfleet_reconcile_duration_seconds", "Time one reconcile takes.",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
API_REQUESTS = Counter(
    "tensorfleet_api_requests_total", "Kubernetes API requests the reconciler made.", ["method", "kind"],
)
API_ERRORS = Counter(
    "tensorfleet_api_errors_total", "Kubernetes API requests that failed, by HTTP code (or network).",
    ["method", "kind", "code"],
)
MANAGED_OBJECTS = Gauge(
    "tensorfleet_managed_objects", "Child objects the operator manages, by kind.", ["kind"],
)
INFERENCE_SERVICES = Gauge(
    "tensorfleet_inference_services", "InferenceServices known to this operator, by Ready status.", ["ready"],
)
QUEUE_DEPTH = Gauge("tensorfleet_work_queue_depth", "InferenceServices waiting to be reconciled.")
IS_LEADER = Gauge("tensorfleet_leader", "1 while this operator replica holds the leader lease.")
