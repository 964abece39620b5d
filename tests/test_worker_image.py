"""worker-image/Dockerfile: a pinned vLLM base, the launcher as entrypoint, the contract's ports.

No Docker daemon runs in CI, so the image is checked as text; worker-image/README.md
says how to build it.
"""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import dockerfile

from tensorfleet import contract

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "worker-image" / "Dockerfile"


def _instructions() -> list[tuple[str, str]]:
    return dockerfile.instructions(DOCKERFILE)


def _args() -> dict[str, str]:
    return dockerfile.arg_defaults(DOCKERFILE)


def test_base_image_is_pinned_by_tag() -> None:
    froms = [rest for word, rest in _instructions() if word == "FROM"]
    assert len(froms) == 1
    image = froms[0].split()[0]
    # ${VAR} references resolve to the ARG defaults declared before FROM.
    resolved = re.sub(r"\$\{(\w+)\}", lambda m: _args()[m.group(1)], image)
    repository, _, tag = resolved.rpartition(":")
    assert repository == "vllm/vllm-openai"
    assert tag and tag != "latest" and "nightly" not in tag
    assert re.fullmatch(r"v\d+\.\d+\.\d+(\.post\d+)?", tag), f"{tag} is not a release tag"
    assert "VLLM_VERSION" in _args(), "the vLLM version is a build arg"


def test_entrypoint_is_the_launcher() -> None:
    entry = [json.loads(rest) for word, rest in _instructions() if word == "ENTRYPOINT"]
    assert entry == [list(contract.WORKER_COMMAND)]
    assert [rest for word, rest in _instructions() if word == "CMD"] == ["[]"]


def test_installs_the_worker_extra() -> None:
    runs = " ".join(rest for word, rest in _instructions() if word == "RUN")
    assert "[worker]" in runs
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(req.startswith("nvidia-ml-py") for req in extras["worker"])
    assert "tensorfleet-worker --help" in runs      # the build fails if the launcher cannot start


def test_runs_as_non_root() -> None:
    users = [rest for word, rest in _instructions() if word == "USER"]
    assert users, "no USER"
    user = re.sub(r"\$\{(\w+)\}", lambda m: _args()[m.group(1)], users[-1])
    assert user.isdigit() and int(user) != 0, "USER must be a numeric non-root uid (runAsNonRoot checks it)"
    # The renderer gives engine pods this fsGroup so the model cache volume is writable.
    assert int(user) == contract.WORKER_UID


def test_exposes_the_contract_ports() -> None:
    ports = {int(p) for word, rest in _instructions() if word == "EXPOSE" for p in rest.split()}
    assert ports == {contract.ENGINE_PORT, contract.RAY_PORT, contract.WORKER_METRICS_PORT}
