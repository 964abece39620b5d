"""The Helm chart: renders, lints, validates, and agrees with the operator's code.

Rendered with helm-python-sdk (Helm's Go engine; no helm binary needed). Every
list the chart must agree with (RBAC rules, `tensorfleet run` flags, metric
names, the CRD) is imported from the code, never re-typed here.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from pod_security import violations

from tensorfleet import contract
from tensorfleet.cli import build_parser
from tensorfleet.controller.cli import config_from_args, rbac_objects
from tensorfleet.kube.resources import rbac_rules

helm = pytest.importorskip("helm_python", reason="helm-python-sdk is a dev dependency (pip install -e '.[dev]')")

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "tensorfleet"
RELEASE = "tf"
NAMESPACE = "tensorfleet-system"
KUBE_VERSIONS = ("1.30.0", kubernetes_validate.latest_version())
# Kinds of other projects' CRDs: opt-in, and not in kubernetes-validate's schemas.
THIRD_PARTY = {"monitoring.coreos.com/v1", "cert-manager.io/v1"}

VALUE_SETS: dict[str, dict[str, Any]] = {
    "default": {},
    "namespaced": {"watchNamespaces": ["team-a", "team-b"]},
    "webhook-off": {"webhook": {"enabled": False}},
    "monitoring-on": {"metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "prom"}}},
                      "grafana": {"dashboard": {"enabled": True}},
                      "monitoring": {"podMonitors": {"enabled": True, "labels": {"release": "prom"},
                                                     "namespaces": ["ml"], "interval": "5s"}}},
    "cert-manager": {"webhook": {"certManager": {"enabled": True}, "failurePolicy": "Ignore"}},
    "cert-manager-cluster-issuer": {"webhook": {"certManager": {"enabled": True,
                                                                "issuerRef": {"kind": "ClusterIssuer", "name": "ca"}}}},
    "single-replica": {"operator": {"replicas": 1, "leaderElection": False}, "webhook": {"enabled": False},
                       "grafana": {"dashboard": {"enabled": False}},
                       "autoscaling": {"prometheusAdapter": {"configMap": False}}, "metrics": {"service": False}},
    # The operator runs outside the cluster (as with envtest): the API server calls it at a URL.
    "outside-cluster": {"webhook": {"url": "https://127.0.0.1:9443/spec"}, "operator": {"replicas": 0}},
    "outside-cluster-cert-manager": {"webhook": {"url": "https://host.docker.internal:9443/spec",
                                                 "certManager": {"enabled": True}}},
    "network-policy-off": {"networkPolicy": {"enabled": False}},
    "hub-off": {"hub": {"enabled": False}},
    "hub-token": {"hub": {"endpoint": "https://hf-mirror.example.com", "tokenSecret": {"name": "hf-token"}}},
    "network-policy-tight": {"networkPolicy": {"monitoringNamespaces": [], "webhookFrom": [{"ipBlock": {"cidr": "10.0.0.0/28"}}]},
                             "webhook": {"enabled": False}},
    "network-policy-loose": {"networkPolicy": {"monitoringNamespaces": ["monitoring", "prometheus"], "extraIngress": [
        {"from": [{"namespaceSelector": {}}], "ports": [{"protocol": "TCP", "port": 9090}]}]}},
}


@pytest.fixture(scope="module")
def chart() -> Any:
    return helm.Chart.load(str(CHART))


def render(chart: Any, values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    manifests = chart.render(values or None, name=RELEASE, namespace=NAMESPACE, is_install=True)
    objects = []
    for path, text in manifests.items():
        if not path.endswith((".yaml", ".yml")):
            continue
        objects += [doc for doc in yaml.safe_load_all(text) if doc]
    return objects


def by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def one(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = by_kind(objects, kind)
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


def operator_container(objects: list[dict[str, Any]]) -> dict[str, Any]:
    return one(objects, "Deployment")["spec"]["template"]["spec"]["containers"][0]


@pytest.mark.parametrize("name", VALUE_SETS)
def test_every_object_validates_strictly(chart: Any, name: str) -> None:
    objects = render(chart, VALUE_SETS[name])
    assert objects
    for obj in objects:
        assert obj["metadata"]["name"], obj
        if obj["apiVersion"] in THIRD_PARTY:
            continue
        for version in KUBE_VERSIONS:
            kubernetes_validate.validate(obj, version, strict=True)


@pytest.mark.parametrize("name", VALUE_SETS)
def test_lint_is_clean(name: str) -> None:
    report = helm.lint(str(CHART), VALUE_SETS[name] or None, strict=True, namespace=NAMESPACE, kube_version="v1.30.0")
    assert report["errors"] == []
    # Severity 1 is informational (e.g. "icon is recommended"); warnings and errors fail.
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


def test_chart_crds_are_the_repository_crds(chart: Any) -> None:
    top = sorted((ROOT / "crds").glob("*.yaml"))
    ours = sorted((CHART / "crds").glob("*.yaml"))
    assert [p.name for p in ours] == [p.name for p in top]
    for a, b in zip(top, ours):
        assert a.read_bytes() == b.read_bytes(), f"{b} differs from {a}: copy crds/ into the chart"
    # What Helm itself loads as the chart's CRDs (installed before the templates).
    loaded = {c["name"]: c["data"] for c in chart.crds}
    assert loaded == {f"crds/{p.name}": p.read_text() for p in top}


def test_cluster_wide_rbac_is_exactly_the_operators_rules(chart: Any) -> None:
    objects = render(chart)
    role = one(objects, "ClusterRole")
    assert role["rules"] == rbac_rules()
    assert by_kind(objects, "Role") == []
    binding = one(objects, "ClusterRoleBinding")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                  "name": role["metadata"]["name"]}
    account = one(objects, "ServiceAccount")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account["metadata"]["name"],
                                    "namespace": NAMESPACE}]
    assert one(objects, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"] == account["metadata"]["name"]


def test_namespaced_rbac_matches_tensorfleet_rbac(chart: Any) -> None:
    watched = VALUE_SETS["namespaced"]["watchNamespaces"]
    objects = render(chart, VALUE_SETS["namespaced"])
    expected = rbac_objects("sa", NAMESPACE, watched)

    def rules_by(objs: list[dict[str, Any]], kind: str) -> dict[str | None, list[Any]]:
        return {o["metadata"].get("namespace"): o["rules"] for o in by_kind(objs, kind)}

    assert rules_by(objects, "ClusterRole") == rules_by(expected, "ClusterRole")
    assert rules_by(objects, "Role") == rules_by(expected, "Role")
    assert set(rules_by(objects, "Role")) == {*watched, NAMESPACE}
    bindings = {o["metadata"]["namespace"]: o for o in by_kind(objects, "RoleBinding")}
    roles = {o["metadata"]["namespace"]: o["metadata"]["name"] for o in by_kind(objects, "Role")}
    assert {ns: b["roleRef"]["name"] for ns, b in bindings.items()} == roles
    # Together the two halves are every rule, once.
    together = [r for o in by_kind(objects, "ClusterRole") for r in o["rules"]] + rules_by(objects, "Role")[NAMESPACE]
    assert sorted(map(json.dumps, together)) == sorted(map(json.dumps, rbac_rules()))


@pytest.mark.parametrize("name", ["default", "namespaced"])
def test_rbac_has_no_wildcards(chart: Any, name: str) -> None:
    for obj in render(chart, VALUE_SETS[name]):
        for rule in obj.get("rules", []):
            for key in ("apiGroups", "resources", "verbs"):
                assert "*" not in rule[key], (obj["metadata"]["name"], rule)


@pytest.mark.parametrize("name", VALUE_SETS)
def test_operator_args_are_what_tensorfleet_run_accepts(chart: Any, name: str) -> None:
    values = VALUE_SETS[name]
    container = operator_container(render(chart, values))
    assert container.get("command") is None, "the image's ENTRYPOINT is `tensorfleet`"
    args = build_parser().parse_args(container["args"])
    assert args.command == "run"
    config = config_from_args(args)
    assert config.namespaces == values.get("watchNamespaces", [])
    assert config.leader_election == values.get("operator", {}).get("leaderElection", True)
    assert config.health_port == 8080 and args.metrics_port == 9090 and args.log_format == "json"
    # Routers, simulator engines and vLLM engines default to the images this release ships.
    assert config.images.control_plane == container["image"]
    assert config.images.worker == contract.DEFAULT_ENGINE_IMAGE
    webhook_on = values.get("webhook", {}).get("enabled", True)
    assert (config.webhook is not None) == webhook_on
    if webhook_on:
        assert config.webhook is not None  # as the assertion above says
        # The API server calls webhooks over HTTPS only.
        assert not config.webhook.insecure and config.webhook.keyfile
        mounts = {m["mountPath"] for m in container["volumeMounts"]}
        assert config.webhook.certfile is not None
        assert str(Path(config.webhook.certfile).parent) in mounts
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"


def test_operator_deployment_defaults(chart: Any) -> None:
    objects = render(chart)
    deployment = one(objects, "Deployment")
    assert deployment["spec"]["replicas"] == 2
    container = operator_container(objects)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "health"}
    assert ports["health"] == 8080 and ports["metrics"] == 9090
    assert container["resources"]["requests"] and container["resources"]["limits"]["memory"]
    assert container["image"] == contract.CONTROL_PLANE_IMAGE
    assert one(objects, "PodDisruptionBudget")["spec"]["selector"] == deployment["spec"]["selector"]


def test_the_hub_token_secret_reaches_the_operator_as_hf_token(chart: Any) -> None:
    """The operator reads config.json with the release's own Secret, never with InferenceServices' Secrets."""
    container = operator_container(render(chart, VALUE_SETS["hub-token"]))
    env = {e["name"]: e for e in container["env"]}
    assert env["HF_TOKEN"]["valueFrom"] == {"secretKeyRef": {"name": "hf-token", "key": "HF_TOKEN"}}
    assert env["HF_ENDPOINT"]["value"] == "https://hf-mirror.example.com"
    assert "--no-hub" not in container["args"]
    default = operator_container(render(chart))
    assert not {"HF_TOKEN", "HF_ENDPOINT"} & {e["name"] for e in default["env"]}
    off = operator_container(render(chart, VALUE_SETS["hub-off"]))
    assert config_from_args(build_parser().parse_args(off["args"])).model_facts.hub is False
    assert not any(r["resources"] == ["secrets"] for r in one(render(chart), "ClusterRole")["rules"])


def test_chart_defaults_are_the_operators_own(chart: Any) -> None:
    """Ports, paths, the Lease and the downward-API env the chart wires are the ones `tensorfleet run` uses."""
    objects = render(chart)
    container = operator_container(objects)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"health": contract.OPERATOR_HEALTH_PORT, "metrics": contract.OPERATOR_METRICS_PORT,
                     "webhook": contract.OPERATOR_WEBHOOK_PORT}
    assert container["livenessProbe"]["httpGet"]["path"] == contract.OPERATOR_LIVENESS_PATH
    assert container["readinessProbe"]["httpGet"]["path"] == contract.OPERATOR_READINESS_PATH
    assert f"--lease-name={contract.OPERATOR_LEASE_NAME}" in container["args"]
    env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in container["env"] if "valueFrom" in e}
    assert env[contract.ENV_OPERATOR_POD_NAMESPACE] == "metadata.namespace"
    assert env[contract.ENV_OPERATOR_POD_NAME] == "metadata.name"
    (hook,) = one(objects, "ValidatingWebhookConfiguration")["webhooks"]
    assert hook["clientConfig"]["service"]["path"] == contract.WEBHOOK_PATH


@pytest.mark.parametrize("name", VALUE_SETS)
def test_restricted_pod_security(chart: Any, name: str) -> None:
    pod = one(render(chart, VALUE_SETS[name]), "Deployment")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    for container in pod["containers"]:
        sc = container["securityContext"]
        assert sc["runAsNonRoot"] is True and isinstance(sc["runAsUser"], int) and sc["runAsUser"] > 0
        assert sc["readOnlyRootFilesystem"] is True
        assert sc["allowPrivilegeEscalation"] is False
        assert sc["capabilities"] == {"drop": ["ALL"]}
        assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert not pod.get("hostNetwork") and not pod.get("hostPID")
    assert all("hostPath" not in v for v in pod.get("volumes", []))
    annotations = one(render(chart, VALUE_SETS[name]), "Deployment")["spec"]["template"]["metadata"].get("annotations")
    assert violations(pod, annotations) == []


def _namespaces_in(rule: dict[str, Any]) -> set[str]:
    return {v for peer in rule.get("from", []) for e in peer.get("namespaceSelector", {}).get("matchExpressions", [])
            if e["key"] == "kubernetes.io/metadata.name" and e["operator"] == "In" for v in e["values"]}


def test_operator_network_policy(chart: Any) -> None:
    objects = render(chart)
    policy = one(objects, "NetworkPolicy")
    deployment = one(objects, "Deployment")
    assert policy["spec"]["podSelector"] == deployment["spec"]["selector"]
    assert policy["spec"]["policyTypes"] == ["Ingress"], "egress stays open: the API server"
    container = operator_container(objects)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    webhook, metrics = policy["spec"]["ingress"]
    # The webhook port from anywhere: the API server cannot be selected.
    assert webhook == {"ports": [{"protocol": "TCP", "port": ports["webhook"]}]}
    assert metrics["ports"] == [{"protocol": "TCP", "port": ports["metrics"]}]
    assert _namespaces_in(metrics) == {"monitoring"}
    # Nothing else: not the health port (kubelet probes come from the node).
    assert ports["health"] not in {p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"]}

    assert by_kind(render(chart, VALUE_SETS["network-policy-off"]), "NetworkPolicy") == []
    tight = one(render(chart, VALUE_SETS["network-policy-tight"]), "NetworkPolicy")
    assert tight["spec"]["ingress"] == [], "no webhook, no scrapers: nothing comes in"
    narrowed = one(render(chart, {"networkPolicy": {"webhookFrom": [{"ipBlock": {"cidr": "10.0.0.0/28"}}]}}), "NetworkPolicy")
    assert narrowed["spec"]["ingress"][0]["from"] == [{"ipBlock": {"cidr": "10.0.0.0/28"}}]
    loose = one(render(chart, VALUE_SETS["network-policy-loose"]), "NetworkPolicy")["spec"]["ingress"]
    assert _namespaces_in(loose[1]) == {"monitoring", "prometheus"}
    assert loose[2] == {"from": [{"namespaceSelector": {}}], "ports": [{"protocol": "TCP", "port": 9090}]}
    # With the operator outside the cluster the policy selects no pod and stays harmless.
    assert one(render(chart, VALUE_SETS["outside-cluster"]), "NetworkPolicy")["spec"]["podSelector"] == \
        one(render(chart, VALUE_SETS["outside-cluster"]), "Deployment")["spec"]["selector"]


def test_self_signed_webhook_has_a_matching_ca_bundle(chart: Any, tmp_path: Path) -> None:
    import ssl

    from cryptography import x509

    objects = render(chart)
    config = one(objects, "ValidatingWebhookConfiguration")
    (hook,) = config["webhooks"]
    assert hook["failurePolicy"] == "Fail" and hook["sideEffects"] == "None"
    assert hook["rules"][0]["apiGroups"] == [contract.GROUP]
    assert hook["rules"][0]["resources"] == [contract.PLURAL]
    service = hook["clientConfig"]["service"]
    # kopf serves a validating handler at /<handler id>; the operator's handler id is "spec".
    assert service["path"] == "/spec"
    svc = next(s for s in by_kind(objects, "Service") if s["metadata"]["name"] == service["name"])
    assert svc["spec"]["ports"][0]["targetPort"] == "webhook"
    secret = one(objects, "Secret")
    ca = x509.load_pem_x509_certificate(base64.b64decode(hook["clientConfig"]["caBundle"]))
    cert = x509.load_pem_x509_certificate(base64.b64decode(secret["data"]["tls.crt"]))
    assert cert.issuer == ca.subject
    cert.verify_directly_issued_by(ca)  # the API server trusts caBundle; this is the chain it checks
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
    assert f"{service['name']}.{NAMESPACE}.svc" in names
    # What kopf's WebhookServer does with --webhook-cert/--webhook-key: load them into an SSL context.
    (tmp_path / "tls.crt").write_bytes(base64.b64decode(secret["data"]["tls.crt"]))
    (tmp_path / "tls.key").write_bytes(base64.b64decode(secret["data"]["tls.key"]))
    ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(tmp_path / "tls.crt", tmp_path / "tls.key")
    deployment = one(objects, "Deployment")
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert volumes["webhook-tls"]["secret"]["secretName"] == secret["metadata"]["name"]


def test_cert_manager_webhook(chart: Any) -> None:
    objects = render(chart, VALUE_SETS["cert-manager"])
    assert by_kind(objects, "Secret") == []
    certificate = one(objects, "Certificate")
    issuer = one(objects, "Issuer")
    assert certificate["spec"]["issuerRef"]["name"] == issuer["metadata"]["name"]
    config = one(objects, "ValidatingWebhookConfiguration")
    assert config["metadata"]["annotations"]["cert-manager.io/inject-ca-from"] == \
        f"{NAMESPACE}/{certificate['metadata']['name']}"
    assert "caBundle" not in config["webhooks"][0]["clientConfig"]
    assert config["webhooks"][0]["failurePolicy"] == "Ignore"
    deployment = one(objects, "Deployment")
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert volumes["webhook-tls"]["secret"]["secretName"] == certificate["spec"]["secretName"]
    external = render(chart, VALUE_SETS["cert-manager-cluster-issuer"])
    assert by_kind(external, "Issuer") == []
    assert one(external, "Certificate")["spec"]["issuerRef"] == {"kind": "ClusterIssuer", "name": "ca"}


def _sans(secret: dict[str, Any], ca_bundle: str) -> Any:
    """The serving certificate's SubjectAlternativeName, after checking it chains to caBundle."""
    from cryptography import x509

    ca = x509.load_pem_x509_certificate(base64.b64decode(ca_bundle))
    cert = x509.load_pem_x509_certificate(base64.b64decode(secret["data"]["tls.crt"]))
    assert cert.issuer == ca.subject
    cert.verify_directly_issued_by(ca)
    return cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value


