"""A GPU InferenceService that names only a stock vLLM image: the real API server
admits its pods (Pod Security `restricted` enforced on the namespace), and the
pods it stores carry the launcher's init container, its volume and the command
that runs the launcher with the image's own Python.

KWOK runs no containers, so what is checked is the pod spec as the API server
holds it, which is what a kubelet would run.
"""

from __future__ import annotations

from typing import Any

from kube import (
    OPERATOR_SELECTOR,
    SYSTEM_NAMESPACE,
    apply,
    engine_pods,
    eventually,
    example,
    items,
    kubectl,
    wait_ready,
)

from tensorfleet import contract

STOCK_VLLM = "docker.io/vllm/vllm-openai:v0.19.1"
RESTRICTED = ("pod-security.kubernetes.io/enforce=restricted", "pod-security.kubernetes.io/enforce-version=latest")


def _control_plane_image() -> str:
    """The image the chart runs the operator from, which it passes as --control-plane-image."""
    [deployment] = items("deployments", SYSTEM_NAMESPACE, OPERATOR_SELECTOR)
    return str(deployment["spec"]["template"]["spec"]["containers"][0]["image"])


def test_stock_vllm_image_runs_the_launcher_copied_in_by_the_init_container(namespace: str) -> None:
    kubectl("label", "namespace", namespace, *RESTRICTED)
    doc = example("llama-3.1-70b-h100.yaml", namespace, imagePullSecrets=[{"name": "regcred"}])
    doc["spec"]["engine"] = {"image": STOCK_VLLM}
    name = doc["metadata"]["name"]
    apply(doc)
    wait_ready(name, namespace)

    pods: list[dict[str, Any]] = list(eventually(f"engine pods of {namespace}/{name}",
                                                 lambda: engine_pods(name, namespace) or None))
    control_plane = _control_plane_image()
    for pod in pods:
        spec = pod["spec"]
        [init] = spec["initContainers"]
        assert init["name"] == contract.LAUNCHER_INIT_CONTAINER
        assert init["image"] == control_plane, "the operator's own image: the launcher matches its env"
        assert init["command"] == list(contract.LAUNCHER_INSTALL_COMMAND)
        assert init["volumeMounts"][0]["mountPath"] == contract.LAUNCHER_DIR

        [engine] = spec["containers"]
        assert engine["image"] == STOCK_VLLM
        assert engine["command"] == list(contract.LAUNCHER_COMMAND)
        mounts = {m["name"]: m for m in engine["volumeMounts"]}
        assert mounts[contract.LAUNCHER_VOLUME]["mountPath"] == contract.LAUNCHER_DIR
        assert mounts[contract.LAUNCHER_VOLUME]["readOnly"] is True
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert "emptyDir" in volumes[contract.LAUNCHER_VOLUME]
        assert spec["imagePullSecrets"] == [{"name": "regcred"}]
        # KWOK reports the init container done, as a kubelet would once it copied the launcher.
        statuses = pod["status"].get("initContainerStatuses") or []
        assert [s["name"] for s in statuses] in ([], [contract.LAUNCHER_INIT_CONTAINER])

    selector = f"{contract.LABEL_INFERENCE_SERVICE}={name},{contract.LABEL_COMPONENT}={contract.COMPONENT_ROUTER}"
    routers = items("pods", namespace, selector)
    assert routers and all(p["spec"]["imagePullSecrets"] == [{"name": "regcred"}] for p in routers)
