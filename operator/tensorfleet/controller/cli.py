"""`tensorfleet run`: the operator process. Design: docs/architecture.md#the-reconcile-loop."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from typing import TYPE_CHECKING, Any

from tensorfleet import argtypes, contract, extras

if TYPE_CHECKING:
    from tensorfleet.controller.operator import OperatorConfig


def _env_list(name: str) -> list[str]:
    return [item.strip() for item in os.environ.get(name, "").split(",") if item.strip()]


def register(commands: Any) -> None:
    run = commands.add_parser("run", help="run the operator (against KUBECONFIG or the in-cluster service account)")
    scope = run.add_argument_group("scope")
    scope.add_argument("-n", "--namespace", dest="namespaces", action="append", default=None,
                       help=f"watch only this namespace (repeatable; env {contract.ENV_WATCH_NAMESPACES}=a,b); "
                            "default: all namespaces")
    scope.add_argument("--context", help="kubeconfig context (outside a cluster)")
    tuning = run.add_argument_group("reconciling")
    tuning.add_argument("--workers", type=argtypes.positive_int, default=4, help="InferenceServices reconciled in parallel (default 4)")
    tuning.add_argument("--resync-seconds", type=argtypes.positive_float, default=300.0,
                        help="re-check every InferenceService this often, besides watch events (default 300)")
    tuning.add_argument("--node-not-ready-seconds", type=argtypes.positive_float, default=60.0,
                        help="restart a multi-node (pipeline-parallel) group once one of its pods' nodes has been "
                             "seen not Ready this long; its peers cannot reach that stage meanwhile (default 60)")
    tuning.add_argument("--worker-image", default=os.environ.get(contract.ENV_DEFAULT_WORKER_IMAGE) or None,
                        help=f"default engine image for vllm InferenceServices (env {contract.ENV_DEFAULT_WORKER_IMAGE}; "
                             "default: the worker image of this release)")
    tuning.add_argument("--cpu-worker-image", default=os.environ.get(contract.ENV_DEFAULT_CPU_WORKER_IMAGE) or None,
                        help=f"default engine image for vllm InferenceServices on accelerator {contract.CPU_ACCELERATOR} "
                             f"(env {contract.ENV_DEFAULT_CPU_WORKER_IMAGE}; default: vLLM's CPU image of the release "
                             "the worker image runs)")
    tuning.add_argument("--control-plane-image", default=os.environ.get(contract.ENV_DEFAULT_CONTROL_PLANE_IMAGE) or None,
                        help=f"default router and simulator image (env {contract.ENV_DEFAULT_CONTROL_PLANE_IMAGE}; "
                             "default: the control-plane image of this release)")
    tuning.add_argument("--gpu-device-class", default=contract.DEFAULT_GPU_DEVICE_CLASS, metavar="NAME",
                        help="the DeviceClass engine pods' GPU claims name under spec.accelerator.allocation "
                             f"deviceClass (Dynamic Resource Allocation; default {contract.DEFAULT_GPU_DEVICE_CLASS}, "
                             "the one NVIDIA's DRA driver installs)")
    gateway = run.add_argument_group("gateway (docs/gateway.md)")
    gateway.add_argument("--gateway-service", metavar="NAMESPACE/NAME", type=_namespaced_name,
                         help="the gateway's Service (the chart's, with gateway.enabled): every --gateway-poll-seconds "
                              "the operator reads the new conversations its pods sent each InferenceService and shows "
                              "them in status.traffic; without it status.traffic shows the weights' shares only")
    gateway.add_argument("--gateway-poll-seconds", type=argtypes.positive_float, default=30.0, metavar="SECONDS",
                         help="how often the gateway's counts are read (default 30)")
    facts = run.add_argument_group("model facts (controller/modelfacts.py)")
    facts.add_argument("--no-hub", action="store_true",
                       help="plan from the built-in catalog (and spec.model.architecture) only; never read a model's "
                            "config.json from the Hugging Face Hub. By default it is read once per model (HF_ENDPOINT, "
                            "HF_HUB_OFFLINE and HF_TOKEN apply) and pinned in status.modelFacts")
    facts.add_argument("--hub-timeout-seconds", type=argtypes.positive_float, default=5.0,
                       help="longest a reconcile waits for the Hub (default 5; the webhook waits at most 2)")
    policy = run.add_argument_group("policy")
    policy.add_argument("--allowed-registry", dest="allowed_registries", action="append", default=None,
                        metavar="PREFIX",
                        help="InferenceServices may name only images under this registry host or host/path, e.g. "
                             "registry.example.com or nvcr.io/nvidia (repeatable; env "
                             f"{contract.ENV_ALLOWED_REGISTRIES}=a,b); default: any registry. Enforced by the webhook "
                             "and at reconcile; the operator's default images are always allowed")
    election = run.add_argument_group("leader election")
    election.add_argument("--no-leader-election", action="store_true",
                          help="reconcile without holding the Lease (only for a single replica)")
    election.add_argument("--lease-namespace", default=os.environ.get(contract.ENV_OPERATOR_POD_NAMESPACE, "default"),
                          help=f"namespace of the Lease (default: ${contract.ENV_OPERATOR_POD_NAMESPACE}, else default)")
    election.add_argument("--lease-name", default=contract.OPERATOR_LEASE_NAME, help="name of the Lease")
    serving = run.add_argument_group("endpoints")
    serving.add_argument("--health-port", type=argtypes.non_negative_int, default=contract.OPERATOR_HEALTH_PORT,
                         help=f"{contract.OPERATOR_LIVENESS_PATH} and {contract.OPERATOR_READINESS_PATH} port "
                              f"(default {contract.OPERATOR_HEALTH_PORT})")
    serving.add_argument("--metrics-port", type=argtypes.non_negative_int, default=contract.OPERATOR_METRICS_PORT,
                         help=f"Prometheus /metrics port; 0 turns it off (default {contract.OPERATOR_METRICS_PORT})")
    serving.add_argument("--log-format", choices=("plain", "json"), default="plain", help="log line format (default plain)")
    serving.add_argument("--verbose", action="store_true", help="debug logging")
    hook = run.add_argument_group("validating admission webhook (off unless --webhook-port is given)")
    hook.add_argument("--webhook-port", type=argtypes.positive_int, help="serve the webhook on this port")
    hook.add_argument("--webhook-cert", help="TLS certificate file (e.g. from cert-manager)")
    hook.add_argument("--webhook-key", help="TLS private key file")
    hook.add_argument("--webhook-insecure", action="store_true",
                      help="serve plain HTTP (local runs only: the API server calls webhooks over HTTPS)")
    run.set_defaults(func=_cmd_run)

    rbac = commands.add_parser("rbac", help="print the RBAC the operator needs (ClusterRole, or Role per namespace)")
    rbac.add_argument("--service-account", default="tensorfleet-operator", help="subject to bind (default tensorfleet-operator)")
    rbac.add_argument("--service-account-namespace", default="tensorfleet-system",
                      help="namespace of that ServiceAccount (default tensorfleet-system)")
    rbac.add_argument("-n", "--namespace", dest="namespaces", action="append", default=None,
                      help="namespaced mode: a Role and RoleBinding in each watched namespace instead of cluster-wide")
    rbac.set_defaults(func=_cmd_rbac)


def rbac_objects(service_account: str, service_account_namespace: str, namespaces: list[str] | None) -> list[dict[str, Any]]:
    """RBAC objects granting exactly kube.resources' verbs; cluster-wide unless namespaces are given."""
    from tensorfleet import contract
    from tensorfleet.kube.resources import ALL_KINDS, rbac_rules

    name = "tensorfleet-operator"
    labels = {contract.LABEL_NAME: contract.APP_NAME, contract.LABEL_COMPONENT: "operator"}
    subject = {"kind": "ServiceAccount", "name": service_account, "namespace": service_account_namespace}
    rules = rbac_rules()
    if not namespaces:
        return [
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
             "metadata": {"name": name, "labels": labels}, "rules": rules},
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
             "metadata": {"name": name, "labels": labels},
             "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
             "subjects": [subject]},
        ]
    cluster_scoped = [r for r in rules if r["resources"][0] in
                      {k.plural for k in ALL_KINDS if not k.namespaced}]
    namespaced = [r for r in rules if r not in cluster_scoped]
    objects: list[dict[str, Any]] = [
        # kopf lists namespaces and CRDs even when it watches chosen namespaces, and Nodes are cluster-scoped.
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
         "metadata": {"name": f"{name}-discovery", "labels": labels}, "rules": cluster_scoped},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
         "metadata": {"name": f"{name}-discovery", "labels": labels},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": f"{name}-discovery"},
         "subjects": [subject]},
    ]
    for namespace in dict.fromkeys([*namespaces, service_account_namespace]):
        objects += [
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
             "metadata": {"name": name, "namespace": namespace, "labels": labels}, "rules": namespaced},
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
             "metadata": {"name": name, "namespace": namespace, "labels": labels},
             "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
             "subjects": [subject]},
        ]
    return objects


