"""What `tensorfleet plan` and `render` read: strict like the API server, bounded, and one line when wrong.

Three parts:
  - the document is checked against the generated CRD as the API server checks
    it with strict field validation (api/strict.py): what passes `plan` is
    what the cluster stores, field for field;
  - engine args are checked in the spellings vLLM reads;
  - hostile or broken bytes (alias bombs, deep nesting, huge files, other
    encodings, binary) end as one line on stderr, exit 1, quickly and in
    bounded memory (api/manifest.py), measured in a real process.
"""

from __future__ import annotations

import codecs
import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import isvc_doc
from worker_helpers import pod_env

from tensorfleet.api import load_inference_service
from tensorfleet.api.errors import SpecError
from tensorfleet.api.manifest import MAX_DEPTH, MAX_INPUT_BYTES, MAX_NODES, ManifestError, parse_manifests
from tensorfleet.cli import main
from tensorfleet.planner import make_plan
from tensorfleet.worker import command
from tensorfleet.worker.role import role_from_env

# An InferenceService that plans, written by hand: the YAML cases below edit its text.
BASE = textwrap.dedent("""\
    apiVersion: tensorfleet.dev/v1alpha1
    kind: InferenceService
    metadata:
      name: demo
    spec:
      model:
        name: meta-llama/Llama-3.1-8B-Instruct
        maxModelLen: 4096
      accelerator:
        type: L4
    """)