def test_webhook_url_for_an_operator_outside_the_cluster(chart: Any) -> None:
    import ipaddress

    from cryptography import x509

    objects = render(chart, VALUE_SETS["outside-cluster"])
    (hook,) = one(objects, "ValidatingWebhookConfiguration")["webhooks"]
    assert hook["clientConfig"]["url"] == "https://127.0.0.1:9443/spec"
    assert "service" not in hook["clientConfig"]
    # Nothing in the cluster serves the webhook: no Service for it (the metrics Service stays).
    assert [s["metadata"]["name"] for s in by_kind(objects, "Service")] == [f"{RELEASE}-tensorfleet-metrics"]
    sans = _sans(one(objects, "Secret"), hook["clientConfig"]["caBundle"])
    assert sans.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1")]
    assert "127.0.0.1" not in sans.get_values_for_type(x509.DNSName)
    # Still valid for the Service name, should the operator move back into the cluster.
    assert f"{RELEASE}-tensorfleet-webhook.{NAMESPACE}.svc" in sans.get_values_for_type(x509.DNSName)
    # The Deployment is still rendered, scaled to 0 (no pods, so no PodDisruptionBudget).
    assert one(objects, "Deployment")["spec"]["replicas"] == 0
    assert by_kind(objects, "PodDisruptionBudget") == []


