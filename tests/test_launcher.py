"""The launcher reaches GPU engine pods without being in their image.

Rendering: a GPU pod's init container (the control-plane image) copies the
launcher zipapp into an emptyDir, and the engine container runs it with the
engine image's python3, so an InferenceService naming only a stock vLLM image
works; simulator pods keep running the control-plane image's own
`tensorfleet-worker`. Every rendered object is checked against the official
schemas (strict) and Pod Security `restricted`.

The bundle (`tensorfleet.worker.bundle`): built here, it runs under a Python
that has nothing but the standard library and pydantic (what a vLLM image
provides), on every interpreter >= 3.10 found on this machine, and refuses
older ones in one line.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
from pod_security import pod_templates, violations

from tensorfleet import contract
from tensorfleet.api import load_inference_service
from tensorfleet.api.errors import SpecError
from tensorfleet.planner import make_plan
from tensorfleet.render import DEFAULT_IMAGES, render
from tensorfleet.render.meta import Images
from tensorfleet.worker import bundle as launcher_bundle
from tensorfleet.worker.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
K8S_VERSIONS = ("1.30.0", kubernetes_validate.latest_version())
STOCK_VLLM = "vllm/vllm-openai:v0.20.0"  # any vLLM image: not ours, not the default


def document(**spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": {"name": "meta-llama/Llama-3.1-70B-Instruct", "maxModelLen": 8192},
        "accelerator": {"type": "H100-80GB"},
        "parallelism": {"tensor": 4, "pipeline": 2},
    }
    body.update(spec)
    return {"apiVersion": contract.API_VERSION, "kind": contract.KIND,
            "metadata": {"name": "llama", "namespace": "ml", "uid": "uid-1"}, "spec": body}


def rendered(doc: dict[str, Any], images: Images | None = None) -> list[dict[str, Any]]:
    isvc = load_inference_service(doc)
    return render(isvc, make_plan(isvc.spec), images=images or DEFAULT_IMAGES)


def pods(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o["spec"]["template"]["spec"] for o in objects if o["kind"] == kind]


STOCK = document(engine={"image": STOCK_VLLM}, imagePullSecrets=[{"name": "regcred"}, {"name": "mirror"}])
SIMULATOR = document(engine={"kind": "simulator"}, imagePullSecrets=[{"name": "regcred"}])


# --- rendering -------------------------------------------------------------------------


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("doc", [STOCK, SIMULATOR, document()], ids=["stock-vllm", "simulator", "default-image"])
def test_rendered_objects_validate_strictly_and_meet_restricted(doc: dict[str, Any], version: str) -> None:
    objects = rendered(doc)
    for obj in objects:
        kubernetes_validate.validate(obj, version, strict=True)
    for name, pod, pod_annotations in pod_templates(objects):
        assert violations(pod, pod_annotations) == [], name


def test_a_stock_vllm_image_runs_the_launcher_from_the_init_container() -> None:
    stages = pods(rendered(STOCK), "StatefulSet")
    assert len(stages) == 2
    for pod in stages:
        [init] = pod["initContainers"]
        assert init["name"] == contract.LAUNCHER_INIT_CONTAINER
        assert init["image"] == contract.CONTROL_PLANE_IMAGE, "the operator's own image: launcher and env agree"
        assert init["command"] == ["tensorfleet-worker", "install-launcher", contract.LAUNCHER_DIR]
        assert init["volumeMounts"] == [{"name": contract.LAUNCHER_VOLUME, "mountPath": contract.LAUNCHER_DIR}]
        assert init["securityContext"]["readOnlyRootFilesystem"] is True
        assert init["terminationMessagePolicy"] == "FallbackToLogsOnError", "its one-line error reaches Degraded"
        assert init["resources"]["limits"]["memory"]

        [engine] = pod["containers"]
        assert engine["image"] == STOCK_VLLM
        assert engine["command"] == ["python3", f"{contract.LAUNCHER_DIR}/launcher.pyz"] == list(contract.LAUNCHER_COMMAND)
        assert "args" not in engine, "the image's ENTRYPOINT (vllm serve) never runs: command replaces it"
        mounts = {m["name"]: m for m in engine["volumeMounts"]}
        assert mounts[contract.LAUNCHER_VOLUME] == {
            "name": contract.LAUNCHER_VOLUME, "mountPath": contract.LAUNCHER_DIR, "readOnly": True}
        assert mounts[contract.ENGINE_HOME_VOLUME]["mountPath"] == contract.ENGINE_HOME_PATH
        env = {item["name"]: item.get("value") for item in engine["env"]}
        assert env["HOME"] == contract.ENGINE_HOME_PATH and env["USER"] == contract.ENGINE_USER

        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes[contract.LAUNCHER_VOLUME] == {"name": contract.LAUNCHER_VOLUME, "emptyDir": {"sizeLimit": "64Mi"}}
        assert volumes[contract.ENGINE_HOME_VOLUME] == {"name": contract.ENGINE_HOME_VOLUME, "emptyDir": {}}
        assert pod["securityContext"]["runAsUser"] == contract.WORKER_UID


def test_the_default_engine_image_is_the_pinned_upstream_vllm_release() -> None:
    for pod in pods(rendered(document()), "StatefulSet"):
        assert pod["containers"][0]["image"] == contract.DEFAULT_ENGINE_IMAGE == "docker.io/vllm/vllm-openai:v0.19.1"
        assert pod["initContainers"][0]["image"] == contract.CONTROL_PLANE_IMAGE
    # The operator's flags (a registry mirror) move both.
    mirror = Images(worker="mirror.example/vllm/vllm-openai:v0.19.1", control_plane="mirror.example/tensorfleet:0.1.0")
    for pod in pods(rendered(document(), mirror), "StatefulSet"):
        assert pod["containers"][0]["image"] == mirror.worker
        assert pod["initContainers"][0]["image"] == mirror.control_plane


def test_the_pin_agrees_with_the_worker_image_and_the_chart() -> None:
    import yaml

    dockerfile = (ROOT / "worker-image" / "Dockerfile").read_text()
    assert f"ARG VLLM_VERSION={contract.VLLM_VERSION}\n" in dockerfile
    values = yaml.safe_load((ROOT / "charts" / "tensorfleet" / "values.yaml").read_text())["workerImage"]
    assert f"{values['repository']}:{values['tag']}" == contract.DEFAULT_ENGINE_IMAGE
    assert contract.VLLM_VERSION in (ROOT / "operator" / "tensorfleet" / "vllm_defaults.py").read_text()


def test_simulator_pods_keep_the_control_plane_images_launcher() -> None:
    for pod in pods(rendered(SIMULATOR), "StatefulSet"):
        assert "initContainers" not in pod
        [engine] = pod["containers"]
        assert engine["image"] == contract.CONTROL_PLANE_IMAGE
        assert engine["command"] == list(contract.WORKER_COMMAND)
        names = {v["name"] for v in pod["volumes"]} | {m["name"] for m in engine["volumeMounts"]}
        assert contract.LAUNCHER_VOLUME not in names and contract.ENGINE_HOME_VOLUME not in names
        assert not {"HOME", "USER"} & {item["name"] for item in engine["env"]}


def test_home_and_user_from_the_spec_win() -> None:
    doc = document(engine={"env": [{"name": "HOME", "value": "/scratch"}]})
    for pod in pods(rendered(doc), "StatefulSet"):
        env = [item for item in pod["containers"][0]["env"] if item["name"] in ("HOME", "USER")]
        assert env == [{"name": "USER", "value": contract.ENGINE_USER}, {"name": "HOME", "value": "/scratch"}]


def test_image_pull_secrets_reach_engine_and_router_pods() -> None:
    objects = rendered(STOCK)
    for pod in [*pods(objects, "StatefulSet"), *pods(objects, "Deployment")]:
        assert pod["imagePullSecrets"] == [{"name": "regcred"}, {"name": "mirror"}]
    for pod in [*pods(rendered(document()), "StatefulSet"), *pods(rendered(document()), "Deployment")]:
        assert "imagePullSecrets" not in pod
    with pytest.raises(SpecError, match="imagePullSecrets.*regcred listed more than once"):
        load_inference_service(document(imagePullSecrets=[{"name": "regcred"}, {"name": "regcred"}]))


def test_the_crd_declares_image_pull_secrets_as_a_map_by_name() -> None:
    import yaml

    crd = yaml.safe_load((ROOT / "crds" / "tensorfleet.dev_inferenceservices.yaml").read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    field = spec["imagePullSecrets"]
    assert field["x-kubernetes-list-type"] == "map" and field["x-kubernetes-list-map-keys"] == ["name"]
    assert field["items"]["required"] == ["name"]
    assert "vLLM image" in spec["engine"]["properties"]["image"]["description"]


def test_the_init_containers_command_is_what_tensorfleet_worker_accepts() -> None:
    args = build_parser().parse_args(list(contract.LAUNCHER_INSTALL_COMMAND[1:]))
    assert args.command == "install-launcher" and args.directory == contract.LAUNCHER_DIR
    assert args.source == contract.LAUNCHER_BUNDLE_PATH


# --- the bundle ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("bundle") / "launcher.pyz"
    launcher_bundle.build(out)
    return out


def _top_level(dist: metadata.Distribution) -> set[str]:
    names = set()
    for file in dist.files or []:
        first = Path(str(file)).parts[0]
        if first != ".." and not first.endswith((".dist-info", ".egg-info")) and first != "__pycache__":
            names.add(first)
    return names


@pytest.fixture(scope="module")
def pydantic_only(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory with pydantic and what it needs, and nothing else: a vLLM image's contribution."""
    out = tmp_path_factory.mktemp("pydantic-only")
    todo, seen = ["pydantic"], set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        dist = metadata.distribution(name)
        for requirement in dist.requires or []:
            if "extra ==" not in requirement:
                todo.append(re.match(r"[A-Za-z0-9_.-]+", requirement).group(0))  # type: ignore[union-attr]
        for top in _top_level(dist):
            (out / top).symlink_to(Path(str(dist.locate_file(top))))
    return out