def _run(tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str | bytes, command: str = "plan") -> tuple[int, str, str]:
    path = tmp_path / "in.yaml"
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    code = main([command, "-f", str(path)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _one_error(tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str | bytes, command: str = "plan") -> str:
    """The single stderr line of a refused input, without its `error: FILE: ` prefix."""
    code, out, err = _run(tmp_path, capsys, text, command)
    assert code == 1 and out == "", err
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert "Traceback" not in err
    prefix = f"error: {tmp_path / 'in.yaml'}"
    assert err.startswith(prefix), err
    return err[len(prefix):].removeprefix(": ").rstrip("\n")


# --- the document, as the API server checks it ----------------------------------------------------------

# (case, a line appended under `spec:` or a replacement of the model block, field, phrase)
STRICT_CASES: list[tuple[str, str, str, str]] = [
    # A non-strict apply drops it without a word, and the operator plans the model's full 131k context.
    ("snake-case-field", "  model:\n    name: meta-llama/Llama-3.1-8B-Instruct\n    max_model_len: 100000",
     "spec.model.max_model_len", "unknown field (fields are camelCase: maxModelLen)"),
    ("quoted-integer", '  replicas: "2"', "spec.replicas", "write 2 without quotes"),
    ("quoted-number", '  engine:\n    gpuMemoryUtilization: "0.9"', "spec.engine.gpuMemoryUtilization", "without quotes"),
    ("quoted-boolean", '  networkPolicy:\n    enabled: "yes"', "spec.networkPolicy.enabled", "expected true or false"),
    ("yaml-boolean-for-string", "  model:\n    name: meta-llama/Llama-3.1-8B-Instruct\n    servedName: yes",
     "spec.model.servedName", "quote the value"),
    ("fraction-for-integer", "  model:\n    name: meta-llama/Llama-3.1-8B-Instruct\n    maxModelLen: 4096.5",
     "spec.model.maxModelLen", "not a whole number"),
    ("nan", "  engine:\n    gpuMemoryUtilization: .nan", "spec.engine.gpuMemoryUtilization", "not a finite number"),
    ("list-for-mapping", "  router: [2]", "spec.router", "expected a mapping"),
    ("number-in-args", "  engine:\n    args: [--enable-prefix-caching, 4096]", "spec.engine.args[1]", "quote the value"),
    ("duplicate-env", "  engine:\n    env:\n    - {name: A, value: '1'}\n    - {name: A, value: '2'}",
     "spec.engine.env[1]", "duplicate entry: name 'A' is also item 0"),
    ("null-required", "  accelerator: null", "spec.accelerator", "required field is missing"),
    ("typo-suggestion", "  autoscalling: {maxReplicas: 2}", "spec.autoscalling", "did you mean autoscaling?"),
    ("number-for-quantity", "  cache: {size: 500}", "spec.cache.size", "quote the value"),
]


@pytest.mark.parametrize(("case", "extra", "field", "phrase"), STRICT_CASES, ids=[c[0] for c in STRICT_CASES])
@pytest.mark.parametrize("command", ["plan", "render"])
def test_what_the_api_server_refuses_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str, case: str, extra: str, field: str, phrase: str,
) -> None:
    text = BASE
    if extra.startswith("  model:"):
        text = text.replace("  model:\n    name: meta-llama/Llama-3.1-8B-Instruct\n    maxModelLen: 4096\n", "")
    if extra.startswith("  accelerator:"):
        text = text.replace("  accelerator:\n    type: L4\n", "")
    line = _one_error(tmp_path, capsys, text + extra + "\n", command)
    assert line.startswith(f"{field}: "), line
    assert phrase in line, line


@pytest.mark.parametrize(("metadata", "field", "phrase"), [
    ({"name": "demo", "lables": {"a": "b"}}, "metadata.lables", "did you mean labels?"),
    ({"name": "demo", "labels": {"tier": 1}}, "metadata.labels.tier", "quote the value"),
    ({"name": "demo", "generation": "1"}, "metadata.generation", "without quotes"),
])
def test_metadata_is_checked_as_object_meta(metadata: dict[str, Any], field: str, phrase: str) -> None:
    doc = isvc_doc()
    doc["metadata"] = metadata
    with pytest.raises(SpecError) as caught:
        load_inference_service(doc, strict=True)
    assert caught.value.field == field and phrase in caught.value.message


def test_unknown_top_level_field() -> None:
    doc = isvc_doc()
    doc["specs"] = doc.pop("spec")
    with pytest.raises(SpecError) as caught:
        load_inference_service(doc, strict=True)
    assert caught.value.field == "specs" and "did you mean spec?" in caught.value.message


def test_what_the_api_server_accepts_plans_the_same(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Nulls the schema does not allow are dropped, status is ignored, dates stay strings, 2.0 is an integer."""
    text = BASE + "  replicas: null\n  router: {replicas: 2.0}\n  engine: {resources: null}\nstatus: {whatever: 1}\n"
    text = text.replace("    maxModelLen: 4096\n", "    maxModelLen: 4096\n    revision: 2024-06-01\n")
    code, out, err = _run(tmp_path, capsys, text, "render")
    assert code == 0, err
    env = {var["name"]: var.get("value") for obj in yaml.safe_load_all(out) if obj and obj["kind"] == "StatefulSet"
           for var in obj["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["TF_MODEL_REVISION"] == "2024-06-01"   # PyYAML alone would have made it a date and refused it


def test_lenient_parsing_stays_for_documents_from_the_api_server() -> None:
    """The operator reads what the API server stored: no second schema walk there (strict is opt-in)."""
    doc = isvc_doc({"replicas": 2})
    doc["status"] = {"observedGeneration": 1, "unknownToThisVersion": True}
    assert load_inference_service(doc).spec.replicas == 2


# --- engine args, in every spelling vLLM reads ------------------------------------------------------------

@pytest.mark.parametrize(("args", "index", "phrase"), [
    (["--max_model_len=100000"], 0, "spec.model.maxModelLen"),
    (["--enable-prefix-caching", "--tensor_parallel_size=4"], 1, "spec.parallelism.tensor"),
    (["-tp", "4"], 0, "spec.parallelism.tensor"),
    (["--max-model-len=1"], 0, "spec.model.maxModelLen"),
    (["--max-model", "1"], 0, "abbreviates --max-model-len"),
    (["--gpu_memory_utilization", "0.95"], 0, "spec.engine.gpuMemoryUtilization"),
    (["-qawq"], 0, "spec.model.quantization"),
    (["--config", "/models/serve.yaml"], 0, "read flags from a file"),
    (["--kv_transfer_config='{\"kv_connector\": \"NixlConnector\", \"kv_role\": \"kv_both\"}'"], 0, "shell quotes"),
    (["--kv-transfer-config", "'{\"kv_connector\": \"NixlConnector\"}'"], 1, "shell quotes"),
])
def test_engine_args_name_the_item(tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], index: int,
                                   phrase: str) -> None:
    doc = yaml.safe_load(BASE)
    doc["spec"]["engine"] = {"args": args}
    line = _one_error(tmp_path, capsys, yaml.safe_dump(doc))
    assert line.startswith(f"spec.engine.args[{index}]: "), line
    assert phrase in line, line


def test_json_config_args_pass(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = yaml.safe_load(BASE)
    args = ['--kv_transfer_config={"kv_connector": "NixlConnector", "kv_role": "kv_both"}',
            "--compilation-config", '{"cudagraph_capture_sizes": [1, 2, 4]}', "--kv-transfer-config.kv_port", "14579",
            "-O3", "--max-num-batched-tokens=4096"]
    doc["spec"]["engine"] = {"args": args}
    code, out, err = _run(tmp_path, capsys, yaml.safe_dump(doc), "render")
    assert code == 0, err
    sts = next(o for o in yaml.safe_load_all(out) if o and o["kind"] == "StatefulSet")
    env = {v["name"]: v.get("value") for v in sts["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert json.loads(env["TF_EXTRA_ARGS"]) == args


# --- dtype: the flag says what the spec says ---------------------------------------------------------------

def test_plan_shows_the_dtype_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(tmp_path, capsys, BASE)
    assert code == 0 and "activations bfloat16 (--dtype auto)" in out


@pytest.mark.parametrize(("model", "gpu", "dtype", "flag", "sized_as"), [
    # auto reaches vLLM as auto, which follows the checkpoint; it used to become bfloat16 always,
    # overriding fp16 checkpoints and breaking AWQ ones (vLLM's AWQ kernels run in float16).
    ("meta-llama/Llama-3.1-8B-Instruct", "H100-80GB", "auto", "auto", "bfloat16"),
    ("hugging-quants/Meta-Llama-3.1-70B-Instruct-AWQ-INT4", "H100-80GB", "auto", "auto", "float16"),
    # T4 has no bfloat16: auto would pick it for a bf16 checkpoint and fail, so the flag says float16.
    ("meta-llama/Llama-3.2-1B-Instruct", "T4", "auto", "float16", "float16"),
    ("meta-llama/Llama-3.1-8B-Instruct", "H100-80GB", "float16", "float16", "float16"),
    ("meta-llama/Llama-3.1-8B-Instruct", "H100-80GB", "bfloat16", "bfloat16", "bfloat16"),
])
def test_the_dtype_flag_says_what_the_spec_says(model: str, gpu: str, dtype: str, flag: str, sized_as: str) -> None:
    doc = isvc_doc({"model": {"name": model, "dtype": dtype, "maxModelLen": 4096}, "accelerator": {"type": gpu}})
    plan = make_plan(load_inference_service(doc, strict=True).spec)
    assert (plan.engine_dtype, plan.dtype) == (flag, sized_as)
    argv = command.vllm_argv(role_from_env(pod_env(doc, 0)))
    assert argv[argv.index("--dtype") + 1] == flag and argv.count("--dtype") == 1


# --- bytes: encodings ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("encoding", ["utf-8-sig", "utf-16", "utf-16-le", "utf-16-be", "utf-32"])
def test_other_unicode_encodings_are_read(tmp_path: Path, capsys: pytest.CaptureFixture[str], encoding: str) -> None:
    """PowerShell's `>` writes UTF-16 with a byte-order mark; YAML also names BOM-less UTF-16 by its zero bytes."""
    code, out, err = _run(tmp_path, capsys, BASE.encode(encoding))
    assert code == 0, err
    assert "InferenceService default/demo" in out


@pytest.mark.parametrize(("data", "phrase"), [
    (BASE.replace("demo", "d\u00e9mo").encode("latin-1"), "not UTF-8 text: byte E9 at line 4, column 10"),
    (codecs.BOM_UTF16_LE + "name: x".encode("utf-16-le") + b"\x00\xd8", "not UTF-16 text"),
    (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256)) * 64, "not UTF-8 text"),
    (BASE.encode() + b"\x00", "not valid YAML"),
])
def test_undecodable_bytes_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], data: bytes, phrase: str) -> None:
    assert phrase in _one_error(tmp_path, capsys, data)