def test_webhook_url_with_a_dns_name(chart: Any) -> None:
    from cryptography import x509

    objects = render(chart, {"webhook": {"url": "https://dev-laptop.example.com:8443/spec"}})
    (hook,) = one(objects, "ValidatingWebhookConfiguration")["webhooks"]
    assert hook["clientConfig"] == {"url": "https://dev-laptop.example.com:8443/spec",
                                    "caBundle": hook["clientConfig"]["caBundle"]}
    sans = _sans(one(objects, "Secret"), hook["clientConfig"]["caBundle"])
    names = sans.get_values_for_type(x509.DNSName)
    assert "dev-laptop.example.com" in names and f"{RELEASE}-tensorfleet-webhook.{NAMESPACE}.svc" in names
    assert sans.get_values_for_type(x509.IPAddress) == []
    assert all("webhook" not in s["metadata"]["name"] for s in by_kind(objects, "Service"))
    # An IPv6 literal (urlParse drops the brackets) is an IP SAN too.
    v6 = render(chart, {"webhook": {"url": "https://[::1]:9443/spec"}})
    (hook,) = one(v6, "ValidatingWebhookConfiguration")["webhooks"]
    assert [str(ip) for ip in _sans(one(v6, "Secret"), hook["clientConfig"]["caBundle"])
            .get_values_for_type(x509.IPAddress)] == ["::1"]


