"""./Dockerfile, the control-plane image (operator, router, simulator).

No Docker daemon runs in CI, so the Dockerfile is checked as text: what the
chart and the renderer rely on (uid 65532, the `tensorfleet` entrypoint, the
`control-plane` extra: operator, router, simulator and `fast`) and what a
production image needs (pinned base, no build tools in the final stage).
"""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import dockerfile

from tensorfleet import contract

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "Dockerfile"
BUILD_TOOLS = ("build-essential", "gcc", "g++", "make", "clang", "cc ", "python3-dev", "libc6-dev")


def _instructions() -> list[tuple[str, str]]:
    return dockerfile.instructions(DOCKERFILE)


def _stages() -> list[list[tuple[str, str]]]:
    stages: list[list[tuple[str, str]]] = []
    for word, rest in _instructions():
        if word == "FROM":
            stages.append([])
        if stages:
            stages[-1].append((word, rest))
    return stages


def _arg_defaults() -> dict[str, str]:
    return dockerfile.arg_defaults(DOCKERFILE)


def _resolve(image: str) -> str:
    args = _arg_defaults()
    return re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], image)


def test_multi_stage_on_a_pinned_python_311_slim_base() -> None:
    stages = _stages()
    assert len(stages) >= 2, "a builder stage and a final stage"
    for stage in stages:
        image = _resolve(stage[0][1].split()[0])
        name, _, tag = image.partition(":")
        assert name in ("python", "docker.io/library/python"), image
        assert re.fullmatch(r"3\.11\.\d+-slim(-\w+)?", tag), f"{image}: pin an exact 3.11.x slim tag"


def test_final_stage_runs_as_the_numeric_uid_the_router_deployment_expects() -> None:
    users = [rest for word, rest in _stages()[-1] if word == "USER"]
    assert users, "the final stage must set USER"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0, "numeric non-root, so runAsNonRoot can verify it"
    assert int(uid) == contract.CONTROL_PLANE_UID


def test_entrypoint_is_the_tensorfleet_command() -> None:
    entrypoints = [rest for word, rest in _stages()[-1] if word == "ENTRYPOINT"]
    assert [json.loads(entrypoints[-1])] == [list(contract.ROUTER_COMMAND[:1])]
    assert contract.SIMULATOR_COMMAND[0] == contract.ROUTER_COMMAND[0] == "tensorfleet"
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert "tensorfleet" in scripts


def test_wheel_built_in_builder_and_fast_extra_installed_without_build_tools() -> None:
    # One image runs the operator, the router and the simulator: their extras, and uvloop (`fast`).
    wanted = {"operator", "router", "sim", "fast"}
    *builders, final = _stages()
    builder_runs = " ".join(rest for stage in builders for word, rest in stage if word == "RUN")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert "pip wheel" in builder_runs and wanted <= dockerfile.installed_extras(builder_runs, extras)
    assert any(dep.startswith("uvloop") for dep in extras["fast"])
    final_runs = " ".join(rest for word, rest in final if word == "RUN")
    assert wanted <= dockerfile.installed_extras(final_runs, extras) and "--no-index" in final_runs
    assert "apt-get install" not in final_runs
    for tool in BUILD_TOOLS:
        assert tool not in final_runs, f"{tool} in the final stage"
    # Only wheels come over from the builder, never its toolchain.
    copies = [rest for word, rest in final if word == "COPY" and "--from" in rest]
    assert all("/wheels" in c for c in copies)


def test_image_name_matches_the_contract_and_the_chart() -> None:
    import yaml

    values = yaml.safe_load((ROOT / "charts" / "tensorfleet" / "values.yaml").read_text())
    chart = yaml.safe_load((ROOT / "charts" / "tensorfleet" / "Chart.yaml").read_text())
    assert f"{values['image']['repository']}:{chart['appVersion']}" == contract.CONTROL_PLANE_IMAGE
    assert chart["appVersion"] == contract.__version__
    assert contract.CONTROL_PLANE_IMAGE in DOCKERFILE.read_text()
