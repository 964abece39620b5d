"""The e2e pod runner's own rules (e2e/podrunner.py): which pods it runs, and how it builds a container's env and
argv the way the kubelet does. Running pods is the e2e suite's (e2e/test_pods.py, against the real control plane);
these are the pure parts, checked against pods the operator's own render code makes."""

from __future__ import annotations

import copy
import importlib
import importlib.util
import sys
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT

from tensorfleet import contract
from tensorfleet.api import load_inference_service
from tensorfleet.planner import make_plan
from tensorfleet.render import render

_spec = importlib.util.spec_from_file_location("podrunner", ROOT / "e2e" / "podrunner.py")
assert _spec and _spec.loader
podrunner = importlib.util.module_from_spec(_spec)
sys.modules["podrunner"] = podrunner
_spec.loader.exec_module(podrunner)
# Where REPO and VENV_BIN live and are read (podrunner re-exports them): a test patches them there. Loading
# podrunner put its folder on sys.path.
podrunner_spec = importlib.import_module("podrunner_spec")

IMAGE = contract.CONTROL_PLANE_IMAGE


def _pods(example: str) -> dict[str, dict[str, Any]]:
    """The pods an example's workloads would make (by component and stage), scheduled on a node."""
    import yaml

    (doc,) = [d for d in yaml.safe_load_all((ROOT / "examples" / example).read_text()) if d]
    isvc = load_inference_service(doc)
    pods = {}
    for obj in render(isvc, make_plan(isvc.spec)):
        if obj["kind"] in ("Deployment", "StatefulSet"):
            template = copy.deepcopy(obj["spec"]["template"])
            template["spec"]["nodeName"] = "node-0"
            pods[obj["metadata"]["name"]] = {"metadata": {"name": "p", "namespace": "ns", **template["metadata"]},
                                             "spec": template["spec"]}
    return pods


def test_it_runs_routers_and_simulator_engines_and_leaves_gpu_engines_to_kwok() -> None:
    simulator = _pods("simulator-cpu.yaml")
    assert simulator and all(podrunner.runs(pod, IMAGE) for pod in simulator.values()), sorted(simulator)
    gpu = _pods("llama-3.1-70b-h100.yaml")
    chosen = {name for name, pod in gpu.items() if podrunner.runs(pod, IMAGE)}
    assert chosen == {contract.router_name("llama-70b-h100")}, "vLLM engines run another image behind an init container"


def _cpu_vllm_pods() -> dict[str, dict[str, Any]]:
    """The pods of a vLLM InferenceService on accelerator CPU, scheduled."""
    doc = {"apiVersion": "tensorfleet.dev/v1alpha1", "kind": "InferenceService",
           "metadata": {"name": "cpu", "namespace": "ns"},
           "spec": {"model": {"name": "meta-llama/Llama-3.2-1B-Instruct", "maxModelLen": 4096},
                    "engine": {"resources": {"requests": {"cpu": "4", "memory": "8Gi"}}},
                    "accelerator": {"type": contract.CPU_ACCELERATOR}, "replicas": 1}}
    isvc = load_inference_service(doc)
    pods = {}
    for obj in render(isvc, make_plan(isvc.spec)):
        if obj["kind"] in ("Deployment", "StatefulSet"):
            template = copy.deepcopy(obj["spec"]["template"])
            template["spec"]["nodeName"] = "cpu-0"
            pods[obj["metadata"]["name"]] = {"metadata": {"name": "p", "namespace": "ns", **template["metadata"]},
                                             "spec": template["spec"]}
    return pods


def test_it_runs_vllm_engines_on_cpu_with_their_init_container_and_leaves_gpu_ones_to_kwok() -> None:
    pods = _cpu_vllm_pods()
    engine = pods[contract.stage_name("cpu", 0)]
    (container,) = engine["spec"]["containers"]
    (init,) = engine["spec"]["initContainers"]
    assert podrunner.is_vllm_image(container["image"]) and init["image"] == IMAGE
    assert all(podrunner.runs(pod, IMAGE) for pod in pods.values()), sorted(pods)
    gpu = next(pod for name, pod in _pods("llama-3.1-70b-h100.yaml").items() if "stage" in name)
    assert podrunner.is_vllm_image(gpu["spec"]["containers"][0]["image"]) and not podrunner.runs(gpu, IMAGE)
    asks = copy.deepcopy(engine)
    asks["spec"]["containers"][0]["resources"] = {"limits": {"nvidia.com/gpu": "1"}}
    assert not podrunner.runs(asks, IMAGE), "a pod that asks for a GPU is KWOK's"
    claims = copy.deepcopy(engine)
    claims["spec"]["resourceClaims"] = [{"name": contract.GPU_CLAIM, "resourceClaimTemplateName": "cpu-gpus-0"}]
    claims["spec"]["containers"][0]["resources"] = {"claims": [{"name": contract.GPU_CLAIM}]}
    assert not podrunner.runs(claims, IMAGE), "a pod that claims GPUs through DRA is KWOK's too"
    other_init = copy.deepcopy(engine)
    other_init["spec"]["initContainers"][0]["image"] = "busybox:1"
    assert not podrunner.runs(other_init, IMAGE), "init containers run the control-plane image only"
    other = copy.deepcopy(engine)
    other["spec"]["containers"][0]["image"] = "registry.example/not-vllm:1"
    assert not podrunner.runs(other, IMAGE)