def test_webhook_url_with_cert_manager(chart: Any) -> None:
    objects = render(chart, VALUE_SETS["outside-cluster-cert-manager"])
    certificate = one(objects, "Certificate")
    assert "host.docker.internal" in certificate["spec"]["dnsNames"]
    assert "ipAddresses" not in certificate["spec"]
    config = one(objects, "ValidatingWebhookConfiguration")
    assert config["webhooks"][0]["clientConfig"] == {"url": "https://host.docker.internal:9443/spec"}
    assert config["metadata"]["annotations"]["cert-manager.io/inject-ca-from"] == \
        f"{NAMESPACE}/{certificate['metadata']['name']}"
    assert all("webhook" not in s["metadata"]["name"] for s in by_kind(objects, "Service"))
    by_ip = one(render(chart, {"webhook": {"url": "https://10.0.0.7/spec", "certManager": {"enabled": True}}}),
                "Certificate")
    assert by_ip["spec"]["ipAddresses"] == ["10.0.0.7"]
    assert "10.0.0.7" not in by_ip["spec"]["dnsNames"]


def test_the_api_server_can_call_an_operator_outside_the_cluster(chart: Any, tmp_path: Path) -> None:
    """What the API server does with clientConfig: TLS to the URL trusting only caBundle, host name checked."""
    import asyncio
    import ssl

    import aiohttp

    from tensorfleet.controller.webhook import WebhookConfig, serve
    from tensorfleet.testing.loopback import free_port

    port = free_port()
    objects = render(chart, {"webhook": {"url": f"https://127.0.0.1:{port}/spec"}, "operator": {"replicas": 0}})
    client_config = one(objects, "ValidatingWebhookConfiguration")["webhooks"][0]["clientConfig"]
    secret = one(objects, "Secret")
    # `kubectl get secret ... -o jsonpath='{.data.tls\.crt}' | base64 -d`, as the chart's README says.
    for name in ("tls.crt", "tls.key"):
        (tmp_path / name).write_bytes(base64.b64decode(secret["data"][name]))
    trust = ssl.create_default_context(cadata=base64.b64decode(client_config["caBundle"]).decode())
    assert trust.check_hostname

    async def call() -> dict[str, Any]:
        runner = await serve(WebhookConfig(addr="127.0.0.1", port=port, certfile=str(tmp_path / "tls.crt"),
                                           keyfile=str(tmp_path / "tls.key")))
        try:
            body = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
                "uid": "42", "operation": "CREATE", "object": {"apiVersion": "tensorfleet.dev/v1alpha1",
                                                               "kind": "InferenceService", "metadata": {"name": "x"},
                                                               "spec": {"accelerator": {"type": "B100"}}}}}
            async with (
                aiohttp.ClientSession() as session,
                session.post(client_config["url"], json=body, ssl=trust) as response,
            ):
                assert response.status == 200
                return (await response.json())["response"]
        finally:
            await runner.cleanup()

    answer = asyncio.run(call())
    assert answer["uid"] == "42" and answer["allowed"] is False


