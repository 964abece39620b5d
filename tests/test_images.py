"""images/: the daemonless build of the control-plane image, checked as far as a test can without root.

CI builds the image (`images/build-control-plane`, mmdebstrap + umoci) and runs
`images/check-control-plane` on it after this suite (.ci/run). Here: the
recipe agrees with the contract, the Dockerfile and the chart, and, when an
image has been built on this machine, its config is the one the renderer and
the chart rely on.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import dockerfile
import pytest

from tensorfleet import contract

ROOT = Path(__file__).resolve().parent.parent
IMAGES = ROOT / "images"
SCRIPTS = ("build-control-plane", "check-control-plane")


def _ocibuild() -> ModuleType:
    spec = importlib.util.spec_from_file_location("ocibuild", IMAGES / "ocibuild.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("script", SCRIPTS)
def test_scripts_are_executable_and_explain_themselves(script: str) -> None:
    path = IMAGES / script
    assert os.access(path, os.X_OK), f"chmod +x images/{script}"
    done = subprocess.run([sys.executable, str(path), "--help"], capture_output=True, text=True, check=False, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "--layout" in done.stdout and "--tag" in done.stdout


def test_the_image_is_the_one_the_renderer_and_the_chart_expect() -> None:
    oci = _ocibuild()
    assert oci.USER == f"{contract.CONTROL_PLANE_UID}:{contract.CONTROL_PLANE_UID}"
    assert oci.ENTRYPOINT == list(contract.ROUTER_COMMAND[:1]) == ["tensorfleet"]
    assert oci.TAG == contract.CONTROL_PLANE_IMAGE.rpartition(":")[2]
    assert set(oci.EXTRAS.split(",")) == {"control-plane", "worker"}
    assert "python3" in oci.packages() and "ca-certificates" in oci.packages()
    # The same image as ./Dockerfile's: its ports, its extras, the launcher bundle where the init container looks.
    instructions = dockerfile.instructions(ROOT / "Dockerfile")
    exposed = {int(p) for word, rest in instructions if word == "EXPOSE" for p in rest.split()}
    assert exposed == set(oci.EXPOSED_PORTS)
    runs = " ".join(rest for word, rest in instructions if word == "RUN")
    assert f"tensorfleet[{oci.EXTRAS}]" in runs
    assert f"python -m tensorfleet.worker.bundle {contract.LAUNCHER_BUNDLE_PATH}" in runs
    build = (IMAGES / "build-control-plane").read_text()
    assert "python3\", \"-m\", \"tensorfleet.worker.bundle\", bundle" in build
    assert "contract.LAUNCHER_BUNDLE_PATH" in build


def test_ci_builds_and_checks_the_image() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    build, check = ci.find("images/build-control-plane"), ci.find("images/check-control-plane")
    assert 0 < build < check, ".ci/run builds the control-plane image, then checks it"
    assert ci.find(".venv/bin/python -m pytest\n") < build, "after the Python suite"


def test_a_built_image_has_the_contracts_config() -> None:
    oci = _ocibuild()
    layout = oci.default_layout()
    if not (layout / "index.json").is_file():
        pytest.skip(f"no image built at {layout} (images/build-control-plane; CI builds it after this suite)")
    manifest, config = oci.manifest_and_config(layout, oci.TAG)
    image = config["config"]
    assert image["User"] == oci.USER and image["Entrypoint"] == ["tensorfleet"] and image["Cmd"] == ["--help"]
    assert image["Labels"]["dev.tensorfleet.launcher"] == contract.LAUNCHER_BUNDLE_PATH
    assert len(manifest["layers"]) == 2
    assert all(layer["mediaType"] == "application/vnd.oci.image.layer.v1.tar+gzip" for layer in manifest["layers"])
    assert json.loads((layout / "oci-layout").read_text())["imageLayoutVersion"] == "1.0.0"
