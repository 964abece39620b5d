"""spec.prefill: two pools planned apart and checked to exchange KV, rendered in the naming contract."""

from __future__ import annotations

import json
from typing import Any

import kubernetes_validate
import pytest

from tensorfleet import contract
from tensorfleet.api import SpecError, load_inference_service
from tensorfleet.planner import make_plan
from tensorfleet.render import leader_selector, render

K8S_VERSIONS = ("1.30.0", kubernetes_validate.latest_version())
LLAMA_70B = "meta-llama/Llama-3.1-70B-Instruct"


def document(name: str = "pd", **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": {"name": LLAMA_70B, "maxModelLen": 16384},
        "parallelism": {"tensor": 4}, "accelerator": {"type": "A100-80GB"}, "replicas": 2,
        "prefill": {"replicas": 3, "parallelism": {"tensor": 4}, "accelerator": {"type": "H100-80GB"}},
    }
    body.update(spec)
    return {"apiVersion": contract.API_VERSION, "kind": contract.KIND,
            "metadata": {"name": name, "namespace": "llm", "uid": "uid-1"}, "spec": body}


def objects(doc: dict[str, Any]) -> list[dict[str, Any]]:
    isvc = load_inference_service(doc)
    return render(isvc, make_plan(isvc.spec))


def one(found: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (obj,) = [o for o in found if o["kind"] == kind and o["metadata"]["name"] == name]
    return obj


def refused(doc: dict[str, Any]) -> SpecError:
    with pytest.raises(SpecError) as caught:
        make_plan(load_inference_service(doc).spec)
    return caught.value


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


# --- planner ------------------------------------------------------------------------------


def test_each_pool_is_planned_on_its_own_gpus() -> None:
    plan = make_plan(load_inference_service(document()).spec)
    assert (plan.accelerator, plan.tensor, plan.pipeline) == ("A100-80GB", 4, 1)
    assert plan.prefill is not None and plan.kv_connector == "NixlConnector"
    assert (plan.prefill.accelerator, plan.prefill.tensor, plan.prefill.pipeline) == ("H100-80GB", 4, 1)
    colocated = make_plan(load_inference_service(document(prefill=None)).spec)
    assert colocated.prefill is None and colocated.kv_connector is None
    assert colocated.kv_cache_tokens == plan.kv_cache_tokens  # the decode pool is the spec's own pool


def test_the_prefill_pool_defaults_to_the_decode_pools_gpus_and_its_own_layout() -> None:
    plan = make_plan(load_inference_service(document(prefill={"replicas": 1})).spec)
    assert plan.prefill is not None and plan.prefill.accelerator == "A100-80GB"
    assert plan.prefill.pipeline == 1 and plan.prefill.fits


@pytest.mark.parametrize(("change", "field"), [
    ({"parallelism": {"tensor": 4, "pipeline": 2}}, "spec.parallelism.pipeline"),
    ({"prefill": {"parallelism": {"tensor": 4, "pipeline": 2}}}, "spec.prefill.parallelism.pipeline"),
    # 70B in bf16 needs more than one 80 GB GPU: the prefill pool's layout is named as the prefill pool's.
    ({"prefill": {"parallelism": {"tensor": 1}, "accelerator": {"type": "H100-80GB"}}}, "spec.prefill.parallelism"),
    ({"prefill": {"accelerator": {"type": "NoSuchGPU"}}}, "spec.prefill.accelerator.type"),
    # A T4 has no bfloat16: its KV cache would be float16 beside the decode pool's bfloat16.
    ({"model": {"name": "meta-llama/Llama-3.1-8B-Instruct", "maxModelLen": 4096}, "parallelism": {"tensor": 1},
      "accelerator": {"type": "L4"}, "prefill": {"accelerator": {"type": "T4"}}}, "spec.prefill.accelerator.type"),
    ({"adapters": [{"name": "sql", "source": "org/sql"}]}, "spec.adapters"),
    ({"engine": {"args": ["--kv_transfer_config={\"kv_connector\":\"NixlConnector\"}"]}}, "spec.engine.args[0]"),
])
def test_pools_that_cannot_exchange_kv_are_refused_naming_the_field(change: dict[str, Any], field: str) -> None:
    doc = document()
    for key, value in change.items():
        doc["spec"][key] = ({**doc["spec"]["prefill"], **value} if key == "prefill" else value)
    error = refused(doc)
    assert error.field == field, str(error)
    assert "\n" not in str(error)


def test_a_kv_transfer_without_a_prefill_pool_is_refused_and_args_may_carry_their_own_connector() -> None:
    assert refused(document(prefill=None, kvTransfer={"connector": "NixlConnector"})).field == "spec.kvTransfer"
    # Colocated engines may still run a connector of their own (say, LMCache offloading).
    args = ['--kv-transfer-config={"kv_connector":"LMCacheConnectorV1","kv_role":"kv_both"}']
    assert make_plan(load_inference_service(document(prefill=None, engine={"args": args})).spec).prefill is None


def test_only_connectors_the_router_speaks_are_accepted_and_names_stay_short() -> None:
    with pytest.raises(SpecError) as caught:
        load_inference_service(document(kvTransfer={"connector": "P2pNcclConnector"}))
    assert caught.value.field == "spec.kvTransfer.connector" and "NixlConnector" in caught.value.message
    with pytest.raises(SpecError) as caught:
        load_inference_service(document(name="a-name-that-is-far-too-long-for-pools"))
    assert caught.value.field == "metadata.name" and "at most 35" in caught.value.message
    load_inference_service(document(name="a-name-that-is-far-too-long-for-pools", prefill=None))


# --- render -------------------------------------------------------------------------------


def test_the_prefill_pool_is_rendered_in_the_naming_contract() -> None:
    found = objects(document())
    decode = one(found, "StatefulSet", "pd-stage-0")
    prefill = one(found, "StatefulSet", "pd-prefill-stage-0")
    assert not [o for o in found if o["kind"] == "StatefulSet" and o["metadata"]["name"] not in
                ("pd-stage-0", "pd-prefill-stage-0")]
    assert prefill["spec"]["replicas"] == 3 and decode["spec"]["replicas"] == 2
    pods = {"decode": decode["spec"]["template"], "prefill": prefill["spec"]["template"]}
    assert pods["decode"]["metadata"]["labels"][contract.LABEL_POOL] == contract.POOL_DECODE
    assert pods["prefill"]["metadata"]["labels"][contract.LABEL_POOL] == contract.POOL_PREFILL
    # No selector of the decode pool (its StatefulSet, the engine Service, the scale subresource's) takes a
    # prefill pod, and the other way round.
    service = one(found, "Service", "pd-engine")
    prefill_service = one(found, "Service", "pd-prefill-engine")
    prefill_labels, decode_labels = pods["prefill"]["metadata"]["labels"], pods["decode"]["metadata"]["labels"]
    for selector in (decode["spec"]["selector"]["matchLabels"], service["spec"]["selector"], leader_selector("pd")):
        assert matches(selector, decode_labels) and not matches(selector, prefill_labels)
    for selector in (prefill["spec"]["selector"]["matchLabels"], prefill_service["spec"]["selector"]):
        assert matches(selector, prefill_labels) and not matches(selector, decode_labels)
    # Both pools are under the PodDisruptionBudget and the engines' NetworkPolicy (peers on every port: NIXL).
    pdb = one(found, "PodDisruptionBudget", "pd-engine")
    policy = one(found, "NetworkPolicy", "pd-engine")
    for labels in (prefill_labels, decode_labels):
        assert matches(pdb["spec"]["selector"]["matchLabels"], labels)
        assert matches(policy["spec"]["podSelector"]["matchLabels"], labels)
    assert prefill["spec"]["updateStrategy"] == {"type": "RollingUpdate"}


def test_both_pools_run_the_connector_with_their_side_channel_and_their_own_gpus() -> None:
    found = objects(document())
    for name, gpu, product in (("pd-stage-0", "A100-80GB", "A100-SXM4-80GB"),
                               ("pd-prefill-stage-0", "H100-80GB", "NVIDIA-H100-80GB-HBM3")):
        pod = one(found, "StatefulSet", name)["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        env = {v["name"]: v for v in container["env"]}
        assert json.loads(env[contract.ENV_KV_TRANSFER_CONFIG]["value"]) == {"kv_connector": "NixlConnector",
                                                                               "kv_role": "kv_both"}
        assert env[contract.ENV_NIXL_SIDE_CHANNEL_HOST]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        assert env[contract.ENV_NIXL_SIDE_CHANNEL_PORT]["value"] == str(contract.NIXL_SIDE_CHANNEL_PORT)
        assert {"name": contract.NIXL_PORT_NAME, "containerPort": contract.NIXL_SIDE_CHANNEL_PORT,
                "protocol": "TCP"} in container["ports"]
        assert env[contract.ENV_ACCELERATOR]["value"] == gpu
        assert container["resources"]["limits"][contract.GPU_RESOURCE] == "4"
        terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        assert any(product in e.get("values", []) for t in terms for e in t["matchExpressions"]), name
    args = one(found, "Deployment", "pd-router")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--prefill-service") + 1] == "pd-prefill-engine"


def test_without_a_prefill_pool_nothing_changes() -> None:
    found = objects(document(prefill=None))
    assert not [o for o in found if "prefill" in o["metadata"]["name"]]
    sts = one(found, "StatefulSet", "pd-stage-0")
    assert contract.LABEL_POOL not in sts["spec"]["template"]["metadata"]["labels"]
    env = {v["name"] for v in sts["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert not {contract.ENV_KV_TRANSFER_CONFIG, contract.ENV_NIXL_SIDE_CHANNEL_HOST} & env
    args = one(found, "Deployment", "pd-router")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--prefill-service" not in args


def test_an_idle_fleet_takes_the_prefill_pool_to_zero_too() -> None:
    doc = document(replicas=None, autoscaling={"minReplicas": 0, "maxReplicas": 3})
    isvc = load_inference_service(doc)
    found = render(isvc, make_plan(isvc.spec), idle=True)
    assert one(found, "StatefulSet", "pd-prefill-stage-0")["spec"]["replicas"] == 0
    assert one(found, "StatefulSet", "pd-stage-0")["spec"]["replicas"] == 0


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_disaggregated_objects_validate_strictly(version: str) -> None:
    for obj in objects(document()):
        kubernetes_validate.validate(obj, version, strict=True)