@pytest.mark.parametrize("url", ["http://127.0.0.1:9443/spec", "127.0.0.1:9443", "https://", "https://u@host/spec"])
def test_webhook_url_must_be_https(chart: Any, url: str, tmp_path: Path) -> None:
    import shutil

    values = {"webhook": {"url": url}}
    with pytest.raises(helm.HelmValuesError) as caught:
        chart.render(values, name=RELEASE, namespace=NAMESPACE)
    assert "/webhook/url" in str(caught.value)
    if not url.startswith("https://"):
        # The template refuses it too, for `helm install --skip-schema-validation`.
        shutil.copytree(CHART, tmp_path / "tensorfleet")
        (tmp_path / "tensorfleet" / "values.schema.json").unlink()
        unchecked = helm.Chart.load(str(tmp_path / "tensorfleet"))
        with pytest.raises(helm.HelmRenderError) as failed:
            unchecked.render(values, name=RELEASE, namespace=NAMESPACE)
        message = str(failed.value)
        assert "webhook.url must be an https:// URL" in message and "\n" not in message


def test_webhook_off_renders_no_webhook(chart: Any) -> None:
    objects = render(chart, VALUE_SETS["webhook-off"])
    for kind in ("ValidatingWebhookConfiguration", "Secret", "Certificate", "Issuer"):
        assert by_kind(objects, kind) == []
    assert all("webhook" not in s["metadata"]["name"] for s in by_kind(objects, "Service"))


