"""`kubectl scale` and the HPA both move an InferenceService through its /scale subresource."""

from __future__ import annotations

import json
from typing import Any

from kube import apply, condition, engine_pods, eventually, example, get, kubectl, wait_ready

from tensorfleet import contract


def _scale(name: str, namespace: str) -> dict[str, Any]:
    path = f"/apis/{contract.API_VERSION}/namespaces/{namespace}/{contract.PLURAL}/{name}/scale"
    return dict(json.loads(kubectl("get", "--raw", path)))


def test_kubectl_scale_moves_every_stage(namespace: str) -> None:
    doc = example("simulator-cpu.yaml", namespace, replicas=1, autoscaling=None)
    name = doc["metadata"]["name"]
    pipeline = doc["spec"]["parallelism"]["pipeline"]
    apply(doc)
    wait_ready(name, namespace)
    kubectl("scale", f"{contract.PLURAL}/{name}", "-n", namespace, "--replicas=3")
    for stage in range(pipeline):
        def at_three(stage: int = stage) -> bool:
            sts = get("statefulset", contract.stage_name(name, stage), namespace) or {}
            return sts.get("spec", {}).get("replicas") == 3
        eventually(f"stage {stage} at 3 replicas", at_three)

    def three_ready() -> dict[str, Any] | None:
        obj = get(contract.PLURAL, name, namespace) or {}
        return obj if obj.get("status", {}).get("readyReplicas") == 3 else None
    obj = eventually("3 ready replicas", three_ready)
    assert obj["spec"]["replicas"] == 3
    assert len(engine_pods(name, namespace)) == 3 * pipeline
    scale = _scale(name, namespace)
    assert scale["kind"] == "Scale" and scale["spec"]["replicas"] == 3 and scale["status"]["replicas"] == 3
    assert scale["status"]["selector"] == obj["status"]["selector"]
    kubectl("scale", f"{contract.PLURAL}/{name}", "-n", namespace, "--replicas=1")
    eventually("back to 1 group of pods", lambda: len(engine_pods(name, namespace)) == pipeline)


def test_the_hpa_controller_reads_scale_and_its_selector(namespace: str) -> None:
    doc = example("simulator-cpu.yaml", namespace)
    assert doc["spec"]["autoscaling"], "the example autoscales"
    name = doc["metadata"]["name"]
    apply(doc)
    wait_ready(name, namespace)

    def able() -> dict[str, Any] | None:
        hpa = get("horizontalpodautoscaler", contract.hpa_name(name), namespace)
        found = condition(hpa, "AbleToScale")
        return hpa if found and found["status"] == "True" else None
    hpa = eventually("the HPA AbleToScale=True", able)
    able_to_scale = condition(hpa, "AbleToScale")
    # The HPA controller's reasons for AbleToScale=True, all of which follow a successful read of /scale
    # (once it has a metric, a stabilisation window or a recent rescale replaces SucceededGetScale).
    assert able_to_scale and able_to_scale["reason"] in {
        "SucceededGetScale", "ReadyForNewScale", "ScaleDownStabilized", "ScaleUpStabilized", "SucceededRescale",
    }, able_to_scale
    assert hpa["status"].get("currentReplicas") == 1, "the HPA read /scale's status.replicas"
    services = kubectl("get", "apiservices", "-o", "name")
    active = eventually("the HPA ScalingActive condition", lambda: condition(
        get("horizontalpodautoscaler", contract.hpa_name(name), namespace), "ScalingActive"))
    if "v1beta1.custom.metrics.k8s.io" in services:
        # prometheus-adapter serves the pending-requests metric (e2e/monitoring.py): the HPA reads it.
        active = eventually("ScalingActive=True", lambda: (found := condition(get(
            "horizontalpodautoscaler", contract.hpa_name(name), namespace), "ScalingActive")) and
            found["status"] == "True" and found)
        assert active["reason"] == "ValidMetricFound", active
    else:
        # Without the custom-metrics API the HPA can read /scale but not the metric: it says so in
        # ScalingActive rather than scaling on anything made up.
        assert active["status"] == "False" and active["reason"] == "FailedGetObjectMetric", active