@pytest.mark.parametrize(("image", "vllm"), [
    (contract.VLLM_IMAGE, True),
    (contract.VLLM_CPU_IMAGE, True),
    ("vllm/vllm-openai:latest", True),
    ("vllm/vllm-openai@sha256:0123", True),
    ("index.docker.io/vllm/vllm-openai-cpu:v0.19.1", True),
    ("ghcr.io/someone/vllm-openai:v0.19.1", False),
    ("docker.io/vllm/vllm-openai-rocm:v0.19.1", False),
    (IMAGE, False),
])
def test_the_images_that_run_with_real_vllm(image: str, vllm: bool) -> None:
    assert podrunner.is_vllm_image(image) is vllm


def test_the_image_files_go_over_the_deepest_folder_that_exists(tmp_path: Any) -> None:
    root = tmp_path / "image"
    bundle = root / podrunner.LAUNCHER_BUNDLE_PATH.lstrip("/")
    bundle.parent.mkdir(parents=True)
    bundle.write_bytes(b"zip")
    (root / "usr" / "share").mkdir(parents=True)
    (root / "usr" / "share" / "tensorfleet-e2e-none").write_text("x")
    overlays = podrunner.image_overlays(root)
    assert [str(root / "usr" / "share"), "/usr/share"] in overlays
    opt = next(pair for pair in overlays if pair[1].startswith("/opt") or pair[1] == "/")
    assert opt[1] != "/", "never over this machine's root"
    assert (Path(opt[0]) / podrunner.LAUNCHER_BUNDLE_PATH.removeprefix(opt[1]).lstrip("/")).is_file()


def test_it_leaves_unscheduled_fault_marked_and_other_image_pods_alone() -> None:
    pod = next(iter(_pods("simulator-cpu.yaml").values()))
    assert podrunner.runs(pod, IMAGE)
    assert not podrunner.runs(pod, "registry.example/other:1")
    other_version = copy.deepcopy(pod)
    other_version["spec"]["containers"][0]["image"] = f"{podrunner.repository(IMAGE)}:e2e-next"
    assert podrunner.runs(other_version, IMAGE), "a rollout to another version of the image runs too"
    other_version["spec"]["containers"][0]["image"] = f"{podrunner.repository(IMAGE)}-other:1"
    assert not podrunner.runs(other_version, IMAGE)
    unscheduled = copy.deepcopy(pod)
    del unscheduled["spec"]["nodeName"]
    assert not podrunner.runs(unscheduled, IMAGE)
    marked = copy.deepcopy(pod)
    marked["spec"]["containers"][0].setdefault("env", []).append({"name": "E2E_KWOK_FAULT", "value": "OOMKilled"})
    assert not podrunner.runs(marked, IMAGE), "the fault stages' pod"
    host = copy.deepcopy(pod)
    host["spec"]["hostNetwork"] = True
    assert not podrunner.runs(host, IMAGE)


@pytest.mark.parametrize(("text", "expanded"), [
    ("$(A)-$(B)", "1-two"),
    ("$(MISSING)", "$(MISSING)"),
    ("$$(A)", "$(A)"),
    ("$$$(A)", "$1"),
    ("cost $5 $(", "cost $5 $("),
    ("$(A", "$(A"),
])
def test_expansion_is_kubernetes_dollar_paren(text: str, expanded: str) -> None:
    assert podrunner.expand(text, {"A": "1", "B": "two"}) == expanded


@pytest.mark.parametrize(("text", "value"), [
    ("250m", Fraction(1, 4)), ("2", Fraction(2)), ("1Gi", Fraction(2**30)), ("64Mi", Fraction(64 * 2**20)),
    ("1e3", Fraction(1000)), ("0.5", Fraction(1, 2)), ("1k", Fraction(1000)),
])
def test_quantities(text: str, value: Fraction) -> None:
    assert podrunner.quantity(text) == value


def test_a_quantity_with_an_unknown_suffix_is_refused() -> None:
    with pytest.raises(ValueError, match="not a quantity"):
        podrunner.quantity("12Qi")


