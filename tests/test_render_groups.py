"""spec.parallelism.groupTopologyKey: the stages of a pipeline group in one domain of a node label (one NVLink
domain with nvidia.com/gpu.clique)."""

from __future__ import annotations

import kubernetes_validate
import pytest
from test_render import by_kind, document, rendered

from tensorfleet import contract
from tensorfleet.api import SpecError, load_inference_service
from tensorfleet.render import stage_selector

CLIQUE = "nvidia.com/gpu.clique"


@pytest.mark.parametrize("allocation", ["extendedResource", "deviceClass"])
def test_every_stage_requires_its_group_leaders_domain(allocation: str) -> None:
    objects = rendered(document(parallelism={"tensor": 8, "pipeline": 2, "groupTopologyKey": CLIQUE},
                                accelerator={"type": "H100-80GB", "allocation": allocation}))
    stages = by_kind(objects, "StatefulSet")
    assert len(stages) == 2
    for stage in stages:
        affinity = stage["spec"]["template"]["spec"]["affinity"]
        (term,) = affinity["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert term == {"labelSelector": {"matchLabels": stage_selector("llama", 0)},
                        "matchLabelKeys": [contract.LABEL_POD_INDEX], "topologyKey": CLIQUE}
        assert term["labelSelector"]["matchLabels"][contract.LABEL_STAGE] == "0"
        # The leaders match the selector themselves: the first of a group chooses its domain.
        labels = stage["spec"]["template"]["metadata"]["labels"]
        leader = labels.get(contract.LABEL_STAGE) == "0"
        assert leader == all(labels.get(k) == v for k, v in term["labelSelector"]["matchLabels"].items())
        # The GPU node affinity stays beside it under the device plugin.
        assert ("nodeAffinity" in affinity) == (allocation == "extendedResource")
        for version in ("1.31.0", kubernetes_validate.latest_version()):
            kubernetes_validate.validate(stage, version, strict=True)


def test_a_single_stage_needs_no_group_affinity_and_a_bad_key_is_refused() -> None:
    (stage,) = by_kind(rendered(document(parallelism={"tensor": 8, "pipeline": 1, "groupTopologyKey": CLIQUE})),
                       "StatefulSet")
    assert "podAffinity" not in stage["spec"]["template"]["spec"].get("affinity", {})
    with pytest.raises(SpecError) as refused:
        load_inference_service(document(parallelism={"tensor": 8, "pipeline": 2, "groupTopologyKey": "bad key/"}))
    assert "groupTopologyKey" in str(refused.value)
