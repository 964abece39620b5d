"""Rendering: InferenceService + Plan -> Kubernetes objects.

Every object is checked against the official OpenAPI schemas (strict: unknown
fields fail) for the oldest and newest Kubernetes versions supported, and the
shapes other components rely on (names, labels, env, probes) are asserted by
value.

This module holds what concerns every object (schema, names, ownership, labels
and selectors, Pod Security, purity), the HPA and PDB, and LoRA; the engine
StatefulSets are in test_render_engine.py, the Services, router and
NetworkPolicies in test_render_router.py. Its documents and helpers serve those
and the other test_render_* modules.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import kubernetes_validate
import pytest
import yaml
from pod_security import pod_templates, violations

from tensorfleet import contract
from tensorfleet.api import load_inference_service
from tensorfleet.planner import make_plan
from tensorfleet.render import leader_selector, render, selector_string

K8S_VERSIONS = ("1.30.0", kubernetes_validate.latest_version())

LLAMA_8B = "meta-llama/Llama-3.1-8B-Instruct"
LLAMA_70B = "meta-llama/Llama-3.1-70B-Instruct"
LLAMA_405B = "meta-llama/Llama-3.1-405B-Instruct"


def document(name: str = "llama", namespace: str | None = "ml", uid: str | None = "uid-1234", **spec: Any) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": name}
    if namespace is not None:
        metadata["namespace"] = namespace
    if uid is not None:
        metadata["uid"] = uid
    body: dict[str, Any] = {
        "model": {"name": LLAMA_8B, "maxModelLen": 8192},
        "accelerator": {"type": "H100-80GB"},
    }
    body.update(spec)
    return {"apiVersion": contract.API_VERSION, "kind": contract.KIND, "metadata": metadata, "spec": body}


def rendered(doc: dict[str, Any], **kwargs: Any) -> list[dict[str, Any]]:
    isvc = load_inference_service(doc)
    return render(isvc, make_plan(isvc.spec), **kwargs)


def by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def one(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: found {len(found)}"
    return found[0]


def engine(obj: dict[str, Any]) -> dict[str, Any]:
    container = obj["spec"]["template"]["spec"]["containers"][0]
    assert container["name"] == "engine"
    return container


def env_map(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {item["name"]: item for item in container["env"]}


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


PIPELINE_1 = document(parallelism={"tensor": 2, "pipeline": 1})
PIPELINE_2 = document(
    model={"name": LLAMA_70B, "maxModelLen": 8192, "servedName": "llama-70b", "revision": "main"},
    parallelism={"tensor": 4, "pipeline": 2},
    hfTokenSecretRef={"name": "hf-token", "key": "hf"},
    cache={"size": "500Gi", "storageClassName": "fast-ssd", "retentionPolicy": "Delete"},
    autoscaling={"minReplicas": 2, "maxReplicas": 6},
    engine={"args": ["--enable-prefix-caching", "--swap-space", "8"], "env": [{"name": "NCCL_DEBUG", "value": "INFO"}]},
)
PIPELINE_3 = document(model={"name": LLAMA_70B, "maxModelLen": 8192}, parallelism={"tensor": 4, "pipeline": 3}, replicas=3)
SIMULATOR = document(
    engine={"kind": "simulator"},
    accelerator={"type": "A100-80GB", "nodeSelector": {"pool": "cpu"}, "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "sim", "effect": "NoSchedule"}]},
    autoscaling={"maxReplicas": 3, "behavior": {"scaleUp": {"policies": [{"type": "Percent", "value": 100, "periodSeconds": 60}]}}},
)
ROUTER_AUTH = document(router={"auth": {"secretRef": {"name": "llm-keys"}, "requestsPerMinute": 600,
                                        "tokensPerMinute": 200000}})
CASES = {"pipeline-1": PIPELINE_1, "pipeline-2": PIPELINE_2, "pipeline-3": PIPELINE_3, "simulator": SIMULATOR,
         "router-auth": ROUTER_AUTH}


# --- schema ------------------------------------------------------------------------


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_every_object_validates_strictly(case: str, version: str) -> None:
    objects = rendered(CASES[case])
    assert objects
    for obj in objects:
        kubernetes_validate.validate(obj, version, strict=True)


def test_strict_validation_catches_a_bad_field() -> None:
    """The schema check is real: a misspelt field fails it."""
    obj = copy.deepcopy(by_kind(rendered(PIPELINE_1), "StatefulSet")[0])
    obj["spec"]["template"]["spec"]["containers"][0]["enviroment"] = []
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(obj, K8S_VERSIONS[0], strict=True)


def _walk(value: Any, path: str = "") -> list[str]:
    if value is None:
        return [path]
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in _walk(v, f"{path}.{k}")]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in _walk(v, f"{path}[{i}]")]
    return []


@pytest.mark.parametrize("case", sorted(CASES))
def test_no_nulls_and_no_status(case: str) -> None:
    for obj in rendered(CASES[case]):
        assert "status" not in obj
        assert set(obj) <= {"apiVersion", "kind", "metadata", "spec", "rules", "roleRef", "subjects"}
        assert _walk(obj) == [], f"{obj['kind']}/{obj['metadata']['name']} has nulls"


# --- names, namespace, ownership ------------------------------------------------------


@pytest.mark.parametrize(("doc", "pipeline"), [(PIPELINE_1, 1), (PIPELINE_2, 2), (PIPELINE_3, 3)])
def test_names_follow_the_contract(doc: dict[str, Any], pipeline: int) -> None:
    objects = rendered(doc)
    names = [(o["kind"], o["metadata"]["name"]) for o in objects]
    expected = {
        ("ServiceAccount", "llama-router"),
        ("Role", "llama-router"),
        ("RoleBinding", "llama-router"),
        ("Service", "llama-workers"),
        ("Service", "llama-engine"),
        ("Service", "llama"),
        ("Deployment", "llama-router"),
        ("PodDisruptionBudget", "llama-engine"),
        ("NetworkPolicy", "llama-engine"),
        ("NetworkPolicy", "llama-router"),
        *(("StatefulSet", f"llama-stage-{k}") for k in range(pipeline)),
    }
    if doc["spec"].get("autoscaling"):
        expected.add(("HorizontalPodAutoscaler", "llama"))
    assert len(names) == len(set(names))
    assert set(names) == expected
    assert [o["metadata"]["name"] for o in by_kind(objects, "StatefulSet")] == [
        contract.stage_name("llama", k) for k in range(pipeline)
    ]


def test_namespace_resolution() -> None:
    assert {o["metadata"]["namespace"] for o in rendered(PIPELINE_1)} == {"ml"}
    assert {o["metadata"]["namespace"] for o in rendered(PIPELINE_1, namespace="prod")} == {"prod"}
    assert {o["metadata"]["namespace"] for o in rendered(document(namespace=None))} == {"default"}
    binding = one(rendered(PIPELINE_1, namespace="prod"), "RoleBinding", "llama-router")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "llama-router", "namespace": "prod"}]
    router = one(rendered(PIPELINE_1, namespace="prod"), "Deployment", "llama-router")
    args = router["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--namespace") + 1] == "prod"


def test_owner_references_with_uid() -> None:
    for obj in rendered(PIPELINE_2):
        assert obj["metadata"]["ownerReferences"] == [{
            "apiVersion": "tensorfleet.dev/v1alpha1",
            "kind": "InferenceService",
            "name": "llama",
            "uid": "uid-1234",
            "controller": True,
            "blockOwnerDeletion": True,
        }]


@pytest.mark.parametrize(("doc", "kwargs"), [(document(uid=None), {}), (document(), {"standalone": True})])
def test_no_owner_references_without_uid_or_standalone(doc: dict[str, Any], kwargs: dict[str, Any]) -> None:
    objects = rendered(doc, **kwargs)
    assert objects
    for obj in objects:
        assert "ownerReferences" not in obj["metadata"]


# --- labels and selectors -------------------------------------------------------------


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_object_is_labelled(case: str) -> None:
    for obj in rendered(CASES[case]):
        labels = obj["metadata"]["labels"]
        assert labels["app.kubernetes.io/name"] == "tensorfleet"
        assert labels["app.kubernetes.io/instance"] == "llama"
        assert labels["app.kubernetes.io/managed-by"] == "tensorfleet"
        assert labels["tensorfleet.dev/inference-service"] == "llama"
        assert labels["app.kubernetes.io/version"] == contract.__version__
        is_router = obj["kind"] in {"ServiceAccount", "Role", "RoleBinding", "Deployment"} or (
            obj["kind"] == "Service" and obj["metadata"]["name"] == "llama"
        ) or (obj["kind"] == "NetworkPolicy" and obj["metadata"]["name"] == "llama-router")
        expected = "router" if is_router else "engine"
        assert labels["app.kubernetes.io/component"] == expected, obj["kind"]


def test_selectors_match_pod_templates() -> None:
    objects = rendered(PIPELINE_3)
    stages = by_kind(objects, "StatefulSet")
    router = one(objects, "Deployment", "llama-router")
    router_pods = router["spec"]["template"]["metadata"]["labels"]
    stage_pods = [s["spec"]["template"]["metadata"]["labels"] for s in stages]
    for k, sts in enumerate(stages):
        selector = sts["spec"]["selector"]["matchLabels"]
        assert selector["tensorfleet.dev/stage"] == str(k)
        assert selector["app.kubernetes.io/instance"] == "llama"
        # Selects its own pods and no other stage's, nor the router's.
        assert [matches(selector, pods) for pods in stage_pods] == [i == k for i in range(3)]
        assert not matches(selector, router_pods)
        assert stage_pods[k]["tensorfleet.dev/role"] == ("leader" if k == 0 else "worker")
        assert stage_pods[k]["app.kubernetes.io/component"] == "engine"
    assert matches(router["spec"]["selector"]["matchLabels"], router_pods)
    assert not any(matches(router["spec"]["selector"]["matchLabels"], pods) for pods in stage_pods)

    workers = one(objects, "Service", "llama-workers")["spec"]["selector"]
    leaders = one(objects, "Service", "llama-engine")["spec"]["selector"]
    front = one(objects, "Service", "llama")["spec"]["selector"]
    pdb = one(objects, "PodDisruptionBudget", "llama-engine")["spec"]["selector"]["matchLabels"]
    assert all(matches(workers, pods) for pods in stage_pods) and not matches(workers, router_pods)
    assert all(matches(pdb, pods) for pods in stage_pods) and not matches(pdb, router_pods)
    assert [matches(leaders, pods) for pods in stage_pods] == [True, False, False]
    assert matches(front, router_pods) and not any(matches(front, pods) for pods in stage_pods)
    assert leaders == leader_selector("llama")


def test_selector_string_is_stable() -> None:
    assert selector_string(leader_selector("llama")) == (
        "app.kubernetes.io/instance=llama,tensorfleet.dev/inference-service=llama,tensorfleet.dev/stage=0"
    )


def test_pod_templates_do_not_carry_the_version_label() -> None:
    """An operator upgrade must not restart GPU pods just by relabelling them."""
    objects = rendered(PIPELINE_2)
    for obj in [*by_kind(objects, "StatefulSet"), *by_kind(objects, "Deployment")]:
        assert contract.LABEL_VERSION not in obj["spec"]["template"]["metadata"]["labels"]


# --- Pod Security ----------------------------------------------------------------------

SIMULATOR_PIPELINE_2 = document(engine={"kind": "simulator"}, parallelism={"tensor": 1, "pipeline": 2})


@pytest.mark.parametrize("doc", [*CASES.values(), SIMULATOR_PIPELINE_2], ids=[*CASES, "simulator-pipeline-2"])
def test_every_pod_meets_the_restricted_profile(doc: dict[str, Any]) -> None:
    templates = pod_templates(rendered(doc))
    assert {name.split("/")[0] for name, _, _ in templates} == {"StatefulSet", "Deployment"}
    for name, pod, pod_annotations in templates:
        assert violations(pod, pod_annotations) == [], name


def test_the_restricted_check_is_real() -> None:
    """Each rule of the profile, broken once on a rendered pod, is caught."""
    base = by_kind(rendered(PIPELINE_2), "StatefulSet")[0]["spec"]["template"]["spec"]
    assert violations(base) == []

    def broken(change: Any) -> list[str]:
        pod = copy.deepcopy(base)
        change(pod, pod["containers"][0])
        return violations(pod)

    cases = {
        "hostNetwork": lambda p, c: p.update(hostNetwork=True),
        "privileged": lambda p, c: c["securityContext"].update(privileged=True),
        "allowPrivilegeEscalation": lambda p, c: c["securityContext"].pop("allowPrivilegeEscalation"),
        "capabilities.drop": lambda p, c: c["securityContext"].pop("capabilities"),
        "capabilities.add": lambda p, c: c["securityContext"]["capabilities"].update(add=["IPC_LOCK"]),
        "runAsNonRoot": lambda p, c: p["securityContext"].pop("runAsNonRoot"),
        "runAsUser must not be 0": lambda p, c: p["securityContext"].update(runAsUser=0),
        "seccompProfile": lambda p, c: p["securityContext"].pop("seccompProfile"),
        "hostPath": lambda p, c: p["volumes"].append({"name": "host", "hostPath": {"path": "/dev/infiniband"}}),
        "hostPort": lambda p, c: c["ports"][0].update(hostPort=8000),
        "nfs is not an allowed volume type": lambda p, c: p["volumes"].append({"name": "n", "nfs": {"server": "s", "path": "/"}}),
        "sysctl": lambda p, c: p["securityContext"].update(sysctls=[{"name": "kernel.msgmax", "value": "1"}]),
    }
    for says, change in cases.items():
        found = broken(change)
        assert found and any(says.split()[0] in line for line in found), (says, found)
    # NET_BIND_SERVICE is the one capability restricted allows adding.
    assert broken(lambda p, c: c["securityContext"]["capabilities"].update(add=["NET_BIND_SERVICE"])) == []
    # Container-level settings satisfy the pod-level rules too.
    def per_container(p: dict[str, Any], c: dict[str, Any]) -> None:
        p["securityContext"].pop("seccompProfile")
        p["securityContext"].pop("runAsNonRoot")
        for each in [*p.get("initContainers", []), *p["containers"]]:
            each["securityContext"].update(seccompProfile={"type": "Localhost", "localhostProfile": "x.json"}, runAsNonRoot=True)
    assert broken(per_container) == []


# --- HPA and PDB ---------------------------------------------------------------------


def test_no_hpa_without_autoscaling() -> None:
    assert by_kind(rendered(PIPELINE_1), "HorizontalPodAutoscaler") == []


def test_hpa_shape_with_defaults() -> None:
    hpa = one(rendered(PIPELINE_2), "HorizontalPodAutoscaler", "llama")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"] == {
        "scaleTargetRef": {"apiVersion": "tensorfleet.dev/v1alpha1", "kind": "InferenceService", "name": "llama"},
        "minReplicas": 2,
        "maxReplicas": 6,
        # Every waiting request of the service (routers and engines), described on the InferenceService and
        # divided by the replica count whether or not each is Ready.
        "metrics": [{
            "type": "Object",
            "object": {
                "describedObject": {"apiVersion": "tensorfleet.dev/v1alpha1", "kind": "InferenceService",
                                    "name": "llama"},
                "metric": {"name": contract.HPA_METRIC_PENDING},
                "target": {"type": "AverageValue", "averageValue": "4"},
            },
        }],
        "behavior": {
            "scaleUp": {"stabilizationWindowSeconds": 0, "selectPolicy": "Max",
                        "policies": [{"type": "Percent", "value": 100, "periodSeconds": 60},
                                     {"type": "Pods", "value": 4, "periodSeconds": 60}]},
            "scaleDown": {"stabilizationWindowSeconds": 600, "selectPolicy": "Max", "policies": [{"type": "Pods", "value": 1, "periodSeconds": 300}]},
        },
    }


def test_hpa_behaviour_override_merges_field_by_field() -> None:
    doc = document(autoscaling={
        "minReplicas": 1, "maxReplicas": 4, "targetPendingRequests": 10,
        "behavior": {
            "scaleUp": {"policies": [{"type": "Pods", "value": 1, "periodSeconds": 180}]},
            "scaleDown": {"stabilizationWindowSeconds": 120},
        },
    })
    hpa = one(rendered(doc), "HorizontalPodAutoscaler", "llama")
    assert hpa["spec"]["metrics"][0]["object"]["target"]["averageValue"] == "10"
    assert hpa["spec"]["behavior"] == {
        "scaleUp": {"stabilizationWindowSeconds": 0, "selectPolicy": "Max", "policies": [{"type": "Pods", "value": 1, "periodSeconds": 180}]},
        "scaleDown": {"stabilizationWindowSeconds": 120, "selectPolicy": "Max", "policies": [{"type": "Pods", "value": 1, "periodSeconds": 300}]},
    }
    # Defaults are not shared state: a second render still has them.
    again = one(rendered(PIPELINE_2), "HorizontalPodAutoscaler", "llama")
    assert again["spec"]["behavior"]["scaleUp"]["policies"] == [{"type": "Percent", "value": 100, "periodSeconds": 60},
                                                                {"type": "Pods", "value": 4, "periodSeconds": 60}]


def test_pdb() -> None:
    pdb = one(rendered(PIPELINE_2), "PodDisruptionBudget", "llama-engine")
    assert pdb["apiVersion"] == "policy/v1"
    assert pdb["spec"] == {
        "maxUnavailable": 1,
        "selector": {"matchLabels": {
            "app.kubernetes.io/instance": "llama",
            "tensorfleet.dev/inference-service": "llama",
            "app.kubernetes.io/component": "engine",
        }},
    }


# --- purity ------------------------------------------------------------------------


@pytest.mark.parametrize("case", sorted(CASES))
def test_rendering_is_deterministic(case: str) -> None:
    first = rendered(CASES[case])
    second = rendered(copy.deepcopy(CASES[case]))
    assert first == second
    assert json.dumps(first) == json.dumps(second)


def test_output_is_not_shared_with_the_input() -> None:
    isvc = load_inference_service(PIPELINE_2)
    plan = make_plan(isvc.spec)
    before = isvc.model_dump(by_alias=True)
    first = render(isvc, plan)
    for obj in first:
        obj["metadata"]["labels"].clear()
        for container in obj.get("spec", {}).get("template", {}).get("spec", {}).get("containers", []):
            for item in container.get("env", []):
                item.get("valueFrom", {}).clear()
                item["name"] = "X"
    assert isvc.model_dump(by_alias=True) == before
    assert render(isvc, plan) == rendered(PIPELINE_2)


def _containers(value: Any) -> list[Any]:
    if isinstance(value, dict):
        return [value, *(c for v in value.values() for c in _containers(v))]
    if isinstance(value, list):
        return [value, *(c for v in value for c in _containers(v))]
    return []


@pytest.mark.parametrize("case", sorted(CASES))
def test_no_dict_or_list_is_shared(case: str) -> None:
    """Shared sub-objects leak edits between objects and dump as YAML anchors (&id001)."""
    objects = rendered(CASES[case])
    ids = [id(c) for c in _containers(objects)]
    assert len(ids) == len(set(ids))
    assert "&id" not in yaml.safe_dump_all(objects)


def test_default_images_can_point_at_a_mirror() -> None:
    from tensorfleet.render import Images

    mirror = Images(worker="mirror.example/worker:1", control_plane="mirror.example/cp:1")
    for doc, engine_image in ((PIPELINE_2, mirror.worker), (SIMULATOR, mirror.control_plane)):
        isvc = load_inference_service(doc)
        objects = render(isvc, make_plan(isvc.spec), images=mirror)
        assert {engine(s)["image"] for s in by_kind(objects, "StatefulSet")} == {engine_image}
        router = by_kind(objects, "Deployment")[0]
        assert router["spec"]["template"]["spec"]["containers"][0]["image"] == mirror.control_plane
    # An image named in the spec still wins.
    doc = copy.deepcopy(PIPELINE_2)
    doc["spec"]["engine"] = {"image": "own/vllm:2"}
    isvc = load_inference_service(doc)
    assert {engine(s)["image"] for s in by_kind(render(isvc, make_plan(isvc.spec), images=mirror), "StatefulSet")} == {"own/vllm:2"}


# --- LoRA -----------------------------------------------------------------------


def _by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def _engine_env(objects: list[dict[str, Any]]) -> dict[str, str | None]:
    (sts,) = _by_kind(objects, "StatefulSet")
    return {v["name"]: v.get("value") for v in sts["spec"]["template"]["spec"]["containers"][0]["env"]}


def test_lora_engines_start_ready_for_adapters_with_the_plans_sizes() -> None:
    adapters = [{"name": "sql", "source": "org/sql", "rank": 8}, {"name": "chat", "source": "/cache/adapters/chat"}]
    objects = rendered(document(adapters=adapters))
    env = _engine_env(objects)
    plan = make_plan(load_inference_service(document(adapters=adapters)).spec)
    assert plan.lora is not None
    assert env[contract.ENV_ENABLE_LORA] == "true" and env[contract.ENV_RUNTIME_LORA_UPDATING] == "True"
    assert env[contract.ENV_MAX_LORAS] == str(plan.lora.max_loras)
    assert env[contract.ENV_MAX_LORA_RANK] == str(plan.lora.max_rank) == "16"  # the rank of "chat" is unknown
    assert env[contract.ENV_MAX_CPU_LORAS] == str(plan.lora.max_cpu_loras)
    # The adapters themselves are not in the pod: the operator loads them at runtime.
    assert "org/sql" not in json.dumps(_by_kind(objects, "StatefulSet"))
    without = _engine_env(rendered(document()))
    assert not {contract.ENV_ENABLE_LORA, contract.ENV_MAX_LORAS, contract.ENV_RUNTIME_LORA_UPDATING} & set(without)


def test_adding_or_removing_an_adapter_changes_no_engine_object() -> None:
    few = [{"name": f"a{i}", "source": f"org/a{i}"} for i in range(1)]
    many = [{"name": f"a{i}", "source": f"org/a{i}"} for i in range(12)]
    engine_kinds = ("StatefulSet", "Service", "PodDisruptionBudget", "NetworkPolicy", "Deployment")
    for kind in engine_kinds:
        assert _by_kind(rendered(document(adapters=few)), kind) == _by_kind(rendered(document(adapters=many)), kind), kind
    # spec.engine.lora alone starts the engines as the first adapter would: adding it restarts nothing either.
    ready = document(engine={"lora": {}})
    assert _by_kind(rendered(ready), "StatefulSet") == _by_kind(rendered(document(adapters=few)), "StatefulSet")


def test_with_lora_the_engines_admit_the_operator_on_the_engine_port() -> None:
    def operator_rules(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
        (policy,) = [p for p in _by_kind(objects, "NetworkPolicy") if p["metadata"]["name"].endswith("-engine")]
        return [rule for rule in policy["spec"]["ingress"]
                for peer in rule["from"] if peer.get("podSelector", {}).get("matchLabels", {}).get(
                    contract.LABEL_COMPONENT) == contract.COMPONENT_OPERATOR]

    doc = document(adapters=[{"name": "sql", "source": "org/sql"}])
    isvc = load_inference_service(doc)
    (rule,) = operator_rules(render(isvc, make_plan(isvc.spec), operator_namespace="tensorfleet-system"))
    assert rule["ports"] == [{"protocol": "TCP", "port": contract.ENGINE_PORT}]
    (peer,) = rule["from"]
    assert peer["namespaceSelector"]["matchExpressions"][0]["values"] == ["tensorfleet-system"]
    assert peer["podSelector"]["matchLabels"] == {contract.LABEL_NAME: contract.APP_NAME,
                                                  contract.LABEL_COMPONENT: contract.COMPONENT_OPERATOR}
    # Not known (a printed render): the operator's pods in any namespace.
    (rule,) = operator_rules(rendered(doc))
    assert rule["from"][0]["namespaceSelector"] == {}
    assert operator_rules(rendered(document())) == []


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_lora_objects_validate_strictly(version: str) -> None:
    doc = document(adapters=[{"name": "sql", "source": "org/sql"}], engine={"lora": {"maxLoras": 2}})
    for obj in rendered(doc):
        kubernetes_validate.validate(obj, version, strict=True)