POD: dict[str, Any] = {
    "metadata": {"name": "web-0", "namespace": "shop", "uid": "u-1", "labels": {"app": "web", "tier": "front"}},
    "spec": {"nodeName": "node-0", "serviceAccountName": "web"},
    "status": {"podIP": "10.244.1.7", "podIPs": [{"ip": "10.244.1.7"}], "hostIP": "127.0.1.1"},
}
DATA = {("secret", "creds"): {"password": "s3cret"}, ("configmap", "settings"): {"mode": "fast", "bad key": "x"}}


def _lookup(kind: str, name: str) -> dict[str, str] | None:
    return DATA.get((kind, name))


def test_the_env_is_built_as_the_kubelet_builds_it() -> None:
    container = {
        "name": "app",
        "resources": {"requests": {"cpu": "250m"}, "limits": {"memory": "64Mi", "cpu": "1500m"}},
        "envFrom": [{"configMapRef": {"name": "settings"}, "prefix": "CM_"}],
        "env": [
            {"name": "CM_mode", "value": "overridden"},
            {"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "URL", "value": "http://$(IP):$(KUBERNETES_SERVICE_PORT)/$(LATER)"},
            {"name": "LATER", "value": "x"},
            {"name": "APP", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['app']"}}},
            {"name": "MEM", "valueFrom": {"resourceFieldRef": {"resource": "limits.memory", "divisor": "1Mi"}}},
            {"name": "CPUS", "valueFrom": {"resourceFieldRef": {"resource": "limits.cpu"}}},
            {"name": "REQ", "valueFrom": {"resourceFieldRef": {"resource": "requests.cpu", "divisor": "1m"}}},
            {"name": "NO_LIMIT", "valueFrom": {"resourceFieldRef": {"resource": "limits.ephemeral-storage"}}},
            {"name": "PW", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "password"}}},
            {"name": "OPT", "valueFrom": {"secretKeyRef": {"name": "gone", "key": "k", "optional": True}}},
        ],
    }
    env = podrunner.container_env(POD, container, _lookup, {"ephemeral-storage": "4Ti"},
                                  {"KUBERNETES_SERVICE_PORT": "6443"})
    assert env == {
        "KUBERNETES_SERVICE_PORT": "6443", "CM_mode": "overridden", "IP": "10.244.1.7",
        "URL": "http://10.244.1.7:6443/$(LATER)", "LATER": "x", "APP": "web", "MEM": "64", "CPUS": "2",
        "REQ": "250", "NO_LIMIT": str(4 * 2**40), "PW": "s3cret",
    }, "envFrom keys that are no variable name are skipped, later env wins, $(VAR) only sees earlier ones"


@pytest.mark.parametrize(("ref", "message"), [
    ({"secretKeyRef": {"name": "gone", "key": "k"}}, 'secret "gone" not found'),
    ({"secretKeyRef": {"name": "creds", "key": "user"}}, "couldn't find key user in Secret shop/creds"),
    ({"configMapKeyRef": {"name": "settings", "key": "level"}}, "couldn't find key level in ConfigMap shop/settings"),
    ({"fieldRef": {"fieldPath": "spec.priority"}}, "unsupported fieldRef fieldPath 'spec.priority'"),
])
def test_a_missing_reference_is_the_kubelets_create_container_config_error(ref: dict[str, Any], message: str) -> None:
    container = {"name": "app", "env": [{"name": "X", "valueFrom": ref}]}
    with pytest.raises(podrunner.ConfigError) as raised:
        podrunner.container_env(POD, container, _lookup, {}, {})
    assert str(raised.value) == message


def test_paths_of_volumes_and_the_image_are_rewritten_where_named() -> None:
    rewrites = [("/etc/tensorfleet/api-keys", "/state/pods/v/api-keys"), ("/cache", "/state/pods/v/cache")]
    assert podrunner.rewrite_paths("/cache/huggingface", rewrites) == "/state/pods/v/cache/huggingface"
    assert podrunner.rewrite_paths("/cache", rewrites) == "/state/pods/v/cache"
    assert podrunner.rewrite_paths("/cachet", rewrites) == "/cachet"
    assert podrunner.rewrite_paths("--api-keys=/etc/tensorfleet/api-keys", rewrites) == \
        "--api-keys=/state/pods/v/api-keys"
    assert podrunner.rewrite_paths("/etc/tensorfleet", rewrites) == "/etc/tensorfleet"
    assert podrunner.image_path("/usr/local/bin/tensorfleet") == f"{podrunner.VENV_BIN}/tensorfleet"
    assert podrunner.image_path("/usr/local/binary") == "/usr/local/binary"


@pytest.mark.parametrize(("image", "repo"), [
    ("ghcr.io/tensorfleet/tensorfleet:0.1.0", "ghcr.io/tensorfleet/tensorfleet"),
    ("registry.example:5000/tf:1@sha256:abc", "registry.example:5000/tf"),
    ("registry.example:5000/tf", "registry.example:5000/tf"),
    ("tensorfleet:dev", "tensorfleet"),
])
def test_the_repository_of_an_image(image: str, repo: str) -> None:
    assert podrunner.repository(image) == repo


