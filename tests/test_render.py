"""Rendering: InferenceService + Plan -> Kubernetes objects.

Every object is checked against the official OpenAPI schemas (strict: unknown
fields fail) for the oldest and newest Kubernetes versions supported, and the
shapes other components rely on (names, labels, env, probes) are asserted by
value.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
from typing import Any

import kubernetes_validate
import pytest
import yaml
from pod_security import pod_templates, violations

from tensorfleet import contract
from tensorfleet.api import SpecError, load_inference_service
from tensorfleet.catalog import find_gpu
from tensorfleet.planner import make_plan
from tensorfleet.render import desired_replicas, leader_selector, render, selector_string
from tensorfleet.router import cli as router_cli

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


# --- engine StatefulSets ---------------------------------------------------------------


def test_gpu_resources_equal_the_plan() -> None:
    doc = document(
        model={"name": LLAMA_405B, "maxModelLen": 8192},
        engine={"resources": {"requests": {"cpu": "16", "memory": "200Gi", "nvidia.com/gpu": "1"}, "limits": {"memory": "400Gi"}}},
    )
    isvc = load_inference_service(doc)
    plan = make_plan(isvc.spec)
    assert plan.auto_layout and (plan.tensor, plan.pipeline) == (8, 2)
    stages = by_kind(render(isvc, plan), "StatefulSet")
    assert len(stages) == plan.pipeline
    for sts in stages:
        container = engine(sts)
        assert container["resources"] == {
            "requests": {"cpu": "16", "memory": "200Gi", "nvidia.com/gpu": "8"},
            "limits": {"memory": "400Gi", "nvidia.com/gpu": "8"},
        }
        env = env_map(container)
        # The planner chose the layout; the env carries its choice.
        assert env["TF_TENSOR_PARALLEL_SIZE"]["value"] == "8"
        assert env["TF_PIPELINE_PARALLEL_SIZE"]["value"] == "2"


@pytest.mark.parametrize("gpu", ["A100-40GB", "H100-80GB", "L40S"])
def test_gpu_affinity_and_toleration(gpu: str) -> None:
    doc = document(accelerator={
        "type": gpu,
        "nodeSelector": {"pool": "gpu"},
        "tolerations": [{"key": "team", "operator": "Equal", "value": "ml", "effect": "NoExecute", "tolerationSeconds": 30}],
    })
    gpu_type = find_gpu(gpu)
    assert gpu_type is not None, f"{gpu} is in the catalog"
    for sts in by_kind(rendered(doc), "StatefulSet"):
        pod = sts["spec"]["template"]["spec"]
        terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        assert terms == gpu_type.node_selector_terms() and len(terms[0]["matchExpressions"]) == 1
        expression = terms[0]["matchExpressions"][0]
        assert expression["key"] == "nvidia.com/gpu.product" and expression["operator"] == "In"
        assert expression["values"] == list(gpu_type.product_labels)
        values = set(expression["values"])
        nvidia = {v for v in values if v.startswith("NVIDIA-")}
        assert nvidia and {v.removeprefix("NVIDIA-") for v in nvidia} <= values
        assert pod["nodeSelector"] == {"pool": "gpu"}
        assert pod["tolerations"] == [
            {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
            {"key": "team", "operator": "Equal", "value": "ml", "effect": "NoExecute", "tolerationSeconds": 30},
        ]
    a100 = by_kind(rendered(document(accelerator={"type": "A100-40GB"})), "StatefulSet")[0]
    values = a100["spec"]["template"]["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0]["matchExpressions"][0]["values"]
    assert "NVIDIA-A100-SXM4-40GB" in values and "A100-SXM4-40GB" in values
    assert not any("80GB" in v for v in values)
    assert "nodeSelector" not in a100["spec"]["template"]["spec"]


@pytest.mark.parametrize("case", sorted(CASES))
def test_shm_and_cache_volumes(case: str) -> None:
    doc = CASES[case]
    for sts in by_kind(rendered(doc), "StatefulSet"):
        pod = sts["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        shm_size = doc["spec"].get("engine", {}).get("shmSize", "16Gi")
        assert volumes["dshm"] == {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": shm_size}}
        launcher = [
            {"name": contract.LAUNCHER_VOLUME, "mountPath": contract.LAUNCHER_DIR, "readOnly": True},
            {"name": contract.ENGINE_HOME_VOLUME, "mountPath": contract.ENGINE_HOME_PATH},
        ] if case != "simulator" else []
        simulated = [{"name": contract.SIMULATED_GPU_VOLUME, "mountPath": contract.SIMULATED_GPU_DIR,
                      "readOnly": True}] if case == "simulator" else []
        assert engine(sts)["volumeMounts"] == [
            {"name": "dshm", "mountPath": "/dev/shm"},
            {"name": "model-cache", "mountPath": contract.CACHE_PATH},
            *launcher,
            *simulated,
        ]
        if doc["spec"].get("cache", {}).get("size"):
            assert "model-cache" not in volumes
        else:
            assert volumes["model-cache"] == {"name": "model-cache", "emptyDir": {}}
            assert "volumeClaimTemplates" not in sts["spec"]
            assert "persistentVolumeClaimRetentionPolicy" not in sts["spec"]


def test_cache_claim_template_and_retention() -> None:
    for sts in by_kind(rendered(PIPELINE_2), "StatefulSet"):
        assert sts["spec"]["persistentVolumeClaimRetentionPolicy"] == {"whenDeleted": "Delete", "whenScaled": "Delete"}
        [claim] = sts["spec"]["volumeClaimTemplates"]
        assert claim["metadata"]["name"] == "model-cache"
        assert claim["spec"] == {
            "accessModes": ["ReadWriteOnce"],
            "resources": {"requests": {"storage": "500Gi"}},
            "storageClassName": "fast-ssd",
        }
        # volumeClaimTemplates are immutable: nothing that changes on upgrade.
        assert contract.LABEL_VERSION not in claim["metadata"].get("labels", {})
    default = by_kind(rendered(document(cache={"size": "100Gi"})), "StatefulSet")[0]
    assert default["spec"]["persistentVolumeClaimRetentionPolicy"] == {"whenDeleted": "Retain", "whenScaled": "Retain"}
    assert "storageClassName" not in default["spec"]["volumeClaimTemplates"][0]["spec"]


@pytest.mark.parametrize("doc", [PIPELINE_1, PIPELINE_2, PIPELINE_3])
def test_update_strategy(doc: dict[str, Any]) -> None:
    # OnDelete for every pipeline size: the operator replaces whole groups, surging first
    # (controller/rollout.py); RollingUpdate would take a one-replica service's only pod down.
    for sts in by_kind(rendered(doc), "StatefulSet"):
        assert sts["spec"]["updateStrategy"] == {"type": "OnDelete"}
        assert sts["spec"]["podManagementPolicy"] == "Parallel"
        assert sts["spec"]["serviceName"] == "llama-workers"
        assert 0 < sts["spec"]["revisionHistoryLimit"] <= 5


@pytest.mark.parametrize(("spec", "replicas"), [
    ({}, 1),
    ({"replicas": 4}, 4),
    ({"replicas": 0}, 0),
    ({"autoscaling": {"minReplicas": 2, "maxReplicas": 5}}, 2),
    ({"replicas": 3, "autoscaling": {"minReplicas": 2, "maxReplicas": 5}}, 3),
    # The API server defaults spec.replicas to 1; under autoscaling the HPA's bounds apply at once.
    ({"replicas": 1, "autoscaling": {"minReplicas": 2, "maxReplicas": 5}}, 2),
    ({"replicas": 9, "autoscaling": {"minReplicas": 2, "maxReplicas": 5}}, 5),
])
def test_replicas(spec: dict[str, Any], replicas: int) -> None:
    doc = document(parallelism={"tensor": 1, "pipeline": 2}, **spec)
    assert desired_replicas(load_inference_service(doc).spec) == replicas
    assert [s["spec"]["replicas"] for s in by_kind(rendered(doc), "StatefulSet")] == [replicas, replicas]


def test_leader_and_worker_pods() -> None:
    objects = rendered(PIPELINE_3)
    leader, *workers = by_kind(objects, "StatefulSet")
    startup_failures = math.ceil(3600 / 10)

    container = engine(leader)
    assert container["ports"] == [
        {"name": "http", "containerPort": 8000, "protocol": "TCP"},
        {"name": "ray", "containerPort": 6379, "protocol": "TCP"},
        {"name": "kv-events", "containerPort": 5557, "protocol": "TCP"},
        {"name": "kv-replay", "containerPort": 5558, "protocol": "TCP"},
        {"name": "gpu-metrics", "containerPort": 9400, "protocol": "TCP"},
    ]
    assert leader["spec"]["template"]["spec"]["securityContext"] == {
        "runAsNonRoot": True, "runAsUser": contract.WORKER_UID, "fsGroup": contract.WORKER_UID,
        "fsGroupChangePolicy": "OnRootMismatch", "seccompProfile": {"type": "RuntimeDefault"},
    }
    assert container["securityContext"] == {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
    vllm = {"httpGet": {"path": "/health", "port": "http"}}
    # The launcher's /health on the GPU metrics port: GPUs (NVML) and, on stage 0, vLLM's /health.
    pod = {"httpGet": {"path": "/health", "port": "gpu-metrics"}}
    assert container["startupProbe"] == {**vllm, "periodSeconds": 10, "timeoutSeconds": 5, "failureThreshold": startup_failures}
    assert container["readinessProbe"] == {**pod, "periodSeconds": 5, "timeoutSeconds": 5, "failureThreshold": 3}
    # A restart mends no GPU: liveness stays with vLLM alone.
    assert container["livenessProbe"] == {**vllm, "periodSeconds": 15, "timeoutSeconds": 5, "failureThreshold": 4}
    assert env_map(container)["TF_STAGE_INDEX"]["value"] == "0"

    for k, sts in enumerate(workers, start=1):
        container = engine(sts)
        assert container["ports"] == [{"name": "ray", "containerPort": 6379, "protocol": "TCP"},
                                      {"name": "gpu-metrics", "containerPort": 9400, "protocol": "TCP"}]
        assert container["startupProbe"] == {**pod, "periodSeconds": 10, "timeoutSeconds": 5, "failureThreshold": startup_failures}
        assert container["readinessProbe"] == {**pod, "periodSeconds": 5, "timeoutSeconds": 5, "failureThreshold": 3}
        assert container["livenessProbe"] == {**pod, "periodSeconds": 15, "timeoutSeconds": 5, "failureThreshold": 4}
        assert env_map(container)["TF_STAGE_INDEX"]["value"] == str(k)


def test_startup_budget_follows_the_spec() -> None:
    sts = by_kind(rendered(document(engine={"startupTimeoutSeconds": 1805})), "StatefulSet")[0]
    # Never shorter than asked for: 1805 s needs 181 probes 10 s apart.
    assert engine(sts)["startupProbe"]["failureThreshold"] == 181


def test_engine_pod_basics() -> None:
    for sts in by_kind(rendered(PIPELINE_2), "StatefulSet"):
        pod = sts["spec"]["template"]["spec"]
        assert pod["enableServiceLinks"] is False
        assert pod["terminationGracePeriodSeconds"] == 120
        container = pod["containers"][0]
        assert container["image"] == contract.DEFAULT_ENGINE_IMAGE == contract.VLLM_IMAGE
        assert container["command"] == list(contract.LAUNCHER_COMMAND)
        assert "args" not in container
        assert "imagePullPolicy" not in container
    custom = document(engine={"image": "registry.example/vllm:1", "imagePullPolicy": "Always", "terminationGracePeriodSeconds": 30})
    sts = by_kind(rendered(custom), "StatefulSet")[0]
    assert engine(sts)["image"] == "registry.example/vllm:1"
    assert engine(sts)["imagePullPolicy"] == "Always"
    assert sts["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 30


def test_no_shell_anywhere() -> None:
    for obj in rendered(PIPELINE_2):
        for container in obj.get("spec", {}).get("template", {}).get("spec", {}).get("containers", []):
            argv = container["command"] + container.get("args", [])
            assert argv[0] not in {"sh", "bash", "/bin/sh", "/bin/bash"}
            assert "-c" not in argv


def test_engine_env() -> None:
    isvc = load_inference_service(PIPELINE_2)
    plan = make_plan(isvc.spec)
    objects = render(isvc, plan)
    for k, sts in enumerate(by_kind(objects, "StatefulSet")):
        env = engine(sts)["env"]
        names = [item["name"] for item in env]
        assert len(names) == len(set(names))
        values = {item["name"]: item.get("value") for item in env}
        refs = {item["name"]: item.get("valueFrom") for item in env if "valueFrom" in item}
        assert values["TF_ENGINE_KIND"] == "vllm"
        assert values["TF_INFERENCE_SERVICE"] == "llama"
        assert refs["TF_NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
        assert refs["TF_POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
        assert refs["TF_GROUP_INDEX"] == {"fieldRef": {"fieldPath": "metadata.labels['apps.kubernetes.io/pod-index']"}}
        assert values["TF_STAGE_INDEX"] == str(k)
        assert values["TF_LEADER_ADDRESS"] == "llama-stage-0-$(TF_GROUP_INDEX).llama-workers.$(TF_NAMESPACE).svc"
        # Dependent expansion only sees variables defined earlier.
        leader_at = names.index("TF_LEADER_ADDRESS")
        assert names.index("TF_GROUP_INDEX") < leader_at and names.index("TF_NAMESPACE") < leader_at
        assert values["TF_RAY_PORT"] == "6379"
        assert values["TF_ENGINE_PORT"] == "8000"
        assert values["TF_TENSOR_PARALLEL_SIZE"] == str(plan.tensor) == "4"
        assert values["TF_PIPELINE_PARALLEL_SIZE"] == str(plan.pipeline) == "2"
        assert values["TF_MODEL"] == LLAMA_70B
        assert values["TF_SERVED_MODEL_NAME"] == "llama-70b"
        assert values["TF_MODEL_REVISION"] == "main"
        # dtype auto reaches vLLM as auto (it used to be the planner's resolved "bfloat16", which
        # overrode fp16 and AWQ checkpoints); the planner still sizes and reports with bfloat16.
        assert values["TF_DTYPE"] == plan.engine_dtype == "auto"
        assert plan.dtype == "bfloat16"
        assert "TF_QUANTIZATION" not in values
        assert values["TF_KV_CACHE_DTYPE"] == "auto"
        assert values["TF_MAX_MODEL_LEN"] == "8192"
        assert values["TF_GPU_MEMORY_UTILIZATION"] == "0.9"
        assert values["TF_MAX_NUM_SEQS"] == str(plan.max_num_seqs)
        assert json.loads(values["TF_EXTRA_ARGS"]) == ["--enable-prefix-caching", "--swap-space", "8"]
        assert values["HF_HOME"] == contract.HF_HOME_PATH
        # The user's variables come last, as given.
        assert env[-1] == {"name": "NCCL_DEBUG", "value": "INFO"}
        for item in env:
            assert set(item) in ({"name", "value"}, {"name", "valueFrom"})
            assert isinstance(item.get("value", ""), str)
            assert set(item.get("valueFrom", {})) <= {"fieldRef", "secretKeyRef"}


def test_optional_env_values() -> None:
    doc = document(
        model={"name": LLAMA_8B, "maxModelLen": 4096, "quantization": "fp8", "dtype": "float16"},
        engine={
            "kvCacheDtype": "fp8",
            "gpuMemoryUtilization": 0.85,
            "maxNumSeqs": 64,
            "args": ["--enable-chunked-prefill", "--max-num-batched-tokens=4096"],
            "env": [{"name": "TOKEN_FROM_SECRET", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}],
        },
    )
    sts = by_kind(rendered(doc), "StatefulSet")[0]
    env = env_map(engine(sts))
    assert env["TF_SERVED_MODEL_NAME"]["value"] == LLAMA_8B
    assert "TF_MODEL_REVISION" not in env
    assert env["TF_QUANTIZATION"]["value"] == "fp8"
    assert env["TF_DTYPE"]["value"] == "float16"
    assert env["TF_KV_CACHE_DTYPE"]["value"] == "fp8"
    assert env["TF_GPU_MEMORY_UTILIZATION"]["value"] == "0.85"
    assert env["TF_MAX_NUM_SEQS"]["value"] == "64"
    assert env["TF_MAX_MODEL_LEN"]["value"] == "4096"
    assert json.loads(env["TF_EXTRA_ARGS"]["value"]) == ["--enable-chunked-prefill", "--max-num-batched-tokens=4096"]
    assert env["TOKEN_FROM_SECRET"] == {"name": "TOKEN_FROM_SECRET", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}
    assert "HF_TOKEN" not in env
    router = one(rendered(doc), "Deployment", "llama-router")["spec"]["template"]["spec"]["containers"][0]
    assert router["args"][router["args"].index("--max-concurrency-per-backend") + 1] == "64"
    # The engines' own prefill budget, where engine.args sets one, in either spelling.
    assert router["args"][router["args"].index("--prompt-queue-tokens") + 1] == "4096"
    for args, budget in ((["--max-num-batched-tokens", "1024"], "1024"), (["--max_num_batched_tokens=512"], "512"),
                         (["--max-num-batched-tokens=auto"], "2048"), ([], "2048")):
        small = document(model={"name": LLAMA_8B, "maxModelLen": 4096}, accelerator={"type": "L4"},
                         engine={"args": args})
        other = one(rendered(small), "Deployment", "llama-router")["spec"]["template"]["spec"]["containers"][0]
        assert other["args"][other["args"].index("--prompt-queue-tokens") + 1] == budget, args
    assert "--burst-concurrency-per-backend" not in router["args"]  # the ceiling is max-num-seqs already


def test_hf_token_only_through_a_secret_ref() -> None:
    for sts in by_kind(rendered(PIPELINE_2), "StatefulSet"):
        token = env_map(engine(sts))["HF_TOKEN"]
        assert token == {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "hf"}}}
    default_key = by_kind(rendered(document(hfTokenSecretRef={"name": "hf"})), "StatefulSet")[0]
    assert env_map(engine(default_key))["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf", "key": "token"}
    # No Secret or ConfigMap object, and no envFrom, is ever rendered.
    objects = rendered(PIPELINE_2)
    assert not by_kind(objects, "Secret") and not by_kind(objects, "ConfigMap")
    assert "envFrom" not in json.dumps(objects)


def test_simulator_has_no_gpu() -> None:
    objects = rendered(SIMULATOR)
    for sts in by_kind(objects, "StatefulSet"):
        pod = sts["spec"]["template"]["spec"]
        container = pod["containers"][0]
        assert container["image"] == contract.CONTROL_PLANE_IMAGE
        assert container["resources"] == {"requests": {"cpu": "100m", "memory": "256Mi"}}
        assert "affinity" not in pod
        assert pod["tolerations"] == [{"key": "dedicated", "operator": "Equal", "value": "sim", "effect": "NoSchedule"}]
        assert pod["nodeSelector"] == {"pool": "cpu"}
        assert "nvidia.com" not in json.dumps(pod)
        env = env_map(container)
        assert env["TF_ENGINE_KIND"]["value"] == "simulator"
        assert set(env) >= {"TF_LEADER_ADDRESS", "TF_MODEL", "TF_MAX_NUM_SEQS"}
        # Readiness is the launcher's verdict on its simulated GPUs (and, on stage 0, the simulator's /health), on
        # the port a GPU pod serves it; startup and liveness stay on the simulator's own /health.
        assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": contract.PORT_NAME_GPU_METRICS}
        assert {"name": contract.PORT_NAME_GPU_METRICS, "containerPort": contract.WORKER_METRICS_PORT,
                "protocol": "TCP"} in container["ports"]
        stage = sts["spec"]["template"]["metadata"]["labels"][contract.LABEL_STAGE]
        assert container["livenessProbe"]["httpGet"]["port"] == ("http" if stage == "0" else contract.PORT_NAME_GPU_METRICS)
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes[contract.SIMULATED_GPU_VOLUME]["downwardAPI"]["items"] == [{"path": "state", "fieldRef": {
            "fieldPath": f"metadata.annotations['{contract.ANNOTATION_SIMULATED_GPU_STATE}']"}}]
        assert env["TF_SIMULATED_GPU_STATE"]["value"] == contract.SIMULATED_GPU_STATE_PATH
        # The control-plane image's user.
        assert pod["securityContext"]["runAsUser"] == pod["securityContext"]["runAsGroup"] == contract.CONTROL_PLANE_UID
        assert pod["securityContext"]["runAsNonRoot"] is True
    bare = by_kind(rendered(document(engine={"kind": "simulator"})), "StatefulSet")[0]["spec"]["template"]["spec"]
    assert "tolerations" not in bare and "nodeSelector" not in bare and "affinity" not in bare
    sized = document(engine={"kind": "simulator", "resources": {"requests": {"cpu": "2"}}})
    assert engine(by_kind(rendered(sized), "StatefulSet")[0])["resources"] == {"requests": {"cpu": "2"}}


# --- Services, router, RBAC ------------------------------------------------------------


def test_services() -> None:
    objects = rendered(PIPELINE_2)
    workers = one(objects, "Service", "llama-workers")["spec"]
    assert workers["clusterIP"] == "None" and workers["publishNotReadyAddresses"] is True
    assert workers["ports"] == [{"name": "ray", "port": 6379, "targetPort": "ray", "protocol": "TCP"}]
    leaders = one(objects, "Service", "llama-engine")["spec"]
    assert leaders["clusterIP"] == "None" and leaders["publishNotReadyAddresses"] is False
    assert leaders["ports"] == [{"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP"}]
    front = one(objects, "Service", "llama")["spec"]
    assert front["type"] == "ClusterIP" and "clusterIP" not in front
    assert front["ports"] == [{"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"}]


def test_router() -> None:
    objects = rendered(PIPELINE_2)
    deployment = one(objects, "Deployment", "llama-router")
    assert deployment["spec"]["replicas"] == 2
    pod = deployment["spec"]["template"]["spec"]
    pod_selector = deployment["spec"]["selector"]["matchLabels"]
    assert pod["serviceAccountName"] == "llama-router"
    assert pod["automountServiceAccountToken"] is True
    [container] = pod["containers"]
    assert container["image"] == contract.CONTROL_PLANE_IMAGE
    assert container["command"] == list(contract.ROUTER_COMMAND)
    plan = make_plan(load_inference_service(PIPELINE_2).spec)
    # What the KV cache holds at 2048 tokens a request, under max-num-seqs 1024.
    concurrency = plan.kv_cache_tokens // 2048
    assert 1 < concurrency < plan.max_num_seqs == 1024
    assert container["args"] == [
        "--service", "llama-engine",
        "--namespace", "ml",
        # The other replicas: the router Service's ready endpoints, less the pod's own address.
        "--peer-service", "llama",
        "--strategy", "cache-aware",  # the default
        # vLLM engines publish their KV-cache events: the router indexes them.
        "--kv-events",
        "--port", "8080",
        "--max-concurrency-per-backend", str(concurrency),
        # The derived ceiling is a typical request's share: an engine with room may take up to max-num-seqs.
        "--burst-concurrency-per-backend", "1024",
        # One step's prefill on an 80 GB A100: vLLM's default budget there.
        "--prompt-queue-tokens", "8192",
        "--model", "llama-70b",
        "--drain-delay", "5",
        "--shutdown-grace", "60",
        # Twice the estimated load: 120 s engine start plus each GPU's weights at 500 MB/s.
        "--cold-start-timeout", str(2 * (120 + -(-plan.weight_bytes_per_gpu // 500_000_000))),
    ]
    # SIGTERM drains: 5 s still serving while the endpoints update, 60 s for in-flight requests, 10 s margin.
    assert pod["terminationGracePeriodSeconds"] == 75
    assert deployment["spec"]["strategy"] == {"type": "RollingUpdate",
                                              "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    assert container["ports"] == [{"name": "http", "containerPort": 8080, "protocol": "TCP"}]
    assert container["env"] == [{"name": "TENSORFLEET_POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]
    assert one(objects, "Service", "llama")["spec"]["selector"] == pod_selector
    assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert container["resources"] == {"requests": {"cpu": "250m", "memory": "256Mi"}, "limits": {"memory": "512Mi"}}
    security = container["securityContext"]
    assert security["runAsNonRoot"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["readOnlyRootFilesystem"] is True
    assert security["capabilities"] == {"drop": ["ALL"]}
    assert security["seccompProfile"] == {"type": "RuntimeDefault"}

    custom = document(router={
        "replicas": 3, "strategy": "prefix-aware", "image": "example/router:2",
        "resources": {"requests": {"cpu": "1"}, "limits": {"cpu": "2", "memory": "1Gi"}},
        "maxConcurrencyPerEngine": 48, "maxQueue": 500, "queueTimeoutSeconds": 10, "coldStartTimeoutSeconds": 90,
    })
    deployment = one(rendered(custom), "Deployment", "llama-router")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert deployment["spec"]["replicas"] == 3
    assert container["image"] == "example/router:2"
    assert container["args"][container["args"].index("--strategy") + 1] == "prefix-aware"
    assert container["args"][container["args"].index("--max-concurrency-per-backend") + 1] == "48"
    assert "--burst-concurrency-per-backend" not in container["args"]  # a ceiling the user set is a hard limit
    assert container["args"][-6:] == ["--max-queue", "500", "--queue-timeout", "10", "--cold-start-timeout", "90"]
    assert container["resources"] == {"requests": {"cpu": "1"}, "limits": {"cpu": "2", "memory": "1Gi"}}


def test_router_api_keys_come_from_the_secret_mounted_read_only() -> None:
    deployment = one(rendered(ROUTER_AUTH), "Deployment", "llama-router")
    pod = deployment["spec"]["template"]["spec"]
    [container] = pod["containers"]
    assert container["args"][-6:] == ["--api-keys", contract.ROUTER_API_KEYS_PATH, "--requests-per-minute", "600",
                                      "--tokens-per-minute", "200000"]
    # The Secret, never optional: a router without its keys does not start. Its files are readable by the
    # router's group only (fsGroup), and the router cannot write them.
    assert pod["volumes"] == [{"name": "api-keys", "secret": {"secretName": "llm-keys", "optional": False,
                                                                "defaultMode": 0o440}}]
    assert container["volumeMounts"] == [{"name": "api-keys", "mountPath": "/etc/tensorfleet/api-keys",
                                          "readOnly": True}]
    assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsGroup"] == contract.CONTROL_PLANE_UID
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    # Limits are optional; keys alone only authenticate. The flags are the router's own.
    only_keys = one(rendered(document(router={"auth": {"secretRef": {"name": "llm-keys"}}})), "Deployment",
                    "llama-router")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert only_keys[-2:] == ["--api-keys", contract.ROUTER_API_KEYS_PATH]
    parser = argparse.ArgumentParser()
    router_cli.register(parser.add_subparsers())
    parsed = parser.parse_args(["router", *container["args"]])
    assert (parsed.api_keys, parsed.requests_per_minute, parsed.tokens_per_minute) == (
        contract.ROUTER_API_KEYS_PATH, 600, 200000)
    # Without auth: no volume, no fsGroup, no key flags (the router's pod is as before).
    plain = one(rendered(PIPELINE_1), "Deployment", "llama-router")["spec"]["template"]["spec"]
    assert "volumes" not in plain and "fsGroup" not in plain["securityContext"]
    assert "volumeMounts" not in plain["containers"][0] and "--api-keys" not in plain["containers"][0]["args"]


@pytest.mark.parametrize(("auth", "says"), [
    ({}, "secretRef"),
    ({"secretRef": {"name": ""}}, "secretRef.name"),
    ({"secretRef": {"name": "k"}, "requestsPerMinute": 0}, "requestsPerMinute"),
    ({"secretRef": {"name": "k"}, "tokensPerMinute": -1}, "tokensPerMinute"),
    ({"secretRef": {"name": "k"}, "burst": 5}, "burst"),
])
def test_router_auth_is_checked(auth: dict[str, Any], says: str) -> None:
    with pytest.raises(SpecError) as caught:
        load_inference_service(document(router={"auth": auth}))
    assert "router.auth" in str(caught.value) and says in str(caught.value)


def test_router_rbac_is_minimal() -> None:
    objects = rendered(PIPELINE_1)
    role = one(objects, "Role", "llama-router")
    assert role["rules"] == [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["get", "list", "watch"]}]
    binding = one(objects, "RoleBinding", "llama-router")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "llama-router"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "llama-router", "namespace": "ml"}]
    assert not by_kind(objects, "ClusterRole") and not by_kind(objects, "ClusterRoleBinding")


# --- NetworkPolicies ----------------------------------------------------------------


def _peers_admit(rule: dict[str, Any], pod_labels: dict[str, str]) -> bool:
    """Whether a rule's `from` admits a pod with these labels in the policy's own namespace."""
    return any("podSelector" in peer and "namespaceSelector" not in peer
               and matches(peer["podSelector"].get("matchLabels", {}), pod_labels) for peer in rule["from"])


def _namespaces_in(rule: dict[str, Any]) -> set[str]:
    names: set[str] = set()
    for peer in rule["from"]:
        for expression in peer.get("namespaceSelector", {}).get("matchExpressions", []):
            assert expression["key"] == "kubernetes.io/metadata.name" and expression["operator"] == "In"
            names |= set(expression["values"])
    return names


def test_network_policies_isolate_engines_and_router() -> None:
    objects = rendered(PIPELINE_3)
    engine_policy = one(objects, "NetworkPolicy", "llama-engine")
    router_policy = one(objects, "NetworkPolicy", "llama-router")
    stage_pods = [s["spec"]["template"]["metadata"]["labels"] for s in by_kind(objects, "StatefulSet")]
    router_pods = one(objects, "Deployment", "llama-router")["spec"]["template"]["metadata"]["labels"]
    other_router = {**router_pods, "app.kubernetes.io/instance": "other", "tensorfleet.dev/inference-service": "other"}
    other_engine = {**stage_pods[0], "app.kubernetes.io/instance": "other", "tensorfleet.dev/inference-service": "other"}

    for policy in (engine_policy, router_policy):
        assert policy["apiVersion"] == "networking.k8s.io/v1"
        assert policy["spec"]["policyTypes"] == ["Ingress"], "egress stays open (model downloads, the API server)"
        assert "egress" not in policy["spec"]
    # The engine policy covers every stage's pods and no router pod.
    selected = engine_policy["spec"]["podSelector"]["matchLabels"]
    assert all(matches(selected, pods) for pods in stage_pods) and not matches(selected, router_pods)
    from_router, peers, monitoring = engine_policy["spec"]["ingress"]
    # The API port and the KV events' two, from this InferenceService's router pods only.
    assert from_router["ports"] == [{"protocol": "TCP", "port": port} for port in (
        contract.ENGINE_PORT, contract.KV_EVENTS_PORT, contract.KV_EVENTS_REPLAY_PORT)]
    assert _peers_admit(from_router, router_pods) and not _peers_admit(from_router, other_router)
    assert not any(_peers_admit(from_router, pods) for pods in stage_pods)
    # Every port (Ray, NCCL), between this InferenceService's engine pods only.
    assert "ports" not in peers
    assert all(_peers_admit(peers, pods) for pods in stage_pods)
    assert not _peers_admit(peers, router_pods) and not _peers_admit(peers, other_engine)
    # Metrics: vLLM's /metrics shares the API port; the GPU gauges have their own.
    assert monitoring["ports"] == [{"protocol": "TCP", "port": contract.ENGINE_PORT},
                                   {"protocol": "TCP", "port": contract.WORKER_METRICS_PORT}]
    assert _namespaces_in(monitoring) == {"monitoring"} and len(monitoring["from"]) == 1

    assert matches(router_policy["spec"]["podSelector"]["matchLabels"], router_pods)
    assert not any(matches(router_policy["spec"]["podSelector"]["matchLabels"], pods) for pods in stage_pods)
    (clients,) = router_policy["spec"]["ingress"]
    assert clients["ports"] == [{"protocol": "TCP", "port": contract.ROUTER_PORT}]
    # By default: any pod of the InferenceService's own namespace, and the monitoring namespace.
    assert {"podSelector": {}} in clients["from"]
    assert _namespaces_in(clients) == {"monitoring"}
    assert not any("ipBlock" in peer for peer in clients["from"])


def test_network_policy_settings() -> None:
    doc = document(networkPolicy={
        "clientNamespaces": ["ingress-nginx", "gateway"],
        "clientCIDRs": ["10.0.0.0/8", "2001:db8::/32"],
        "monitoringNamespaces": ["prometheus", "gateway"],
    })
    objects = rendered(doc)
    (clients,) = one(objects, "NetworkPolicy", "llama-router")["spec"]["ingress"]
    assert _namespaces_in(clients) == {"ingress-nginx", "gateway", "prometheus"}
    assert [p["ipBlock"] for p in clients["from"] if "ipBlock" in p] == [{"cidr": "10.0.0.0/8"}, {"cidr": "2001:db8::/32"}]
    monitoring = one(objects, "NetworkPolicy", "llama-engine")["spec"]["ingress"][2]
    assert _namespaces_in(monitoring) == {"prometheus", "gateway"}
    # Client namespaces reach the router only, never the engines.
    engine_rules = one(objects, "NetworkPolicy", "llama-engine")["spec"]["ingress"]
    assert "ingress-nginx" not in set().union(*(_namespaces_in(r) for r in engine_rules))

    quiet = rendered(document(networkPolicy={"monitoringNamespaces": []}))
    assert len(one(quiet, "NetworkPolicy", "llama-engine")["spec"]["ingress"]) == 2
    assert one(quiet, "NetworkPolicy", "llama-router")["spec"]["ingress"][0]["from"] == [{"podSelector": {}}]

    assert by_kind(rendered(document(networkPolicy={"enabled": False})), "NetworkPolicy") == []

    # The simulator's gauges of its simulated GPUs are scraped as a GPU pod's are.
    sim = one(rendered(SIMULATOR), "NetworkPolicy", "llama-engine")["spec"]["ingress"][2]
    assert sim["ports"] == [{"protocol": "TCP", "port": contract.ENGINE_PORT},
                            {"protocol": "TCP", "port": contract.WORKER_METRICS_PORT}]


def test_network_policies_come_before_the_pods_they_protect() -> None:
    kinds = [o["kind"] for o in rendered(PIPELINE_2)]
    last_policy = max(i for i, k in enumerate(kinds) if k == "NetworkPolicy")
    assert last_policy < kinds.index("StatefulSet") and last_policy < kinds.index("Deployment")


@pytest.mark.parametrize(("field", "value", "says"), [
    ("clientCIDRs", ["10.0.0.1/8"], "host bits set"),
    ("clientCIDRs", ["10.0.0.1"], "needs its prefix length"),
    ("clientCIDRs", ["anywhere"], "is not a CIDR"),
    ("clientNamespaces", ["Ingress_NGINX"], "clientNamespaces"),
    ("monitoringNamespaces", ["monitoring", "monitoring"], "listed more than once"),
    ("enable", True, "enable"),
])
def test_network_policy_mistakes_name_the_field(field: str, value: Any, says: str) -> None:
    from tensorfleet.api import SpecError

    with pytest.raises(SpecError) as caught:
        load_inference_service(document(networkPolicy={field: value}))
    assert "networkPolicy" in str(caught.value) and says in str(caught.value)


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


def test_a_surge_adds_groups_to_every_stage() -> None:
    isvc = load_inference_service(PIPELINE_2)
    plan = make_plan(isvc.spec)
    wanted = {sts["metadata"]["name"]: sts["spec"]["replicas"] for sts in by_kind(render(isvc, plan), "StatefulSet")}
    surged = {sts["metadata"]["name"]: sts["spec"]["replicas"]
              for sts in by_kind(render(isvc, plan, surge=2), "StatefulSet")}
    assert len(wanted) == 2 and surged == {name: replicas + 2 for name, replicas in wanted.items()}


def _schedulable(terms: list[dict[str, Any]], labels: dict[str, str]) -> bool:
    """The scheduler's rule for required node affinity: any term, all of its (In) expressions."""
    return any(all(labels.get(e["key"]) in e["values"] for e in term["matchExpressions"]) for term in terms)