def _run(python: str, bundle: Path, *args: str, path: Path | None, env: dict[str, str] | None = None,
         ) -> subprocess.CompletedProcess[str]:
    """The bundle under PYTHON with only the standard library and PATH on sys.path (-S: no site-packages)."""
    clean = {"PATH": os.environ["PATH"], "PYTHONPATH": str(path) if path else "", **(env or {})}
    return subprocess.run([python, "-S", str(bundle), *args], capture_output=True, text=True, env=clean,
                          timeout=60, check=False)


def test_bundle_holds_the_package_and_its_pure_python_dependencies(bundle: Path) -> None:
    assert bundle.read_bytes().startswith(b"#!/usr/bin/env python3\n")
    with zipfile.ZipFile(bundle) as zf:
        names = set(zf.namelist())
        manifest = json.loads(zf.read("LAUNCHER.json"))
    assert {"__main__.py", "tensorfleet/__init__.py", "tensorfleet/worker/cli.py", "tensorfleet/contract.py",
            "pynvml.py", "prometheus_client/__init__.py"} <= names
    assert not [n for n in names if n.endswith((".so", ".pyc")) or "__pycache__" in n]
    assert not [n for n in names if n.startswith("tensorfleet/testing/")]
    assert not [n for n in names if n.split("/")[0] in ("pydantic", "pydantic_core", "yaml")], "the image's own"
    assert manifest == {
        "tensorfleet": contract.__version__,
        "distributions": {"prometheus_client": metadata.version("prometheus-client"),
                          "nvidia-ml-py": metadata.version("nvidia-ml-py")},
        "python": ">=3.10",
        "fromImage": ["pydantic>=2.6,<3"],
    }


