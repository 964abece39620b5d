"""The router: its Deployment (Pod Security `restricted` with a read-only root filesystem and, with spec.router.auth,
the API-key Secret mounted read-only and never optional) and the least RBAC it needs to find ready leaders.
Design: docs/security.md#clients-of-the-router.
"""

from __future__ import annotations

from typing import Any

from tensorfleet import contract
from tensorfleet.engine_settings import engine_arg_value
from tensorfleet.render.meta import (
    Context,
    metadata,
    pod_labels,
    publishes_kv_events,
    resources_block,
    router_selector,
    scales_to_zero,
)

CONTAINER_NAME = "router"
DEFAULT_REQUESTS = {"cpu": "250m", "memory": "256Mi"}
DEFAULT_LIMITS = {"memory": "512Mi"}
API_KEYS_MODE = 0o440  # readable by the owner (root) and the group (fsGroup: the router's)
# The default cold-start timeout's bounds: long enough for any engine to load, short enough that a client
# (most time out after minutes) still gets the router's 503 rather than its own timeout.
COLD_START_MIN_SECONDS = 120
COLD_START_MAX_SECONDS = 1800


def _name(ctx: Context) -> str:
    return contract.router_name(ctx.name)


def service_account(ctx: Context) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": metadata(ctx, _name(ctx), contract.COMPONENT_ROUTER),
    }


def role(ctx: Context) -> dict[str, Any]:
    # EndpointSlice names are generated, so resourceNames cannot narrow
    # this further; the router filters by the engine Service's label.
    rules: list[dict[str, Any]] = [{
        "apiGroups": ["discovery.k8s.io"],
        "resources": ["endpointslices"],
        "verbs": ["get", "list", "watch"],
    }]
    if scales_to_zero(ctx):
        # Renewing the demand Lease (router/demand.py) by server-side apply: that one Lease, which the
        # operator creates, and nothing else (create cannot be narrowed by name, and is not needed).
        rules.append({
            "apiGroups": ["coordination.k8s.io"],
            "resources": ["leases"],
            "resourceNames": [contract.demand_lease_name(ctx.name)],
            "verbs": ["get", "patch"],
        })
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": metadata(ctx, _name(ctx), contract.COMPONENT_ROUTER),
        "rules": rules,
    }


def cold_start_timeout(ctx: Context) -> int:
    """spec.router.coldStartTimeoutSeconds, or twice the plan's estimated load time within [120, 1800]."""
    given = ctx.spec.router.cold_start_timeout_seconds
    if given is not None:
        return given
    return min(COLD_START_MAX_SECONDS, max(COLD_START_MIN_SECONDS, 2 * ctx.plan.load_seconds))


def role_binding(ctx: Context) -> dict[str, Any]:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": metadata(ctx, _name(ctx), contract.COMPONENT_ROUTER),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": _name(ctx)},
        "subjects": [{"kind": "ServiceAccount", "name": _name(ctx), "namespace": ctx.namespace}],
    }


def _resources(ctx: Context) -> dict[str, Any]:
    user = ctx.spec.router.resources
    requests, limits = (dict(user.requests), dict(user.limits)) if user else (DEFAULT_REQUESTS, DEFAULT_LIMITS)
    return resources_block(requests, limits)


def _health() -> dict[str, Any]:
    # A fresh dict per probe: shared ones would be dumped as YAML anchors.
    return {"httpGet": {"path": contract.HEALTH_PATH, "port": contract.PORT_NAME_HTTP}}


def _auth_args(ctx: Context) -> list[str]:
    auth = ctx.spec.router.auth
    if auth is None:
        return []
    return [
        "--api-keys", contract.ROUTER_API_KEYS_PATH,
        *(["--requests-per-minute", str(auth.requests_per_minute)] if auth.requests_per_minute else []),
        *(["--tokens-per-minute", str(auth.tokens_per_minute)] if auth.tokens_per_minute else []),
    ]


def _concurrency_args(ctx: Context) -> list[str]:
    """The per-engine ceiling. The derived default is a typical request's share of the KV cache, so an engine
    may burst up to max-num-seqs while it reports room (router/dispatch.py); a ceiling the user set holds."""
    router = ctx.spec.router
    if router.max_concurrency_per_engine:
        return ["--max-concurrency-per-backend", str(router.max_concurrency_per_engine)]
    ceiling = ctx.plan.engine_concurrency(router.typical_request_tokens)
    return ["--max-concurrency-per-backend", str(ceiling),
            *(["--burst-concurrency-per-backend", str(ctx.plan.max_num_seqs)] if ctx.plan.max_num_seqs > ceiling
              else [])]


BATCHED_TOKENS_FLAG = "--max-num-batched-tokens"


def engine_step_tokens(ctx: Context) -> int:
    """The engines' prefill budget per step: spec.engine.args' --max-num-batched-tokens (in any spelling vLLM
    reads) where it sets one, else vLLM's default as the plan has it."""
    value = engine_arg_value(ctx.spec.engine.args, BATCHED_TOKENS_FLAG)
    if value is not None and value.strip().isdigit() and int(value) > 0:
        return int(value)
    return ctx.plan.batched_tokens