def test_third_party_kinds_are_opt_in(chart: Any) -> None:
    kinds = {o["kind"] for o in render(chart)}
    assert not kinds & {"ServiceMonitor", "Certificate", "Issuer", "ScaledObject"}
    monitor = one(render(chart, VALUE_SETS["monitoring-on"]), "ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "prom"
    assert monitor["spec"]["endpoints"][0]["port"] == "metrics"


def test_prometheus_adapter_rules_expose_the_hpa_metrics(chart: Any) -> None:
    maps = {c["metadata"]["name"]: c for c in by_kind(render(chart), "ConfigMap")}
    config = yaml.safe_load(maps[f"{RELEASE}-tensorfleet-adapter-rules"]["data"]["config.yaml"])
    rules = {r["name"]["as"]: r for r in config["rules"]}
    assert set(rules) == {contract.HPA_METRIC_PENDING, contract.HPA_METRIC_WAITING, contract.HPA_METRIC_ROUTER_PENDING}
    # The operator's HPAs: an Object metric per InferenceService, both queues summed.
    pending = rules[contract.HPA_METRIC_PENDING]
    assert pending["resources"]["overrides"] == {
        "namespace": {"resource": "namespace"},
        contract.METRIC_LABEL_INFERENCE_SERVICE: {"group": contract.GROUP, "resource": contract.PLURAL}}
    assert contract.ROUTER_METRIC_PENDING in pending["metricsQuery"]
    assert contract.VLLM_METRIC_WAITING in pending["metricsQuery"]
    waiting = rules[contract.HPA_METRIC_WAITING]
    assert waiting["seriesQuery"].startswith(contract.VLLM_METRIC_WAITING + "{")
    # Per pod (a Pods metric), not summed per namespace: two models in one namespace keep separate signals.
    assert waiting["resources"]["overrides"]["pod"] == {"resource": "pod"}
    assert "by (<<.GroupBy>>)" in waiting["metricsQuery"]
    assert rules[contract.HPA_METRIC_ROUTER_PENDING]["seriesQuery"].startswith(contract.ROUTER_METRIC_PENDING + "{")
    # The same rules are values the prometheus-adapter chart can take as rules.custom.
    assert config["rules"] == chart.values["autoscaling"]["prometheusAdapter"]["rules"]


def test_hpa_the_operator_renders_uses_the_adapter_metric(chart: Any) -> None:
    """The HPA the renderer writes asks the custom-metrics API for an Object metric the chart's adapter rules serve."""
    from tensorfleet.api import load_inference_service
    from tensorfleet.planner import make_plan
    from tensorfleet.render import render as render_isvc

    isvc = load_inference_service({
        "apiVersion": contract.API_VERSION, "kind": contract.KIND,
        "metadata": {"name": "llama", "namespace": "ml"},
        "spec": {"model": {"name": "meta-llama/Llama-3.1-8B-Instruct", "maxModelLen": 8192},
                 "accelerator": {"type": "H100-80GB"}, "autoscaling": {"maxReplicas": 4}},
    })
    (hpa,) = by_kind(render_isvc(isvc, make_plan(isvc.spec)), "HorizontalPodAutoscaler")
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Object"
    name = metric["object"]["metric"]["name"]
    assert metric["object"]["describedObject"] == {"apiVersion": contract.API_VERSION, "kind": contract.KIND,
                                                   "name": "llama"}

    maps = {c["metadata"]["name"]: c for c in by_kind(render(chart), "ConfigMap")}
    rules = yaml.safe_load(maps[f"{RELEASE}-tensorfleet-adapter-rules"]["data"]["config.yaml"])["rules"]
    serving = [r for r in rules if r["name"]["as"] == name]
    assert len(serving) == 1, f"no prometheus-adapter rule exposes the HPA's metric {name!r}"
    # An Object metric: the adapter must tie each series to the InferenceService (and its namespace).
    overrides = serving[0]["resources"]["overrides"]
    assert overrides[contract.METRIC_LABEL_INFERENCE_SERVICE] == {"group": contract.GROUP, "resource": contract.PLURAL}
    assert overrides["namespace"] == {"resource": "namespace"}


def test_pod_monitors_label_every_series_with_its_inference_service(chart: Any) -> None:
    assert not by_kind(render(chart), "PodMonitor")
    monitors = by_kind(render(chart, VALUE_SETS["monitoring-on"]), "PodMonitor")
    assert {m["spec"]["selector"]["matchLabels"][contract.LABEL_COMPONENT] for m in monitors} == {
        contract.COMPONENT_ENGINE, contract.COMPONENT_ROUTER}
    for monitor in monitors:
        assert monitor["metadata"]["labels"]["release"] == "prom"
        assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["ml"]}
        assert monitor["spec"]["selector"]["matchLabels"][contract.LABEL_MANAGED_BY] == contract.APP_NAME
        for endpoint in monitor["spec"]["podMetricsEndpoints"]:
            assert endpoint["interval"] == "5s" and endpoint["path"] == contract.METRICS_PATH
            # The pod label tensorfleet.dev/inference-service, as Prometheus names its meta label.
            source = "__meta_kubernetes_pod_label_" + contract.LABEL_INFERENCE_SERVICE.replace(".", "_").replace(
                "/", "_").replace("-", "_")
            assert {"sourceLabels": [source], "targetLabel": contract.METRIC_LABEL_INFERENCE_SERVICE,
                    "action": "replace"} in endpoint["relabelings"]
    ports = {m["spec"]["selector"]["matchLabels"][contract.LABEL_COMPONENT]:
             [e["port"] for e in m["spec"]["podMetricsEndpoints"]] for m in monitors}
    assert ports == {contract.COMPONENT_ENGINE: [contract.PORT_NAME_HTTP, contract.PORT_NAME_GPU_METRICS],
                     contract.COMPONENT_ROUTER: [contract.PORT_NAME_HTTP]}


def test_grafana_dashboard(chart: Any) -> None:
    maps = {c["metadata"]["name"]: c for c in by_kind(render(chart), "ConfigMap")}
    dashboard_map = maps[f"{RELEASE}-tensorfleet-dashboard"]
    assert dashboard_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(dashboard_map["data"]["tensorfleet-fleet.json"])
    exprs = " ".join(t["expr"] for p in dashboard["panels"] for t in p["targets"])
    for metric in (contract.VLLM_METRIC_WAITING, contract.ROUTER_METRIC_PENDING, contract.VLLM_METRIC_TTFT,
                   contract.VLLM_METRIC_KV_CACHE_USAGE, contract.GPU_METRIC_ALL_HEALTHY, contract.GPU_METRIC_TEMPERATURE):
        assert metric in exprs, metric
    assert "histogram_quantile(0.5," in exprs and "histogram_quantile(0.99," in exprs
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    off = render(chart, {"grafana": {"dashboard": {"enabled": False}}})
    assert all(not c["metadata"]["name"].endswith("-dashboard") for c in by_kind(off, "ConfigMap"))


def test_notes_tell_the_next_command(chart: Any) -> None:
    notes = chart.render(None, name=RELEASE, namespace=NAMESPACE, is_install=True)["tensorfleet/templates/NOTES.txt"]
    assert "kubectl apply -f" in notes and "examples/simulator-cpu.yaml" in notes
    assert "curl" in notes and "/v1/chat/completions" in notes