def test_bundle_is_reproducible(bundle: Path, tmp_path: Path) -> None:
    again = launcher_bundle.build(tmp_path / "again.pyz")
    assert again.sha256 == launcher_bundle.inspect(bundle).sha256


def test_bundle_refuses_compiled_distributions(tmp_path: Path) -> None:
    site = tmp_path / "site"
    (site / "prometheus_client").mkdir(parents=True)
    (site / "prometheus_client" / "_speedups.so").write_bytes(b"\x7fELF")
    info = site / "prometheus_client-9.9.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: prometheus_client\nVersion: 9.9\n")
    (info / "RECORD").write_text("prometheus_client/_speedups.so,,\nprometheus_client-9.9.dist-info/METADATA,,\n")
    with pytest.raises(launcher_bundle.WorkerError, match="ships compiled code"):
        launcher_bundle.build(tmp_path / "x.pyz", search_path=[str(site)])


def test_bundle_runs_with_only_the_standard_library_and_pydantic(bundle: Path, pydantic_only: Path) -> None:
    assert _run(sys.executable, bundle, "--help", path=pydantic_only).returncode == 0
    env = {"TF_MODEL": "meta-llama/Llama-3.1-8B-Instruct", "TF_TENSOR_PARALLEL_SIZE": "2", "TF_MAX_MODEL_LEN": "8192"}
    planned = _run(sys.executable, bundle, "--print-command", path=pydantic_only, env=env)
    assert planned.returncode == 0, planned.stderr
    installed = subprocess.run([sys.executable, "-m", "tensorfleet.worker.cli", "--print-command"],
                               capture_output=True, text=True, env={**os.environ, **env}, check=True)
    assert json.loads(planned.stdout)["commands"] == json.loads(installed.stdout)["commands"]
    assert json.loads(planned.stdout)["commands"][0][:3] == ["vllm", "serve", "meta-llama/Llama-3.1-8B-Instruct"]
    # No GPU here: pynvml (bundled) loads, NVML does not start; one line, exit 3.
    health = _run(sys.executable, bundle, "health", "--state-file", "", path=pydantic_only)
    assert health.returncode == 3 and "NVML did not start" in health.stdout + health.stderr, health
    metrics = _run(sys.executable, bundle, "metrics", path=pydantic_only)
    assert metrics.returncode == 0 and f"{contract.GPU_METRIC_NVML_UP} 0.0" in metrics.stdout


