"""GPUs through Dynamic Resource Allocation (spec.accelerator.allocation deviceClass): what the renderer makes of
it, checked against the Kubernetes schemas of the releases where resource.k8s.io/v1 is GA, and by value."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
from test_render import LLAMA_70B, by_kind, document, engine, rendered

from tensorfleet import contract
from tensorfleet.api import SpecError, load_inference_service
from tensorfleet.catalog import GPUS, find_gpu
from tensorfleet.planner import make_plan

# resource.k8s.io/v1 (ResourceClaimTemplate) is served from 1.34 on.
DRA_VERSIONS = ("1.34.0", kubernetes_validate.latest_version())
TEMPLATE = "ResourceClaimTemplate"


def dra(**spec: Any) -> dict[str, Any]:
    accelerator = {"type": "H100-80GB", "allocation": contract.ALLOCATION_DEVICE_CLASS, **spec.pop("accelerator", {})}
    return document(accelerator=accelerator, **spec)


def request_of(template: dict[str, Any]) -> dict[str, Any]:
    (request,) = template["spec"]["spec"]["devices"]["requests"]
    assert request["name"] == contract.GPU_CLAIM
    return dict(request["exactly"])


@pytest.mark.parametrize("version", DRA_VERSIONS)
def test_every_object_validates_strictly(version: str) -> None:
    for doc in (dra(parallelism={"tensor": 4, "pipeline": 2}),
                dra(prefill={"replicas": 1, "parallelism": {"tensor": 2}})):
        for obj in rendered(doc):
            kubernetes_validate.validate(obj, version, strict=True)


def test_each_pod_claims_tensor_devices_of_the_class_by_the_planned_gpus_attributes_and_asks_no_device_plugin() -> None:
    objects = rendered(dra(parallelism={"tensor": 4, "pipeline": 2}, engine={"resources": {"requests": {"cpu": "8"}}}))
    (template,) = by_kind(objects, TEMPLATE)
    request = request_of(template)
    assert (request["deviceClassName"], request["allocationMode"], request["count"]) == \
        (contract.DEFAULT_GPU_DEVICE_CLASS, "ExactCount", 4)
    (selector,) = request["selectors"]
    assert selector["cel"]["expression"] == find_gpu("H100-80GB").dra_selector()  # type: ignore[union-attr]
    assert template["metadata"]["ownerReferences"][0]["uid"] == "uid-1234"
    assert template["spec"]["metadata"]["labels"][contract.LABEL_INSTANCE] == "llama"
    stages = by_kind(objects, "StatefulSet")
    assert len(stages) == 2
    for stage in stages:
        pod = stage["spec"]["template"]["spec"]
        # Every stage of every group claims its own devices from the one template.
        assert pod["resourceClaims"] == [{"name": contract.GPU_CLAIM,
                                          "resourceClaimTemplateName": template["metadata"]["name"]}]
        resources = engine(stage)["resources"]
        assert resources["claims"] == [{"name": contract.GPU_CLAIM}]
        assert resources["requests"] == {"cpu": "8"} and contract.GPU_RESOURCE not in resources.get("limits", {})
        # The scheduler matches devices by attribute: no node label is required, the GPU taint still tolerated.
        assert "affinity" not in pod
        assert {"key": contract.GPU_TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    names = [o["kind"] for o in objects]
    assert names.index(TEMPLATE) < names.index("StatefulSet"), "the template goes before the pods naming it"


def test_the_selector_names_every_variant_of_the_type_and_its_memory() -> None:
    for gpu in GPUS:
        expression = gpu.dra_selector()
        domain = contract.NVIDIA_DRA_DRIVER
        assert expression.startswith(f"device.driver == '{domain}' && ")
        names = re.search(r"productName in \[(.*?)\]", expression)
        assert names and names.group(1).split(", ") == [f"'{name}'" for name in gpu.nvml_names], expression
        assert f"device.capacity['{domain}'].memory.compareTo(quantity('{gpu.memory_mib}Mi')) >= 0" in expression


def test_the_device_class_is_the_operators_and_the_default_stays_the_device_plugin() -> None:
    (template,) = by_kind(rendered(dra(), gpu_device_class="h100.example.com"), TEMPLATE)
    assert request_of(template)["deviceClassName"] == "h100.example.com"
    plain = rendered(document())
    assert not by_kind(plain, TEMPLATE)
    (stage,) = by_kind(plain, "StatefulSet")
    assert "resourceClaims" not in stage["spec"]["template"]["spec"]
    assert engine(stage)["resources"]["limits"][contract.GPU_RESOURCE] == "1"


def test_a_changed_request_gets_a_template_of_its_own_and_the_same_request_the_same_name() -> None:
    def name(doc: dict[str, Any]) -> str:
        (template,) = by_kind(rendered(doc), TEMPLATE)
        return str(template["metadata"]["name"])

    base = name(dra(parallelism={"tensor": 2}))
    assert base == name(dra(parallelism={"tensor": 2}, replicas=3, engine={"image": "vllm/vllm-openai:v9"}))
    assert re.fullmatch(r"llama-gpus-[0-9a-f]{10}", base), base
    others = {name(dra(parallelism={"tensor": 4})), name(dra(parallelism={"tensor": 2}, accelerator={"type": "H200"})),
              name(dra(parallelism={"tensor": 2}))}
    assert len(others) == 3 and base in others
    assert name(dra(model={"name": LLAMA_70B}, parallelism={"tensor": 8})) != base


def test_each_pool_of_a_disaggregated_service_claims_its_own_gpus() -> None:
    objects = rendered(dra(parallelism={"tensor": 2}, prefill={"replicas": 1, "parallelism": {"tensor": 1},
                                                                "accelerator": {"type": "H200",
                                                                                "allocation": "deviceClass"}}))
    templates = {t["metadata"]["name"]: request_of(t) for t in by_kind(objects, TEMPLATE)}
    assert len(templates) == 2
    (prefill,) = [n for n in templates if n.startswith("llama-prefill-gpus-")]
    assert templates[prefill]["count"] == 1 and "NVIDIA H200" in templates[prefill]["selectors"][0]["cel"]["expression"]
    for stage in by_kind(objects, "StatefulSet"):
        (claim,) = stage["spec"]["template"]["spec"]["resourceClaims"]
        expected = prefill if stage["metadata"]["name"].startswith("llama-prefill-") else (set(templates) - {prefill}).pop()
        assert claim["resourceClaimTemplateName"] == expected


def test_no_claim_where_no_gpu_is_asked_for() -> None:
    """The simulator stands in for GPUs without asking for any, whatever the allocation."""
    objects = rendered(dra(engine={"kind": "simulator"}))
    assert not by_kind(objects, TEMPLATE)
    assert all("resourceClaims" not in s["spec"]["template"]["spec"] for s in by_kind(objects, "StatefulSet"))


def test_the_cpu_backend_refuses_a_device_class_naming_the_field() -> None:
    doc = document(accelerator={"type": contract.CPU_ACCELERATOR, "allocation": "deviceClass"},
                   engine={"resources": {"requests": {"memory": "16Gi"}}})
    with pytest.raises(SpecError) as refused:
        make_plan(load_inference_service(doc).spec)
    assert refused.value.field == "spec.accelerator.allocation"


def test_an_unknown_allocation_is_refused_by_the_schema() -> None:
    with pytest.raises(SpecError) as refused:
        load_inference_service(document(accelerator={"type": "H100-80GB", "allocation": "dra"}))
    assert "allocation" in str(refused.value)


def test_the_docs_tables_are_the_catalogs() -> None:
    """The selector tables of docs/dra.md and the chart's README: each GPU type's NVML names and memory, as the
    claims ask for them."""
    root = Path(__file__).resolve().parent.parent
    row = re.compile(r"^ *\| ([A-Z0-9][-A-Za-z0-9]*) \| `.*$", flags=re.MULTILINE)
    for doc in (root / "docs" / "dra.md", root / "charts" / "tensorfleet" / "README.md"):
        rows = {m.group(1): m.group(0).strip() for m in row.finditer(doc.read_text())}
        assert set(rows) == {gpu.name for gpu in GPUS}, doc
        for gpu in GPUS:
            names = ", ".join(f"`{name}`" for name in gpu.nvml_names)
            assert rows[gpu.name] == f"| {gpu.name} | {names} | {gpu.memory_mib}Mi |", doc