@pytest.mark.parametrize(("values", "expected"), [
    ({"operator": {"replicas": "two"}}, "/operator/replicas"),
    ({"webhook": {"failurePolicy": "Never"}}, "/webhook/failurePolicy"),
    ({"watchNamespaces": ["Team_A"]}, "/watchNamespaces/0"),
    ({"operator": {"logFormat": "xml"}}, "/operator/logFormat"),
    ({"operatr": {"replicas": 2}}, "operatr"),
    ({"image": {"pullPolicy": "Sometimes"}}, "/image/pullPolicy"),
    ({"webhook": {"timeoutSeconds": 60}}, "/webhook/timeoutSeconds"),
    ({"webhook": {"url": "http://127.0.0.1:9443/spec"}}, "/webhook/url"),
    ({"operator": {"replicas": -1}}, "/operator/replicas"),
    ({"networkPolicy": {"monitoringNamespaces": ["Monitoring_NS"]}}, "/networkPolicy/monitoringNamespaces/0"),
    ({"networkPolicy": {"enable": False}}, "enable"),
])
def test_schema_rejects_bad_values_naming_the_key(chart: Any, values: dict[str, Any], expected: str) -> None:
    with pytest.raises(helm.HelmValuesError) as caught:
        chart.validate_schema(values)
    assert expected in str(caught.value)
    with pytest.raises(helm.HelmValuesError):
        chart.render(values, name=RELEASE, namespace=NAMESPACE)


def test_several_operators_without_leader_election_are_refused(chart: Any) -> None:
    with pytest.raises(helm.HelmError) as caught:
        chart.render({"operator": {"replicas": 2, "leaderElection": False}}, name=RELEASE, namespace=NAMESPACE)
    assert "leaderElection" in str(caught.value)


def test_default_values_pass_the_schema(chart: Any) -> None:
    chart.validate_schema(None)
    for values in VALUE_SETS.values():
        chart.validate_schema(values)


def test_the_charts_argo_cd_health_check_reads_the_operators_conditions() -> None:
    """The ready resource.customizations block in the chart's README reads the conditions the operator writes
    (e2e/test_gitops.py runs it in gopher-lua on real objects); docs/gitops.md points to it."""
    import re

    from tensorfleet.controller import status

    text = (CHART / "README.md").read_text()
    block = re.search(r"```yaml\n(resource\.customizations\.health\.tensorfleet\.dev_InferenceService: \|\n.*?)```",
                      text, re.DOTALL)
    assert block, "the chart's README must carry the Argo CD health check"
    (lua,) = yaml.safe_load(block.group(1)).values()
    for condition in (status.READY, status.PLAN_VALID, status.STALLED, status.RECONCILING):
        assert f"c.{condition}" in lua
    assert "observedGeneration" in lua and "Suspended" in lua
    docs = (ROOT / "docs" / "gitops.md").read_text()
    assert "charts/tensorfleet/README.md#argo-cd-health-check" in docs
    assert "argocd.argoproj.io/sync-wave" in docs and "/spec/replicas" in docs


def _leaves(values: dict[str, Any], schema: dict[str, Any], prefix: str = "") -> list[str]:
    out = []
    for key, value in values.items():
        sub = schema.get("properties", {}).get(key, {})
        # resources is one knob (a Kubernetes ResourceRequirements), documented as a whole.
        if isinstance(value, dict) and value and "properties" in sub and key != "resources":
            out += _leaves(value, sub, f"{prefix}{key}.")
        else:
            out.append(f"{prefix}{key}")
    return out


def test_every_value_is_documented_and_in_the_schema(chart: Any) -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    lines = (CHART / "values.yaml").read_text().splitlines()
    leaves = _leaves(chart.values, schema)
    assert len(leaves) > 30
    for path in leaves:
        node = schema
        for part in path.split("."):
            assert part in node.get("properties", {}), f"{path} is not in values.schema.json"
            node = node["properties"][part]
        # The key's line in values.yaml has a comment right above it (the line, or a comment block).
        index = -1
        for depth, key in enumerate(path.split(".")):  # each part's line, after its parent's
            index = next(i for i in range(index + 1, len(lines)) if lines[i] == f"{'  ' * depth}{key}:" or
                         lines[i].startswith(f"{'  ' * depth}{key}: "))
        above = lines[index - 1].strip()
        assert above.startswith("#"), f"values.yaml: {path} has no comment saying what it does"


# --- the gateway (gateway.enabled) ---------------------------------------------------------------------------------

GATEWAY_VALUES: dict[str, dict[str, Any]] = {
    "cluster-wide": {"gateway": {"enabled": True}},
    "namespaced-keys": {"watchNamespaces": ["team-a", "team-b"],
                        "gateway": {"enabled": True, "autoscaling": {"enabled": False}, "replicas": 1,
                                    "apiKeys": {"secretName": "gateway-keys", "requestsPerMinute": 600,
                                                "tokensPerMinute": 100000},
                                    "networkPolicy": {"from": [{"namespaceSelector": {"matchLabels": {"edge": "1"}}}]},
                                    "extraArgs": ["--max-body-bytes=33554432"]}},
}


def gateway_objects(chart: Any, name: str) -> list[dict[str, Any]]:
    return [o for o in render(chart, GATEWAY_VALUES[name])
            if o["metadata"]["name"].endswith("-gateway")]