def _cmd_rbac(args: argparse.Namespace) -> int:
    import yaml

    objects = rbac_objects(args.service_account, args.service_account_namespace, args.namespaces)
    sys.stdout.write(yaml.safe_dump_all(objects, sort_keys=False, explicit_start=True))
    return 0


def config_from_args(args: argparse.Namespace) -> OperatorConfig:
    """The OperatorConfig that `tensorfleet run ARGS` runs with (env defaults applied).

    Raises ValueError for a combination of arguments the operator cannot run with.
    """
    from tensorfleet.controller.modelfacts import ModelFactsConfig
    from tensorfleet.controller.operator import OperatorConfig, WebhookConfig
    from tensorfleet.render import Images

    webhook = None
    if args.webhook_port and not args.webhook_insecure and not (args.webhook_cert and args.webhook_key):
        raise ValueError("--webhook-port needs --webhook-cert and --webhook-key (or --webhook-insecure for local runs)")
    registries = tuple(args.allowed_registries or _env_list(contract.ENV_ALLOWED_REGISTRIES))
    for prefix in registries:
        if not prefix.strip("/") or "://" in prefix or any(c.isspace() for c in prefix):
            raise ValueError(f"--allowed-registry {prefix!r}: give a registry host or host/path, "
                             "such as registry.example.com or nvcr.io/nvidia")
    if args.webhook_port:
        webhook = WebhookConfig(port=args.webhook_port, certfile=args.webhook_cert, keyfile=args.webhook_key,
                                insecure=args.webhook_insecure, allowed_registries=registries)
    return OperatorConfig(
        allowed_registries=registries,
        namespaces=args.namespaces or _env_list(contract.ENV_WATCH_NAMESPACES),
        workers=args.workers,
        resync_seconds=args.resync_seconds,
        node_not_ready_seconds=args.node_not_ready_seconds,
        leader_election=not args.no_leader_election,
        lease_namespace=args.lease_namespace,
        lease_name=args.lease_name,
        health_port=args.health_port or None,
        webhook=webhook,
        images=Images(worker=args.worker_image or Images.worker,
                      control_plane=args.control_plane_image or Images.control_plane,
                      cpu_worker=args.cpu_worker_image or Images.cpu_worker),
        gpu_device_class=args.gpu_device_class,
        gateway_service=args.gateway_service,
        gateway_poll_seconds=args.gateway_poll_seconds,
        model_facts=ModelFactsConfig(hub=not args.no_hub, timeout_seconds=args.hub_timeout_seconds,
                                     admission_timeout_seconds=min(2.0, args.hub_timeout_seconds)),
    )