def _container(ctx: Context) -> dict[str, Any]:
    router = ctx.spec.router
    container = {
        "name": CONTAINER_NAME,
        "image": router.image or ctx.images.control_plane,
        "command": list(contract.ROUTER_COMMAND),
        "args": [
            "--service", contract.engine_service_name(ctx.name),
            # With spec.prefill, each request's prompt goes to the prefill pool first (docs/disaggregation.md).
            *(["--prefill-service", contract.prefill_engine_service_name(ctx.name)] if ctx.spec.prefill else []),
            "--namespace", ctx.namespace,
            # The other replicas: the router Service's ready endpoints, less this pod (router/peers.py).
            "--peer-service", ctx.name,
            "--strategy", router.strategy,
            # vLLM engines publish their KV-cache events (render/engine.py): the router indexes them.
            *(["--kv-events"] if publishes_kv_events(ctx) else []),
            "--port", str(contract.ROUTER_PORT),
            # Beyond what the KV cache holds at a typical request size (and
            # max-num-seqs) requests only queue or preempt inside the engine;
            # held at the router they are counted by the autoscaler too.
            *_concurrency_args(ctx),
            # One step's prefill: cache-aware holds the prompts beyond it, for whichever engine clears first.
            "--prompt-queue-tokens", str(engine_step_tokens(ctx)),
            "--model", ctx.served_name,
            "--drain-delay", str(contract.ROUTER_DRAIN_SECONDS),
            "--shutdown-grace", str(contract.ROUTER_SHUTDOWN_GRACE_SECONDS),
            *(["--max-queue", str(router.max_queue)] if router.max_queue else []),
            *(["--queue-timeout", str(router.queue_timeout_seconds)] if router.queue_timeout_seconds else []),
            "--cold-start-timeout", str(cold_start_timeout(ctx)),
            *(["--demand-lease", contract.demand_lease_name(ctx.name)] if scales_to_zero(ctx) else []),
            *_auth_args(ctx),
        ],
        "env": [{"name": contract.ENV_ROUTER_POD_IP, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
        "ports": [{"name": contract.PORT_NAME_HTTP, "containerPort": contract.ROUTER_PORT, "protocol": "TCP"}],
        "readinessProbe": {**_health(), "periodSeconds": 5, "timeoutSeconds": 3, "failureThreshold": 3},
        "livenessProbe": {**_health(), "periodSeconds": 10, "timeoutSeconds": 5, "failureThreshold": 6},
        "resources": _resources(ctx),
        "securityContext": {
            "runAsNonRoot": True,
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"},
        },
    }
    if router.auth is not None:
        container["volumeMounts"] = [
            {"name": contract.ROUTER_API_KEYS_VOLUME, "mountPath": contract.ROUTER_API_KEYS_PATH, "readOnly": True}]
    return container


def deployment(ctx: Context) -> dict[str, Any]:
    labels = pod_labels(ctx.name, contract.COMPONENT_ROUTER)
    pod = {
        "serviceAccountName": _name(ctx),
        # It watches EndpointSlices through the API server.
        "automountServiceAccountToken": True,
        "enableServiceLinks": False,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": contract.CONTROL_PLANE_UID,
            "runAsGroup": contract.CONTROL_PLANE_UID,
            # The API keys' files get this group (see API_KEYS_MODE).
            **({"fsGroup": contract.CONTROL_PLANE_UID} if ctx.spec.router.auth is not None else {}),
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        # Two router pods on one node would fail together.
        "topologySpreadConstraints": [{
            "maxSkew": 1,
            "topologyKey": contract.LABEL_HOSTNAME,
            "whenUnsatisfiable": "ScheduleAnyway",
            "labelSelector": {"matchLabels": router_selector(ctx.name)},
        }],
        "containers": [_container(ctx)],
        # SIGTERM starts the drain: keep serving while the endpoints update, then
        # let in-flight generations finish (the router ends the rest with an SSE error).
        "terminationGracePeriodSeconds": contract.ROUTER_DRAIN_SECONDS + contract.ROUTER_SHUTDOWN_GRACE_SECONDS
        + contract.ROUTER_TERMINATION_MARGIN_SECONDS,
    }
    if ctx.spec.image_pull_secrets:
        pod["imagePullSecrets"] = [{"name": ref.name} for ref in ctx.spec.image_pull_secrets]
    auth = ctx.spec.router.auth
    if auth is not None:
        pod["volumes"] = [{"name": contract.ROUTER_API_KEYS_VOLUME, "secret": {
            "secretName": auth.secret_ref.name, "optional": False, "defaultMode": API_KEYS_MODE}}]
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata(ctx, _name(ctx), contract.COMPONENT_ROUTER),
        "spec": {
            "replicas": ctx.spec.router.replicas,
            "revisionHistoryLimit": 3,
            # A new router is Ready before an old one starts draining: capacity never drops in a rollout.
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "selector": {"matchLabels": router_selector(ctx.name)},
            "template": {"metadata": {"labels": labels}, "spec": pod},
        },
    }