@pytest.mark.parametrize("name", GATEWAY_VALUES)
def test_gateway_objects_validate_and_lint(chart: Any, name: str) -> None:
    objects = gateway_objects(chart, name)
    assert {"ServiceAccount", "Deployment", "Service", "NetworkPolicy"} <= {o["kind"] for o in objects}
    for obj in objects:
        for version in KUBE_VERSIONS:
            kubernetes_validate.validate(obj, version, strict=True)
    report = helm.lint(str(CHART), GATEWAY_VALUES[name], strict=True, namespace=NAMESPACE, kube_version="v1.30.0")
    assert report["errors"] == [] and [m for m in report["messages"] if m["severity"] >= 2] == []
    assert by_kind(render(chart), "HorizontalPodAutoscaler") == []  # off by default: nothing of it renders
    assert not [o for o in render(chart) if o["metadata"]["name"].endswith("-gateway")]


@pytest.mark.parametrize("name", GATEWAY_VALUES)
def test_gateway_args_are_what_tensorfleet_gateway_accepts(chart: Any, name: str) -> None:
    values = GATEWAY_VALUES[name]
    objects = gateway_objects(chart, name)
    deployment = one(objects, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    args = build_parser().parse_args(container["args"])
    assert args.command == "gateway" and args.port == 8080
    assert args.namespace == values.get("watchNamespaces", [])
    keys = values["gateway"].get("apiKeys", {})
    if keys:
        assert args.api_keys and args.requests_per_minute == 600 and args.tokens_per_minute == 100000
        (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == args.api_keys]
        (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
        assert volume["secret"]["secretName"] == "gateway-keys"
        assert args.max_body_bytes == 33554432
    else:
        assert args.api_keys is None
    assert container["readinessProbe"]["httpGet"] == {"path": contract.HEALTH_PATH, "port": "http"}
    assert violations(pod, None) == []
    # The operator reads its conversation counts from its Service.
    service = one(objects, "Service")
    operator = build_parser().parse_args(operator_container(
        [o for o in render(chart, values) if not o["metadata"]["name"].endswith("-gateway")])["args"])
    assert config_from_args(operator).gateway_service == (NAMESPACE, service["metadata"]["name"])
    assert config_from_args(operator).gateway_poll_seconds == 30
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]


def test_gateway_rbac_reads_inference_services_and_router_endpoints(chart: Any) -> None:
    wide = gateway_objects(chart, "cluster-wide")
    (rules,) = [o["rules"] for o in wide if o["kind"] == "ClusterRole"]
    assert {(g, r, tuple(rule["verbs"])) for rule in rules for g in rule["apiGroups"] for r in rule["resources"]} == {
        (contract.GROUP, contract.PLURAL, ("list", "watch")), ("discovery.k8s.io", "endpointslices", ("list", "watch"))}
    namespaced = gateway_objects(chart, "namespaced-keys")
    assert not by_kind(namespaced, "ClusterRole")
    assert {o["metadata"]["namespace"] for o in by_kind(namespaced, "Role")} == {"team-a", "team-b"}
    for binding in by_kind(namespaced, "RoleBinding"):
        assert binding["subjects"][0]["name"] == one(namespaced, "ServiceAccount")["metadata"]["name"]


def test_every_router_admits_the_gateway_pods(chart: Any) -> None:
    """The routers' NetworkPolicy (rendered by the operator beside the chart's gateway) selects its pods."""
    from tensorfleet.api import load_inference_service
    from tensorfleet.planner import make_plan
    from tensorfleet.render import render as render_isvc

    pods = one(gateway_objects(chart, "cluster-wide"), "Deployment")["spec"]["template"]["metadata"]["labels"]
    doc = {"apiVersion": contract.API_VERSION, "kind": contract.KIND, "metadata": {"name": "m", "namespace": "ml"},
           "spec": {"model": {"name": "meta-llama/Llama-3.1-8B-Instruct"}, "accelerator": {"type": "L4"}}}
    isvc = load_inference_service(doc)
    objects = render_isvc(isvc, make_plan(isvc.spec), operator_namespace=NAMESPACE)
    (policy,) = [o for o in objects if o["kind"] == "NetworkPolicy" and o["metadata"]["name"] == "m-router"]
    admitted = [peer for rule in policy["spec"]["ingress"] for peer in rule["from"]
                if "podSelector" in peer and peer["podSelector"].get("matchLabels")
                and all(pods.get(k) == v for k, v in peer["podSelector"]["matchLabels"].items())
                and NAMESPACE in {v for e in peer.get("namespaceSelector", {}).get("matchExpressions", [])
                                  for v in e["values"]}]
    assert admitted


def test_gateway_network_policy(chart: Any) -> None:
    (open_door,) = by_kind(gateway_objects(chart, "cluster-wide"), "NetworkPolicy")
    assert open_door["spec"]["ingress"] == [{"ports": [{"protocol": "TCP", "port": 8080}]}]
    (narrowed,) = by_kind(gateway_objects(chart, "namespaced-keys"), "NetworkPolicy")
    (rule,) = narrowed["spec"]["ingress"]
    peers = rule["from"]
    assert {"namespaceSelector": {"matchLabels": {"edge": "1"}}} in peers
    operator_pods = one([o for o in render(chart) if o["kind"] == "Deployment"], "Deployment")
    assert {"podSelector": {"matchLabels": operator_pods["spec"]["selector"]["matchLabels"]}} in peers
    assert _namespaces_in(rule) == {"monitoring"}