def _namespaced_name(text: str) -> tuple[str, str]:
    namespace, slash, name = text.partition("/")
    if not slash or not namespace or not name or "/" in name:
        raise argparse.ArgumentTypeError(f"{text!r}: want NAMESPACE/NAME, e.g. tensorfleet-system/tensorfleet-gateway")
    return namespace, name


def _configure_logging(args: argparse.Namespace) -> None:
    import kopf

    kopf.configure(verbose=args.verbose, log_format=kopf.LogFormat.JSON if args.log_format == "json" else kopf.LogFormat.PLAIN)
    logging.getLogger("tensorfleet").setLevel(logging.DEBUG if args.verbose else logging.INFO)
    # kopf logs every handler call; ours run on every watch event, so that is
    # noise unless debugging. The reconciler logs what it changes.
    logging.getLogger("kopf.objects").setLevel(logging.DEBUG if args.verbose else logging.WARNING)


def _cmd_run(args: argparse.Namespace) -> int:
    extras.require("tensorfleet run", "operator")
    from prometheus_client import start_http_server

    from tensorfleet.controller.operator import Operator
    from tensorfleet.kube.connection import Connection
    from tensorfleet.kube.lease import LostLease

    try:
        config = config_from_args(args)
    except ValueError as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 2
    try:
        connection = Connection.from_environment(context=args.context)
    except Exception as exc:  # noqa: BLE001 - config loading raises many types (no kubeconfig, bad file, no context)
        sys.stderr.write(f"error: cannot find a Kubernetes API to talk to: {exc}\n")
        return 1
    _configure_logging(args)
    if args.metrics_port:
        try:
            start_http_server(args.metrics_port)
        except OSError as exc:
            sys.stderr.write(f"error: metrics port {args.metrics_port}: {exc.strerror}\n")
            return 1
    operator = Operator(config, connection)
    try:
        asyncio.run(operator.run())
    except OSError as exc:  # a port already taken, mostly
        sys.stderr.write(f"error: {exc}\n")
        return 1
    except LostLease as exc:
        sys.stderr.write(f"error: {exc}; exiting so a fresh process rejoins the election\n")
        return 1
    except KeyboardInterrupt:
        return 0
    return 0