def test_bundle_without_pydantic_says_so_in_one_line(bundle: Path) -> None:
    done = _run(sys.executable, bundle, "--help", path=None)
    assert done.returncode == 127
    assert done.stderr.startswith("tensorfleet-worker: error: the launcher needs pydantic 2 in the engine image's Python")
    assert len(done.stderr.splitlines()) == 1 and done.stdout == ""


def _interpreters() -> dict[tuple[int, int], str]:
    """Other CPython interpreters on this machine (PATH's python3.N, pyenv's), by version."""
    candidates = [shutil.which(f"python3.{minor}") for minor in range(6, 15)]
    root = os.environ.get("PYENV_ROOT", str(Path.home() / ".pyenv"))
    candidates += sorted(glob.glob(f"{root}/versions/3.*/bin/python3"))
    found: dict[tuple[int, int], str] = {}
    for candidate in candidates:
        if not candidate:
            continue
        try:
            out = subprocess.run([candidate, "-c", "import sys; print(*sys.version_info[:2])"], capture_output=True,
                                 text=True, timeout=20, check=True).stdout.split()
        except (OSError, subprocess.SubprocessError):
            continue
        found.setdefault((int(out[0]), int(out[1])), candidate)
    return found


def test_bundle_on_other_interpreters(bundle: Path) -> None:
    """Every Python >= 3.10 here compiles every module of the bundle and reaches the pydantic check; older ones
    are refused in one line. (pydantic-core is compiled per interpreter, so only this one runs the launcher.)"""
    interpreters = _interpreters()
    if not interpreters:
        pytest.skip("no other Python interpreter on this machine")
    compile_all = ("import sys, zipfile\n"
                   "zf = zipfile.ZipFile(sys.argv[1])\n"
                   "for name in zf.namelist():\n"
                   "    if name.endswith('.py'):\n"
                   "        compile(zf.read(name), name, 'exec', dont_inherit=True)\n")
    for version, python in sorted(interpreters.items()):
        done = _run(python, bundle, "--help", path=None)
        assert done.returncode == 127, (python, done)
        if version >= launcher_bundle.MIN_PYTHON:
            assert "needs pydantic 2" in done.stderr, (python, done.stderr)
            compiled = subprocess.run([python, "-c", compile_all, str(bundle)], capture_output=True, text=True,
                                      timeout=120, check=False)
            assert compiled.returncode == 0, (python, compiled.stderr)
        else:
            assert f"needs Python >= 3.10; {python} is {version[0]}.{version[1]}" in done.stderr, (python, done.stderr)