# --- bytes: structure ------------------------------------------------------------------------------------------

def _alias_bomb(levels: int = 9, width: int = 9) -> str:
    lines = ['      a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for level in range(1, levels):
        lines.append(f"      a{level}: &a{level} [{', '.join([f'*a{level - 1}'] * width)}]")
    body = "\n".join(lines)
    # Under valueFrom, which keeps unknown fields: no schema error stops it before it expands.
    return BASE + f"  engine:\n    env:\n    - name: BOMB\n      valueFrom:\n{body}\n"


@pytest.mark.parametrize(("text", "phrase"), [
    (_alias_bomb(), f"more than {MAX_NODES:,} values"),
    (BASE + "  engine:\n    args: &a [*a]\n", "refers to a node that contains it"),
    (BASE + "  engine:\n    args: *nowhere\n", "refers to no anchor"),
    (BASE + "  x: " + "[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1) + "\n", f"nested more than {MAX_DEPTH} levels"),
    (BASE + "  replicas: 1\n  replicas: 2\n", "spec.replicas: duplicate key (lines 11 and 12)"),
    (BASE + "  x: !Ref y\n", "not valid YAML"),
    ("spec: [unclosed", "not valid YAML"),
    ("", "no InferenceService"),
])
def test_bad_structure_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, phrase: str) -> None:
    assert phrase in _one_error(tmp_path, capsys, text, "render")


def test_anchors_and_merge_keys_within_bounds_are_yaml(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = BASE.replace("  accelerator:\n    type: L4\n", "  accelerator: &gpu\n    type: L4\n") + (
        "  engine:\n    env:\n    - &var {name: A, value: '1'}\n    - {<<: *var, name: B}\n")
    code, _, err = _run(tmp_path, capsys, text, "render")
    assert code == 0, err


def test_duplicate_keys_in_a_later_document_name_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = BASE + "---\n" + BASE.replace("name: demo", "name: other\n  name: again")
    assert _one_error(tmp_path, capsys, text).startswith("[1]: metadata.name: duplicate key")


def test_too_large(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = BASE + "# " + "x" * MAX_INPUT_BYTES + "\n"
    assert "larger than 3 MiB" in _one_error(tmp_path, capsys, text)


def test_not_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "-f", str(tmp_path)]) == 1
    assert capsys.readouterr().err == f"error: {tmp_path}: is a directory; name one YAML file (or - for stdin)\n"


# --- messages: one readable line, whatever the input holds ----------------------------------------------

@pytest.mark.parametrize(("extra", "field"), [
    ("  accelerator:\n    type: " + "x" * 100_000, "spec.accelerator.type"),
    ('  "' + "k" * 500 + '\\nline two\\u2028\\x1b[31m": 1', "spec.kkkkkkkk"),
    ("  engine:\n    args: ['--max-model-len=" + "9" * 100_000 + "']", "spec.engine.args[0]"),
    ("  model:\n    name: '" + "m" * 100_000 + "'", "spec.model.name"),
])
def test_long_and_odd_values_stay_one_short_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: str,
                                                  field: str) -> None:
    text = BASE
    for block in ("  accelerator:\n    type: L4\n", "  model:\n    name: meta-llama/Llama-3.1-8B-Instruct\n    maxModelLen: 4096\n"):
        if extra.startswith(block.split("\n")[0]):
            text = text.replace(block, "")
    line = _one_error(tmp_path, capsys, text + extra + "\n")
    assert line.startswith(field), line
    assert len(line) < 1000 and line.isprintable(), line


