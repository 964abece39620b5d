"""Rendering, the engine StatefulSets: GPU resources, placement (node affinity under every provider's labels,
tolerations), volumes and the model cache, update strategy and replicas, the leader's and workers' ports and probes,
the engine's environment, and the simulator's GPU-less pods.
"""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from test_render import (
    CASES,
    LLAMA_8B,
    LLAMA_70B,
    LLAMA_405B,
    PIPELINE_1,
    PIPELINE_2,
    PIPELINE_3,
    SIMULATOR,
    by_kind,
    document,
    engine,
    env_map,
    one,
    rendered,
)

from tensorfleet import contract
from tensorfleet.api import load_inference_service
from tensorfleet.catalog import find_gpu
from tensorfleet.planner import make_plan
from tensorfleet.render import desired_replicas, render

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
