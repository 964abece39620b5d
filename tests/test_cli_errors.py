"""Malformed and impossible specs: one line on stderr naming the field, exit 1, no traceback."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import isvc_doc

from tensorfleet.cli import main

Doc = dict[str, Any]


def _base() -> Doc:
    return isvc_doc({"accelerator": {"type": "L4"}})


def _set(path: str, value: Any) -> Callable[[Doc], None]:
    def mutate(doc: Doc) -> None:
        node = doc
        parts = path.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return mutate


def _del(path: str) -> Callable[[Doc], None]:
    def mutate(doc: Doc) -> None:
        node = doc
        parts = path.split(".")
        for part in parts[:-1]:
            node = node[part]
        del node[parts[-1]]
    return mutate


UNKNOWN_ARCH = {"parameters": 20_000_000_000, "layers": 48, "hiddenSize": 6144, "attentionHeads": 48, "kvHeads": 8,
                "maxContextLength": 8192}

# (case id, mutation of a valid document, field the error must name, a phrase it must contain)
CASES: list[tuple[str, Callable[[Doc], None], str, str]] = [
    ("unknown-gpu", _set("spec.accelerator.type", "H100-40GB"), "spec.accelerator.type", "known types"),
    ("tensor-not-dividing-heads", _set("spec.parallelism", {"tensor": 3}), "spec.parallelism.tensor", "attention heads"),
    ("tensor-16-on-8-gpu-nodes", _set("spec.parallelism", {"tensor": 16}), "spec.parallelism.tensor", "pipeline 2"),
    ("tensor-over-gpus-per-node", _set("spec", {**_base()["spec"], "accelerator": {"type": "L4", "gpusPerNode": 2},
                                                "parallelism": {"tensor": 4}}), "spec.parallelism.tensor", "2 GPUs"),
    ("model-too-large", _set("spec", {**_base()["spec"], "model": {"name": "meta-llama/Llama-3.1-405B-Instruct", "maxModelLen": 8192},
                                      "parallelism": {"tensor": 1, "pipeline": 1}}), "spec.parallelism", "needs tensor 8 x pipeline"),
    ("kv-too-small", _set("spec", {**_base()["spec"], "model": {"name": "meta-llama/Llama-3.1-8B-Instruct", "maxModelLen": 131072},
                                   "parallelism": {"tensor": 1, "pipeline": 1}}), "spec.parallelism", "maxModelLen <="),
    ("nothing-fits-anywhere", _set("spec.model", {"name": "acme/huge", "maxModelLen": 8192, "architecture": {
        **UNKNOWN_ARCH, "parameters": 4_000_000_000_000, "layers": 8}}), "spec.model.name", "larger GPU type"),
    ("negative-replicas", _set("spec.replicas", -1), "spec.replicas", "greater than or equal to 0"),
    ("absurd-replicas", _set("spec.replicas", 1_000_000), "spec.replicas", "less than or equal"),
    ("replicas-not-a-number", _set("spec.replicas", "two"), "spec.replicas", "integer"),
    ("unknown-model-no-facts", _set("spec.model.name", "acme/secret-model-20b"), "spec.model.architecture", "not in the catalog"),
    ("architecture-bad-kv-heads", _set("spec.model.architecture", {**UNKNOWN_ARCH, "kvHeads": 7}),
     "spec.model.architecture", "kvHeads 7"),
    ("architecture-missing-layers", _set("spec.model.architecture", {k: v for k, v in UNKNOWN_ARCH.items() if k != "layers"}),
     "spec.model.architecture.layers", "required"),
    ("shell-string-args", _set("spec.engine.args", "--enable-prefix-caching --max-num-seqs 64"), "spec.engine.args", "shell string"),
    # Errors about one item of engine.args name the item.
    ("flag-and-value-in-one-arg", _set("spec.engine.args", ["--max-num-batched-tokens 4096"]), "spec.engine.args[0]", "separate items"),
    ("managed-flag-in-args", _set("spec.engine.args", ["--tensor-parallel-size", "4"]), "spec.engine.args[0]", "spec.parallelism.tensor"),
    ("unknown-spec-field", _set("spec.gpus", 8), "spec.gpus", "unknown field"),
    ("unknown-model-field", _set("spec.model.nmae", "x"), "spec.model.nmae", "unknown field"),
    ("autoscaling-min-over-max", _set("spec.autoscaling", {"minReplicas": 5, "maxReplicas": 2}), "spec.autoscaling", "minReplicas 5"),
    ("autoscaling-min-negative", _set("spec.autoscaling", {"minReplicas": -1, "maxReplicas": 2}), "spec.autoscaling.minReplicas", "greater than"),
    ("scale-to-zero-too-soon", _set("spec.autoscaling", {"minReplicas": 0, "maxReplicas": 2, "scaleToZeroAfterSeconds": 5}),
     "spec.autoscaling.scaleToZeroAfterSeconds", "greater than"),
    ("autoscaling-no-max", _set("spec.autoscaling", {"minReplicas": 1}), "spec.autoscaling.maxReplicas", "required"),
    ("pipeline-over-layers", _set("spec", {"model": {"name": "meta-llama/Llama-3.2-1B-Instruct", "maxModelLen": 4096},
                                            "accelerator": {"type": "L4"}, "parallelism": {"tensor": 1, "pipeline": 20}}),
     "spec.parallelism.pipeline", "16 layers"),
    ("max-model-len-over-context", _set("spec.model.maxModelLen", 200_000), "spec.model.maxModelLen", "context length 131072"),
    ("utilization-over-one", _set("spec.engine.gpuMemoryUtilization", 1.5), "spec.engine.gpuMemoryUtilization", "less than or equal"),
    ("bad-dtype", _set("spec.model.dtype", "int8"), "spec.model.dtype", "not one of"),
    ("awq-on-bf16-checkpoint", _set("spec.model.quantization", "awq"), "spec.model.quantization", "AWQ checkpoint"),
    ("none-on-fp8-checkpoint", _set("spec.model", {"name": "deepseek-ai/DeepSeek-V3", "quantization": "none", "maxModelLen": 8192}),
     "spec.model.quantization", "ships fp8"),
    ("bf16-on-t4", _set("spec", {"model": {"name": "meta-llama/Llama-3.2-1B-Instruct", "dtype": "bfloat16", "maxModelLen": 4096},
                                  "accelerator": {"type": "T4"}}), "spec.model.dtype", "bfloat16"),
    ("bad-name", _set("metadata.name", "Llama_70B"), "metadata.name", "DNS-1035"),
    ("name-too-long", _set("metadata.name", "a" * 50), "metadata.name", "at most 43"),
    ("wrong-kind", _set("kind", "Deployment"), "apiVersion/kind", "InferenceService"),
    ("missing-accelerator", _del("spec.accelerator"), "spec.accelerator", "required"),
    ("missing-model-name", _set("spec.model", {"maxModelLen": 8192}), "spec.model.name", "required"),
    ("reserved-env", _set("spec.engine.env", [{"name": "TF_TENSOR_PARALLEL_SIZE", "value": "2"}]), "spec.engine.env", "set by the operator"),
    ("env-value-and-valuefrom", _set("spec.engine.env", [{"name": "A", "value": "1", "valueFrom": {"fieldRef": {"fieldPath": "x"}}}]),
     "spec.engine.env[0]", "not both"),
    ("bad-cache-size", _set("spec.cache.size", "lots"), "spec.cache.size", "quantity"),
    ("bad-router-strategy", _set("spec.router.strategy", "random"), "spec.router.strategy", "least-pending"),
    ("bad-toleration-effect", _set("spec.accelerator.tolerations", [{"key": "a", "effect": "Sometimes"}]),
     "spec.accelerator.tolerations[0].effect", "NoSchedule"),
]


def test_base_document_is_valid(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "ok.yaml"
    path.write_text(yaml.safe_dump(_base()))
    assert main(["plan", "-f", str(path)]) == 0


@pytest.mark.parametrize("case,mutate,field,phrase", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("command", ["plan", "render"])
def test_bad_spec_is_one_line_naming_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str, case: str,
    mutate: Callable[[Doc], None], field: str, phrase: str,
) -> None:
    doc = _base()
    mutate(doc)
    path = tmp_path / f"{case}.yaml"
    path.write_text(yaml.safe_dump(doc))
    assert main([command, "-f", str(path)]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith(f"error: {path}: {field}:"), lines[0]
    assert phrase in lines[0], lines[0]
    assert "Traceback" not in captured.err


@pytest.mark.parametrize(
    "content,phrase",
    [
        ("spec: [unclosed", "not valid YAML"),
        ("- just\n- a list\n", "expected a mapping"),
        ("", "no InferenceService"),
    ],
)
def test_unreadable_files(tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str, phrase: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(content)
    assert main(["plan", "-f", str(path)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and phrase in err[0]


def test_missing_file(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "-f", "/nonexistent/x.yaml"]) == 1
    assert capsys.readouterr().err.strip() == "error: /nonexistent/x.yaml: no such file"


def test_usage_error_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["plan"])
    assert exit_info.value.code == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_console_script_process_has_no_traceback(tmp_path: Path) -> None:
    """The installed entry point, as a user runs it."""
    doc = _base()
    doc["spec"]["parallelism"] = {"tensor": 3}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(doc))
    result = subprocess.run([sys.executable, "-m", "tensorfleet.cli", "render", "-f", str(path)],
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 1
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1 and "spec.parallelism.tensor" in result.stderr