# --- bounds, measured on a real process --------------------------------------------------------------------------

# Runs the CLI as a child and reports its exit code, output, peak RSS and time, so that the
# test's own process (pytest, with its imports and earlier children) does not count.
_MEASURE = textwrap.dedent("""\
    import json, resource, subprocess, sys, time
    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (2 * 1024**3, 2 * 1024**3))   # a regression fails, not the machine
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "tensorfleet.cli", *sys.argv[1:]], capture_output=True,
                          text=True, errors="replace", preexec_fn=limit, timeout=60)
    seconds = time.monotonic() - start
    peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    print(json.dumps({"code": done.returncode, "out": done.stdout[-2000:], "err": done.stderr, "seconds": seconds,
                      "peak_mib": peak_kib / 1024}))
    """)

BOUNDED = {
    "alias-bomb": _alias_bomb(levels=12).encode(),
    "deep-nesting": (BASE + "  x: " + "[" * 100_000 + "]" * 100_000 + "\n").encode(),
    "deep-mappings": (BASE + "  x: " + "{a: " * 50_000 + "1" + "}" * 50_000 + "\n").encode(),
    "huge": (BASE + "# " + "x" * (MAX_INPUT_BYTES * 4) + "\n").encode(),
    "many-values": (BASE + "  x:\n" + "  - 1\n" * 500_000).encode(),
    "many-documents": (BASE + "---\n").encode() * 15_000,
    "long-value": BASE.replace("type: L4", "type: '" + "x" * (MAX_INPUT_BYTES - 1000) + "'").encode(),
    "latin-1": BASE.replace("demo", "d\u00e9mo").encode("latin-1"),
    "binary": b"\x1f\x8b\x08\x00" + bytes(range(256)) * 8192,
    "binary-zeros-first": bytes(range(256)) * 8192,
}