def test_go_durations_as_the_kubelet_prints_its_back_off() -> None:
    assert [podrunner.go_duration(s) for s in (10, 40, 160, 300, 3700)] == ["10s", "40s", "2m40s", "5m0s", "1h1m40s"]


@pytest.mark.parametrize(("repo", "venv_bin", "bound"), [
    ("/work/main", "/work/main/.venv/bin", []),
    ("/tmp/ci/clone", "/tmp/ci/clone/.venv/bin", ["/tmp/ci/clone"]),
    ("/work/main", "/tmp/venv/bin", ["/tmp/venv"]),
    ("/tmp/clone", "/run/user/0/venv/bin", ["/tmp/clone", "/run/user/0/venv"]),
    ("/tmp/clone/sub", "/tmp/clone/venv/bin", ["/tmp/clone/sub", "/tmp/clone/venv"]),
])
def test_a_checkout_or_venv_under_a_pods_own_tmp_is_bound_back(monkeypatch: pytest.MonkeyPatch, repo: str,
                                                                venv_bin: str, bound: list[str]) -> None:
    from pathlib import Path

    monkeypatch.setattr(podrunner_spec, "REPO", Path(repo))
    monkeypatch.setattr(podrunner_spec, "VENV_BIN", Path(venv_bin))
    assert podrunner.host_paths_under_private_tops() == bound


def test_a_vllm_pods_precompiled_headers_are_the_shared_caches(monkeypatch: pytest.MonkeyPatch,
                                                                tmp_path: Path) -> None:
    """torch keeps its precompiled headers under $TMPDIR/torchinductor_<user> (getpass's order of variables,
    sanitised), not under TORCHINDUCTOR_CACHE_DIR: the runner links them from each pod's /tmp to one cache."""
    monkeypatch.setenv("TF_E2E_CACHE", str(tmp_path / "cache"))
    shared = tmp_path / "cache" / "vllm-cpu" / "precompiled-headers"
    pod_tmp = tmp_path / "pod-tmp"
    pod_tmp.mkdir()
    podrunner.share_header_cache(pod_tmp, {"USER": "tensor/fleet", "LNAME": "other"})
    link = pod_tmp / "torchinductor_tensor_fleet" / "precompiled_headers"
    assert link.is_symlink() and link.resolve() == shared.resolve() and shared.is_dir()
    podrunner.share_header_cache(pod_tmp, {"USER": "tensor/fleet"})  # a container started again: left as it is
    assert link.is_symlink()
    podrunner.share_header_cache(pod_tmp, {"LOGNAME": "first", "USER": "second"})
    assert (pod_tmp / "torchinductor_first" / "precompiled_headers").is_symlink()
    assert not (pod_tmp / "torchinductor_second").exists()
    podrunner.share_header_cache(pod_tmp, {"USER": "elsewhere", "TMPDIR": "/var/tmp"})
    assert not (pod_tmp / "torchinductor_elsewhere").exists()


@pytest.mark.parametrize(("resources", "want"), [
    ({"requests": {"cpu": "1", "memory": "5Gi"}}, 1),
    ({"requests": {"cpu": "500m"}}, 1),
    ({"requests": {"cpu": "1"}, "limits": {"cpu": "2500m"}}, 3),
    ({}, 1),
])
def test_a_vllm_container_asks_for_its_cpu_limit_else_request_in_whole_cpus(resources: dict[str, Any],
                                                                            want: int) -> None:
    assert podrunner.whole_cpus({"name": "engine", "resources": resources}) == want


def test_vllm_containers_get_cpus_no_other_one_runs_on_while_there_are_enough(monkeypatch: pytest.MonkeyPatch
                                                                               ) -> None:
    """vLLM binds a thread to every core it may use: two engines on the same cores run in lock-step."""
    monkeypatch.setattr(podrunner.os, "sched_getaffinity", lambda _: {0, 1, 2, 3})
    pins = podrunner.CpuPins()
    assert pins.pin("a/engine", 1) == [0]
    assert pins.pin("b/engine", 2) == [1, 2]
    assert pins.pin("c/engine", 2) == [0, 3]    # one left free: it shares the least held
    assert pins.pin("d/engine", 9) == [0, 1, 2, 3]   # never more than there are
    pins.unpin("d/engine")
    pins.unpin("a/engine")
    assert pins.pin("b/engine", 2) == [1, 2]     # a restart of the same container: its own again
    assert pins.pin("e/engine", 1) == [0]        # every one held once now: the lowest
    assert pins.pin("f/engine", 1) == [1]