# Node labels as each provider sets them, without GFD (sources cited in gpus.py).
NODES = {
    "gfd-h100": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
    "gfd-legacy-a100": {"nvidia.com/gpu.product": "A100-SXM4-80GB"},
    "gke-l4": {"cloud.google.com/gke-accelerator": "nvidia-l4", "node.kubernetes.io/instance-type": "g2-standard-8"},
    "gke-a100-40": {"cloud.google.com/gke-accelerator": "nvidia-tesla-a100"},
    "gke-h100-mega": {"cloud.google.com/gke-accelerator": "nvidia-h100-mega-80gb"},
    "eks-p4d": {"karpenter.k8s.aws/instance-gpu-name": "a100", "karpenter.k8s.aws/instance-gpu-memory": "40960",
                "node.kubernetes.io/instance-type": "p4d.24xlarge"},
    "eks-p4de": {"karpenter.k8s.aws/instance-gpu-name": "a100", "karpenter.k8s.aws/instance-gpu-memory": "81920",
                 "node.kubernetes.io/instance-type": "p4de.24xlarge"},
    "eks-p5": {"karpenter.k8s.aws/instance-gpu-name": "h100", "karpenter.k8s.aws/instance-gpu-memory": "81920"},
    "eks-g6e": {"karpenter.k8s.aws/instance-gpu-name": "l40s", "karpenter.k8s.aws/instance-gpu-memory": "45776"},
    "aks-nd-h100": {"kubernetes.azure.com/accelerator": "nvidia", "node.kubernetes.io/instance-type": "Standard_ND96isr_H100_v5"},
    "aks-nc-h100-nvl": {"kubernetes.azure.com/accelerator": "nvidia",
                        "node.kubernetes.io/instance-type": "Standard_NC40ads_H100_v5"},
    "aks-nc-a100": {"kubernetes.azure.com/accelerator": "nvidia",
                    "node.kubernetes.io/instance-type": "Standard_NC24ads_A100_v4"},
    "aks-t4": {"kubernetes.azure.com/accelerator": "nvidia", "node.kubernetes.io/instance-type": "Standard_NC4as_T4_v3"},
    "cpu": {"node.kubernetes.io/instance-type": "m5.xlarge"},
}
LANDS_ON = {
    "H100-80GB": {"gfd-h100", "gke-h100-mega", "eks-p5", "aks-nd-h100"},
    "H100-NVL-94GB": {"aks-nc-h100-nvl"},
    "A100-80GB": {"gfd-legacy-a100", "eks-p4de", "aks-nc-a100"},
    "A100-40GB": {"gke-a100-40", "eks-p4d"},
    "L4": {"gke-l4"},
    "L40S": {"eks-g6e"},
    "T4": {"aks-t4"},
}