@pytest.mark.parametrize("name", sorted(BOUNDED))
@pytest.mark.parametrize("command", ["render"])
def test_pathological_input_fails_fast_in_bounded_memory(tmp_path: Path, name: str, command: str) -> None:
    path = tmp_path / f"{name}.yaml"
    path.write_bytes(BOUNDED[name])
    result = subprocess.run([sys.executable, "-c", _MEASURE, command, "-f", str(path)],
                            capture_output=True, text=True, timeout=120, check=True)
    report = json.loads(result.stdout)
    assert report["code"] == 1, report
    assert report["out"] == "" and report["err"].startswith("error: ") and report["err"].count("\n") == 1, report
    assert "Traceback" not in report["err"] and len(report["err"]) < 1000, report
    # The target is under a second and 200 MiB (a few tenths and ~60 MiB here); time allows for a loaded CI machine.
    assert report["peak_mib"] < 200, report
    assert report["seconds"] < 10, report


def test_the_largest_accepted_input_stays_within_bounds(tmp_path: Path) -> None:
    """Just under MAX_NODES, all of it passed on to the rendered pods (valueFrom keeps what it is given)."""
    values = "\n".join(f"        k{i}: v" for i in range(MAX_NODES // 2 - 100))
    path = tmp_path / "big.yaml"
    path.write_text(BASE + f"  engine:\n    env:\n    - name: BIG\n      valueFrom:\n{values}\n")
    result = subprocess.run([sys.executable, "-c", _MEASURE, "render", "-f", str(path)],
                            capture_output=True, text=True, timeout=120, check=True)
    report = json.loads(result.stdout)
    assert report["code"] == 0, report["err"]
    assert report["peak_mib"] < 200 and report["seconds"] < 10, report


def test_stdin_is_bounded_too() -> None:
    data = BASE.encode() + b"# " + b"x" * (MAX_INPUT_BYTES * 2) + b"\n"
    result = subprocess.run([sys.executable, "-m", "tensorfleet.cli", "plan", "-f", "-"], input=data,
                            capture_output=True, timeout=60, check=False)
    assert result.returncode == 1 and result.stdout == b""
    assert result.stderr.decode() == ("error: <stdin>: larger than 3 MiB, the most the API server accepts in one "
                                      "request; an InferenceService is a few KiB\n")


def test_manifest_errors_carry_no_label_twice() -> None:
    with pytest.raises(ManifestError) as caught:
        parse_manifests(b"a: 1\na: 2\n", "x.yaml")
    assert str(caught.value) == ("x.yaml: a: duplicate key (lines 1 and 2): the API server refuses a field given "
                                 "twice, and which value would win is not what you see; keep one")
