"""Bad specs are refused at `kubectl apply`, naming the field, and nothing is stored.

Three layers refuse them, each a real part of the API server's admission chain:
strict field validation against the CRD's structural schema, the CRD's CEL rules,
and the operator's validating webhook (the planner's checks).
"""

from __future__ import annotations

from typing import Any

import yaml
from kube import example, isvc, kubectl_result


def _refused(doc: dict[str, Any]) -> str:
    done = kubectl_result("apply", "-f", "-", stdin=yaml.safe_dump(doc))
    assert done.returncode != 0, f"kubectl apply accepted it: {done.stdout}"
    assert isvc(doc["metadata"]["name"], doc["metadata"]["namespace"]) is None, "a refused spec must not be stored"
    assert "Traceback" not in done.stderr
    return done.stderr.strip()


def test_an_unknown_field_is_refused_by_strict_field_validation(namespace: str) -> None:
    doc = example("simulator-cpu.yaml", namespace)
    doc["spec"]["model"]["maxModelLenght"] = 4096
    error = _refused(doc)
    assert 'unknown field "spec.model.maxModelLenght"' in error, error


def test_a_cel_rule_is_enforced_by_the_api_server(namespace: str) -> None:
    doc = example("simulator-cpu.yaml", namespace, autoscaling={"minReplicas": 3, "maxReplicas": 2})
    error = _refused(doc)
    assert "spec.autoscaling" in error and "minReplicas must not be greater than maxReplicas" in error, error


def test_a_long_name_is_refused_by_its_cel_rule(namespace: str) -> None:
    doc = example("simulator-cpu.yaml", namespace)
    doc["metadata"]["name"] = "n" * 44
    error = _refused(doc)
    assert "metadata.name must be at most 43 characters" in error, error


def test_a_tensor_size_that_does_not_divide_the_heads_is_refused_by_the_webhook(namespace: str) -> None:
    doc = example("llama-3.1-70b-a100.yaml", namespace, parallelism={"tensor": 3})
    error = _refused(doc)
    assert "admission webhook" in error and "denied the request" in error, error
    assert "spec.parallelism.tensor" in error and "64" in error, error


def test_a_model_that_does_not_fit_is_refused_by_the_webhook_with_what_would(namespace: str) -> None:
    doc = example("llama-3.1-405b-h100-multinode.yaml", namespace, accelerator={"type": "L4"},
                  parallelism={"tensor": 1, "pipeline": 1})
    error = _refused(doc)
    assert "admission webhook" in error and "denied the request" in error, error
    assert "spec.parallelism" in error and "L4" in error, error
    assert len(error.splitlines()) == 1, "one line"