@pytest.mark.parametrize("gpu", sorted(LANDS_ON))
def test_engine_pods_find_their_gpu_under_every_providers_labels(gpu: str) -> None:
    sts = by_kind(rendered(document(accelerator={"type": gpu})), "StatefulSet")[0]
    terms = sts["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert {node for node, labels in NODES.items() if _schedulable(terms, labels)} == LANDS_ON[gpu]


def test_node_affinity_none_leaves_placement_to_the_node_selector() -> None:
    doc = document(accelerator={"type": "H100-80GB", "nodeAffinity": "none", "nodeSelector": {"pool": "h100"}})
    pod = by_kind(rendered(doc), "StatefulSet")[0]["spec"]["template"]["spec"]
    assert "affinity" not in pod and pod["nodeSelector"] == {"pool": "h100"}


@pytest.mark.parametrize("doc", [PIPELINE_1, PIPELINE_2])
def test_a_crashed_engine_leaves_its_last_log_lines_as_the_termination_message(doc: dict[str, Any]) -> None:
    for sts in by_kind(rendered(doc), "StatefulSet"):
        engine = sts["spec"]["template"]["spec"]["containers"][0]
        assert engine["terminationMessagePolicy"] == "FallbackToLogsOnError"


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


def test_the_routers_admit_the_gateway_beside_the_operator() -> None:
    isvc = load_inference_service(document())
    objects = render(isvc, make_plan(isvc.spec), operator_namespace="tensorfleet-system")
    (clients,) = one(objects, "NetworkPolicy", "llama-router")["spec"]["ingress"]
    gateway = {contract.LABEL_NAME: contract.APP_NAME, contract.LABEL_COMPONENT: contract.COMPONENT_GATEWAY}
    (peer,) = [p for p in clients["from"] if p.get("podSelector", {}).get("matchLabels") == gateway]
    assert peer["namespaceSelector"]["matchExpressions"][0]["values"] == ["tensorfleet-system"]
    assert clients["ports"] == [{"protocol": "TCP", "port": contract.ROUTER_PORT}]
    # Where the operator runs is not known (a printed render): no gateway is admitted from anywhere.
    (clients,) = one(rendered(document()), "NetworkPolicy", "llama-router")["spec"]["ingress"]
    assert not any(p.get("podSelector", {}).get("matchLabels") == gateway for p in clients["from"])


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_lora_objects_validate_strictly(version: str) -> None:
    doc = document(adapters=[{"name": "sql", "source": "org/sql"}], engine={"lora": {"maxLoras": 2}})
    for obj in rendered(doc):
        kubernetes_validate.validate(obj, version, strict=True)