def test_the_launchers_modules_type_check_for_python_310(bundle: Path, pydantic_only: Path) -> None:
    """The standard library the launcher uses exists in 3.10 (typeshed's version guards, through mypy)."""
    from mypy import api

    probe = ("import sys\n"
             "import tensorfleet.worker.cli, tensorfleet.worker.launcher, tensorfleet.worker.metrics\n"
             "import tensorfleet.worker.health, tensorfleet.worker.supervise, tensorfleet.worker.idle, tensorfleet.promtext\n"
             "print('\\n'.join(sorted(m for m in sys.modules if m.split('.')[0] == 'tensorfleet')))\n")
    done = subprocess.run([sys.executable, "-S", "-c", probe], capture_output=True, text=True, check=True,
                          env={"PATH": os.environ["PATH"], "PYTHONPATH": f"{bundle}{os.pathsep}{pydantic_only}"})
    package = ROOT / "operator"
    files = []
    for module in done.stdout.split():
        path = package.joinpath(*module.split("."))
        files.append(str(path / "__init__.py") if path.is_dir() else str(path.with_suffix(".py")))
    assert any(f.endswith("worker/cli.py") for f in files)
    out, err, code = api.run(["--python-version", "3.10", "--follow-imports=silent", "--no-error-summary", *files])
    assert code == 0, out + err


def test_install_launcher_copies_the_bundle(bundle: Path, tmp_path: Path) -> None:
    target = tmp_path / "launcher"
    target.mkdir()
    worker = [sys.executable, "-m", "tensorfleet.worker.cli"]
    done = subprocess.run([*worker, "install-launcher", str(target), "--from", str(bundle)],
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    installed = target / "launcher.pyz"
    assert installed.read_bytes() == bundle.read_bytes()
    assert installed.stat().st_mode & 0o777 == 0o755, "readable by the engine's uid, not the init container's"
    assert done.stdout.startswith(f"tensorfleet-worker: installed {installed}: tensorfleet {contract.__version__} launcher")
    assert [p.name for p in target.iterdir()] == ["launcher.pyz"], "no temporary file left"

    missing = subprocess.run([*worker, "install-launcher", str(target), "--from", str(tmp_path / "none.pyz")],
                             capture_output=True, text=True, check=False)
    assert missing.returncode == 127 and len(missing.stderr.splitlines()) == 1
    assert "no launcher bundle at" in missing.stderr and "built without it" in missing.stderr
    not_a_dir = subprocess.run([*worker, "install-launcher", str(installed), "--from", str(bundle)],
                               capture_output=True, text=True, check=False)
    assert not_a_dir.returncode == 2 and "is not a directory" in not_a_dir.stderr
    not_a_bundle = tmp_path / "plain.zip"
    with zipfile.ZipFile(not_a_bundle, "w") as zf:
        zf.writestr("x.py", "")
    bad = subprocess.run([*worker, "install-launcher", str(target), "--from", str(not_a_bundle)],
                         capture_output=True, text=True, check=False)
    assert bad.returncode == 2 and "is not a launcher bundle: it lacks" in bad.stderr
